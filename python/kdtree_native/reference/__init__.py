"""NumPy references (the oracle) for every algorithm of kdtree-native: plain and slow."""
from .tree import (  # noqa: F401
    MAX_TREE_BUDGET, MAX_TREE_DEPTH, Tree, compact_index_map, kv_compact, topk_logsoftmax,
    tree_accept, tree_build, tree_build_from_logits, tree_positions, tree_visibility,
)
from .mla import absorb_queries, unabsorb_output, verify_attention, verify_attention_plain  # noqa: F401,E402
from .model import ReferenceModel  # noqa: F401,E402
from .drafters import ngram_draft  # noqa: F401,E402
