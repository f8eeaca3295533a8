"""Gradients of a native-engine step, written once for every layout: backward (a pipeline's schedule already ran it:
its gradients are put back), the data-parallel reduction awaited once per optimizer step (:mod:`.grad_buckets`;
FSDP2 reduce-scatters its own units), tensor-parallel ``Partial`` gradients reduced, global-norm clipping over every
shard, stage and replica, and accumulation micro-batches without communication.

:class:`EngineGradients` is a part of :class:`~.engine.ParallelEngine`; it reads what the engine set up: ``dims``,
``zero_stage``, ``stages`` (``pipelined``), ``_params``, ``_sharded_logits`` and ``_batch_idx``, and the groups its
reduction runs over; it sets up the reduction itself with the optimizers (``_reducer``; ZeRO-1/2: the partitioned
optimizers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from torch.distributed.tensor.parallel import loss_parallel as _loss_parallel_ctx
from typing_extensions import override

from lightning_llm.strategies.engine.grad_buckets import GradReducer, reducer_for
from lightning_llm.strategies.mesh import MESH_DIMS, ParallelDims
from lightning_llm.strategies.tensor.parallelize import clip_grads_by_global_norm, reduce_partial_grads
from lightning_llm.strategies.zero.native import PartitionedOptimizer, gradient_sync_paused, partition_optimizers

__all__ = ["EngineGradients"]


class EngineGradients(ParallelStrategy):
    """Backward, gradient reduction, clipping and accumulation of the native engine (see the module doc)."""

    dims: ParallelDims | None
    zero_stage: int
    offload_optimizer: bool
    args: Any  # layout.LayoutArgs
    stages: Any  # layout.PipelineStages (pp > 1)
    replica_rank: int
    _params: list[nn.Parameter]
    _dp_group: Any
    _mesh: Any
    _stage_group: Any = None  # the ranks of a pipeline stage (dp x cp x tp), built for Muon under tp
    _replica_mesh: Any
    _expert_mesh: Any
    _reducer: GradReducer | None
    _grad_hooks: list[Any]
    _sharded_logits: bool  # the task's loss receives vocab-sharded DTensor logits
    _grads_finalized: bool  # the current gradients are reduced and averaged (see _finalize_gradients)
    _batch_idx: int

    @property
    def pipelined(self) -> bool:
        raise NotImplementedError

    @property
    def grad_reducer(self) -> GradReducer | None:
        """The data-parallel gradient reduction (set up with the optimizers when fitting), else ``None``."""
        return self._reducer

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for h in self._grad_hooks:
            h.remove()
        assert self.dims is not None
        owners: dict[int, int] = {}  # ZeRO-2: id(param) -> the dp rank that keeps its gradient
        self._check_muon_offload()
        # Over one data-parallel rank a partition is the whole: the task's optimizer steps as it is (no wrapper, no
        # per-step group copies), unless the states are offloaded to the CPU.
        if self.zero_stage in (1, 2) and (self.dims.replicas > 1 or self.offload_optimizer):
            self.optimizers, owners = partition_optimizers(
                self.optimizers, self.lr_scheduler_configs, dp_mesh=self._replica_mesh, stage=self.zero_stage,
                offload=self.offload_optimizer, bucket_size_mb=self.args.bucket_size_mb)
        experts = None
        if self._expert_mesh is not None:
            edp = self._expert_mesh["edp"]
            experts = (edp.get_group(), edp.size(), edp.get_local_rank())
        self._reducer = reducer_for(self.lightning_module, group=self._dp_group, world=self.dims.replicas,
                                    rank=self.replica_rank, bucket_size_mb=self.args.bucket_size_mb, owners=owners,
                                    experts=experts)
        # A pipeline's backward runs inside its schedule: it reduces after the schedule (PipelineStages), no hooks.
        self._grad_hooks = [] if self.pipelined else self._reducer.register_hooks()
        self._share_muon()

    def _share_muon(self) -> None:
        """Muon shares Newton-Schulz of its plain parameters over every rank that holds them with the same reduced
        gradient. Unwrapped (ZeRO-0): the ranks of a pipeline stage (dp x cp x tp; the task only knows the
        data-parallel ones). Inside ZeRO-1/2's :class:`PartitionedOptimizer`: an owner's tensor-parallel ranks, which
        own the same parameters (the experts stay whole under tp: else every tp rank would orthogonalise them)."""
        assert self.dims is not None
        if self.dims.tp == 1:
            return
        for opt in self.optimizers:
            inner = getattr(opt, "_optimizer", opt)
            if isinstance(inner, PartitionedOptimizer):
                if hasattr(inner.local_optimizer, "replica_group"):
                    inner.local_optimizer.replica_group = self._mesh["tp"].get_group()
            elif hasattr(inner, "replica_group"):
                if self._stage_group is None:  # built once (a mesh dim flattened under one name)
                    dims = [d for d in ("dp", "cp", "tp") if self._mesh.size(MESH_DIMS.index(d)) > 1]
                    stage = self._mesh[tuple(dims)]._flatten("_".join(dims)) if len(dims) > 1 else self._mesh[dims[0]]
                    self._stage_group = stage.get_group()
                inner.replica_group = self._stage_group

    def _check_muon_offload(self) -> None:
        """Muon (param groups marked ``muon``) orthogonalises whole matrices gathered from their shards on the
        device: offloaded states (fp32 CPU masters of shards, FSDP2's CPU shards) are refused before the first step."""
        muon = any(g.get("muon") for opt in self.optimizers for g in getattr(opt, "param_groups", []))
        sharded = self.dims is not None and (self.dims.tp > 1 or self.zero_stage == 3)
        if muon and sharded and (self.offload_optimizer or getattr(self, "offload_params", False)):
            raise ValueError(f"--model.optim.name=muon: not with offloaded optimizer states under a sharded layout "
                             f"(ZeRO-{self.zero_stage}, tp={self.dims.tp}); use the layout without offload")

    @contextlib.contextmanager
    def _loss_context(self) -> Generator[None, None, None]:
        with _loss_parallel_ctx() if self._sharded_logits else contextlib.nullcontext():
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if not self.pipelined:
            self._grads_finalized = False  # this backward adds gradients no replica has averaged yet
            with self._loss_context():
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward; put its gradients (kept aside from Lightning's zero_grad) back.
        assert self.stages is not None and self.dims is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accum = module.trainer.accumulate_grad_batches
        self.stages.restore_grads(self._params, accumulate=accum, first=self._batch_idx % accum == 0)
        reduce_partial_grads(self._params)
        if self._reducer is not None and not self._reducer.paused:  # the last micro-batch of the window
            self._reducer.finish()
            self.stages.sum_tied()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.pipelined:  # gradients were finalized in backward()
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_sync() -> Any:
            out = closure()
            self._finalize_gradients()
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @torch.no_grad()
    def _finalize_gradients(self) -> None:
        """pp == 1, once per optimizer step: wait for the data-parallel reduction backward started (every gradient
        the replicas hold whole; FSDP2 reduce-scatters its units), then reduce TP ``Partial`` grads. Runs before
        clipping: Lightning clips after the closure in automatic optimization, while a manual-optimization task
        (PPO, GRPO) clips before ``opt.step()``, where the clip itself finalizes first; the second call of the step
        is then a no-op."""
        if self._grads_finalized:
            return
        if self._reducer is not None:
            self._reducer.finish()
        reduce_partial_grads(self._params)
        self._grads_finalized = True

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient communication on accumulation micro-batches (bucketed reduction, FSDP2 reduce-scatter)."""
        if self.dims is None:
            yield
            return
        with gradient_sync_paused(self.lightning_module, self._reducer):
            yield

    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        assert self.dims is not None
        if not self.pipelined:
            self._finalize_gradients()  # the norm of the averaged gradients, not of this replica's own
        params = [p for g in optimizer.param_groups for p in g["params"]]
        copy = self.stages.tied_copy() if self.stages is not None else None
        clip_grads_by_global_norm(params, clip_val, pp=self.dims.pp, dp=self.dims.replicas,
                                  grads_sharded_over_dp=self.zero_stage == 2 and not self.pipelined,
                                  skip=[copy] if copy is not None else [], device=self.root_device)
