"""Megatron-style tensor parallelism on DTensor: column/row-parallel blocks, vocab-parallel embedding and loss,
optional sequence parallelism. Registered as ``tp``.

``--trainer.strategy=tp`` puts all devices in one tensor-parallel group; ``tensor_parallel_size=k`` with ``n`` devices
gives ``n/k`` data-parallel replicas (gradients averaged over the ``dp`` mesh dim before each optimizer step).
The model is built by the task's ``configure_model`` (full weights, same seed on every rank) and sharded here with
``parallelize_module`` following a plan from :mod:`lightning_llm.strategies.plans` (or the user's ``plan``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel_ctx
from torch.distributed.tensor.parallel import parallelize_module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm.contract import Capabilities
from lightning_llm.strategies.parallelize import (
    average_replicated_grads,
    local_loss,
    reduce_partial_grads,
    sharded_logits_for,
)
from lightning_llm.strategies import checkpoint as ckpt
from lightning_llm.strategies.mesh import ParallelDims, device_type_of, mesh_coordinate
from lightning_llm.models import parallel_spec_of
from lightning_llm.strategies.plans import TPPlan, tp_plan, validate_tp_for

log = logging.getLogger(__name__)

__all__ = ["TensorParallelStrategy"]

PlanArg = TPPlan | Callable[[nn.Module], TPPlan] | str | None


def _resolve_plan_fn(spec: str) -> Callable[[nn.Module], TPPlan]:
    """``"pkg.module:function"`` (or ``pkg.module.function``) -> the function."""
    mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"plan={spec!r}: cannot import a plan function from it ({e})") from e
    if not callable(fn):
        raise ValueError(f"plan={spec!r} is not callable")
    return fn


class TensorParallelStrategy(ModelParallelStrategy):
    """Tensor parallelism (Megatron column/row split) with optional sequence parallelism and vocab-parallel loss.

    Args:
        tensor_parallel_size: Ranks per tensor-parallel group; ``-1`` = all devices. Must divide devices x nodes;
            the quotient is the data-parallel degree.
        sequence_parallel: Shard the residual stream on the sequence dim between blocks (norms/dropout on
            ``[B, S/tp, H]``; all-gather + reduce-scatter instead of all-reduce).
        loss_parallel: Keep the LM head's logits vocab-sharded and compute cross-entropy on the shards
            (``torch.distributed.tensor.parallel.loss_parallel``) instead of gathering ``[B, S, V]``.
        plan: A custom plan for a custom model: a dict ``module path -> ParallelStyle`` (relative to the task's
            ``model`` attribute, or the LightningModule when it has none), a callable ``model -> plan``, or its
            import path ``"pkg.module:function"``. Default: the plan of our decoder/encoder families.
        save_distributed_checkpoint: Save sharded DCP directories (``True``) or one consolidated file from rank 0.
    """

    strategy_name = "tp"

    def __init__(
        self,
        tensor_parallel_size: int = -1,
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        plan: PlanArg = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size="auto",
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        if tensor_parallel_size == 0 or tensor_parallel_size < -1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: must be a positive integer or -1 "
                             "(all devices)")
        self.tp_size_arg = tensor_parallel_size
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.plan = plan
        self._sharded_logits = False  # whether the task's loss receives vocab-sharded DTensor logits
        self.dims: ParallelDims | None = None
        self._parallelized: nn.Module | None = None

    # ------------------------------------------------------------------------------------------ layout
    def _world_size_from_devices(self) -> int:
        return max(1, self.num_processes) * self.num_nodes

    def _check_degrees(self, world_size: int) -> ParallelDims:
        tp = world_size if self.tp_size_arg == -1 else self.tp_size_arg
        if world_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the number of devices "
                             f"(devices x nodes = {world_size})")
        return ParallelDims(dp=-1, tp=tp, pp=1).resolved(world_size)

    @override
    def _configure_launcher(self) -> None:
        # Fail at Trainer construction, before any process is launched.
        self._check_degrees(self._world_size_from_devices())
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()  # process group (ModelParallelStrategy's helper; also runs the accelerator setup)
        self.dims = self._check_degrees(self.world_size)
        self._device_mesh = self.dims.build_mesh(device_type_of(self.root_device))
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        log.info("tensor parallel: tp=%d dp=%d sequence_parallel=%s loss_parallel=%s", self.dims.tp, self.dims.dp,
                 self.sequence_parallel, self.loss_parallel)

    @property
    def tp_mesh(self) -> Any:
        return self.device_mesh["tp"]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks of one tensor-parallel group must see identical batches: key the sampler by the dp coordinate.
        rank, size = mesh_coordinate(self.device_mesh, "dp")
        return {"num_replicas": size, "rank": rank}

    # ------------------------------------------------------------------------------------------ model
    def _target(self) -> nn.Module:
        """The module the plan paths are relative to: ``pl_module.model`` (our tasks) or the LightningModule."""
        pl_module = self.lightning_module
        assert pl_module is not None
        model = getattr(pl_module, "model", None)
        return model if isinstance(model, nn.Module) else pl_module

    @property
    def capabilities(self) -> Capabilities:
        """Tensor-parallel ranks of one replica share its batch; the model is whole on each, so generation works."""
        if self.dims is None:
            return Capabilities()
        return Capabilities(data_parallel_size=self.dims.dp, batch_shared=self.dims.tp > 1,
                            data_parallel_group=self.device_mesh["dp"].get_group())

    def build_plan(self, model: nn.Module) -> TPPlan:
        if self.plan is None:
            return tp_plan(model, sequence_parallel=self.sequence_parallel, loss_parallel=self._sharded_logits)
        plan = self.plan
        if isinstance(plan, str):
            plan = _resolve_plan_fn(plan)
        if callable(plan):
            plan = plan(model)
        if not isinstance(plan, Mapping):
            raise ValueError(f"plan: expected a dict of module path -> ParallelStyle, got {type(plan).__name__}")
        return dict(plan)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Validate the model's dimensions against the TP size, then shard it in place following the plan."""
        assert self.dims is not None
        validate_tp_for(model, self.dims.tp)
        if self.dims.tp == 1:
            return model
        plan = self.build_plan(model)
        trainable = {n: p.requires_grad for n, p in model.named_parameters()}
        tied = self._tied_parameters(model)
        parallelize_module(model, self.tp_mesh, plan)
        for name, p in model.named_parameters():  # some styles (SequenceParallel) re-create params trainable
            if name in trainable:
                p.requires_grad_(trainable[name])
        for dst, src in tied:  # parallelize_module distributes each module separately: tie the shards again
            self._set_param(model, dst, self._get_param(model, src))
        if any(p.is_meta for p in model.parameters()):
            # Built on the meta device: allocate the local shards, then initialise them (DTensor-aware init).
            model.to_empty(device=self.root_device)
            found = parallel_spec_of(model)
            init = getattr(found[1], found[2].init, None) if found else getattr(model, "init_weights", None)
            if init is None:
                raise RuntimeError("model has meta parameters but no init_weights() to materialise them")
            init()
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        log.info("tensor-parallel plan applied (%d entries); %s parameters on this rank", len(plan), f"{local:,}")
        return model

    @staticmethod
    def _tied_parameters(model: nn.Module) -> list[tuple[str, str]]:
        seen: dict[int, str] = {}
        tied = []
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                tied.append((name, seen[id(p)]))
            else:
                seen[id(p)] = name
        return tied

    @staticmethod
    def _get_param(model: nn.Module, name: str) -> nn.Parameter:
        mod_name, _, attr = name.rpartition(".")
        return getattr(model.get_submodule(mod_name), attr)

    @staticmethod
    def _set_param(model: nn.Module, name: str, p: nn.Parameter) -> None:
        mod_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, p)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.plugins.precision import MixedPrecision

        assert self.dims is not None
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None \
                and self.dims.tp > 1:
            # GradScaler's inf check is per rank: with sharded gradients the ranks could disagree on skipping a step.
            raise ValueError(f"--trainer.precision={self.precision_plugin.precision}: fp16 loss scaling is not "
                             "supported with strategy=tp (tensor_parallel_size > 1); use bf16-mixed or 32-true")
        target = self._target()
        if self._parallelized is not target:  # setup runs again for validate/test after fit
            # Vocab-sharded logits only reach a loss that declares it handles them; other task code gets full ones.
            self._sharded_logits = sharded_logits_for(self.lightning_module, requested=self.loss_parallel,
                                                      tp=self.dims.tp)
            self.parallelize(target)
            self._parallelized = target
        super().setup(trainer)
        # Lightning's clip_grad_norm_ cannot mix DTensor shards with plain (replicated) grads: use the global norm.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        from lightning_llm.strategies.parallelize import clip_grads_by_global_norm

        assert self.dims is not None
        params = [p for g in optimizer.param_groups for p in g["params"]]
        clip_grads_by_global_norm(params, clip_val, dp=self.dims.dp, device=torch.device("cpu"))

    # ------------------------------------------------------------------------------------------ steps
    @contextlib.contextmanager
    def _loss_context(self) -> Generator[None, None, None]:
        ctx = _loss_parallel_ctx() if self._sharded_logits else contextlib.nullcontext()
        with ctx:
            yield

    _local_loss = staticmethod(local_loss)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return self._local_loss(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return self._local_loss(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return self._local_loss(super().test_step(*args, **kwargs))

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        # Values logged with sync_dist=True may be replicated DTensors (the loss under loss_parallel); c10d
        # collectives need plain tensors.
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        with self._loss_context():  # the vocab-parallel cross-entropy backward dispatches on DTensors too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            out = closure()
            self.finalize_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @torch.no_grad()
    def finalize_gradients(self) -> None:
        """Make gradients match their parameters before the update: reduce ``Partial`` grads of replicated DTensor
        params (sequence-parallel norms, LoRA factors next to sharded layers) once per step, and average over the
        data-parallel replicas when ``dp > 1``."""
        assert self.model is not None and self.dims is not None
        params = list(self.model.parameters())
        reduce_partial_grads(params)
        average_replicated_grads(params, dp_group=self.device_mesh["dp"].get_group(), dp=self.dims.dp)

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return ckpt.model_state_dict(self.model, full=not self._save_distributed_checkpoint)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated (unsharded) weights of the LightningModule on rank 0, ``{}`` on other ranks (collective)."""
        assert self.model is not None
        return ckpt.full_state_dict(self.model)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(filepath))
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        ckpt.save_sharded(path, model_state=model_state, optimizer_states=optimizer_states, metadata=checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if not ckpt.is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)  # a consolidated single file
        assert self.model is not None and self.lightning_module is not None
        return ckpt.load_sharded(path, model=self.model, optimizers=self.optimizers,
                                 strict=self.lightning_module.strict_loading, weights_only=weights_only)
