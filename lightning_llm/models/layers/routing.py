"""Router statistics of a model's MoE layers over one training step: the load per expert, and transformers'
load-balancing loss over the *global* batch, its gradient injected where backward reaches each router.

transformers' auxiliary loss (``load_balancing_loss_func``), pooled over the MoE layers and the real (unpadded)
tokens::

    aux = E * sum_i f_i * P_i,   f_i = C_i / T,   P_i = Psum_i / T

``C_i`` counts the top-k assignments to expert ``i`` over every layer and token, ``Psum_i`` sums the softmax of the
router logits, ``T`` counts (layer, token) pairs. Over a global batch split across ranks (data, context and
pipeline parallel; the tokens of one tensor-parallel group are counted once) the sums are the ranks' sums, so a
layout gives one device's value once ``C``, ``Psum`` and ``T`` are summed over the ranks: one all-reduce of
``[L, 2E + 1]`` numbers per step (the *reduction*, a callable a layout supplies: :attr:`RoutingStats.reduce`).

The gradient: ``d aux / d p[t, i] = E * C_i / T^2`` for every real token ``t`` of every layer, with ``C`` global, so
it is only known once every micro-batch's routing is (a pipeline sends its micro-batches through the stages before
their backward). It is added to the router logits' gradient in backward (through the softmax's Jacobian) by
:class:`_AuxGrad`, with ``coef * grad_scale``: the factor that turns the global objective's gradient into what this
rank's backward must produce (its data-parallel replicas' count, over the accumulation window, times a loss scale).
Independent of how the loss was scaled, so one mechanism serves one device, data, context, tensor and pipeline
parallelism, recomputed blocks included (a block recomputed in backward records nothing twice).

The statistics are recorded only between :meth:`RoutingStats.begin` and the end of the step's expected forwards
(a training step opens them; evaluation, generation and reference models never record).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["RoutingStats"]

Reduction = Callable[[Tensor], Any]
"""Sums a tensor in place over the ranks whose tokens and layers make the global batch; returns a handle with
``wait()`` (an asynchronous collective) or ``None`` (done)."""


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (a checkpointed block's recompute runs inside one)."""
    return torch._C._current_graph_task_id() != -1


