"""Pieces of :class:`~lightning_llm.strategies.engine.strategy.ParallelEngine` that are not Lightning hooks.

* :class:`LayoutArgs`: the layout's arguments and every check on them, run before any process starts or any step
  (degrees, ZeRO/offload combinations, pipeline schedule, precision, batch size).
* :class:`PipelineStages`: the pipeline component for ``pp > 1``: this rank's stages of the split, the process group
  that sums a weight tied across stages, the :class:`~.pipeline.runner.PipelineRunner`, and putting the schedule's
  gradients back where Lightning expects them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_llm.contract import check_context_parallel, check_pipelinable
from lightning_llm.logs import PER_RANK
from lightning_llm.models import routing_stats_of
from lightning_llm.models.init import canonical_name
from lightning_llm.models.tp_plans import TPPlan
from lightning_llm.strategies.engine.grad_buckets import DEFAULT_BUCKET_MB
from lightning_llm.strategies.mesh import ParallelDims
from lightning_llm.strategies.tensor.parallelize import reduce_partial_grads
from lightning_llm.strategies.pipeline.decode import MICROBATCH_MIN_FLOPS
from lightning_llm.strategies.pipeline.runner import PipelineRunner
from lightning_llm.strategies.pipeline.runtime import SCHEDULES, check_microbatches
from lightning_llm.strategies.pipeline.split import (
    StageSpec,
    prune_model,
    split_layers,
    stage_module,
    stage_ranks,
    stage_specs,
    tied_across_stages,
)

log = logging.getLogger(__name__)

__all__ = ["LayoutArgs", "PipelineStages", "NATIVE_PRECISIONS"]

NATIVE_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true")


@dataclass
class LayoutArgs:
    """A layout's arguments, validated on construction (the parameter is named in every error)."""

    dims: ParallelDims
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    n_microbatches: int = 4
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    save_distributed_checkpoint: bool = True
    bucket_size_mb: float = DEFAULT_BUCKET_MB
    decode_microbatches: str = "auto"

    def __post_init__(self) -> None:
        d = self.dims
        if self.decode_microbatches not in ("auto", "stages"):
            raise ValueError(f"decode_microbatches={self.decode_microbatches!r}: expected auto or stages")
        # degree syntax (positive or one -1); whether ep divides the replicas is known once the world size is
        dataclasses.replace(d, ep=1).resolved(abs(d.dp * d.tp * d.pp * d.cp))
        if d.ep == 0 or d.ep < -1:
            raise ValueError(f"expert_parallel_size={d.ep}: must be a positive integer or -1 (all the replicas)")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb!r}: must be > 0 (MiB per gradient bucket)")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r}: must be 0, 1, 2 or 3")
        if self.zero_stage >= 2 and d.pp != 1:
            raise ValueError(f"zero_stage={self.zero_stage} with pipeline_parallel_size={d.pp} is not supported: a "
                             "pipeline keeps its gradients aside between the schedule and the optimizer step; use "
                             "zero_stage 0 or 1 with pipeline parallelism")
        if d.ep != 1 and self.zero_stage in (1, 2):
            raise ValueError(f"expert_parallel_size={d.ep} with zero_stage={self.zero_stage} is not supported: ZeRO-1/2 "
                             "partition whole parameters over every replica, while each expert-parallel rank holds "
                             "other experts; use zero_stage 0 (averaged gradients) or 3 (experts sharded over the ranks "
                             "holding the same ones)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params=True needs stage=3 (got stage={self.zero_stage}); parameters are only "
                             "partitioned, hence offloadable, in stage 3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer=True needs zero_stage 1, 2 or 3 (partitioned optimizer states)")
        if self.zero_stage == 3 and self.offload_optimizer != self.offload_params:
            raise ValueError("stage=3: offload_optimizer and offload_params must be equal - FSDP2's CPUOffloadPolicy "
                             "moves parameter shards, their gradients and hence the optimizer states together")
        if not self.save_distributed_checkpoint and d.pp != 1:
            raise ValueError("save_distributed_checkpoint=False needs pipeline_parallel_size=1 (a consolidated file "
                             "is gathered from whole tensors)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        fixed_v = SCHEDULES[self.schedule][2]
        if self.stages_per_rank < 1 or (fixed_v is not None and self.stages_per_rank != fixed_v):
            need = f"must be {fixed_v} for schedule={self.schedule!r}" if fixed_v else "must be >= 1"
            raise ValueError(f"stages_per_rank={self.stages_per_rank}: {need}")
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches={self.n_microbatches}: must be >= 1")

    def check_pipeline(self, dims: ParallelDims) -> None:
        if dims.pp > 1:
            check_microbatches(n_microbatches=self.n_microbatches, n_stages=dims.pp * self.stages_per_rank,
                               schedule=self.schedule)

    def check_precision(self, precision: str, dims: ParallelDims, *, fp16_scaler: bool) -> None:
        """The one precision check: what the native engine runs, and where fp16 loss scaling is exact."""
        if precision not in NATIVE_PRECISIONS:
            raise ValueError(f"--trainer.precision={precision} is not supported by the native parallel engine; use "
                             f"one of {', '.join(NATIVE_PRECISIONS)}")
        sharded_grads = dims.pp > 1 or dims.tp > 1 or self.zero_stage >= 2
        if fp16_scaler and sharded_grads:
            # GradScaler's inf check is per rank: with sharded gradients the ranks could disagree on skipping a step.
            raise ValueError(f"--trainer.precision={precision}: fp16 loss scaling needs tensor_parallel_size=1, "
                             "pipeline_parallel_size=1 and zero_stage 0 or 1 (gradients whole on every rank); use "
                             "bf16-mixed or 32-true (or a deepspeed_* strategy)")

    @staticmethod
    def check_task(module: nn.Module, dims: ParallelDims, *, strategy: str) -> None:
        """What the task must allow under these degrees, refused before anything is parallelized."""
        if dims.tp > 1 and getattr(module, "compile_blocks", False):
            raise ValueError(
                f"--model.compile=true under tensor parallelism (tp={dims.tp}): torch {torch.__version__} "
                "compiles transformer blocks around DTensor's tensor-parallel hooks wrongly (measured on CPU: without "
                "sequence parallelism backward fails inside DTensor's redistribute; with it the loss departs from "
                "eager by 8e-2 at the second step). Compile under ddp, pp, zero1/2/3 or deepspeed_*, or train tp "
                "eagerly")
        if dims.pp > 1:
            check_pipelinable(module, strategy=strategy)
        if dims.cp > 1:
            check_context_parallel(module, cp=dims.cp)
        if dims.ep > 1 and not getattr(module, "automatic_optimization", True):
            raise ValueError(f"expert_parallel_size={dims.ep}: {type(module).__name__} (manual optimization: rollouts "
                             "and mini-batch updates) is not checked against one device under expert parallelism, "
                             "where every expert-parallel rank must run the same forwards (each MoE layer exchanges "
                             "tokens with the others); train it with expert_parallel_size=1 (ddp, tp, pp, zero*)")

    def check_batch_size(self, trainer: pl.Trainer) -> None:
        dm = trainer.datamodule
        bs = getattr(dm, "batch_size", None) if dm is not None else None
        if trainer.state.fn == TrainerFn.FITTING and isinstance(bs, int) and bs % self.n_microbatches:
            raise ValueError(f"--data.batch_size={bs} is not divisible by n_microbatches={self.n_microbatches} "
                             "(pipeline parallelism splits every batch into equal micro-batches)")

    @staticmethod
    def resolve_plan(plan: Any, model: nn.Module) -> TPPlan | None:
        """A user ``plan`` argument as a plan dict (``None``: the model family's own plan)."""
        if plan is None:
            return None
        if isinstance(plan, str):
            plan = _import_plan_fn(plan)
        if callable(plan):
            plan = plan(model)
        if not isinstance(plan, Mapping):
            raise ValueError(f"plan: expected a dict of module path -> ParallelStyle, got {type(plan).__name__}")
        return dict(plan)


def _import_plan_fn(spec: str) -> Callable[[nn.Module], TPPlan]:
    """``"pkg.module:function"`` (or ``pkg.module.function``) -> the function."""
    mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"plan={spec!r}: cannot import a plan function from it ({e})") from e
    if not callable(fn):
        raise ValueError(f"plan={spec!r} is not callable")
    return fn


