"""Pipeline parallelism inside Lightning's loop (registered as ``pp``): a preset of the one parallel engine.

How a step runs (the task contract of :mod:`lightning_llm.contract`; nothing of the task is replaced):

* ``configure_model`` builds the full model as usual; the engine splits it (:mod:`.pipeline_split`, by the family's
  :class:`~lightning_llm.models.parallel_spec.ParallelSpec`): this rank keeps only its stages' blocks/embeddings/head
  (names stay global, so the optimizer and checkpoints hold exactly this rank's shard) and a
  :class:`~.pipeline_engine.PipelineRunner` wraps each stage view in a ``PipelineStage``. The split model refuses
  direct calls (a forward pre-hook names ``run_model``); a task that overrides ``compute_loss`` or has trainable
  modules outside ``self.model`` is refused at set-up, before any step.
* Training: the task's ``step_loss`` asks the runner, which runs the schedule (forward *and* backward of every
  micro-batch) on ``task.model_inputs(batch)``; the last stage computes each micro-batch's loss with
  ``task.loss_from_output``. The mean loss is sent to every pipeline rank, so the task's ``train_loss``, the progress
  bar and checkpoint monitoring see the real value.
* Gradients vs Lightning's closure (training_step -> zero_grad -> backward): the schedule's gradients are moved out
  of ``.grad`` right after the schedule, so Lightning's ``zero_grad`` finds nothing to clear, and are put back in the
  engine's ``backward``, which replaces Lightning's ``loss.backward()`` (it keeps Lightning's hook order:
  ``on_before_backward``/``on_after_backward``, accumulation, clipping).
* Validation/test run forward-only schedules (the last stage computes loss and metric outputs with
  ``loss_from_output`` and sends them to the other ranks); ``task.run_model`` (predict) gets the last stage's
  output on every rank.
* Gradient clipping by norm uses the global norm over all stages; checkpoints are the engine's layout-free format.

Per step the strategy logs each rank's busy time (inside stage forward/backward and loss) and idle fraction
(``pp/idle_frac_rank{r}``) and keeps them in :attr:`step_stats`; with ``measure_activations`` it also counts peak
live saved-activation bytes (:mod:`.pipeline_stats`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_llm.strategies.engine import ParallelEngine
from lightning_llm.strategies.grad_buckets import DEFAULT_BUCKET_MB
from lightning_llm.strategies.pipeline_checkpoint import CHECKPOINT_FILE, consolidate_checkpoint
from lightning_llm.strategies.pipeline_runtime import SCHEDULES, ScheduleName

# SCHEDULES, ScheduleName, CHECKPOINT_FILE and consolidate_checkpoint are re-exported: they were defined here first.
__all__ = ["PipelineParallelStrategy", "SCHEDULES", "ScheduleName", "CHECKPOINT_FILE", "consolidate_checkpoint"]


class PipelineParallelStrategy(ParallelEngine):
    """Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) for the registered model families."""

    strategy_name = "pp"

    def __init__(
        self,
        pipeline_parallel_size: int = -1,
        n_microbatches: int = 4,
        schedule: ScheduleName = "1f1b",
        stages_per_rank: int = 1,
        split_points: list[int] | None = None,
        balance: Literal["layers", "params"] = "layers",
        activation_checkpointing: bool = False,
        log_pipeline_stats: bool = True,
        measure_activations: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            pipeline_parallel_size: Pipeline ranks; ``-1`` = all devices. The rest of the world is data parallel.
            n_microbatches: Micro-batches per batch; the per-device batch size must be divisible by it.
            schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble`` (interleaved zero-bubble: the
                backward is split into input- and weight-gradient passes to fill the bubble).
            stages_per_rank: Virtual stages per rank (interleaved schedules).
            split_points: Block indices where stages 1..n-1 begin; default: balanced by ``balance``.
            balance: Automatic split balanced by block count (``layers``) or by parameter count (``params``).
            activation_checkpointing: Recompute each transformer block in backward.
            log_pipeline_stats: Log per-rank busy/idle time (and activation bytes) every training step.
            measure_activations: Count peak live saved-activation bytes per step (slower; for benchmarks).
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        if balance not in ("layers", "params"):
            raise ValueError(f"balance={balance!r}: expected 'layers' or 'params'")
        super().__init__(data_parallel_size=1 if pipeline_parallel_size == -1 else -1,
                         pipeline_parallel_size=pipeline_parallel_size, n_microbatches=n_microbatches,
                         schedule=schedule, stages_per_rank=stages_per_rank, split_points=split_points,
                         balance=balance, activation_checkpointing=activation_checkpointing,
                         log_pipeline_stats=log_pipeline_stats, measure_activations=measure_activations,
                         bucket_size_mb=bucket_size_mb, process_group_backend=process_group_backend,
                         timeout=timeout)
