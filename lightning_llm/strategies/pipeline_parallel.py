"""Pipeline parallelism inside Lightning's loop, built on ``torch.distributed.pipelining`` (registered as ``pp``).

How a step runs (tasks are unchanged):

* ``configure_model`` builds the full model as usual; :meth:`PipelineParallelStrategy.setup` splits it
  (:mod:`.pipeline_split`): this rank keeps only its stages' blocks/embeddings/head (names stay global, so the
  optimizer and checkpoints hold exactly this rank's shard) and wraps each stage view in a ``PipelineStage``
  (:mod:`.pipeline_runtime`).
* Training: during ``training_step`` the task's ``compute_loss`` is replaced by one that runs the schedule
  (forward *and* backward of every micro-batch). The last stage computes each micro-batch's loss with the task's own
  ``compute_loss``, fed the stage output instead of a model call. The mean loss is sent to every pipeline rank, so
  the task's ``self.log("train_loss", ...)``, the progress bar and checkpoint monitoring see the real value.
* Gradients vs Lightning's closure (training_step -> zero_grad -> backward): the schedule's gradients are moved out
  of ``.grad`` right after the schedule, so Lightning's ``zero_grad`` finds nothing to clear, and are put back in
  :meth:`backward`, which replaces Lightning's ``loss.backward()``. We chose this over running the schedule inside
  ``backward`` because the loss must exist when ``training_step`` logs it, and it keeps Lightning's hook order
  (``on_before_backward``/``on_after_backward``, accumulation, clipping) intact.
* Validation/test run forward-only schedules (the last stage computes loss and metric outputs with the task's
  ``compute_loss`` and sends them to the other ranks); predict gets the last stage's output on every rank.
* Gradient clipping by norm uses the global norm over all stages; checkpoints are a directory with one file per
  pipeline rank (that rank's shard + its optimizer state), see :mod:`.pipeline_checkpoint`.

Per step the strategy logs each rank's busy time (inside stage forward/backward and loss) and idle fraction
(``pp/idle_frac_rank{r}``) and keeps them in :attr:`PipelineParallelStrategy.step_stats`; with
``measure_activations`` it also counts peak live saved-activation bytes (:mod:`.pipeline_stats`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _init_dist_connection
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from typing_extensions import override

from lightning_llm.strategies.mesh import ParallelDims, device_type_of, mesh_coordinate
from lightning_llm.strategies.pipeline_checkpoint import (
    CHECKPOINT_FILE, check_layout, consolidate_checkpoint, pipeline_layout, stage_checkpoint_file,
)
from lightning_llm.strategies.pipeline_runtime import (
    SCHEDULES, ScheduleName, build_schedule, capture_model_inputs, check_microbatches, checkpoint_blocks,
    microbatch_count, model_call, run_schedule, schedule_key, select_microbatch, task_loss,
)
from lightning_llm.strategies.pipeline_split import (
    prune_model, split_layers, stage_module, stage_ranks, stage_specs, tied_across_stages,
)
from lightning_llm.strategies.pipeline_stats import ActivationMeter, BusyTimer, gather_step_stats, log_step_stats

log = logging.getLogger(__name__)

# SCHEDULES, ScheduleName, CHECKPOINT_FILE and consolidate_checkpoint are re-exported: they were defined here first.
__all__ = ["PipelineParallelStrategy", "SCHEDULES", "ScheduleName", "CHECKPOINT_FILE", "consolidate_checkpoint"]


class PipelineParallelStrategy(ParallelStrategy):
    """Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero-bubble) for the built-in model families."""

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
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
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
        """
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
        _, _, fixed_v = SCHEDULES[schedule]
        if stages_per_rank < 1 or (fixed_v is not None and stages_per_rank != fixed_v):
            need = f"must be {fixed_v} for schedule={schedule!r}" if fixed_v else "must be >= 1"
            raise ValueError(f"stages_per_rank={stages_per_rank}: {need}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches={n_microbatches}: must be >= 1")
        if balance not in ("layers", "params"):
            raise ValueError(f"balance={balance!r}: expected 'layers' or 'params'")
        self.pipeline_parallel_size, self.n_microbatches = pipeline_parallel_size, n_microbatches
        self.schedule = schedule
        self.stages_per_rank, self.split_points, self.balance = stages_per_rank, split_points, balance
        self.activation_checkpointing, self.log_pipeline_stats = activation_checkpointing, log_pipeline_stats
        self.measure_activations = measure_activations
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self.pp_rank = self.dp_rank = 0
        self._pp_group: Any = None
        self._dp_group: Any = None
        self._tie_group: Any = None
        self._stage_mods: list[nn.Module] = []
        self._pp_model: nn.Module | None = None  # the task's split model (not Lightning's ``_model``: the task)
        self._params: list[nn.Parameter] = []
        self._specs: list[Any] = []
        self._last_stage_rank = 0  # global rank holding the last stage in this rank's pipeline
        self._schedules: dict[tuple[Any, ...], tuple[Any, list[PipelineStage]]] = {}
        self._grads: tuple[list[Tensor | None], list[Tensor | None]] | None = None
        self._batch_idx = 0
        self._timer = BusyTimer()
        self._meter: ActivationMeter | None = None
        self._current: tuple[Any, str] | None = None  # (batch, stage) whose micro-batch losses the schedule asks for
        self.step_stats: list[dict[str, Any]] = []
        """Per training step: ``busy_s``, ``wall_s``, ``idle_frac`` (lists over pipeline ranks), ``loss`` and, with
        ``measure_activations``, ``peak_act_bytes``/``act_bytes_per_mb`` per rank."""

    # ------------------------------------------------------------------------------------------ environment
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Pipeline ranks of one data-parallel group must see identical batches: key the sampler by dp only.
        dp = self.dims.dp if self.dims is not None else 1
        return {"num_replicas": dp, "rank": self.dp_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints hold this rank's shard: load after the model is split

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        pp = self.pipeline_parallel_size  # degrees that cannot fit fail here, before any process or group starts
        ParallelDims(dp=-1 if pp != -1 else 1, tp=1, pp=pp).resolved(max(1, self.num_processes) * self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        pp = self.pipeline_parallel_size
        self.dims = ParallelDims(dp=-1 if pp != -1 else 1, tp=1, pp=pp).resolved(self.world_size)
        mesh = self.dims.build_mesh(device_type_of(self.root_device))
        self.pp_rank, _ = mesh_coordinate(mesh, "pp")
        self.dp_rank, _ = mesh_coordinate(mesh, "dp")
        self._pp_group, self._dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
        self._mesh = mesh
        self._check_microbatches(self.dims.pp * self.stages_per_rank)

    def _check_microbatches(self, n_stages: int) -> None:
        check_microbatches(n_microbatches=self.n_microbatches, n_stages=n_stages, schedule=self.schedule)

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.dims is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        model = getattr(module, "model", None)
        if not isinstance(model, nn.Module):
            raise ValueError("strategy=pp needs a task that builds `self.model` in configure_model() (an LLMTask)")
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError("--trainer.precision=16-mixed: fp16 loss scaling is not supported with strategy=pp; "
                             "use 32-true, bf16-mixed or bf16-true")
        self._check_batch_size(trainer)
        if model is not self._pp_model:  # else already split: e.g. trainer.validate() after trainer.fit()
            self._split(model)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        self._stage_mods = [stage_module(model, s) for s in self._specs]
        # The real model and its (local) parameters: while a task hook runs, ``task.model`` is a stand-in.
        self._pp_model, self._params = model, list(model.parameters())
        self._schedules.clear()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the local norm; a pipeline rank only has its stages' gradients.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _check_batch_size(self, trainer: pl.Trainer) -> None:
        dm = trainer.datamodule
        bs = getattr(dm, "batch_size", None) if dm is not None else None
        if trainer.state.fn == TrainerFn.FITTING and isinstance(bs, int) and bs % self.n_microbatches:
            raise ValueError(f"--data.batch_size={bs} is not divisible by n_microbatches={self.n_microbatches} "
                             "(strategy=pp splits every batch into equal micro-batches)")

    def _split(self, model: nn.Module) -> None:
        assert self.dims is not None
        n_stages = self.dims.pp * self.stages_per_rank
        layers = split_layers(model, n_stages, split_points=self.split_points, balance=self.balance)
        owners = stage_ranks(self.dims.pp, self.stages_per_rank, style=SCHEDULES[self.schedule][1])
        self._specs = stage_specs(layers, self.pp_rank, owners)
        pp_ranks = self._mesh["pp"].mesh.flatten().tolist()  # global ranks of this pipeline, by pp index
        self._last_stage_rank = pp_ranks[owners[-1]]
        if tied_across_stages(model, n_stages) and owners[0] != owners[-1]:
            # The LM head on the last stage keeps a copy of the token embedding; their gradients are summed.
            all_pp = self._mesh.mesh.permute(1, 2, 0).reshape(-1, self.dims.pp).tolist()  # [dp*tp, pp] global ranks
            for ranks in all_pp:
                group = dist.new_group([ranks[owners[0]], ranks[owners[-1]]])
                if self.global_rank in (ranks[owners[0]], ranks[owners[-1]]):
                    self._tie_group = group
        if self.activation_checkpointing:
            checkpoint_blocks(model, self._specs)
        prune_model(model, self._specs)
        log.info("pipeline rank %d/%d runs stages %s (blocks %s)", self.pp_rank, self.dims.pp,
                 [s.index for s in self._specs], [list(s.layers) for s in self._specs])

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------ schedules
    def _schedule(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool) -> tuple[Any, int]:
        """The (cached) schedule for these input shapes; stages infer their P2P shapes on first use."""
        batch = next(t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, Tensor))
        m = microbatch_count(batch, n_microbatches=self.n_microbatches, train=train)
        key = schedule_key(args, kwargs, train=train, m=m)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                schedule=self.schedule, stage_mods=self._stage_mods, specs=self._specs, device=self.root_device,
                group=self._pp_group, n_microbatches=m, loss_fn=self._microbatch_loss if train else None,
                wrap=self._timer.wrap,
            )
        return self._schedules[key][0], m

    def _run(self, sched: Any, args: tuple[Any, ...], kwargs: dict[str, Any], **step_kwargs: Any) -> Any:
        return run_schedule(sched, self._specs, args, kwargs, **step_kwargs)

    # ------------------------------------------------------------------------------------------ task hooks
    def _microbatch_loss(self, output: Any, index: Tensor) -> Tensor:
        """Schedule loss_fn on the last stage: the task's compute_loss on micro-batch ``index`` of the current batch,
        with the model call answered by the stage output."""
        t0 = time.perf_counter()
        assert self._current is not None
        batch, stage = self._current
        mb = select_microbatch(batch, index.to(self.root_device))
        loss, _ = task_loss(self.lightning_module, mb, stage, output)
        self._timer.busy += time.perf_counter() - t0
        return loss

    def _pipelined_compute_loss(self, batch: Any, stage: str) -> tuple[Tensor, dict[str, Any]]:
        args, kwargs = capture_model_inputs(self.lightning_module, batch, stage)
        if stage == "train":
            return self._train_schedule(batch, args, kwargs), {}
        sched, _ = self._schedule(args, kwargs, train=False)
        out = self._run(sched, args, kwargs)
        result: list[Any] = [None]
        if self.global_rank == self._last_stage_rank:
            loss, outputs = task_loss(self.lightning_module, batch, stage, out)
            result = [(loss.detach(), outputs)]
        dist.broadcast_object_list(result, src=self._last_stage_rank, group=self._pp_group)
        loss, outputs = result[0]
        return loss.to(self.root_device), outputs

    def _train_schedule(self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        assert self.dims is not None
        sched, m = self._schedule(args, kwargs, train=True)
        params = self._params
        prev = [p.grad for p in params]
        for p in params:  # the schedule accumulates into .grad: start from zero, keep earlier accumulation aside
            p.grad = None
        n = args[0].shape[0] if args else next(v.shape[0] for v in kwargs.values() if isinstance(v, Tensor))
        self._current = (batch, "train")
        self._timer.reset()
        losses: list[Tensor] = []
        if self.measure_activations and self._meter is None:
            self._meter = ActivationMeter(params)
        if self._meter is not None:
            self._meter.reset()
        t0 = time.perf_counter()
        with self._meter.hooks() if self._meter is not None else nullcontext():
            self._run(sched, args, kwargs, target=torch.arange(n, device=self.root_device), losses=losses)
        wall = time.perf_counter() - t0
        new = [p.grad for p in params]
        for p in params:  # hidden from Lightning's zero_grad; restored in backward()
            p.grad = None
        self._grads = (prev, new)
        loss, row = gather_step_stats(losses=losses, busy=self._timer.busy, wall=wall, meter=self._meter,
                                      n_microbatches=m, last_pp_rank=self._specs_owner_of_last(), pp_size=self.dims.pp,
                                      group=self._pp_group, device=self.root_device)
        self.step_stats.append(row)
        if self.log_pipeline_stats:
            log_step_stats(self.lightning_module, row, batch_size=n)
        return loss.to(device=self.root_device, dtype=torch.float32)

    def _specs_owner_of_last(self) -> int:
        assert self.dims is not None
        return stage_ranks(self.dims.pp, self.stages_per_rank, style=SCHEDULES[self.schedule][1])[-1]

    @contextmanager
    def _pipelined(self, stage: str | None) -> Iterator[None]:
        """Within a task hook: compute_loss runs the pipeline; any other model call runs a forward-only schedule."""
        module = self.lightning_module
        with model_call(module, self._forward):
            if stage is None:
                yield
                return
            module.compute_loss = self._pipelined_compute_loss  # type: ignore[method-assign]
            try:
                yield
            finally:
                del module.compute_loss

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """A direct model call (e.g. in predict_step): forward-only schedule, last-stage output sent to all ranks."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        sched, _ = self._schedule(args, kwargs, train=False)
        out = [self._run(sched, args, kwargs)]
        dist.broadcast_object_list(out, src=self._last_stage_rank, group=self._pp_group)
        return out[0].to(self.root_device) if isinstance(out[0], Tensor) else out[0]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch_idx = int(args[1]) if len(args) > 1 else int(kwargs.get("batch_idx", 0))
        with self.precision_plugin.train_step_context(), self._pipelined("train"):
            return self.lightning_module.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context(), self._pipelined("val"):
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context(), self._pipelined("test"):
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context(), self._pipelined(None):
            return self.lightning_module.predict_step(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ backward / clipping
    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Replaces ``loss.backward()``: the schedule already ran it; put its gradients (moved aside before
        Lightning's zero_grad) back, averaged over data-parallel replicas and summed across tied copies."""
        module = self.lightning_module
        if self._grads is None:
            raise RuntimeError("strategy=pp: backward() without a pipelined training_step (manual optimization is "
                               "not supported)")
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        prev, new = self._grads
        self._grads = None
        accum = self.lightning_module.trainer.accumulate_grad_batches
        first = self._batch_idx % accum == 0  # Lightning zeroed (set aside) the earlier gradients
        assert self.dims is not None
        for p, g_prev, g in zip(self._params, prev, new, strict=True):
            if g is not None and self.dims.dp > 1:  # SUM then divide: gloo has no AVG; DTensor grads: local shard
                local = g.to_local() if hasattr(g, "to_local") else g
                dist.all_reduce(local, group=self._dp_group)
                local.div_(self.dims.dp)
            if g is not None and accum > 1:
                g = g / accum
            if not first and g_prev is not None:
                g = g_prev if g is None else g_prev + g
            p.grad = g
        tied = self._tied_param()
        if tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=self._tie_group)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _tied_param(self) -> nn.Parameter | None:
        if self._tie_group is None:
            return None
        if getattr(self._pp_model, "embed_tokens", None) is not None:
            return self._pp_model.embed_tokens.weight
        return self._pp_model.lm_head.weight

    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        tied = self._tied_param()
        # The LM-head copy of a tied embedding (last stage) is the same weight as the embedding: count it once.
        copy = tied if tied is not None and getattr(self._pp_model, "embed_tokens", None) is None else None
        sq = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for p in params:
            if p is not copy:
                sq += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(sq, group=self._pp_group)
        total = math.sqrt(float(sq))
        scale = clip_val / (total + 1e-6)
        if scale < 1.0:
            for p in params:
                p.grad.detach().mul_(scale)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _layout(self) -> dict[str, Any]:
        assert self.dims is not None
        return pipeline_layout(pp_size=self.dims.pp, stages_per_rank=self.stages_per_rank,
                               placement=SCHEDULES[self.schedule][1], specs=self._specs)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A directory with one file per pipeline rank: its shard of the weights, its optimizer state, the loops."""
        path = Path(self.broadcast(str(filepath)))
        if self.is_global_zero and path.is_file():
            path.unlink()
        self.barrier("pp_checkpoint_dir")
        if self.dp_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            checkpoint = {**checkpoint, "pipeline_layout": self._layout()}
            self.checkpoint_io.save_checkpoint(checkpoint, stage_checkpoint_file(path, self.pp_rank),
                                               storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        file = stage_checkpoint_file(checkpoint_path, self.pp_rank, must_exist=True)
        ckpt = self.checkpoint_io.load_checkpoint(file, weights_only=weights_only)
        check_layout(ckpt, self._layout(), checkpoint_path)
        return ckpt

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor

    @override
    def teardown(self) -> None:
        self._schedules.clear()
        self._stage_mods = []
        super().teardown()

