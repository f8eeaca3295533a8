"""Parallel strategies, registered in Lightning's StrategyRegistry on import.

``tp``, ``pp``, ``zero1/2/3(_offload)`` and ``3d`` are presets of the one native engine (:class:`ParallelEngine`);
``deepspeed_zero*`` run DeepSpeed's engine.
"""

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_llm.strategies.engine import ParallelEngine
from lightning_llm.strategies.hybrid import HybridParallelStrategy
from lightning_llm.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_llm.strategies.tensor_parallel import TensorParallelStrategy
from lightning_llm.strategies.zero import ZeroStrategy
from lightning_llm.strategies.zero_deepspeed import DeepSpeedZeroStrategy

__all__ = ["DeepSpeedZeroStrategy", "HybridParallelStrategy", "ParallelEngine", "PipelineParallelStrategy",
           "TensorParallelStrategy", "ZeroStrategy"]

_PRESETS = {
    "tp": (TensorParallelStrategy, "Megatron-style tensor parallelism (DTensor)"),
    "pp": (PipelineParallelStrategy, "Pipeline parallelism (GPipe/1F1B/interleaved)"),
    "3d": (HybridParallelStrategy, "3-D parallelism: DP x TP x PP with ZeRO"),
}
for _name, (_cls, _description) in _PRESETS.items():
    if _name not in _StrategyRegistry:
        _StrategyRegistry.register(_name, _cls, description=_description)
ZeroStrategy.register_presets(_StrategyRegistry)  # zero1/2/3(_offload), deepspeed_zero1/2/3(_offload); idempotent
