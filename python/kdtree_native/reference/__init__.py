"""NumPy references (the oracle) for every algorithm of kdtree-native: plain and slow."""
