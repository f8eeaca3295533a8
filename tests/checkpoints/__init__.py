"""State: exports, safe loading, faults during saves, async saves, NVMe offload, file modes, resume."""
