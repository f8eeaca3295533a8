"""Decoding (dynamic and static caches, compiled steps) under every layout, and lm-eval scoring."""
