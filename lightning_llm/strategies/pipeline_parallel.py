"""Pipeline parallelism inside Lightning's loop, built on ``torch.distributed.pipelining`` (registered as ``pp``).

How a step runs (the task contract of :mod:`lightning_llm.contract`; nothing of the task is replaced):

* ``configure_model`` builds the full model as usual; :meth:`PipelineParallelStrategy.setup` splits it
  (:mod:`.pipeline_split`): this rank keeps only its stages' blocks/embeddings/head (names stay global, so the
  optimizer and checkpoints hold exactly this rank's shard) and a :class:`~.pipeline_engine.PipelineRunner` wraps
  each stage view in a ``PipelineStage``. The split model refuses direct calls (a forward pre-hook names
  ``run_model``); a task that overrides ``compute_loss`` is refused at set-up, before any step.
* Training: the task's ``step_loss`` asks the runner, which runs the schedule (forward *and* backward of every
  micro-batch) on ``task.model_inputs(batch)``; the last stage computes each micro-batch's loss with
  ``task.loss_from_output``. The mean loss is sent to every pipeline rank, so the task's ``train_loss``, the
  progress bar and checkpoint monitoring see the real value.
* Gradients vs Lightning's closure (training_step -> zero_grad -> backward): the schedule's gradients are moved out
  of ``.grad`` right after the schedule, so Lightning's ``zero_grad`` finds nothing to clear, and are put back in
  :meth:`backward`, which replaces Lightning's ``loss.backward()``. We chose this over running the schedule inside
  ``backward`` because the loss must exist when ``training_step`` logs it, and it keeps Lightning's hook order
  (``on_before_backward``/``on_after_backward``, accumulation, clipping) intact.
* Validation/test run forward-only schedules (the last stage computes loss and metric outputs with
  ``loss_from_output`` and sends them to the other ranks); ``task.run_model`` (predict) gets the last stage's
  output on every rank.
* Gradient clipping by norm uses the global norm over all stages; checkpoints are a directory with one file per
  pipeline rank (that rank's shard + its optimizer state), see :mod:`.pipeline_checkpoint`.

Per step the strategy logs each rank's busy time (inside stage forward/backward and loss) and idle fraction
(``pp/idle_frac_rank{r}``) and keeps them in :attr:`PipelineParallelStrategy.step_stats`; with
``measure_activations`` it also counts peak live saved-activation bytes (:mod:`.pipeline_stats`).
"""

from __future__ import annotations

import logging
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
from typing_extensions import override