class RoutingStats:
    """One model's router statistics (see the module docstring). ``layers``: the MoE layer indices, in order."""

    def __init__(self, layers: Sequence[int], *, num_experts: int, top_k: int, aux_loss_coef: float,
                 bias_update_rate: float = 0.0) -> None:
        self.index = {int(layer): i for i, layer in enumerate(layers)}
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.bias_update_rate = aux_loss_coef, bias_update_rate
        self.reduce: Reduction | None = None
        """Supplied by a layout that splits the global batch's tokens or layers over ranks (``None``: one rank)."""
        self.grad_scale: float | Tensor = 1.0
        """This rank's backward's factor on the global objective's gradient (set with :meth:`begin`, or in backward
        as a 0-d tensor on the device: ``tasks.callbacks.moe.attach_aux_loss``)."""
        self.window: Tensor | None = None
        """[L, E] loads summed over the steps since :meth:`take_window` (the aux-free bias update reads it)."""
        self._open = False
        self._attaching = False  # this step's forwards inject the aux gradient (so do their recomputes in backward)
        self._chunks_only = self._in_chunk = False
        self._expected = self._forwards = 0
        self._buf: Tensor | None = None  # [L, 2E + 1] float64: assignments, summed probabilities, real tokens
        self._work: Any = None
        self._reduced: Tensor | None = None

    # ------------------------------------------------------------------------------------------ the step
    def begin(self, *, forwards: int = 1, grad_scale: float = 1.0, chunks_only: bool = False) -> None:
        """Record the next ``forwards`` model forwards (a pipeline's micro-batches through this rank's stages); their
        statistics are reduced after the last one (asynchronously: a pipeline's stages reach it at different
        times, and each waits for it only in its first backward). ``chunks_only``: only forwards and backwards run
        inside :meth:`chunk` count (a pipeline's schedule also runs its stages once on placeholder inputs to infer
        shapes, which must neither record nor inject)."""
        if forwards < 1:
            raise ValueError(f"RoutingStats.begin: forwards={forwards} must be >= 1")
        self._open, self._expected, self._forwards = True, forwards, 0
        self._chunks_only, self._in_chunk = chunks_only, False
        self._attaching = self.aux_loss_coef > 0
        self.grad_scale = float(grad_scale)
        self._buf, self._work, self._reduced = None, None, None

    @property
    def recording(self) -> bool:
        return self._open and not _in_backward() and self._chunk_ok()

    def _chunk_ok(self) -> bool:
        return not self._chunks_only or self._in_chunk

    @contextlib.contextmanager
    def chunk(self) -> Iterator[None]:
        """A pipeline schedule's real forward or backward of a micro-batch (see ``chunks_only``)."""
        before, self._in_chunk = self._in_chunk, True
        try:
            yield
        finally:
            self._in_chunk = before

    def attach(self, layer: int, logits: Tensor, keep: Tensor | None) -> Tensor:
        """``logits`` [N, E] unchanged, with the load-balancing loss's gradient added in backward (when its
        coefficient is not 0 and the step is open); ``keep`` [N] marks the real tokens."""
        # A block recomputed in backward (activation checkpointing) attaches again, as its first forward did: a
        # non-reentrant recompute must save the same tensors, a reentrant one backpropagates the recomputed graph.
        if not (self._attaching and self._chunk_ok() and (self._open or _in_backward())) or not logits.requires_grad:
            return logits
        return _AuxGrad.apply(logits, self, keep)

    def record(self, layer: int, logits: Tensor, ids: Tensor, keep: Tensor | None) -> None:
        """Add one MoE layer's forward: assignments ``ids`` [N, k] and router ``logits`` [N, E] of real tokens."""
        if not self.recording:
            return
        if self._forwards >= self._expected:
            raise RuntimeError(f"MoE layer {layer} routed tokens after the step's {self._expected} expected "
                               "forward(s) were reduced: a task that calls the model more than once per training "
                               "step records routing statistics the load-balancing loss cannot pool")
        e = self.num_experts
        if self._buf is None:
            self._buf = torch.zeros(len(self.index), 2 * e + 1, dtype=torch.float64, device=logits.device)
        with torch.no_grad():
            probs = torch.softmax(logits.detach().float(), dim=-1)  # [N, E]
            k = ids.shape[1]
            w = torch.ones(ids.shape[0], device=ids.device, dtype=torch.float64) if keep is None else keep.double()
            row = self._buf[self.index[layer]]
            row[:e].scatter_add_(0, ids.reshape(-1), w.repeat_interleave(k))
            row[e:2 * e] += (probs.double() * w[:, None]).sum(0)
            row[2 * e] += w.sum()

    def forward_done(self) -> None:
        """One model forward finished (called by the model): after the step's last one, the statistics are reduced
        over the ranks (every rank calls this the same number of times, a rank holding no MoE layer included)."""
        if not self.recording:
            return
        self._forwards += 1
        if self._forwards < self._expected:
            return
        if self._buf is None:  # no MoE layer on this rank (a pipeline stage): zeros in the sum
            self._buf = torch.zeros(len(self.index), 2 * self.num_experts + 1, dtype=torch.float64,
                                    device=self._device())
        self._work = self.reduce(self._buf) if self.reduce is not None else None
        self._open = False

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def reduced(self) -> Tensor:
        """The step's statistics summed over the ranks, [L, 2E + 1] (waits for the reduction once)."""
        if self._reduced is None:
            if self._buf is None or self._open:
                raise RuntimeError("RoutingStats: no reduced statistics (the step's forwards have not all run)")
            if self._work is not None:
                self._work.wait()
                self._work = None
            self._reduced = self._buf
            loads = self._reduced[:, :self.num_experts]
            self.window = loads.clone() if self.window is None else self.window + loads
        return self._reduced

    @property
    def has_step(self) -> bool:
        """Whether a step's statistics were recorded and reduced (or are being reduced)."""
        return self._buf is not None and not self._open

    # ------------------------------------------------------------------------------------------ results
    def loads(self) -> Tensor:
        """[L, E] top-k assignments per expert and layer over the global batch of the step."""
        return self.reduced()[:, :self.num_experts]

    def aux_loss(self) -> Tensor:
        """transformers' load-balancing loss of the step's global batch (float64 scalar; NaN without real tokens)."""
        r = self.reduced()
        e = self.num_experts
        counts, psum, rows = r[:, :e].sum(0), r[:, e:2 * e].sum(0), r[:, 2 * e].sum()
        return e * (counts / rows * (psum / rows)).sum()

    def prob_grad(self) -> Tensor:
        """[E] ``coef * grad_scale * E * C / T^2``: the gradient of ``coef * aux`` by each real token's router
        probabilities, as this rank's backward must produce it."""
        r = self.reduced()
        e = self.num_experts
        counts, rows = r[:, :e].sum(0), r[:, 2 * e].sum()
        scale = self.aux_loss_coef * e * self.grad_scale  # a number, or a 0-d tensor read from the loss's gradient
        # no real token anywhere: no gradient (decided on the device: a host read here would stall backward)
        return torch.where(rows > 0, counts * scale / (rows * rows).clamp(min=1), 0.0)

    def take_window(self) -> Tensor | None:
        """The [L, E] loads summed since the last call (an optimizer step's), and start a new window."""
        window, self.window = self.window, None
        return window


class _AuxGrad(torch.autograd.Function):
    """Identity on the router logits; backward adds the load-balancing loss's gradient through the softmax:
    ``dJ/dz = p * (g - <p, g>)`` with ``g = prob_grad()`` on the real tokens."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, stats: RoutingStats, keep: Tensor | None) -> Tensor:
        ctx.stats = stats
        ctx.save_for_backward(logits, keep)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        logits, keep = ctx.saved_tensors
        stats: RoutingStats = ctx.stats
        g = stats.prob_grad().to(torch.float32)  # [E]
        p = torch.softmax(logits.float(), dim=-1)  # [N, E]
        inject = p * (g - (p * g).sum(-1, keepdim=True))
        if keep is not None:
            inject = inject * keep[:, None]
        return grad + inject.to(grad.dtype), None, None
