"""3-D parallelism: data x tensor x pipeline parallel with ZeRO on the data-parallel dim (registered as ``3d``).

One :class:`~lightning_llm.strategies.mesh.ParallelDims` validates the degrees (product = devices x nodes, one may
be ``-1``) and builds the named mesh ``("pp", "dp", "tp")``; every group below is a dim of that mesh.

Order of application in :meth:`HybridParallelStrategy.setup` (the task has built the full model, same seed on
every rank, in ``configure_model``):

1. pipeline split (``pp > 1``): keep this rank's stages, names stay global (:mod:`.pipeline_split`);
2. tensor parallelism on the ``tp`` dim (:func:`.parallelize.apply_tensor_parallel`);
3. activation checkpointing of the local blocks;
4. ZeRO on the ``dp`` dim: stage 1/2 partition the optimizer (and gradients) with
   :class:`~.zero_native.PartitionedOptimizer`, stage 3 is FSDP2 over ``dp`` (2-D with TP shards).

Steps: with ``pp > 1`` the pipeline runtime of :class:`~.pipeline_parallel.PipelineParallelStrategy` (this class's
base) runs each batch's schedule; with ``pp == 1`` Lightning's usual training_step/backward run on the TP/FSDP
model. Gradients are averaged over ``dp`` once per optimizer step (ZeRO-0/1; ZeRO-2 reduces to owners, FSDP
reduce-scatters), and ``gradient_clip_val`` clips by the global norm over every shard, stage and replica.

Unsupported combinations raise before training: ``zero_stage`` 2/3 with ``pp > 1``, ``16-mixed`` with ``pp > 1``.
Checkpoints are layout-free DCP directories (:mod:`.hybrid_checkpoint`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel_ctx
from typing_extensions import override

from lightning_llm.contract import Capabilities, check_pipelinable
from lightning_llm.strategies import hybrid_checkpoint as hckpt
from lightning_llm.strategies.mesh import ParallelDims, device_type_of, mesh_coordinate
from lightning_llm.strategies.parallelize import (
    apply_tensor_parallel,
    average_replicated_grads,
    local_loss,
    reduce_partial_grads,
    sharded_logits_for,
)
from lightning_llm.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_llm.strategies.pipeline_runtime import ScheduleName, checkpoint_blocks
from lightning_llm.strategies.pipeline_split import StageSpec, layout_of
from lightning_llm.strategies.zero_native import (
    PartitionedOptimizer,
    apply_fsdp,
    fsdp_units,
    register_grad_hooks,
)

log = logging.getLogger(__name__)

__all__ = ["HybridParallelStrategy"]


class HybridParallelStrategy(PipelineParallelStrategy):
    """DP x TP x PP with ZeRO stage 0-3 on the data-parallel dim, for the built-in model families."""

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel_size: int = -1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        zero_stage: int = 0,
        *,
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        n_microbatches: int = 4,
        schedule: ScheduleName = "1f1b",
        stages_per_rank: int = 1,
        split_points: list[int] | None = None,
        balance: Literal["layers", "params"] = "layers",
        activation_checkpointing: bool = False,
        log_pipeline_stats: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            data_parallel_size: Data-parallel replicas (ZeRO shards); ``-1`` = inferred from the world size.
            tensor_parallel_size: Ranks per tensor-parallel group (Megatron column/row split).
            pipeline_parallel_size: Pipeline ranks.
            zero_stage: 0 (plain gradient averaging), 1 (partitioned optimizer states), 2 (+ gradients; ``pp=1``
                only), 3 (FSDP2 parameter sharding over ``dp``; ``pp=1`` only).
            sequence_parallel: Shard the residual stream on the sequence dim inside each TP group.
            loss_parallel: Vocab-parallel cross-entropy on the TP-sharded logits (``pp=1``; a pipeline's last stage
                gathers the logits instead, since stage outputs are plain tensors).
            n_microbatches, schedule, stages_per_rank, split_points, balance: Pipeline options (see ``strategy=pp``).
            activation_checkpointing: Recompute each transformer block in backward.
            log_pipeline_stats: Log per-rank pipeline busy/idle time every step (``pp > 1``).
        """
        super().__init__(pipeline_parallel_size=pipeline_parallel_size, n_microbatches=n_microbatches,
                         schedule=schedule, stages_per_rank=stages_per_rank, split_points=split_points,
                         balance=balance, activation_checkpointing=activation_checkpointing,
                         log_pipeline_stats=log_pipeline_stats, process_group_backend=process_group_backend,
                         timeout=timeout, **kwargs)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage!r}: must be 0, 1, 2 or 3")
        if zero_stage >= 2 and pipeline_parallel_size != 1:
            raise ValueError(f"zero_stage={zero_stage} with pipeline_parallel_size={pipeline_parallel_size} is not "
                             "supported: a pipeline keeps its gradients aside between the schedule and the optimizer "
                             "step; use zero_stage 0 or 1 with pipeline parallelism")
        self.requested = ParallelDims(dp=data_parallel_size, tp=tensor_parallel_size, pp=pipeline_parallel_size)
        self.requested.resolved(abs(data_parallel_size * tensor_parallel_size * pipeline_parallel_size))  # degrees
        self.zero_stage = zero_stage
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.tp_rank = 0
        self._sharded_logits = False  # whether the task's loss receives vocab-sharded DTensor logits
        self._tp_mesh: Any = None
        self._dp_mesh: Any = None
        self._grad_hooks: list[Any] = []

    # ------------------------------------------------------------------------------------------ layout
    @property
    def pipelined(self) -> bool:
        assert self.dims is not None
        return self.dims.pp > 1

    @override
    def _configure_launcher(self) -> None:
        self.requested.resolved(max(1, self.num_processes) * self.num_nodes)  # fail before launching processes
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        from lightning.fabric.utilities.distributed import (
            _get_default_process_group_backend_for_device,
            _init_dist_connection,
        )
        from lightning.fabric.utilities.seed import reset_seed
        from lightning.pytorch.utilities.rank_zero import rank_zero_only
        from lightning_utilities.core.rank_zero import (
            rank_zero_only as utils_rank_zero_only,
        )

        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self.dims = self.requested.resolved(self.world_size)
        mesh = self.dims.build_mesh(device_type_of(self.root_device))
        self._mesh = mesh
        self.pp_rank, _ = mesh_coordinate(mesh, "pp")
        self.dp_rank, _ = mesh_coordinate(mesh, "dp")
        self.tp_rank, _ = mesh_coordinate(mesh, "tp")
        self._pp_group, self._dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self._tp_mesh, self._dp_mesh = mesh["tp"], mesh["dp"]
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh
        if self.dims.pp > 1:
            self._check_microbatches(self.dims.pp * self.stages_per_rank)
        log.info("3-D mesh pp=%d dp=%d tp=%d zero_stage=%d", self.dims.pp, self.dims.dp, self.dims.tp,
                 self.zero_stage)

    @property
    def device_mesh(self) -> Any:
        return self._mesh

    @property
    @override
    def capabilities(self) -> Capabilities:
        if self.dims is None:
            return Capabilities()
        return Capabilities(data_parallel_size=self.dims.dp, batch_shared=self.dims.tp * self.dims.pp > 1,
                            pipelined=self.pipelined, generation=not self.pipelined,
                            data_parallel_group=self._dp_group)

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.dims is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        model = getattr(module, "model", None)
        if not isinstance(model, nn.Module):
            raise ValueError("strategy=3d needs a task that builds `self.model` in configure_model() (an LLMTask)")
        if self.pipelined:
            check_pipelinable(module, strategy="3d")
        precision = str(self.precision_plugin.precision)
        scaler = isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None
        if scaler and (self.pipelined or self.zero_stage >= 2 or self.dims.tp > 1):
            # GradScaler's inf check is per rank: with sharded gradients the ranks could disagree on skipping a step.
            raise ValueError(f"--trainer.precision={precision}: fp16 loss scaling with strategy=3d needs "
                             "tensor_parallel_size=1, pipeline_parallel_size=1 and zero_stage 0 or 1 (gradients whole "
                             "on every rank); use bf16-mixed or 32-true")
        if self.pipelined:
            self._check_batch_size(trainer)
        self.precision_plugin.convert_module(module)
        if model is not self._pp_model:  # else already parallelized (e.g. trainer.validate() after fit)
            self._parallelize(model, precision=precision)
        self.model_to_device()
        # Every parameter of the task (its model and any module of its own; a pipeline refuses the latter).
        self._pp_model, self._params = model, list(module.parameters())
        if self.pipelined:
            self._build_runner(model)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _parallelize(self, model: nn.Module, *, precision: str) -> None:
        """Pipeline split -> TP -> activation checkpointing -> FSDP (ZeRO-3)."""
        assert self.dims is not None
        if self.pipelined:
            self._split(model)  # also checkpoints the kept blocks when activation_checkpointing is set
        # Vocab-sharded logits only reach a loss that declares it handles them (and never a pipeline's stage output).
        self._sharded_logits = sharded_logits_for(self.lightning_module, requested=self.loss_parallel and not
                                                  self.pipelined, tp=self.dims.tp)
        apply_tensor_parallel(model, self._tp_mesh, sequence_parallel=self.sequence_parallel,
                              loss_parallel=self._sharded_logits)
        if not self.pipelined:
            keys = tuple(getattr(model, layout_of(model).layers).keys())
            self._specs = [StageSpec(0, 1, keys)]
            if self.activation_checkpointing:
                checkpoint_blocks(model, self._specs)
        if self.zero_stage == 3:
            apply_fsdp(self.lightning_module, dp_mesh=self._dp_mesh, units=fsdp_units(self.lightning_module),
                       reshard_after_forward=True,
                       precision=precision)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        if self.zero_stage not in (1, 2):
            return
        wrapped = []
        for opt in self.optimizers:
            opt = getattr(opt, "_optimizer", opt)
            zero = PartitionedOptimizer(opt, dp_mesh=self._dp_mesh, stage=self.zero_stage)
            for cfg in self.lr_scheduler_configs:
                if getattr(cfg.scheduler, "optimizer", None) is opt:
                    cfg.scheduler.optimizer = zero
            if self.pipelined:
                zero.sync_grads = False  # the pipeline averages gradients over dp itself (in backward)
            else:
                assert self._pp_model is not None
                self._grad_hooks += register_grad_hooks(self._pp_model, zero)
            wrapped.append(zero)
        self.optimizers = wrapped

    # ------------------------------------------------------------------------------------------ steps (pp == 1)
    @contextlib.contextmanager
    def _loss_context(self) -> Generator[None, None, None]:
        with _loss_parallel_ctx() if self._sharded_logits else contextlib.nullcontext():
            yield

    _local_loss = staticmethod(local_loss)

    def _plain(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return self._local_loss(getattr(ParallelStrategy, hook)(self, *args, **kwargs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().training_step(*args, **kwargs) if self.pipelined else self._plain("training_step", *args,
                                                                                          **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().validation_step(*args, **kwargs) if self.pipelined else self._plain("validation_step", *args,
                                                                                            **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().test_step(*args, **kwargs) if self.pipelined else self._plain("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().predict_step(*args, **kwargs) if self.pipelined else self._plain("predict_step", *args,
                                                                                         **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.pipelined:
            out = super().backward(closure_loss, optimizer, *args, **kwargs)
            reduce_partial_grads(self._params)
            return out
        with self._loss_context():
            return ParallelStrategy.backward(self, closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.pipelined:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_sync() -> Any:
            out = closure()
            self._finalize_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @torch.no_grad()
    def _finalize_gradients(self) -> None:
        """pp == 1: reduce TP ``Partial`` grads, then average over ``dp`` once per optimizer step what no ZeRO
        mechanism reduced: every gradient under ZeRO-0, the task's own plain parameters under ZeRO-3 (FSDP2
        reduce-scatters its units; ZeRO-1/2 reduce in their gradient hooks)."""
        assert self.dims is not None
        reduce_partial_grads(self._params)
        if self.zero_stage in (0, 3):
            average_replicated_grads(self._params, dp_group=self._dp_group, dp=self.dims.dp)

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient communication on accumulation micro-batches (ZeRO-1/2 hooks, FSDP2 reduce-scatter)."""
        if self.dims is None or self.pipelined:
            yield
            return
        partitioned = [o for o in (getattr(x, "_optimizer", x) for x in self.optimizers)
                       if isinstance(o, PartitionedOptimizer)]
        fsdp = [m for m in self.lightning_module.modules() if hasattr(m, "set_requires_gradient_sync")]
        for o in partitioned:
            o.sync_grads = False
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for o in partitioned:
                o.sync_grads = True
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)

    @override
    def _norm_kwargs(self) -> dict[str, Any]:
        # ZeRO-2 keeps each gradient on its owner only (pp == 1): the norm counts each shard once.
        return {**super()._norm_kwargs(), "grads_sharded_over_dp": self.zero_stage == 2 and not self.pipelined}

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    # ------------------------------------------------------------------------------------------ checkpoints
    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer states are loaded by name in load_checkpoint

    def layout(self) -> dict[str, Any]:
        assert self.dims is not None
        return {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp, "zero_stage": self.zero_stage}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the DCP writer takes the module's (sharded) state dict itself

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy=3d: save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        assert self.lightning_module is not None
        hckpt.save_hybrid(path, module=self.lightning_module, optimizers=self.optimizers, metadata=meta,
                          layout=self.layout(), is_global_zero=self.is_global_zero, barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not hckpt.is_hybrid_checkpoint(path):
            raise FileNotFoundError(f"--ckpt_path={path}: not a strategy=3d checkpoint directory (convert a plain "
                                    "Lightning .ckpt by loading it with strategy=3d on one device and saving)")
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return hckpt.load_hybrid(path, module=self.lightning_module, optimizers=self.optimizers if fitting else [],
                                 strict=self.lightning_module.strict_loading)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            import shutil

            shutil.rmtree(filepath, ignore_errors=True)
