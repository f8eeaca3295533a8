"""Megatron-style tensor parallelism on DTensor, registered as ``tp``: a preset of the one parallel engine.

``--trainer.strategy=tp`` puts all devices in one tensor-parallel group; ``tensor_parallel_size=k`` with ``n`` devices
gives ``n/k`` data-parallel replicas (gradients averaged over the ``dp`` mesh dim before each optimizer step). The
model is sharded with ``parallelize_module`` following its family's plan
(:mod:`lightning_llm.models.parallel_spec`) or the user's ``plan``. Everything else (process group, gradient
averaging, clipping, layout-free checkpoints) is :class:`~lightning_llm.strategies.engine.ParallelEngine`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from lightning_llm.strategies.engine import ParallelEngine
from lightning_llm.strategies.grad_buckets import DEFAULT_BUCKET_MB
from lightning_llm.strategies.plans import TPPlan

__all__ = ["TensorParallelStrategy"]

PlanArg = TPPlan | Callable[[nn.Module], TPPlan] | str | None


class TensorParallelStrategy(ParallelEngine):
    """Tensor parallelism (Megatron column/row split) with optional sequence parallelism and vocab-parallel loss."""

    strategy_name = "tp"

    def __init__(
        self,
        tensor_parallel_size: int = -1,
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        plan: PlanArg = None,
        save_distributed_checkpoint: bool = True,
        activation_checkpointing: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            tensor_parallel_size: Ranks per tensor-parallel group; ``-1`` = all devices. Must divide devices x nodes;
                the quotient is the data-parallel degree.
            sequence_parallel: Shard the residual stream on the sequence dim between blocks (norms/dropout on
                ``[B, S/tp, H]``; all-gather + reduce-scatter instead of all-reduce).
            loss_parallel: Keep the LM head's logits vocab-sharded and compute cross-entropy on the shards, for losses
                marked ``@accepts_sharded_logits`` (others receive gathered logits).
            plan: A custom plan for a custom model: a dict ``module path -> ParallelStyle`` (relative to the task's
                ``model`` attribute, or the LightningModule when it has none), a callable ``model -> plan``, or its
                import path ``"pkg.module:function"``. Default: the plan of the model's family.
            save_distributed_checkpoint: Sharded layout-free checkpoints (``True``) or one file of full weights from
                rank 0 (for export/inference).
            activation_checkpointing: Recompute each transformer block in backward.
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(data_parallel_size=1 if tensor_parallel_size == -1 else -1,
                         tensor_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel, plan=plan,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         activation_checkpointing=activation_checkpointing, bucket_size_mb=bucket_size_mb,
                         process_group_backend=process_group_backend, timeout=timeout)
