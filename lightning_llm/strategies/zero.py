"""ZeRO-sharded data parallel: one strategy front for stages 1/2/3, CPU offload, and two engines.

``ZeroStrategy(stage=..., offload_optimizer=..., offload_params=..., engine="native" | "deepspeed")``:

* ``engine="native"`` (this class): stages 1/2 partition optimizer states (and gradients) over the ``dp`` mesh dim with
  :class:`~lightning_llm.strategies.zero_native.PartitionedOptimizer`; stage 3 is FSDP2 (see ``zero_native.py``).
* ``engine="deepspeed"``: constructing ``ZeroStrategy`` returns a
  :class:`~lightning_llm.strategies.zero_deepspeed.DeepSpeedZeroStrategy` (``deepspeed.initialize``, CPU included).

Registered presets: ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload`` (native) and
``deepspeed_zero1/2/3``, ``deepspeed_zero3_offload``.

The native presets are :class:`~lightning_llm.strategies.engine.ParallelEngine` with ``zero_stage`` set: its
layout-free checkpoints (any layout resumes from any other), gradient averaging and global-norm clipping. The
consolidated export (:meth:`ZeroStrategy.export_consolidated`, or the :class:`ExportWeights` callback) writes the full
backbone ``state_dict`` (or only the LoRA adapter) as one ``torch.save`` file - full tensors, never shards.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_llm.strategies.engine import ParallelEngine
from lightning_llm.strategies.grad_buckets import DEFAULT_BUCKET_MB

log = logging.getLogger(__name__)

Engine = Literal["native", "deepspeed"]

PRESETS: dict[str, dict[str, Any]] = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    "deepspeed_zero1": dict(stage=1, engine="deepspeed"),
    "deepspeed_zero2": dict(stage=2, engine="deepspeed"),
    "deepspeed_zero3": dict(stage=3, engine="deepspeed"),
    "deepspeed_zero3_offload": dict(stage=3, engine="deepspeed", offload_optimizer=True, offload_params=True),
}
"""Registered strategy names -> ZeroStrategy init args."""

def validate_zero_args(*, stage: int, offload_optimizer: bool, offload_params: bool, engine: str) -> None:
    """Raise ``ValueError`` naming the parameter for a configuration no engine can run."""
    if engine not in ("native", "deepspeed"):
        raise ValueError(f"ZeroStrategy: engine={engine!r}, must be 'native' or 'deepspeed'")
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroStrategy: stage={stage!r}, must be 1, 2 or 3")
    if offload_params and stage != 3:
        raise ValueError(f"ZeroStrategy: offload_params=True needs stage=3 (got stage={stage}); parameters are only "
                         "partitioned, hence offloadable, in stage 3")
    if engine == "native" and stage == 3 and offload_optimizer != offload_params:
        raise ValueError("ZeroStrategy(engine='native', stage=3): offload_optimizer and offload_params must be equal - "
                         "FSDP2's CPUOffloadPolicy moves parameter shards, their gradients and hence the optimizer "
                         "states together")


NATIVE_ONLY: dict[str, Any] = {"save_distributed_checkpoint": True, "activation_checkpointing": False,
                               "bucket_size_mb": DEFAULT_BUCKET_MB}
"""``ZeroStrategy`` options the DeepSpeed engine has no argument for, with their defaults (only those pass)."""


class _EngineChoice:
    """``ZeroStrategy(engine="deepspeed", ...)`` constructs a ``DeepSpeedZeroStrategy`` instead. A base class rather
    than ``ZeroStrategy.__new__``: jsonargparse reads a class's own ``__new__`` as its signature, which would hide
    ``__init__``'s arguments (``activation_checkpointing``, ...) from ``--trainer.strategy.OPTION``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is ZeroStrategy and kwargs.get("engine", "native") == "deepspeed":
            from lightning_llm.strategies.zero_deepspeed import DeepSpeedZeroStrategy

            kwargs.pop("engine")
            if args:
                kwargs["stage"] = args[0]
            for name, default in NATIVE_ONLY.items():  # the CLI passes every option, at its default when not given
                if name in kwargs and kwargs.pop(name) != default:
                    raise ValueError(f"ZeroStrategy(engine='deepspeed'): {name} is an option of the native engine; "
                                     "DeepSpeed takes its equivalent from --trainer.strategy.config (a DeepSpeed "
                                     "JSON)")
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
        activation_checkpointing: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
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
            activation_checkpointing: Recompute each transformer block in backward.
            bucket_size_mb: Data-parallel gradient buckets in MiB (DDP's default): each bucket's reduction starts
                during backward as soon as its gradients are ready.
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
                         activation_checkpointing=activation_checkpointing, bucket_size_mb=bucket_size_mb,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.stage = stage
        self.engine = engine

    @classmethod
    def register_presets(cls, registry: Any) -> None:
        """Add :data:`PRESETS` to Lightning's ``StrategyRegistry`` (skips names already registered)."""
        from lightning_llm.strategies.zero_deepspeed import DeepSpeedZeroStrategy

        for name, args in PRESETS.items():
            if name in registry:
                continue
            args = dict(args)
            if args.pop("engine", "native") == "deepspeed":
                registry.register(name, DeepSpeedZeroStrategy, description=f"ZeRO preset {args} (DeepSpeed)", **args)
            else:
                registry.register(name, cls, description=f"ZeRO preset {args} (native)", **args)

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
        return _write_export(sd, path, adapter_only=adapter_only, rank0=self.is_global_zero, barrier=self.barrier)


def check_adapter(module: nn.Module, adapter_only: bool) -> None:
    """Raise on every rank (before any collective) when an adapter export is asked of a model without one."""
    if adapter_only and not any("lora_" in n for n, _ in module.named_parameters()):
        raise ValueError("export_consolidated(adapter_only=True): the model has no lora_* parameters")


def _write_export(sd: dict[str, torch.Tensor], path: _PATH, *, adapter_only: bool, rank0: bool,
                  barrier: Any) -> Path | None:
    if adapter_only:
        sd = {k: v for k, v in sd.items() if "lora_" in k}
    out = Path(path)
    if rank0:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(sd, out)
        log.info("exported %d tensors (%s elements) to %s", len(sd), f"{sum(v.numel() for v in sd.values()):,}", out)
    barrier()
    return out if rank0 else None


class ExportWeights(pl.Callback):
    """At the end of ``fit``, write the consolidated backbone weights (or only the LoRA adapter) to ``path``."""

    def __init__(self, path: str, adapter_only: bool = False) -> None:
        """
        Args:
            path: Output file (``torch.save`` of a ``state_dict`` with full tensors).
            adapter_only: Only ``lora_*`` tensors.
        """
        self.path = path
        self.adapter_only = adapter_only

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        export = getattr(trainer.strategy, "export_consolidated", None)
        if export is not None:
            export(self.path, adapter_only=self.adapter_only)
            return
        module = getattr(pl_module, "model", None) or pl_module
        check_adapter(module, self.adapter_only)
        sd = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        _write_export(sd, self.path, adapter_only=self.adapter_only, rank0=trainer.is_global_zero,
                      barrier=trainer.strategy.barrier)
