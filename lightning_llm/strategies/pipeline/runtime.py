"""Pipeline building blocks used by :class:`~lightning_llm.strategies.pipeline.runner.PipelineRunner`.

* The schedule table (:data:`SCHEDULES`) and :func:`build_schedule`, which wraps this rank's stage views in
  ``PipelineStage`` objects and picks the schedule class (forward-only for evaluation).
* :func:`select_microbatch`: the rows of a batch that one micro-batch's loss needs.
* Activation checkpointing of the local blocks (:func:`checkpoint_blocks`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    _ScheduleForwardOnly,
)
from torch.utils.checkpoint import checkpoint

from lightning_llm.strategies.expert import shapes_only
from lightning_llm.strategies.pipeline.split import StageSpec, layout_of, module_at

log = logging.getLogger(__name__)

__all__ = ["ScheduleName", "SCHEDULES", "check_microbatches", "build_schedule", "microbatch_count", "schedule_key",
           "run_schedule", "select_microbatch", "checkpoint_blocks"]

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
# name -> (schedule class, stage placement, allowed stages_per_rank or None for any)
SCHEDULES: dict[str, tuple[type, Literal["loop", "v"], int | None]] = {
    "gpipe": (ScheduleGPipe, "loop", 1),
    "1f1b": (Schedule1F1B, "loop", 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, "loop", None),
    "zero_bubble": (ScheduleInterleavedZeroBubble, "loop", None),  # interleaved, backward split into input/weight
}
# ScheduleZBVZeroBubble (V placement, see stage_ranks(style="v")) trains, but its forward-only use for validation
# fails in torch 2.13 ("can't steal_bwd_input if this stage doesn't have backward"), so it is not offered.

# PipelineStage methods whose time counts as "busy" in the per-step stats.
TIMED_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
METADATA_STAGE_METHODS = ("_forward_metadata_inference", "_backward_metadata_inference")
"""A stage's passes on placeholder inputs the first time a schedule runs (torch's shape inference): they run without
expert parallelism's token exchange (:func:`~lightning_llm.strategies.expert.shapes_only`), since replicas whose
batches have other shapes run them at other steps."""


# ---------------------------------------------------------------------------------------------------- schedules
def check_microbatches(*, n_microbatches: int, n_stages: int, schedule: str) -> None:
    """Fewer micro-batches than stages: a warning (large bubble) for GPipe, an error before training for the
    1F1B-family schedules, which torch rejects then only when the first step builds them."""
    if n_microbatches < n_stages:
        bubble = (n_stages - 1) / (n_microbatches + n_stages - 1)
        warnings.warn(f"n_microbatches={n_microbatches} is less than the {n_stages} pipeline stages: "
                      f"each step idles about {bubble:.0%} of the time (bubble); use n_microbatches >= {n_stages}",
                      stacklevel=3)
        if schedule != "gpipe":
            raise ValueError(f"n_microbatches={n_microbatches}: schedule={schedule!r} needs at least "
                             f"as many micro-batches as pipeline stages ({n_stages})")


def microbatch_count(batch_size: int, *, n_microbatches: int, train: bool) -> int:
    """Micro-batches for a batch: ``n_microbatches`` in training (the batch must divide evenly, so the mean of the
    micro-batch losses is the batch mean); in evaluation the largest divisor of the batch up to it (a last,
    partial batch still runs)."""
    m = n_microbatches if train else max(d for d in range(1, n_microbatches + 1) if batch_size % d == 0)
    if batch_size % m:
        raise ValueError(f"a training batch of {batch_size} samples is not divisible by n_microbatches={m} "
                         "(e.g. the last, partial batch of an epoch); use a dataset size divisible by the batch")
    return m


def schedule_key(args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool, m: int) -> tuple[Any, ...]:
    """Cache key of a schedule: stages infer their P2P shapes once, so each input shape needs its own."""
    shapes = tuple(tuple(t.shape) if isinstance(t, Tensor) else None for t in (*args, *kwargs.values()))
    return (train, m, shapes, tuple(kwargs))


def build_schedule(
    *,
    schedule: str,
    stage_mods: Sequence[nn.Module],
    specs: Sequence[StageSpec],
    device: torch.device,
    group: Any,
    n_microbatches: int,
    loss_fn: Callable[[Any, Tensor], Tensor] | None,
    wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None,
) -> tuple[Any, list[PipelineStage]]:
    """A schedule over this rank's stages; ``loss_fn=None`` gives a forward-only one (evaluation, predict).

    ``wrap(name, method)`` (e.g. a busy-time counter) is applied to each stage's forward/backward chunk methods.
    """
    n_stages = specs[0].num_stages
    stages = [PipelineStage(mod, s.index, n_stages, device, group=group) for mod, s in zip(stage_mods, specs)]
    for st in stages:
        for name in METADATA_STAGE_METHODS:
            if hasattr(st, name):
                setattr(st, name, _shapes_only(getattr(st, name)))
    if wrap is not None:
        for st in stages:
            for name in TIMED_STAGE_METHODS:
                setattr(st, name, wrap(name, getattr(st, name)))
    cls = SCHEDULES[schedule][0]
    if loss_fn is None and len(stages) == 1:
        sched = _ScheduleForwardOnly(stages[0], n_microbatches)
    elif len(stages) == 1 and cls in (ScheduleGPipe, Schedule1F1B):
        sched = cls(stages[0], n_microbatches, loss_fn=loss_fn)
    else:
        sched = cls(stages, n_microbatches, loss_fn=loss_fn)
    return sched, stages


def _shapes_only(method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with shapes_only():
            return method(*args, **kwargs)
    return run


def run_schedule(sched: Any, specs: Sequence[StageSpec], args: tuple[Any, ...], kwargs: dict[str, Any],
                 **step_kwargs: Any) -> Any:
    """One schedule step: positional inputs go to the first stage only; keyword inputs (masks, type ids) are
    chunked for every stage. Returns the last stage's output there, ``None`` elsewhere."""
    first = any(s.is_first for s in specs)
    return sched.step(*(args if first else ()), **kwargs, **step_kwargs)


# ---------------------------------------------------------------------------------------------------- micro-batches
def select_microbatch(batch: dict[str, Any], index: Tensor) -> dict[str, Any]:
    """Rows ``index`` of every per-sample tensor of ``batch`` (first dimension = batch size); the rest as is."""
    n = next(v.shape[0] for v in batch.values() if isinstance(v, Tensor))
    return {k: v.index_select(0, index) if isinstance(v, Tensor) and v.dim() and v.shape[0] == n else v
            for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------- recompute
def _checkpointed(forward: Callable[..., Tensor]) -> Callable[..., Tensor]:
    def run(*args: Any, **kwargs: Any) -> Tensor:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def checkpoint_blocks(model: nn.Module, specs: Sequence[StageSpec]) -> None:
    """Recompute each of the local stages' blocks in backward (non-reentrant ``torch.utils.checkpoint``)."""
    blocks = module_at(model, layout_of(model).layers)
    for k in (k for s in specs for k in s.layers):
        blocks[k].forward = _checkpointed(blocks[k].forward)