from lightning_llm.contract import Capabilities, check_pipelinable
from lightning_llm.strategies.mesh import ParallelDims, device_type_of, mesh_coordinate
from lightning_llm.strategies.pipeline_checkpoint import (
    CHECKPOINT_FILE, check_layout, consolidate_checkpoint, pipeline_layout, stage_checkpoint_file,
)
from lightning_llm.strategies.parallelize import average_replicated_grads, clip_grads_by_global_norm
from lightning_llm.strategies.pipeline_engine import PipelineRunner
from lightning_llm.strategies.pipeline_runtime import SCHEDULES, ScheduleName, check_microbatches, checkpoint_blocks
from lightning_llm.strategies.pipeline_split import (
    prune_model, split_layers, stage_module, stage_ranks, stage_specs, tied_across_stages,
)

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
        self._tied_names: tuple[str, str] | None = None  # (copy, source) of a weight tied across stages
        self._stage_mods: list[nn.Module] = []
        self._pp_model: nn.Module | None = None  # the task's split model (not Lightning's ``_model``: the task)
        self._params: list[nn.Parameter] = []
        self._specs: list[Any] = []
        self._last_stage_rank = 0  # global rank holding the last stage in this rank's pipeline
        self.pipeline_runner: PipelineRunner | None = None
        self._guard: Any = None  # forward pre-hook refusing direct calls of the split model
        self._batch_idx = 0
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
        check_pipelinable(module, strategy="pp")
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError("--trainer.precision=16-mixed: fp16 loss scaling is not supported with strategy=pp; "
                             "use 32-true, bf16-mixed or bf16-true")
        self._check_batch_size(trainer)
        if model is not self._pp_model:  # else already split: e.g. trainer.validate() after trainer.fit()
            self._split(model)
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        self._pp_model, self._params = model, list(module.parameters())  # == the model's: extras are refused
        self._build_runner(model)
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
        self._tied_names = tied_across_stages(model, n_stages)
        if self._tied_names is not None and owners[0] != owners[-1]:
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

    # ------------------------------------------------------------------------------------------ task contract
    @property
    def capabilities(self) -> Capabilities:
        """Pipeline ranks of one replica share its batch; generation is not offered (one round trip per token)."""
        if self.dims is None:
            return Capabilities()
        pp = self.dims.pp
        return Capabilities(data_parallel_size=self.dims.dp, batch_shared=pp > 1, pipelined=pp > 1,
                            generation=pp == 1, data_parallel_group=self._dp_group)

    def _build_runner(self, model: nn.Module) -> None:
        """Stage views of the split model, the runner that schedules them, and the guard on direct model calls."""
        assert self.dims is not None
        if self._guard is not None:  # set-up again (validate after fit): the views must not inherit the guard
            self._guard.remove()
        self._stage_mods = [stage_module(model, s) for s in self._specs]
        self.pipeline_runner = PipelineRunner(
            schedule=self.schedule, n_microbatches=self.n_microbatches, stage_mods=self._stage_mods,
            specs=self._specs, params=self._params, device=self.root_device, pp_group=self._pp_group,
            pp_size=self.dims.pp, last_stage_rank=self._last_stage_rank,
            last_stage_pp_rank=self._specs_owner_of_last(), step_stats=self.step_stats,
            log_stats=self.log_pipeline_stats, measure_activations=self.measure_activations,
        )
        self._guard = model.register_forward_pre_hook(_refuse_direct_call)

    def _specs_owner_of_last(self) -> int:
        assert self.dims is not None
        return stage_ranks(self.dims.pp, self.stages_per_rank, style=SCHEDULES[self.schedule][1])[-1]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch_idx = int(args[1]) if len(args) > 1 else int(kwargs.get("batch_idx", 0))
        with self.precision_plugin.train_step_context():
            return self.lightning_module.training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ backward / clipping
    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Replaces ``loss.backward()``: the schedule already ran it; put its gradients (moved aside before
        Lightning's zero_grad) back, averaged over data-parallel replicas and summed across tied copies."""
        module = self.lightning_module
        assert self.pipeline_runner is not None
        prev, new = self.pipeline_runner.take_grads()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        accum = self.lightning_module.trainer.accumulate_grad_batches
        first = self._batch_idx % accum == 0  # Lightning zeroed (set aside) the earlier gradients
        assert self.dims is not None
        for p, g in zip(self._params, new, strict=True):
            p.grad = g
        average_replicated_grads(self._params, dp_group=self._dp_group, dp=self.dims.dp)
        new = [p.grad for p in self._params]
        for p, g_prev, g in zip(self._params, prev, new, strict=True):
            if g is not None and accum > 1:
                g = g / accum
            if not first and g_prev is not None:
                g = g_prev if g is None else g_prev + g
            p.grad = g
        tied, _ = self._tied_local()
        if tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=self._tie_group)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _tied_local(self) -> tuple[nn.Parameter | None, bool]:
        """This rank's use of the weight the family ties across stages (an LM head tied to the token embedding), and
        whether it is the copy (the same weight as the source on another stage: counted once in norms)."""
        if self._tie_group is None or self._tied_names is None:
            return None, False
        copy, source = self._tied_names
        params = dict(self._pp_model.named_parameters())
        return (params[source], False) if source in params else (params[copy], True)

    def _norm_kwargs(self) -> dict[str, Any]:
        """How gradients are laid out, for the global norm over every stage and replica."""
        assert self.dims is not None
        tied, is_copy = self._tied_local()
        return dict(pp=self.dims.pp, dp=self.dims.dp, skip=[tied] if is_copy else [], device=self.root_device)

    def _clip_grad_by_global_norm(self, optimizer: Any, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grads_by_global_norm(params, clip_val, **self._norm_kwargs())

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
        if self.pipeline_runner is not None:
            self.pipeline_runner.clear()
        self._stage_mods = []
        super().teardown()


def _refuse_direct_call(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a pipeline-split model: only the stage views (which the schedule runs) may run it."""
    raise RuntimeError(
        "pipeline parallelism: the task's model holds only this rank's pipeline stages and cannot be called "
        "directly; call it through the task's run_model(...) (a forward-only pipeline pass), or compute the loss "
        "with the model_inputs()/loss_from_output() hooks")

