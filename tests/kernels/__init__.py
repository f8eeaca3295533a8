"""Kernels (Triton and torch), the fused LM-head loss and torch.compile, against float64 and one-device references."""
