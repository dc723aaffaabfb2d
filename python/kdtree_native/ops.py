"""Native ops (placeholder until the tree area lands)."""
