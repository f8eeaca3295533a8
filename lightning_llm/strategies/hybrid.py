"""3-D parallelism: data x tensor x pipeline parallel with ZeRO on the data-parallel dim (registered as ``3d``).

The full engine with every degree exposed: :class:`~lightning_llm.strategies.engine.ParallelEngine` (which also
backs the ``tp``, ``pp`` and ``zero*`` presets). Its checkpoints are layout-free (:mod:`.hybrid_checkpoint`).
"""

from __future__ import annotations

from lightning_llm.strategies.engine import ParallelEngine

__all__ = ["HybridParallelStrategy"]


class HybridParallelStrategy(ParallelEngine):
    """DP x TP x PP with ZeRO stage 0-3 on the data-parallel dim (all of :class:`ParallelEngine`'s arguments)."""

    strategy_name = "3d"
