"""The registered presets of the one native engine (:class:`~lightning_llm.strategies.engine.strategy.ParallelEngine`): each
is an ``__init__`` that exposes one technique's arguments under its own name (the engine does the work).

* ``tp``: :class:`TensorParallelStrategy`, Megatron-style tensor parallelism on DTensor. ``tensor_parallel_size=k``
  with ``n`` devices gives ``n/k`` data-parallel replicas; the model is sharded with ``parallelize_module`` following
  its family's plan (:mod:`lightning_llm.models.parallel_spec`) or the user's ``plan``.
* ``pp``: :class:`PipelineParallelStrategy`, the pipeline runtime of :mod:`lightning_llm.strategies.pipeline` (how a
  step runs is told there).
* ``zero1/2/3``, ``zero2_offload``, ``zero3_offload``: :class:`ZeroStrategy`, ZeRO over the ``dp`` mesh dim
  (:mod:`lightning_llm.strategies.zero`); ``deepspeed_zero1/2/3(_offload)``, ``deepspeed_zero3_nvme`` (ZeRO-Infinity:
  the states swapped to ``nvme_path``, :mod:`lightning_llm.strategies.zero.nvme`): the same arguments with
  ``engine="deepspeed"``, for which constructing ``ZeroStrategy`` returns a
  :class:`~lightning_llm.strategies.zero.deepspeed.DeepSpeedZeroStrategy`.
* ``cp``: :class:`ContextParallelStrategy`, context parallelism (:mod:`lightning_llm.strategies.context`): the ranks
  of a cp group share each sequence, ``context_parallel_size=k`` of ``n`` devices leaving ``n/k`` data-parallel
  replicas.
* ``ep``: :class:`ExpertParallelStrategy`, expert parallelism (:mod:`lightning_llm.strategies.expert`): each MoE
  layer's experts spread over groups of ``expert_parallel_size`` data-parallel ranks.
* ``3d``: :class:`HybridParallelStrategy`, every degree of the engine exposed (dp x cp x tp x pp, ZeRO 0-3 on
  dp x cp; ``expert_parallel_size`` borrowed from dp x cp).

Everything else (process group, gradient averaging, global-norm clipping, layout-free checkpoints:
:mod:`.hybrid_checkpoint`) is the engine's. :func:`register_presets` adds every name to Lightning's
``StrategyRegistry``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm.strategies.decoding import GatherForDecoding
from lightning_llm.strategies.engine.strategy import ParallelEngine
from lightning_llm.strategies.engine.grad_buckets import DEFAULT_BUCKET_MB
from lightning_llm.strategies.pipeline.runtime import ScheduleName
from lightning_llm.models.tp_plans import TPPlan
from lightning_llm.strategies.zero.common import Engine, check_adapter, validate_zero_args, write_export
from lightning_llm.strategies.zero.deepspeed import DeepSpeedZeroStrategy

__all__ = ["ContextParallelStrategy", "ExpertParallelStrategy", "HybridParallelStrategy", "PipelineParallelStrategy", "TensorParallelStrategy", "ZeroStrategy",
           "ZERO_PRESETS", "register_presets"]

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
        async_save: bool = False,
        activation_checkpointing: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        gather_for_decoding: GatherForDecoding = "auto",
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
            async_save: Write checkpoints in the background (staged in host memory, written while training goes on,
                published only complete: :mod:`~lightning_llm.strategies.engine.async_save`).
            activation_checkpointing: Recompute each transformer block in backward.
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
            gather_for_decoding: Generation (rollouts, evaluation): ``once`` assembles a whole copy of the model
                (and the task's frozen models) on every rank once per generation or rollout and decodes as one
                device does, without a collective per token; ``per_layer`` decodes through the shards (each layer's
                collectives in every step); ``auto`` gathers once where the copies fit in half the free memory
                (:mod:`.decoding`; the run summary names the choice).
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(data_parallel_size=1 if tensor_parallel_size == -1 else -1,
                         tensor_parallel_size=tensor_parallel_size, sequence_parallel=sequence_parallel,
                         loss_parallel=loss_parallel, plan=plan,
                         save_distributed_checkpoint=save_distributed_checkpoint, async_save=async_save,
                         activation_checkpointing=activation_checkpointing, bucket_size_mb=bucket_size_mb,
                         gather_for_decoding=gather_for_decoding,
                         process_group_backend=process_group_backend, timeout=timeout)


class PipelineParallelStrategy(ParallelEngine):
    """Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) for the registered model families: how a
    step runs, and the per-step busy/idle statistics, are told in :mod:`lightning_llm.strategies.pipeline`."""

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
        async_save: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        decode_microbatches: Literal["auto", "stages"] = "auto",
        gather_for_decoding: GatherForDecoding = "auto",
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
            async_save: Write checkpoints in the background (staged in host memory, written while training goes on,
                published only complete: :mod:`~lightning_llm.strategies.engine.async_save`).
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
            decode_microbatches: Generation (rollouts, evaluation): ``stages`` decodes one micro-batch per stage in
                flight, so every stage works; ``auto`` does so where a micro-batch's step is enough work to pay for
                a stage call of its own, else one batch (same tokens either way). Used where generation decodes
                through the stages (``gather_for_decoding``).
            gather_for_decoding: Generation: ``once`` assembles a whole copy of the model (and the task's frozen
                models) on every pipeline rank once per generation or rollout, the other stages' weights broadcast
                by their owners, and every rank decodes as one device does, no message per token; ``per_layer``
                decodes through the stages; ``auto`` gathers once where the copies fit in half the free memory.
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
                         async_save=async_save, bucket_size_mb=bucket_size_mb,
                         decode_microbatches=decode_microbatches, gather_for_decoding=gather_for_decoding,
                         process_group_backend=process_group_backend, timeout=timeout)


class ContextParallelStrategy(ParallelEngine):
    """Context parallelism: each sequence is split over the ranks of a cp group (load-balanced causal chunks),
    attention all-gathers keys and values across them; the rest of the world is data parallel."""

    strategy_name = "cp"

    def __init__(
        self,
        context_parallel_size: int = -1,
        zero_stage: int = 0,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            context_parallel_size: Ranks sharing each sequence; ``-1`` = all devices. Must divide devices x nodes
                (the quotient is the data-parallel degree); the sequence length must be divisible by twice it.
            zero_stage: ZeRO over the ``dp x cp`` ranks (they hold the same parameters): 0-3.
            activation_checkpointing: Recompute each transformer block in backward.
            save_distributed_checkpoint: Sharded layout-free checkpoints (``True``) or one file of full weights from
                rank 0 (for export/inference).
            async_save: Write checkpoints in the background (staged in host memory, written while training goes on,
                published only complete: :mod:`~lightning_llm.strategies.engine.async_save`).
            bucket_size_mb: Gradient buckets in MiB (DDP's default) of the ``dp x cp`` reduction.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(data_parallel_size=1 if context_parallel_size == -1 else -1,
                         context_parallel_size=context_parallel_size, zero_stage=zero_stage,
                         save_distributed_checkpoint=save_distributed_checkpoint, async_save=async_save,
                         activation_checkpointing=activation_checkpointing, bucket_size_mb=bucket_size_mb,
                         process_group_backend=process_group_backend, timeout=timeout)


class ExpertParallelStrategy(ParallelEngine):
    """Expert parallelism for Mixture-of-Experts models: every rank is a data-parallel replica, and the replicas
    spread each MoE layer's experts over groups of ``expert_parallel_size`` ranks (tokens sent to their experts by
    all-to-all); the rest of the model is replicated (or ZeRO-3 sharded)."""

    strategy_name = "ep"

    def __init__(
        self,
        expert_parallel_size: int = -1,
        zero_stage: int = 0,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            expert_parallel_size: Ranks sharing each MoE layer's experts (each holds ``experts / ep`` of them);
                ``-1`` = all devices. Must divide devices x nodes (the data-parallel degree) and the experts per layer.
            zero_stage: 0 (averaged gradients) or 3 (FSDP2: the experts sharded over the ranks holding the same ones,
                the rest over every replica).
            activation_checkpointing: Recompute each transformer block in backward.
            save_distributed_checkpoint: Sharded layout-free checkpoints (``True``) or one file of full weights from
                rank 0 (for export/inference).
            async_save: Write checkpoints in the background (staged in host memory, written while training goes on,
                published only complete: :mod:`~lightning_llm.strategies.engine.async_save`).
            bucket_size_mb: Gradient buckets in MiB (DDP's default).
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(data_parallel_size=-1, expert_parallel_size=expert_parallel_size, zero_stage=zero_stage,
                         save_distributed_checkpoint=save_distributed_checkpoint, async_save=async_save,
                         activation_checkpointing=activation_checkpointing, bucket_size_mb=bucket_size_mb,
                         process_group_backend=process_group_backend, timeout=timeout)


def _drop_native_only(kwargs: dict[str, Any]) -> None:
    """Remove from ``kwargs`` the ``ZeroStrategy`` options ``DeepSpeedZeroStrategy`` has no argument for (read from
    both signatures, so a new native option is covered): the CLI passes every option, at its default when not given;
    one set to anything else is refused (it would otherwise reach DeepSpeed's ``**kwargs``, or be lost)."""
    deepspeed = inspect.signature(DeepSpeedZeroStrategy.__init__).parameters
    for name, p in inspect.signature(ZeroStrategy.__init__).parameters.items():
        if name in ("self", "engine") or name in deepspeed or name not in kwargs:
            continue
        if kwargs.pop(name) != p.default:
            raise ValueError(f"ZeroStrategy(engine='deepspeed'): {name} is an option of the native engine; DeepSpeed "
                             "takes its equivalent from --trainer.strategy.config (a DeepSpeed JSON)")


class _EngineChoice:
    """``ZeroStrategy(engine="deepspeed", ...)`` constructs a ``DeepSpeedZeroStrategy`` instead. A base class rather
    than ``ZeroStrategy.__new__``: jsonargparse reads a class's own ``__new__`` as its signature, which would hide
    ``__init__``'s arguments (``activation_checkpointing``, ...) from ``--trainer.strategy.OPTION``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is ZeroStrategy and kwargs.get("engine", "native") == "deepspeed":
            kwargs.pop("engine")
            if args:
                kwargs["stage"] = args[0]
            _drop_native_only(kwargs)
            return DeepSpeedZeroStrategy(**kwargs)
        return super().__new__(cls)


class ZeroStrategy(_EngineChoice, ParallelEngine):
    """ZeRO data parallelism (stage 1, 2 or 3) over the ``dp`` dim: a preset of the one parallel engine.

    With ``engine="deepspeed"`` the constructor returns a ``DeepSpeedZeroStrategy`` configured from the same args.
    """

    def __init__(
        self,
        stage: int = 2,
        *,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        engine: Engine = "native",
        optimizer: str | None = None,
        config: str | dict[str, Any] | None = None,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        activation_checkpointing: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        gather_for_decoding: GatherForDecoding = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.
            offload_optimizer: Keep optimizer states (and their fp32 masters) in CPU memory.
            offload_params: Keep parameter shards in CPU memory (stage 3 only).
            engine: ``native`` (torch: partitioned optimizer / FSDP2) or ``deepspeed`` (``deepspeed.initialize``).
            optimizer: DeepSpeed engine only - a DeepSpeed optimizer by name (``adam``, ``adamw``, ``cpu_adam``,
                ``lamb``, ``onebitadam``, ``zerooneadam``); default: the task's ``configure_optimizers``.
            config: DeepSpeed engine only - a DeepSpeed JSON file (or dict) merged over the generated config.
            save_distributed_checkpoint: Sharded layout-free checkpoints (``True``) or one file of full weights from
                rank 0 (for export/inference).
            async_save: Write checkpoints in the background (staged in host memory, written while training goes on,
                published only complete: :mod:`~lightning_llm.strategies.engine.async_save`).
            activation_checkpointing: Recompute each transformer block in backward.
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
            gather_for_decoding: Stage 3 generation (rollouts, evaluation): ``once`` gathers the parameters once per
                generation, ``per_layer`` in every decoding step (FSDP2's default), ``auto`` once when they fit in
                half the free memory.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        validate_zero_args(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                           engine=engine)
        if optimizer is not None or config is not None:
            raise ValueError("ZeroStrategy: optimizer= and config= select DeepSpeed optimizers/config; they need "
                             "engine='deepspeed' (the native engine uses the task's configure_optimizers)")
        super().__init__(data_parallel_size=-1, zero_stage=stage, offload_optimizer=offload_optimizer,
                         offload_params=offload_params, save_distributed_checkpoint=save_distributed_checkpoint,
                         async_save=async_save, activation_checkpointing=activation_checkpointing,
                         bucket_size_mb=bucket_size_mb, gather_for_decoding=gather_for_decoding,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.stage = stage
        self.engine = engine

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.device_mesh["dp"]

    def export_consolidated(self, path: _PATH, *, adapter_only: bool = False) -> Path | None:
        """Write the backbone's full ``state_dict`` (``adapter_only``: only ``lora_*`` tensors) to one file on rank 0.

        A collective under stage 3 (shards are all-gathered): call it on every rank. Returns the path on rank 0.
        """
        assert self.lightning_module is not None
        backbone: nn.Module = getattr(self.lightning_module, "model", None) or self.lightning_module
        check_adapter(backbone, adapter_only)
        full = self.full_state_dict()
        prefix = "model." if backbone is not self.lightning_module else ""
        sd = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
        return write_export(sd, path, adapter_only=adapter_only, rank0=self.is_global_zero, barrier=self.barrier)


class HybridParallelStrategy(ParallelEngine):
    """DP x CP x TP x PP with ZeRO stage 0-3 on the data-parallel dim (all of :class:`ParallelEngine`'s
    arguments)."""

    strategy_name = "3d"


ZERO_PRESETS: dict[str, dict[str, Any]] = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    "deepspeed_zero1": dict(stage=1, engine="deepspeed"),
    "deepspeed_zero2": dict(stage=2, engine="deepspeed"),
    "deepspeed_zero3": dict(stage=3, engine="deepspeed"),
    "deepspeed_zero3_offload": dict(stage=3, engine="deepspeed", offload_optimizer=True, offload_params=True),
    "deepspeed_zero3_nvme": dict(stage=3, engine="deepspeed", offload_optimizer=True, offload_params=True,
                                 offload_device="nvme"),
}
"""Registered ZeRO strategy names -> ZeroStrategy init args."""

_PRESETS = {
    "tp": (TensorParallelStrategy, "Megatron-style tensor parallelism (DTensor)"),
    "pp": (PipelineParallelStrategy, "Pipeline parallelism (GPipe/1F1B/interleaved)"),
    "cp": (ContextParallelStrategy, "Context parallelism: sequences split over ranks (all-gather attention)"),
    "ep": (ExpertParallelStrategy, "Expert parallelism: MoE experts spread over data-parallel ranks (all-to-all)"),
    "3d": (HybridParallelStrategy, "3-D parallelism: DP x CP x TP x PP with ZeRO"),
}


def register_presets(registry: Any) -> None:
    """Add ``tp``, ``pp``, ``3d`` and :data:`ZERO_PRESETS` to Lightning's ``StrategyRegistry`` (names already
    registered are skipped, so this is idempotent)."""
    for name, (cls, description) in _PRESETS.items():
        if name not in registry:
            registry.register(name, cls, description=description)
    for name, args in ZERO_PRESETS.items():
        if name in registry:
            continue
        args = dict(args)
        if args.pop("engine", "native") == "deepspeed":
            registry.register(name, DeepSpeedZeroStrategy, description=f"ZeRO preset {args} (DeepSpeed)", **args)
        else:
            registry.register(name, ZeroStrategy, description=f"ZeRO preset {args} (native)", **args)
