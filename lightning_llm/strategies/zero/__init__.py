"""ZeRO-sharded data parallelism: the pieces of its two engines (the strategy front, ``ZeroStrategy``, is a preset
of the native engine: :mod:`lightning_llm.strategies.presets`).

* :mod:`.native`: the torch-native engine pieces the native engine applies on the ``dp`` mesh dim: stages 1/2
  partition optimizer states (and gradients) with :class:`PartitionedOptimizer`; stage 3 is FSDP2 (:func:`apply_fsdp`).
* :mod:`.deepspeed`: :class:`DeepSpeedZeroStrategy`, DeepSpeed's engine (``deepspeed.initialize``, CPU included),
  what ``ZeroStrategy(engine="deepspeed")`` and the ``deepspeed_zero*`` names construct; :mod:`.deepspeed_optimizers`:
  its optimizers by name.
* :mod:`.common`: what both share: the argument checks and the consolidated weights file (:class:`ExportWeights`).
"""

from lightning_llm.strategies.zero.common import ExportWeights, validate_zero_args
from lightning_llm.strategies.zero.deepspeed import DeepSpeedZeroStrategy, deepspeed_model_state_bytes
from lightning_llm.strategies.zero.native import PartitionedOptimizer, apply_fsdp, model_state_bytes

__all__ = ["DeepSpeedZeroStrategy", "ExportWeights", "PartitionedOptimizer", "apply_fsdp",
           "deepspeed_model_state_bytes", "model_state_bytes", "validate_zero_args"]
