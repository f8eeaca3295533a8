"""ZeRO-sharded data parallel: one strategy front for stages 1/2/3, CPU offload, and two engines.

``ZeroStrategy(stage=..., offload_optimizer=..., offload_params=..., engine="native" | "deepspeed")``:

* ``engine="native"`` (this class): stages 1/2 partition optimizer states (and gradients) over the ``dp`` mesh dim with
  :class:`~lightning_llm.strategies.zero_native.PartitionedOptimizer`; stage 3 is FSDP2 (see ``zero_native.py``).
* ``engine="deepspeed"``: constructing ``ZeroStrategy`` returns a
  :class:`~lightning_llm.strategies.zero_deepspeed.DeepSpeedZeroStrategy` (``deepspeed.initialize``, CPU included).

Registered presets: ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload`` (native) and
``deepspeed_zero1/2/3``, ``deepspeed_zero3_offload``.

Checkpoints: ``Trainer.save_checkpoint(path)`` writes a sharded directory (stage 3: torch.distributed.checkpoint
shards; stages 1/2: the replicated weights once plus one optimizer shard per rank), loaded back by ``ckpt_path``. The
consolidated export (:meth:`ZeroStrategy.export_consolidated`, or the :class:`ExportWeights` callback) writes the full
backbone ``state_dict`` (or only the LoRA adapter) as one ``torch.save`` file - full tensors, never shards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm.contract import Capabilities
from lightning_llm.strategies.mesh import ParallelDims, device_type_of, mesh_coordinate
from lightning_llm.strategies.parallelize import average_replicated_grads
from lightning_llm.strategies.zero_native import (
    PartitionedOptimizer,
    apply_fsdp,
    fsdp_units,
    register_grad_hooks,
)

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

_NATIVE_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true")


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


class ZeroStrategy(ModelParallelStrategy):
    """ZeRO data parallelism (stage 1, 2 or 3) over the ``dp`` dim of a :class:`ParallelDims` mesh.

    With ``engine="deepspeed"`` the constructor returns a ``DeepSpeedZeroStrategy`` configured from the same args.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is ZeroStrategy and kwargs.get("engine", "native") == "deepspeed":
            from lightning_llm.strategies.zero_deepspeed import DeepSpeedZeroStrategy

            kwargs.pop("engine")
            if args:
                kwargs["stage"] = args[0]
            return DeepSpeedZeroStrategy(**kwargs)
        return super().__new__(cls)

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
            save_distributed_checkpoint: Stage 3: sharded checkpoints (``True``) or one full file from rank 0.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        validate_zero_args(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                           engine=engine)
        if optimizer is not None or config is not None:
            raise ValueError("ZeroStrategy: optimizer= and config= select DeepSpeed optimizers/config; they need "
                             "engine='deepspeed' (the native engine uses the task's configure_optimizers)")
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.stage = stage
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.engine = engine
        self._dims: ParallelDims | None = None
        self._grad_hooks: list[Any] = []

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

    # ------------------------------------------------------------------------------------------ mesh
    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.device_mesh["dp"]

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._dims = ParallelDims(dp=-1, tp=1, pp=1).resolved(self.world_size)
        self._device_mesh = self._dims.build_mesh(device_type_of(self.root_device))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = mesh_coordinate(self.device_mesh, "dp")
        return {"num_replicas": size, "rank": rank}

    @property
    def capabilities(self) -> Capabilities:
        """Every rank is a data-parallel replica holding (or gathering) the whole model."""
        if self._dims is None:
            return Capabilities()
        return Capabilities(data_parallel_size=self._dims.dp, data_parallel_group=self.dp_mesh.get_group())

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        precision = str(self.precision_plugin.precision)
        if precision not in _NATIVE_PRECISIONS:
            raise ValueError(f"ZeroStrategy(engine='native'): --trainer.precision={precision} is not supported; use "
                             f"one of {', '.join(_NATIVE_PRECISIONS)} (or engine='deepspeed' for fp16 loss scaling)")
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        if self.stage == 3:
            apply_fsdp(self.model, dp_mesh=self.dp_mesh, units=fsdp_units(self.model), reshard_after_forward=True,
                       precision=precision, offload=self.offload_params)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.offload_params:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self.stage == 2:
            # Stage 2 keeps each gradient on its owner only: Lightning's local norm would miss the others' shards.
            self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        from lightning_llm.strategies.parallelize import clip_grads_by_global_norm

        assert self._dims is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        clip_grads_by_global_norm(params, clip_val, dp=self._dims.dp, grads_sharded_over_dp=True)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.stage != 3:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_sync() -> Any:
            # FSDP2 reduce-scatters the gradients of its units; a task's own modules outside them are replicated.
            out = closure()
            assert self.model is not None and self._dims is not None
            average_replicated_grads(self.model.parameters(), dp_group=self.dp_mesh.get_group(), dp=self._dims.dp)
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.offload_params:  # FSDP2 CPU offload keeps the shards on the host
            self.model.to(self.root_device)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if self.stage == 3:
            return
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        wrapped: list[Optimizer] = []
        for opt in self.optimizers:
            opt = getattr(opt, "_optimizer", opt)
            zero = PartitionedOptimizer(opt, dp_mesh=self.dp_mesh, stage=self.stage, offload=self.offload_optimizer)
            for cfg in self.lr_scheduler_configs:  # schedulers keep working: same param-group dicts
                if getattr(cfg.scheduler, "optimizer", None) is opt:
                    cfg.scheduler.optimizer = zero
            assert self.model is not None
            self._grad_hooks += register_grad_hooks(self.model, zero)
            wrapped.append(zero)
        self.optimizers = wrapped

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient communication on accumulation micro-batches (reduced on the last one)."""
        partitioned = [o for o in (getattr(x, "_optimizer", x) for x in self.optimizers)
                       if isinstance(o, PartitionedOptimizer)]
        fsdp_modules = [m for m in self.model.modules() if hasattr(m, "set_requires_gradient_sync")] \
            if self.model is not None and self.stage == 3 else []
        for o in partitioned:
            o.sync_grads = False
        for m in fsdp_modules:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for o in partitioned:
                o.sync_grads = True
            for m in fsdp_modules:
                m.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _partitioned(self) -> bool:
        return self.stage in (1, 2)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._partitioned():
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()  # replicated: every rank holds the full weights
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        opt = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(opt, PartitionedOptimizer):
            return opt.local_state_dict()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self._partitioned():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        if path.is_file():
            self.barrier()
            if self.is_global_zero:
                path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        shards = checkpoint.pop("optimizer_states", [])
        torch.save({"optimizer_states": shards}, path / f"optim-rank{self.global_rank:05d}.pt")
        if self.is_global_zero:
            torch.save(checkpoint, path / "model.pt")  # weights (replicated) + loop/scheduler/callback states
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if not self._partitioned():
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(str(checkpoint_path)))
        if not (path / "model.pt").is_file():
            raise FileNotFoundError(f"ckpt_path={path}: not a ZeRO-{self.stage} checkpoint directory (no model.pt)")
        checkpoint = torch.load(path / "model.pt", map_location="cpu", weights_only=False)
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=self.lightning_module.strict_loading)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            shard_file = path / f"optim-rank{self.global_rank:05d}.pt"
            if not shard_file.is_file():
                raise FileNotFoundError(f"ckpt_path={path}: missing {shard_file.name}; a ZeRO-{self.stage} checkpoint "
                                        "resumes with the world size it was saved with")
            shards = torch.load(shard_file, map_location="cpu", weights_only=False)["optimizer_states"]
            for opt, state in zip(self.optimizers, shards):
                getattr(opt, "_optimizer", opt).load_state_dict(state)
        return checkpoint

    def export_consolidated(self, path: _PATH, *, adapter_only: bool = False) -> Path | None:
        """Write the backbone's full ``state_dict`` (``adapter_only``: only ``lora_*`` tensors) to one file on rank 0.

        A collective under stage 3 (shards are all-gathered): call it on every rank. Returns the path on rank 0.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.lightning_module is not None
        backbone: nn.Module = getattr(self.lightning_module, "model", None) or self.lightning_module
        check_adapter(backbone, adapter_only)
        if self.stage == 3:
            sd = get_model_state_dict(backbone, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            sd = {k: v.detach().cpu() for k, v in backbone.state_dict().items()}
        return _write_export(sd, path, adapter_only=adapter_only, rank0=self.is_global_zero, barrier=self.barrier)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint


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
