"""Trust layer: tokens, permissions, signing and the cache registry with its write policies."""
