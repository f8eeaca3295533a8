"""The one native parallel engine: data x context x tensor x pipeline parallel with ZeRO 0-3 on the data-parallel
dim, and expert parallelism borrowed from the data-parallel ranks.

Every native layout is a preset of :class:`ParallelEngine` (:mod:`.presets`): ``tp`` (``TensorParallelStrategy``),
``pp`` (``PipelineParallelStrategy``), ``cp`` (``ContextParallelStrategy``), ``ep`` (``ExpertParallelStrategy``),
``zero1/2/3`` and ``zero*_offload`` (``ZeroStrategy``) and ``3d`` (``HybridParallelStrategy``). DeepSpeed is its own
engine (it owns its loop) under the same task contract.

One :class:`~lightning_llm.strategies.mesh.ParallelDims` validates the degrees (product = devices x nodes, one may be
``-1``; ``ep`` divides ``dp x cp``) and builds the named mesh ``("pp", "dp", "cp", "tp")`` (and, with ``ep > 1``, the
experts' ``("pp", "edp", "ep", "tp")`` over the same ranks); every group below is a dim of them. Set-up applies, for
whichever degrees are > 1 (the task has built its model in ``configure_model``, on the meta device when the layout
shards it: ``capabilities.deferred_init``):

1. pipeline split (``pp > 1``): keep this rank's stages, names stay global (:mod:`.pipeline.split`), and a
   :class:`~.pipeline.runner.PipelineRunner` component runs the task's declared hooks through the schedule;
2. tensor parallelism on the ``tp`` dim with the family's plan (:func:`.parallelize.apply_tensor_parallel`);
3. expert parallelism on the ``ep`` dim (:mod:`.expert`), context parallelism on ``cp`` (:mod:`.context`);
4. activation checkpointing of the local blocks;
5. ZeRO on the ``dp x cp`` ranks: stage 1/2 partition the optimizer (and gradients) with
   :class:`~.zero.native.PartitionedOptimizer`, stage 3 is FSDP2 (2-D with TP shards; experts over ``edp``);
6. materialization of meta-device tensors: each rank allocates and fills only its shards, from the checkpoint of a
   lazily loaded model or the family's init plan (:mod:`.materialize`), the same values a one-device build has.

Written once here: process-group set-up, precision checks and the set-up above; beside it, also written once for
every layout: a step's gradients (:mod:`.grads`: data-parallel averaging bucketed and overlapping backward,
awaited once per optimizer step, global-norm clipping over every shard, stage and replica), what a generation
decodes with (:mod:`.decoding`) and checkpoint IO (:mod:`.checkpoint`: every layout saves the layout-free
DCP format of :mod:`.hybrid_checkpoint`, keyed by global names, optimizer included, so any layout resumes from any
other).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn
from typing_extensions import override

from lightning_llm.contract import Capabilities
from lightning_llm.models.init import is_meta
from lightning_llm.models.tp_plans import TPPlan
from lightning_llm.strategies.context import apply_context_parallel, slice_step
from lightning_llm.strategies.decoding import (DecodingSessions, GatherForDecoding, WholeCopies, ZeroDecoding,
                                               copy_skeletons)
from lightning_llm.strategies.engine.checkpoint import DefaultGroupCollectives, LayoutFreeCheckpointing
from lightning_llm.strategies.engine.grads import EngineGradients
from lightning_llm.strategies.engine.layout import LayoutArgs, PipelineStages
from lightning_llm.strategies.expert import apply_expert_parallel, expert_blocker, expert_mesh
from lightning_llm.strategies.frozen import (check_frozen_models, decoding_frozen_models_of, frozen_models_of,
                                             place_frozen_models, place_scoring_models, scoring_models_of)
from lightning_llm.strategies.engine.grad_buckets import DEFAULT_BUCKET_MB, GradReducer
from lightning_llm.strategies.materialize import materialize_shards
from lightning_llm.strategies.mesh import (ParallelDims, device_type_of, mesh_coordinate, model_parallel_mesh,
                                          replica_mesh)
from lightning_llm.strategies.tensor.parallelize import (
    apply_tensor_parallel,
    local_loss,
    sharded_logits_for,
)
from lightning_llm.strategies.pipeline.runtime import ScheduleName, checkpoint_blocks
from lightning_llm.strategies.pipeline.split import StageSpec, layout_of, module_at
from lightning_llm.strategies.zero.native import (
    apply_fsdp,
    fsdp_mixed_precision,
    fsdp_units,
    shard_experts,
)

log = logging.getLogger(__name__)

__all__ = ["ParallelEngine"]


class ParallelEngine(EngineGradients, DecodingSessions, DefaultGroupCollectives, LayoutFreeCheckpointing):
    """DP x TP x PP with ZeRO stage 0-3 on the data-parallel dim; the presets ``tp``, ``pp``, ``zero*`` and ``3d``."""

    strategy_name = "3d"

    def __init__(
        self,
        data_parallel_size: int = -1,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        zero_stage: int = 0,
        *,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        plan: TPPlan | Callable[[nn.Module], TPPlan] | str | None = None,
        n_microbatches: int = 4,
        schedule: ScheduleName = "1f1b",
        stages_per_rank: int = 1,
        split_points: list[int] | None = None,
        balance: Literal["layers", "params"] = "layers",
        activation_checkpointing: bool = False,
        log_pipeline_stats: bool = False,
        measure_activations: bool = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        bucket_size_mb: float = DEFAULT_BUCKET_MB,
        gather_for_decoding: GatherForDecoding = "auto",
        decode_microbatches: Literal["auto", "stages"] = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        """
        Args:
            data_parallel_size: Data-parallel replicas (ZeRO shards); ``-1`` = inferred from the world size.
            tensor_parallel_size: Ranks per tensor-parallel group (Megatron column/row split).
            pipeline_parallel_size: Pipeline ranks.
            zero_stage: 0 (plain gradient averaging), 1 (partitioned optimizer states), 2 (+ gradients; ``pp=1``
                only), 3 (FSDP2 parameter sharding over ``dp``; ``pp=1`` only). With ``context_parallel_size > 1``
                over ``dp x cp`` (cp ranks hold the same parameters).
            context_parallel_size: Ranks sharing each sequence (:mod:`.context`; inside a node with tp), each
                holding ``1/cp`` of every row's tokens; the sequence length must be divisible by ``2 x cp``.
            expert_parallel_size: Mixture-of-Experts models: ranks sharing each MoE layer's experts (:mod:`.expert`),
                each holding ``E / ep`` of them, tokens sent to them by all-to-all; borrowed from the ``dp x cp``
                replicas (must divide them; ``-1``: all of them), so it adds no ranks. ZeRO stage 0 or 3.
            offload_optimizer: Keep optimizer states (fp32 masters) in CPU memory (ZeRO 1-3).
            offload_params: Keep parameter shards in CPU memory (ZeRO-3; then also ``offload_optimizer``).
            sequence_parallel: Shard the residual stream on the sequence dim inside each TP group.
            loss_parallel: Vocab-parallel cross-entropy on the TP-sharded logits, for losses that accept them
                (``pp=1``; a pipeline's last stage gathers the logits, since stage outputs are plain tensors).
            plan: A tensor-parallel plan for a model of no registered family: ``module path -> ParallelStyle``
                (relative to ``task.model``), a callable ``model -> plan`` or its import path ``"pkg.mod:fn"``.
            n_microbatches: Micro-batches per batch (``pp > 1``); the per-device batch must be divisible by it.
            schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble``.
            stages_per_rank: Virtual pipeline stages per rank (interleaved schedules).
            split_points: Block indices where stages 1..n-1 begin; default: balanced by ``balance``.
            balance: Automatic split balanced by block count (``layers``) or by parameter count (``params``).
            activation_checkpointing: Recompute each transformer block in backward.
            log_pipeline_stats: Log per-rank pipeline busy/idle time every step (``pp > 1``).
            measure_activations: Count peak live saved-activation bytes per pipeline step (slower; benchmarks).
            save_distributed_checkpoint: ``False``: checkpoints are one consolidated file of full weights written by
                rank 0 (for export and inference; no optimizer state, so not for resuming; ``pp=1`` only).
            async_save: Write checkpoints in the background: a save stands still only while this rank's state is
                copied to host memory (pinned on CUDA), DCP writes it while training goes on, and it appears under
                its name only complete (:mod:`.async_save`). A save waits for the previous one; a failed write is
                raised at the next step, save or the end of fit, which waits for the last write.
            bucket_size_mb: Data-parallel gradient buckets (MiB; DDP's default): each bucket's all-reduce (ZeRO-2:
                reduce to the owners) starts during backward as soon as its gradients are ready; also the bucket of
                the ZeRO-1/2 parameter broadcast.
            gather_for_decoding: Generation (rollouts, evaluation): ``once`` gathers the model (and the task's frozen
                models) once per generation or rollout and decodes without communication: under tp or pp whole
                copies on every rank decode as one device does, under ZeRO-3 FSDP2's units stay gathered;
                ``per_layer`` decodes the way the layout trains (ZeRO-3: every unit gathered in every step; tp: the
                shards' collectives; pp: through the stages); ``auto`` gathers once where that fits in half the free
                memory (:mod:`.decoding`; the run summary names the choice).
            decode_microbatches: Pipeline generation (``pp > 1``): ``stages`` decodes one micro-batch per stage in
                flight, so every stage works; ``auto`` does so where a micro-batch's step is enough work to pay for
                a stage call of its own (``pipeline.decode.MICROBATCH_MIN_FLOPS``), else one batch. Same tokens.
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.args = LayoutArgs(
            dims=ParallelDims(dp=data_parallel_size, tp=tensor_parallel_size, pp=pipeline_parallel_size,
                              cp=context_parallel_size, ep=expert_parallel_size),
            zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
            n_microbatches=n_microbatches, schedule=schedule, stages_per_rank=stages_per_rank,
            save_distributed_checkpoint=save_distributed_checkpoint, bucket_size_mb=bucket_size_mb,
            decode_microbatches=decode_microbatches,
        )
        self.zero_stage, self.offload_optimizer, self.offload_params = zero_stage, offload_optimizer, offload_params
        self.sequence_parallel, self.loss_parallel, self.plan = sequence_parallel, loss_parallel, plan
        self._grads_finalized = False  # the current gradients are reduced and averaged (see _finalize_gradients)
        self.n_microbatches, self.schedule, self.stages_per_rank = n_microbatches, schedule, stages_per_rank
        self.split_points, self.balance = split_points, balance
        self.activation_checkpointing = activation_checkpointing
        self.log_pipeline_stats, self.measure_activations = log_pipeline_stats, measure_activations
        self.save_distributed_checkpoint, self.async_save = save_distributed_checkpoint, async_save
        if gather_for_decoding not in ("auto", "once", "per_layer"):
            raise ValueError(f"gather_for_decoding={gather_for_decoding!r}: expected auto, once or per_layer")
        self.gather_for_decoding = gather_for_decoding
        self._zero_decoding: ZeroDecoding | None = None  # ZeRO-3: how a generation gathers the parameters
        self._process_group_backend, self._timeout = process_group_backend, timeout
        self.num_nodes = 1
        self.dims: ParallelDims | None = None
        self.pp_rank = self.dp_rank = self.tp_rank = self.cp_rank = self.ep_rank = 0
        self.replica_rank = 0  # rank among the dp x cp ranks holding the same parameters
        self._mesh: Any = None
        self._pp_group: Any = None
        self._dp_group: Any = None  # the ranks holding the same parameters: dp, or dp x cp under context parallelism
        self._cp_group: Any = None
        self._replica_mesh: Any = None  # the 1-D mesh of _dp_group
        self._expert_mesh: Any = None  # (pp, edp, ep, tp) under expert parallelism
        self._routing_group: Any = None  # ranks summing an MoE model's router statistics (pp x dp x cp)
        self._sharded_logits = False  # whether the task's loss receives vocab-sharded DTensor logits
        self._pp_model: nn.Module | None = None  # the task's parallelized model (set-up runs again for validate)
        self._params: list[nn.Parameter] = []  # every parameter of the task
        self._grad_hooks: list[Any] = []
        self._reducer: GradReducer | None = None  # data-parallel gradient reduction (set up with the optimizers)
        self._batch_idx = 0
        self.stages: PipelineStages | None = None  # the pipeline component (pp > 1)
        self.materialized_params = 0
        """Parameters this rank allocated from the meta device at set-up (its shards only; 0: built whole)."""
        self.step_stats: list[dict[str, Any]] = []
        """Per pipelined training step: ``busy_s``, ``wall_s``, ``idle_frac`` (lists over pipeline ranks), ``loss``
        and, with ``measure_activations``, ``peak_act_bytes``/``act_bytes_per_mb`` per rank; filled at logging steps
        and when training ends (``pipeline.stats.StepStatsLog``)."""

    # ------------------------------------------------------------------------------------------ environment
    @property
    def pipelined(self) -> bool:
        return self.dims is not None and self.dims.pp > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def is_distributed(self) -> bool:
        return True

    @property
    def device_mesh(self) -> Any:
        return self._mesh

    @property
    def context_parallel_group(self) -> Any:
        """The process group of this rank's context-parallel group (the ranks sharing its sequences)."""
        return self._cp_group

    @property
    def pipeline_runner(self) -> Any:
        """The contract's pipeline runner (``pp > 1``), else ``None``."""
        return self.stages.runner if self.stages is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor and pipeline ranks of one data-parallel replica must see identical batches: key the sampler by dp.
        return {"num_replicas": self.dims.dp if self.dims is not None else 1, "rank": self.dp_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # checkpoints hold this rank's shards: load after the model is parallelized

    @property
    def capabilities(self) -> Capabilities:
        if self.dims is None:
            return Capabilities()
        # Context-parallel ranks see different slices of the rows: to the task they are replicas (their losses are
        # weighted by token count and their gradients averaged over dp x cp).
        d = self.dims
        return Capabilities(data_parallel_size=d.replicas, batch_shared=d.tp * d.pp > 1,
                            pipelined=self.pipelined, generation=d.cp == 1 and d.ep == 1,
                            context_parallel_size=d.cp, context_parallel_group=self._cp_group,
                            data_parallel_group=self._dp_group, routing_ranks=d.pp * d.dp * d.cp,
                            routing_group=self._routing_group, deferred_init=self.shards_model)

    @property
    def shards_model(self) -> bool:
        """Whether no rank holds the whole model (tp, pp or ZeRO-3): then tasks build on the meta device and set-up
        materializes each rank's shards only."""
        return self.dims is not None and (self.dims.tp > 1 or self.dims.pp > 1 or self.dims.ep > 1
                                          or self.zero_stage == 3)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:  # torchrun, SLURM: refuse a --trainer.devices or
            # num_nodes that miscounts its processes (as Lightning's launcher does for ddp), not an IndexError later
            self.cluster_environment.validate_settings(num_devices=max(1, self.num_processes), num_nodes=self.num_nodes)
        self.args.dims.resolved(max(1, self.num_processes) * self.num_nodes)  # fail before launching processes
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """The process group and the named mesh: written once for every layout."""
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self.dims = self.args.dims.resolved(self.world_size)
        self.args.check_pipeline(self.dims)
        self._mesh = mesh = self.dims.build_mesh(device_type_of(self.root_device))
        self.pp_rank, _ = mesh_coordinate(mesh, "pp")
        self.dp_rank, _ = mesh_coordinate(mesh, "dp")
        self.tp_rank, _ = mesh_coordinate(mesh, "tp")
        self.cp_rank, _ = mesh_coordinate(mesh, "cp")
        self._replica_mesh = replicas = replica_mesh(mesh)
        self.replica_rank = replicas.get_local_rank()
        self._pp_group, self._dp_group, self._cp_group = (mesh["pp"].get_group(), replicas.get_group(),
                                                          mesh["cp"].get_group())
        routing = self.dims.routing_mesh(mesh)
        self._routing_group = routing.get_group() if routing is not None else None
        if self.dims.ep > 1:
            self._expert_mesh = expert_mesh(self.dims, device_type_of(self.root_device))
            self.ep_rank = self._expert_mesh.get_local_rank("ep")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = mesh

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.dims is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = str(self.precision_plugin.precision)
        self.args.check_precision(precision, self.dims, fp16_scaler=isinstance(self.precision_plugin, MixedPrecision)
                                  and self.precision_plugin.scaler is not None)
        model = self._target()
        self.args.check_task(module, self.dims, strategy=self._name())
        if self.pipelined:
            self.args.check_batch_size(trainer)
        self.precision_plugin.convert_module(module)
        frozen = frozen_models_of(module)
        decoding = decoding_frozen_models_of(module, frozen)  # those a generation calls (an RL rollout's reference)
        skeletons: dict[str, nn.Module] = {}
        layout = ""
        if model is not self._pp_model:  # else already parallelized (e.g. trainer.validate() after fit)
            skeletons, layout = copy_skeletons(model, decoding, task=module, dims=self.dims,
                                               offload=self.offload_params, mode=self.gather_for_decoding)  # unsplit
            self._parallelize(model, frozen=frozen, precision=precision)
            # Meta-device family models (built lazily under a sharding layout) get this rank's shards only.
            self.materialized_params = materialize_shards(
                module, torch.device("cpu") if self.offload_params else self.root_device)
        self.model_to_device()
        self._pp_model, self._params = model, list(module.parameters())
        if self.zero_stage == 3:
            self._zero_decoding = ZeroDecoding([model, *decoding.values()], mode=self.gather_for_decoding,
                                               device=self.root_device, dp_group=self._dp_group,
                                               dtype=fsdp_mixed_precision(precision).param_dtype)
        if skeletons:
            self._whole_copies = WholeCopies(
                {"model": model, **decoding}, skeletons, layout=layout, mode=self.gather_for_decoding,
                device=self.root_device, pp_group=self._pp_group, pp_size=self.dims.pp,
                share_group=model_parallel_mesh(self._mesh).get_group(),
                dtype=fsdp_mixed_precision(precision).param_dtype if self.zero_stage == 3 else None)
        if self.dims.ep > 1:  # an ep group's MoE layers exchange tokens in every decoding step: they end together
            self._stop_group = (self._expert_mesh["ep"].get_group(), self.root_device)
        if self.pipelined:
            assert self.stages is not None
            self.stages.build_runner(model, params=self._params, device=self.root_device, step_stats=self.step_stats,
                                     log_stats=self.log_pipeline_stats, measure=self.measure_activations,
                                     dp_group=self._dp_group, dp=self.dims.replicas,
                                     frozen=frozen)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self.setup_background_saves(trainer)
        self.setup_precision_plugin()
        if fitting and not self.offload_params:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning clips with the local norm; shards, stages and ZeRO-2 owners need the global one.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]

    def _target(self) -> nn.Module:
        """``task.model`` (what a plan, a split and FSDP units are relative to); the LightningModule itself only for a
        tensor-parallel plan on a module that has no ``model``."""
        module = self.lightning_module
        model = getattr(module, "model", None)
        if isinstance(model, nn.Module):
            return model
        if self.plan is not None and self.dims is not None and self.dims.pp == 1 and self.zero_stage != 3:
            return module
        raise ValueError(f"--trainer.strategy={self._name()} needs a task that builds `self.model` in "
                         "configure_model() (an LLMTask)")

    def _parallelize(self, model: nn.Module, *, frozen: dict[str, nn.Module], precision: str) -> None:
        """Pipeline split -> TP -> activation checkpointing -> FSDP (ZeRO-3); then the task's ``frozen`` models
        placed like ``model``."""
        assert self.dims is not None
        module = self.lightning_module
        check_frozen_models(module, frozen, model=model, pp=self.dims.pp, cp=self.dims.cp)
        if self.pipelined:
            self.stages = PipelineStages.split(model, dims=self.dims, pp_rank=self.pp_rank, mesh=self._mesh,
                                               args=self.args, split_points=self.split_points, balance=self.balance,
                                               global_rank=self.global_rank)
            specs = self.stages.specs
        else:
            specs = [StageSpec(0, 1, tuple(module_at(model, layout_of(model).layers).keys()))] \
                if self.activation_checkpointing else []
        # Vocab-sharded logits only reach a loss that declares it handles them (and never a pipeline's stage output).
        self._sharded_logits = sharded_logits_for(module, requested=self.loss_parallel and not self.pipelined,
                                                  tp=self.dims.tp)
        apply_tensor_parallel(model, self._mesh["tp"], sequence_parallel=self.sequence_parallel,
                              loss_parallel=self._sharded_logits, plan=self.args.resolve_plan(self.plan, model))
        if self.dims.ep > 1:
            blocker = expert_blocker(model, self.dims.ep)
            if blocker:
                raise ValueError(blocker)
            apply_expert_parallel(model, self._expert_mesh)
        if self.dims.cp > 1:
            apply_context_parallel(model, group=self._cp_group, cp=self.dims.cp, rank=self.cp_rank)
        if self.activation_checkpointing:
            checkpoint_blocks(model, specs)
        zero3 = dict(dp_mesh=self._replica_mesh, reshard_after_forward=True, precision=precision,
                     offload=self.offload_params) if self.zero_stage == 3 else None
        if zero3 is not None:
            if self.dims.ep > 1:  # the experts first: units of their own over the ranks holding the same experts
                shard_experts(module, edp_mesh=self._expert_mesh["edp"], replicas=self.dims.replicas,
                              precision=precision, offload=self.offload_params)
            apply_fsdp(module, units=fsdp_units(module), **zero3)
        # The task's frozen models (a full fine-tune's reference) go where the model went: its stages, plan, shards.
        place_frozen_models(module, frozen, specs=self.stages.specs if self.stages else None,
                            tp_mesh=self._mesh["tp"], sequence_parallel=self.sequence_parallel,
                            sharded_logits=self._sharded_logits, zero3=zero3,
                            expert_mesh=self._expert_mesh if self.dims.ep > 1 else None)
        place_scoring_models(scoring_models_of(module), tp_mesh=self._mesh["tp"], zero3=zero3)  # an RL reward model

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.offload_params:  # FSDP2 CPU offload keeps the shards on the host
            self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------ steps
    def _step(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        if self.dims is not None and self.dims.cp > 1:  # the task's step gets this rank's slice of the batch
            args, kwargs = slice_step(hook, args, kwargs, cp=self.dims.cp, rank=self.cp_rank, model=self._target())
        with context(), self._loss_context():
            return local_loss(getattr(self.lightning_module, hook)(*args, **kwargs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._batch_idx = int(args[1]) if len(args) > 1 else int(kwargs.get("batch_idx", 0))
        return self._step("training_step", self.precision_plugin.train_step_context, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    # ------------------------------------------------------------------------------------------ checkpoints
    def layout(self) -> dict[str, Any]:
        assert self.dims is not None
        return {"dp": self.dims.dp, "tp": self.dims.tp, "pp": self.dims.pp, "cp": self.dims.cp, "ep": self.dims.ep,
                "zero_stage": self.zero_stage}

    @override
    def on_train_end(self) -> None:
        runner = self.stages.runner if self.stages is not None else None
        if runner is not None:
            runner.stats_log.flush()  # the steps since the last logging step (a collective of the pipeline group)
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self.stages is not None:
            self.stages.clear()
        module = self._lightning_module
        if module is not None and any(is_meta(t) for t in (*module.parameters(), *module.buffers())):
            # Set-up stopped before materializing (e.g. a refused task): nothing to move to the CPU, and the base
            # class's `module.cpu()` would fail on meta tensors, hiding the real error.
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        super().teardown()
