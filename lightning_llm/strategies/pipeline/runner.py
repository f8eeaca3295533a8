"""The pipeline runtime as a component: runs a task's declared hooks through ``torch.distributed.pipelining``.

A pipelined strategy (``pp``, or ``3d`` with ``pipeline_parallel_size > 1``) owns one :class:`PipelineRunner` per
set-up and exposes it as ``strategy.pipeline_runner``; :meth:`LLMTask.step_loss` and :meth:`LLMTask.run_model`
call it (the contract of :mod:`lightning_llm.contract`). Nothing of the task is replaced or captured:

* inputs come from ``task.model_inputs(batch, stage)`` (``contract.declared_inputs``); the first positional input feeds the first stage, keyword
  inputs are split into micro-batches for every stage;
* the loss of micro-batch ``i`` is ``task.loss_from_output(output_i, batch_i, stage)`` on the last stage;
* training runs forward and backward of every micro-batch; the gradients are kept aside (:meth:`take_grads`) until
  the strategy's ``backward``, because Lightning zeroes gradients between ``training_step`` and ``backward``;
* the mean loss and the metric outputs (in training only for a task that logs them, ``wants_train_outputs``) are
  sent to every pipeline rank, so logging, progress bars and checkpoint monitors see the real value;
* a manual-optimization task (PPO, GRPO) runs each optimizer step's forward and backward with
  :meth:`PipelineRunner.train_additive`: a loss function whose losses and statistics add up over micro-batches (each
  a share of a global sum), the gradients kept aside for the strategy's ``backward`` as in automatic training.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_llm.contract import declared_inputs, device_scalar
from lightning_llm.strategies.pipeline.decode import MICROBATCH_MIN_FLOPS, PipelineDecoder
from lightning_llm.strategies.pipeline.runtime import (
    build_schedule,
    microbatch_count,
    run_schedule,
    schedule_key,
    select_microbatch,
)
from lightning_llm.strategies.pipeline.split import StageSpec
from lightning_llm.strategies.pipeline.stats import (
    ActivationMeter,
    BusyTimer,
    StepStatsLog,
    last_stage_loss,
    log_step_stats,
)

log = logging.getLogger(__name__)

__all__ = ["AdditiveLoss", "PipelineRunner", "split_inputs"]

AdditiveLoss = Callable[[Any, Tensor], tuple[Tensor, dict[str, Tensor]]]
"""``loss_fn(output, rows) -> (loss, stats)`` of the micro-batch holding ``rows`` (indices into the batch): scalars
whose sums over the micro-batches are the batch's loss and statistics."""


def split_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Schedule inputs from a task's ``model_inputs``: ``None`` keywords dropped, ``input_ids=`` made positional
    (the schedule hands positional inputs to the first stage only)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if not args and "input_ids" in kwargs:
        args = (kwargs.pop("input_ids"),)
    if not args:
        raise ValueError("model_inputs() returned no positional input: a pipeline feeds the first positional input "
                         "to its first stage")
    return tuple(args), kwargs


def _detached(outputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach() if isinstance(v, Tensor) else v for k, v in (outputs or {}).items()}


