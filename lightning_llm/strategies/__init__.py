"""Parallel strategies, registered in Lightning's StrategyRegistry on import."""

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_llm.strategies.tensor_parallel import TensorParallelStrategy

if "tp" not in _StrategyRegistry:
    _StrategyRegistry.register("tp", TensorParallelStrategy, description="Megatron-style tensor parallelism (DTensor)")

from lightning_llm.strategies.zero import ZeroStrategy  # noqa: E402
from lightning_llm.strategies.zero_deepspeed import DeepSpeedZeroStrategy  # noqa: E402,F401

ZeroStrategy.register_presets(_StrategyRegistry)  # zero1/2/3(_offload), deepspeed_zero1/2/3(_offload); idempotent

from lightning_llm.strategies.pipeline_parallel import PipelineParallelStrategy  # noqa: E402

if "pp" not in _StrategyRegistry:
    _StrategyRegistry.register("pp", PipelineParallelStrategy, description="Pipeline parallelism (GPipe/1F1B/interleaved)")

from lightning_llm.strategies.hybrid import HybridParallelStrategy  # noqa: E402

if "3d" not in _StrategyRegistry:
    _StrategyRegistry.register("3d", HybridParallelStrategy, description="3-D parallelism: DP x TP x PP with ZeRO")