class PipelineStages:
    """This rank's pipeline stages (``pp > 1``): the split, the tie group, the runner and the gradient hand-off."""

    def __init__(self, *, specs: list[StageSpec], args: LayoutArgs, pp_size: int, pp_group: Any,
                 last_stage_rank: int, last_stage_pp_rank: int, tie_group: Any, tied_names: tuple[str, str] | None):
        self.specs, self.args, self.pp_size, self.pp_group = specs, args, pp_size, pp_group
        self.last_stage_rank, self.last_stage_pp_rank = last_stage_rank, last_stage_pp_rank
        self.tie_group, self.tied_names = tie_group, tied_names
        self.model: nn.Module | None = None
        self.runner: PipelineRunner | None = None
        self._guards: list[Any] = []  # forward pre-hooks refusing direct calls of the split model (and frozen ones)

    @classmethod
    def split(cls, model: nn.Module, *, dims: ParallelDims, pp_rank: int, mesh: Any, args: LayoutArgs,
              split_points: Sequence[int] | None, balance: str, global_rank: int) -> PipelineStages:
        """Split ``model`` in place: keep this rank's stages (names stay global); a tied weight gets a group of the
        two ranks holding its uses in each pipeline."""
        n_stages = dims.pp * args.stages_per_rank
        layers = split_layers(model, n_stages, split_points=split_points, balance=balance)  # type: ignore[arg-type]
        owners = stage_ranks(dims.pp, args.stages_per_rank, style=SCHEDULES[args.schedule][1])
        specs = stage_specs(layers, pp_rank, owners)
        pp_ranks = mesh["pp"].mesh.flatten().tolist()  # global ranks of this pipeline, by pp index
        tied_names, tie_group = tied_across_stages(model, n_stages), None
        if tied_names is not None and owners[0] != owners[-1]:
            # The LM head on the last stage keeps a copy of the token embedding; their gradients are summed.
            all_pp = mesh.mesh.movedim(0, -1).reshape(-1, dims.pp).tolist()  # [dp*cp*tp, pp] global ranks
            for ranks in all_pp:
                group = dist.new_group([ranks[owners[0]], ranks[owners[-1]]])
                if global_rank in (ranks[owners[0]], ranks[owners[-1]]):
                    tie_group = group
        prune_model(model, specs)
        log.info("rank %d (pipeline rank %d/%d) runs stages %s (blocks %s)", global_rank, pp_rank, dims.pp,
                 [s.index for s in specs], [list(s.layers) for s in specs], extra=PER_RANK)
        return cls(specs=specs, args=args, pp_size=dims.pp, pp_group=mesh["pp"].get_group(),
                   last_stage_rank=pp_ranks[owners[-1]], last_stage_pp_rank=owners[-1], tie_group=tie_group,
                   tied_names=tied_names if tie_group is not None else None)

    def build_runner(self, model: nn.Module, *, params: list[nn.Parameter], device: torch.device,
                     step_stats: list[dict[str, Any]], log_stats: bool, measure: bool, dp_group: Any,
                     dp: int, frozen: dict[str, nn.Module] | None = None) -> None:
        """Stage views of the split model, the runner that schedules them, and the guard on direct model calls;
        the same for each of the task's ``frozen`` models split like it (forward only: ``runner.frozen(name)``)."""
        for guard in self._guards:  # set-up again (validate after fit): the views must not inherit the guards
            guard.remove()
        self.model = model
        routing = routing_stats_of(model)
        if routing is not None and routing.aux_loss_coef > 0 and self.args.schedule != "gpipe":
            raise ValueError(
                f"pipeline parallelism with schedule={self.args.schedule!r}: the MoE load-balancing loss over the "
                "global batch needs every micro-batch's routing before the first backward (its gradient depends on "
                "the whole batch's expert loads), which only the gpipe schedule runs; pass "
                "--trainer.strategy.schedule=gpipe, or --model.router_aux_loss_coef=0 to train without it")

        decode_min_flops = MICROBATCH_MIN_FLOPS if self.args.decode_microbatches == "auto" else 0.0

        def runner(module: nn.Module, **kw: Any) -> PipelineRunner:
            return PipelineRunner(
                schedule=self.args.schedule, n_microbatches=self.args.n_microbatches,
                stage_mods=[stage_module(module, s) for s in self.specs], specs=self.specs, device=device,
                pp_group=self.pp_group, pp_size=self.pp_size, last_stage_rank=self.last_stage_rank,
                last_stage_pp_rank=self.last_stage_pp_rank, dp_group=dp_group, dp=dp,
                decode_min_flops=decode_min_flops, **kw)

        # frozen models run forward only: no routing statistics (theirs are never opened)
        frozen_runners = {name: runner(m, params=[], step_stats=[], log_stats=False)
                          for name, m in (frozen or {}).items()}
        self.runner = runner(model, params=params, step_stats=step_stats, log_stats=log_stats,
                             measure_activations=measure, routing=routing, frozen=frozen_runners)
        self._guards = [m.register_forward_pre_hook(_refuse_direct_call) for m in (model, *(frozen or {}).values())]

    def _tied_local(self) -> tuple[nn.Parameter | None, bool]:
        """This rank's use of the tied weight, and whether it is the copy (the source lives on another stage)."""
        if self.tie_group is None or self.tied_names is None or self.model is None:
            return None, False
        copy, source = self.tied_names
        params = dict(self.model.named_parameters())
        found = _tied_param(params, source)
        if found is not None:
            return found, False
        return _tied_param(params, copy), True

    def tied_copy(self) -> nn.Parameter | None:
        """The local copy of a weight whose source is on another stage (counted once in the global norm)."""
        param, is_copy = self._tied_local()
        return param if is_copy else None

    @torch.no_grad()
    def restore_grads(self, params: list[nn.Parameter], *, accumulate: int, first: bool) -> None:
        """Put the schedule's gradients back, scaled for accumulation and added to earlier accumulation (the
        data-parallel reduction and :meth:`sum_tied` follow on the last micro-batch of the window only)."""
        assert self.runner is not None
        prev, new = self.runner.take_grads()
        for p, g_prev, g in zip(params, prev, new, strict=True):
            if g is not None and accumulate > 1:
                g = g / accumulate
            if not first and g_prev is not None:  # Lightning zeroed (set aside) the earlier gradients otherwise
                g = g_prev if g is None else g_prev + g
            p.grad = g

    @torch.no_grad()
    def sum_tied(self) -> None:
        """Sum the gradients of a weight used on two stages (the tied LM head), once per optimizer step."""
        tied, _ = self._tied_local()
        if tied is not None and tied.grad is not None:
            # Under pp x tp both uses hold the vocab shard of one tp coordinate (the tie group pairs those ranks); the
            # embedding's gradient can come out replicated, so bring it to the parameter's placement first.
            reduce_partial_grads([tied])
            g = tied.grad
            dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=self.tie_group)

    def clear(self) -> None:
        if self.runner is not None:
            self.runner.clear()


def _tied_param(params: Mapping[str, nn.Parameter], name: str) -> nn.Parameter | None:
    """The parameter a family's tied name denotes on this rank, through PEFT wrappers: the frozen original a
    ``modules_to_save`` wrapper keeps (its trained copies are separate parameters, no longer tied), or a LoRA
    ``base_layer``'s. None when this rank holds neither."""
    if name in params:
        return params[name]
    hits = [p for n, p in params.items() if ".modules_to_save." not in n and canonical_name(n) == name]
    return hits[0] if hits else None


def _refuse_direct_call(module: nn.Module, args: Any) -> None:
    """Forward pre-hook of a pipeline-split model: only the stage views (which the schedule runs) may run it."""
    raise RuntimeError(
        "pipeline parallelism: the task's model holds only this rank's pipeline stages and cannot be called "
        "directly; call it through the task's run_model(...) (a forward-only pipeline pass; run_frozen(name, ...) "
        "for a frozen model of frozen_models()), or compute the loss with the model_inputs()/loss_from_output() "
        "hooks")