def _merge_outputs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Micro-batch outputs -> one dict: per-row tensors concatenated along dim 0, anything else listed."""
    merged: dict[str, Any] = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if all(isinstance(v, Tensor) and v.dim() for v in values):
            merged[key] = torch.cat(values)
        else:
            merged[key] = values
    return merged


@dataclass(frozen=True)
class _TensorMeta:
    """What a rank allocates to receive one broadcast tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class PipelineRunner:
    """Schedules for one rank's stages, and the task calls a pipelined strategy makes."""

    def __init__(
        self,
        *,
        schedule: str,
        n_microbatches: int,
        stage_mods: Sequence[nn.Module],
        specs: Sequence[StageSpec],
        params: Sequence[nn.Parameter],
        device: torch.device,
        pp_group: Any,
        pp_size: int,
        last_stage_rank: int,
        last_stage_pp_rank: int,
        step_stats: list[dict[str, Any]],
        dp_group: Any = None,
        dp: int = 1,
        log_stats: bool = True,
        measure_activations: bool = False,
        routing: Any = None,
        frozen: dict[str, PipelineRunner] | None = None,
        decode_min_flops: float = MICROBATCH_MIN_FLOPS,
    ) -> None:
        self.schedule, self.n_microbatches = schedule, n_microbatches
        self.routing = routing  # an MoE model's router statistics (models.layers.routing.RoutingStats), opened per step
        self.stage_mods, self.specs, self.params = list(stage_mods), list(specs), list(params)
        self.device, self.pp_group, self.pp_size = device, pp_group, pp_size
        self.last_stage_rank, self.last_stage_pp_rank = last_stage_rank, last_stage_pp_rank
        self.step_stats, self.log_stats, self.measure_activations = step_stats, log_stats, measure_activations
        self.stats_log = StepStatsLog(step_stats, last_pp_rank=last_stage_pp_rank, pp_size=pp_size, group=pp_group,
                                      device=device)
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._timer = BusyTimer()
        self._meter: ActivationMeter | None = None
        self.dp_group, self.dp = dp_group, dp
        self._current: tuple[Any, Any, str] | None = None  # (task, batch, stage) whose micro-batch losses are asked
        self._scale: tuple[int, float] | None = None  # (micro-batches, loss weight of the global batch) in training
        self._weighted: dict[int, tuple[Tensor, Tensor]] = {}  # first row -> (micro-batch loss, its loss weight)
        self._target: Tensor | None = None  # the row numbers the current schedule split (see _first_row)
        self._outputs: dict[int, dict[str, Any]] | None = None  # first row -> micro-batch outputs (when asked for)
        self._grads: tuple[list[Tensor | None], list[Tensor | None]] | None = None
        self._decoder: PipelineDecoder | None = None
        self.decode_min_flops = decode_min_flops  # micro-batches in flight from this much work (decode.py)
        # train_additive: (loss function, micro-batches, first row -> (loss, stats)) while its schedule runs
        self._additive: tuple[AdditiveLoss, int, dict[int, tuple[Tensor, dict[str, Tensor]]]] | None = None
        self._output_spec: TreeSpec | None = None  # the last stage's output structure (see _plain_tuple_output)
        self._frozen = dict(frozen or {})  # the runners of the task's frozen models, split into the same stages
        for mod, spec in zip(self.stage_mods, self.specs):
            if spec.is_last:
                mod.register_forward_hook(self._plain_tuple_output)

    def _plain_tuple_output(self, _module: nn.Module, _args: Any, out: Any) -> Any:
        """torch's stages take a last-stage output of several tensors only as a flat ``tuple`` of tensors (a
        NamedTuple such as ``TokenScores``, or PPO's ``(TokenScores, values)``, is refused or taken as one value):
        hand them the flat leaves and give the task its structure back (:meth:`_task_output`)."""
        self._output_spec = None
        if isinstance(out, Tensor) or (type(out) is tuple and all(isinstance(t, Tensor) for t in out)):
            return None
        leaves, spec = tree_flatten(out)
        self._output_spec = spec
        return tuple(leaves)

    def _task_output(self, out: Any) -> Any:
        if self._output_spec is not None and type(out) is tuple:
            return tree_unflatten(list(out), self._output_spec)
        return out

    @property
    def is_last_stage_rank(self) -> bool:
        return dist.get_rank() == self.last_stage_rank

    # ------------------------------------------------------------------------------------------ schedules
    def _schedule_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, train: bool,
                      additive: bool = False, n_microbatches: int | None = None) -> tuple[Any, int]:
        """The (cached) schedule for these input shapes; stages infer their P2P shapes on first use. ``additive``
        (training with losses that add up): micro-batches need not be equal, so any divisor of the batch serves."""
        batch = next(t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, Tensor))
        m = microbatch_count(batch, n_microbatches=n_microbatches or self.n_microbatches,
                             train=train and not additive)
        if additive and m < len(self.specs) * self.pp_size and self.schedule != "gpipe":
            raise ValueError(f"a manual-optimization step of {batch} rows splits into {m} micro-batches, fewer than "
                             f"the {len(self.specs) * self.pp_size} pipeline stages that schedule={self.schedule!r} "
                             "needs: use a mini-batch size divisible by --trainer.strategy.n_microbatches, or "
                             "--trainer.strategy.schedule=gpipe")
        key = schedule_key(args, kwargs, train=train, m=m)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                schedule=self.schedule, stage_mods=self.stage_mods, specs=self.specs, device=self.device,
                group=self.pp_group, n_microbatches=m, loss_fn=self._microbatch_loss if train else None,
                wrap=self._wrap_chunk,
            )[0]
        return self._schedules[key], m

    def _wrap_chunk(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """A stage's forward/backward of one micro-batch: timed, and (an MoE model) inside its router statistics'
        chunk, so the schedule's shape-inference pass on placeholder inputs records nothing."""
        timed = self._timer.wrap(method)
        if self.routing is None:
            return timed

        def run(*args: Any, **kwargs: Any) -> Any:
            with self.routing.chunk():
                return timed(*args, **kwargs)
        return run

    def _broadcast_from_last(self, out: Any) -> Any:
        """The last stage owner's ``out`` (a pytree: losses, statistics, outputs) on every pipeline rank, its tensors
        on this rank's device, in two broadcasts: the sizes, then one byte buffer holding the structure (pickled,
        without the tensors) and every tensor's bytes (8-byte aligned); no tensor goes through pickle."""
        sizes = torch.zeros(2, dtype=torch.long, device=self.device)
        buffer = None
        if self.is_last_stage_rank:
            leaves, spec = tree_flatten(out)
            tensors = [t.detach().to(self.device).contiguous() for t in leaves if isinstance(t, Tensor)]
            meta = pickle.dumps((spec, [_TensorMeta(tuple(t.shape), t.dtype) if isinstance(t, Tensor) else t
                                        for t in leaves]))
            parts = [torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)]
            parts += [t.reshape(-1).view(torch.uint8) for t in tensors]
            buffer = torch.cat([torch.nn.functional.pad(p, (0, -p.numel() % 8)) for p in parts])
            sizes[0], sizes[1] = len(meta), buffer.numel()
        dist.broadcast(sizes, src=self.last_stage_rank, group=self.pp_group)
        if buffer is None:
            buffer = torch.empty(int(sizes[1]), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=self.last_stage_rank, group=self.pp_group)
        n = int(sizes[0])
        spec, described = pickle.loads(buffer[:n].cpu().numpy().tobytes())
        offset, got = n + (-n % 8), []
        for m in described:
            if isinstance(m, _TensorMeta):
                nbytes = math.prod(m.shape) * m.dtype.itemsize
                got.append(buffer[offset:offset + nbytes].view(m.dtype).view(m.shape).clone())
                offset += nbytes + (-nbytes % 8)
            else:
                got.append(m)
        return tree_unflatten(got, spec)

    # ------------------------------------------------------------------------------------------ contract
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A forward-only pass (prediction, an RL rollout's log-probs): the last stage's output, on every pipeline
        rank. Its rows are independent, so it takes the fewest micro-batches that keep every stage busy (one per
        stage): each costs every stage a call and a hand-off."""
        args, kwargs = split_inputs(args, kwargs)
        sched, _ = self._schedule_for(args, kwargs, train=False, n_microbatches=self.specs[0].num_stages)
        out = run_schedule(sched, self.specs, args, kwargs)
        return self._broadcast_from_last(self._task_output(out) if self.is_last_stage_rank else None)

    def frozen(self, name: str) -> PipelineRunner:
        """The forward-only runner of the task's frozen model ``name`` (``task.frozen_models()``), split into the
        same stages as the model."""
        if name not in self._frozen:
            raise KeyError(f"no frozen model {name!r} in this pipeline (the task declares {sorted(self._frozen)})")
        return self._frozen[name]

    def decoder(self, **stage_inputs: Any) -> PipelineDecoder:
        """The model for token-by-token generation through this rank's stages (:mod:`.decode`; micro-batches in
        flight: one per stage, the fewest that keep every stage busy, since each micro-batch costs every stage a
        call per token, where each one's work pays for that: ``decode_min_flops``); ``stage_inputs``: keyword inputs
        every stage receives as well (PPO's ``values=False``)."""
        if self._decoder is None:
            self._decoder = PipelineDecoder(stage_mods=self.stage_mods, specs=self.specs, pp_group=self.pp_group,
                                            pp_size=self.pp_size, last_stage_rank=self.last_stage_rank,
                                            device=self.device, microbatches=self.specs[0].num_stages,
                                            min_flops=self.decode_min_flops)
        return self._decoder.with_inputs(**stage_inputs) if stage_inputs else self._decoder

    def loss(self, task: Any, batch: Any, stage: str) -> tuple[Tensor, dict[str, Any]]:
        """The batch's loss (and, in evaluation, the metric outputs) from the task's declared hooks."""
        args, kwargs = split_inputs(*declared_inputs(task, batch, stage))
        if stage == "train":
            return self._train(task, batch, args, kwargs)
        sched, _ = self._schedule_for(args, kwargs, train=False)
        out = run_schedule(sched, self.specs, args, kwargs)
        result: Any = None
        if self.is_last_stage_rank:
            loss, outputs = task.loss_from_output(self._task_output(out), batch, stage)
            result = (loss.detach(), outputs)
        loss, outputs = self._broadcast_from_last(result)
        return loss.to(self.device), outputs

    def _microbatch_loss(self, output: Any, index: Tensor) -> Tensor:
        """Schedule ``loss_fn`` on the last stage: the task's loss of micro-batch ``index`` of the current batch."""
        if self._additive is not None:
            return self._additive_loss(output, index)
        t0 = time.perf_counter()
        assert self._current is not None
        task, batch, stage = self._current
        mb = select_microbatch(batch, index.to(self.device))
        loss, outputs = task.loss_from_output(self._task_output(output), mb, stage)
        if self._outputs is not None:
            self._outputs[self._first_row(index)] = _detached(outputs)
        if self._scale is not None:
            # Weighted by what it averages over: after the schedule's 1/m and the replicas' 1/dp, the gradient is
            # that of the global batch's mean, as on one device, whatever the micro-batches' token counts.
            m, total = self._scale
            weight = device_scalar(task.loss_weight(mb), loss.device)
            self._weighted[self._first_row(index)] = (loss.detach(), weight)  # keyed: a repeat replaces
            loss = loss * (weight * m * self.dp / total).to(loss)
        self._timer.busy += time.perf_counter() - t0
        return loss

    def _train(self, task: Any, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[Tensor, dict[str, Any]]:
        sched, m = self._schedule_for(args, kwargs, train=True)
        prev = self._grads_aside()
        n = args[0].shape[0]
        self._current = (task, batch, "train")
        self._scale = (m, self._global_weight(task.loss_weight(batch)))
        self._weighted = {}
        want_outputs = task.wants_train_outputs()
        self._outputs = {} if want_outputs else None
        self._timer.reset()
        losses: list[Tensor] = []
        if self.measure_activations and self._meter is None:
            self._meter = ActivationMeter(self.params)
        if self._meter is not None:
            self._meter.reset()
        if self.routing is not None:
            # every micro-batch through this rank's stages is one forward of the step; the injected load-balancing
            # gradient is the global objective's times the replicas (averaged) and the micro-batches (the schedule
            # divides by them)
            self.routing.begin(forwards=m * len(self.specs), grad_scale=self.dp * m, chunks_only=True)
        t0 = time.perf_counter()
        with self._meter.hooks() if self._meter is not None else nullcontext():
            run_schedule(sched, self.specs, args, kwargs, target=self._rows(n), losses=losses)
        wall = time.perf_counter() - t0
        self._current, self._scale = None, None
        if self._weighted:  # this rank's loss: its micro-batches' losses weighted as the gradient was
            weight = sum(w for _, w in self._weighted.values())
            losses = [(sum(loss * w for loss, w in self._weighted.values()) / weight.clamp(min=1e-12)).float()]
        self._keep_schedule_grads(prev)
        loss = last_stage_loss(losses, last_stage_rank=self.last_stage_rank, group=self.pp_group, device=self.device)
        self.stats_log.add(loss, busy=self._timer.busy, wall=wall, meter=self._meter, n_microbatches=m)
        # the step's numbers are gathered when the logger records them (a read of the device per step otherwise)
        if self.log_stats and getattr(task, "logging_step", lambda: True)():
            log_step_stats(task, self.stats_log.flush()[-1], batch_size=n)
        outputs: dict[str, Any] = {}
        if want_outputs:  # the last stage's micro-batch outputs, in row order, on every pipeline rank
            merged = _merge_outputs([self._outputs[k] for k in sorted(self._outputs)]) if self._outputs else {}
            outputs = self._broadcast_from_last(merged if self.is_last_stage_rank else None)
        self._outputs = None
        return loss.to(device=self.device, dtype=torch.float32), outputs

    def _additive_loss(self, output: Any, index: Tensor) -> Tensor:
        assert self._additive is not None
        loss_fn, m, parts = self._additive
        loss, stats = loss_fn(self._task_output(output), index.to(self.device))
        # keyed by the first row: torch's schedule may call the loss of a micro-batch again (a repeat replaces)
        parts[self._first_row(index)] = (loss.detach(), {k: v.detach() for k, v in stats.items()})
        return loss * m  # the schedule divides gradients by the micro-batch count; these losses add up instead

    def train_additive(self, loss_fn: AdditiveLoss, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward of the model call ``model(*args, **kwargs)`` through the pipeline, micro-batch by
        micro-batch, with the loss ``loss_fn`` (see :data:`AdditiveLoss`): the gradients are those of the sum of
        the micro-batch losses, kept aside for the strategy's ``backward`` (a task's ``manual_backward``). Returns
        the summed loss (detached) and statistics, the same on every pipeline rank.

        Micro-batches: the largest divisor of the batch up to ``n_microbatches`` (the losses add up, so they need
        not be equal)."""
        args, kwargs = split_inputs(args, kwargs)
        sched, m = self._schedule_for(args, kwargs, train=True, additive=True)
        prev = self._grads_aside()
        self._additive = (loss_fn, m, {})
        try:
            run_schedule(sched, self.specs, args, kwargs, target=self._rows(args[0].shape[0]))
            parts = self._additive[2]
        finally:
            self._additive = None
        self._keep_schedule_grads(prev)
        summed = None
        if self.is_last_stage_rank:
            rows = [parts[k] for k in sorted(parts)]
            summed = (torch.stack([loss for loss, _ in rows]).sum(),
                      {name: torch.stack([stats[name] for _, stats in rows]).sum() for name in rows[0][1]})
        loss, stats = self._broadcast_from_last(summed)
        return loss.to(self.device), {k: v.to(self.device) for k, v in stats.items()}

    def _rows(self, n: int) -> Tensor:
        """The target of a training schedule: the batch's row numbers, which torch's schedule splits into each
        micro-batch's (views of it: :meth:`_first_row`)."""
        self._target = torch.arange(n, device=self.device)
        return self._target

    def _first_row(self, index: Tensor) -> int:
        """The first row of a micro-batch (its key), from where its ``index`` view starts in the target: no host
        read of a device tensor (a copy, which torch's split does not make, is read)."""
        target = self._target
        if target is not None and index.numel() and index.untyped_storage().data_ptr() == \
                target.untyped_storage().data_ptr():
            return index.storage_offset() - target.storage_offset()
        return int(index[0])

    def _grads_aside(self) -> list[Tensor | None]:
        """Take the gradients off the parameters (the schedule accumulates into ``.grad``: it starts from zero)."""
        prev = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return prev

    def _keep_schedule_grads(self, prev: list[Tensor | None]) -> None:
        """Keep the schedule's gradients for the strategy's ``backward()`` (hidden from Lightning's zero_grad)."""
        self._grads = (prev, self._grads_aside())

    def _global_weight(self, weight: float | Tensor) -> Tensor:
        """The loss weight of the global batch: summed over the data-parallel replicas (a collective), an fp64 0-d
        tensor on the device (no host read)."""
        t = device_scalar(weight, self.device)
        if self.dp > 1:
            dist.all_reduce(t, group=self.dp_group)
        return t

    def take_grads(self) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """``(gradients before the step, the schedule's gradients)``, once per training step."""
        if self._grads is None:
            raise RuntimeError("pipeline parallelism: backward() without a pipelined training step (manual "
                               "optimization is not supported)")
        grads, self._grads = self._grads, None
        return grads

    def clear(self) -> None:
        self._schedules.clear()
