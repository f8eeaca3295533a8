"""The model families against transformers: construction, attention, MoE and MLA layers, HF checkpoints in and out."""
