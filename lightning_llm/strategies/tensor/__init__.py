"""Tensor parallelism: :mod:`.plans` (the Megatron-style plan a family's ``parallel_spec`` declares, turned into
DTensor parallel styles, LoRA adapters beside sharded layers) and :mod:`.parallelize` (the plan applied to a model,
partial gradients reduced, clipping by the global norm)."""
