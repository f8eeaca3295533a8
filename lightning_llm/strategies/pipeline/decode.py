"""Token-by-token decoding through a pipeline: the model protocol of :func:`lightning_llm.generation.generate`
across this rank's stages, with micro-batches in flight.

**Micro-batches in flight** (:meth:`PipelineDecoder.generate_rows`: greedy decoding, or sampling from per-row draws,
with the KV cache). The rows are cut into micro-batches and every micro-batch advances on its own: the owner of the
first stage embeds micro-batch ``m``'s next token and hands its hidden states on while the next stages still work on
``m - 1``; the owner of the last stage picks ``m``'s tokens from its logits (``generate``'s own
:class:`~lightning_llm.generation.TokenChooser`, the rows' own draws) and sends them back to the first stage's owner.
So every stage works while a rollout decodes, and a micro-batch whose rows all ended stops early. A row's tokens
depend on its own logits and draws only, so they equal the whole batch decoded at once (one device).

The ranks of a pipeline form a ring (stage ``s`` is owned by rank ``s mod P``, interleaved stages included; the last
stage's owner hands tokens to the first's): every rank receives from one rank only, in the order that rank sent,
so every rank runs its work in an order that does not depend on timing - tensor-parallel peers of a stage run the
same calls. Messages are a small header (kind, micro-batch, stage, step, dtype, shape) and a tensor; sends are
asynchronous (``isend``), receives block, so no two ranks wait on each other. At the end the last stage's owner
broadcasts every row's tokens to the pipeline. Every rank keeps the per-micro-batch KV cache of its own layers and
the micro-batch's mask and positions (new tokens are always attended, so they follow from the step alone).

**Lock-step** (``__call__``; beam search, sampling with one generator, decoding without a cache): every pipeline
rank runs the same ``generate()`` loop with the same draws; each call walks the stages in order, the last stage's
last-position logits ``[B, V]`` are broadcast to every pipeline rank, and all pick the same token (one stage busy at
a time).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm.models.decoding import DecodeRows, KVCache
from lightning_llm.strategies.pipeline.split import StageSpec, stage_ranks

log = logging.getLogger(__name__)

__all__ = ["MICROBATCH_MIN_FLOPS", "PipelineDecoder"]

MICROBATCH_MIN_FLOPS = 5e7
"""The least work of one micro-batch's decoding step on a stage (2 x the largest stage's parameters on a rank x the
micro-batch's rows) for micro-batches in flight to pay. Below it, what each stage call costs whatever its size
(Python over the layers, kernel launches, a message) outweighs the overlap, and the rows decode as one micro-batch.
Measured on the 2-core CPU (``benchmarks/generation.py``, pp x2): ``configs/grpo.yaml``'s 2-layer ``debug``, 64 rows
(4e6 per micro-batch of 32): a rollout's sampling 46 ms with two micro-batches, 26 ms with one; ``small``, 8 rows
(4e7): 0.30 vs 0.29 s for 32 tokens; 32 rows (1.7e8): 0.56 vs 0.72 s (one device: 0.71 s)."""

_LOGGED: list[bool] = []  # the static cache's fallback here was logged (once per process)
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEADER = 12  # kind, micro-batch, stage, step, dtype index, ndim, up to 6 sizes
_HIDDEN, _TOKENS, _DONE, _END = 1, 2, 3, 4  # message kinds of the ring


def _control(kind: int, m: int = 0, stage: int = 0, step: int = 0, *, x: Tensor | None = None,
             device: torch.device, width: int = 0) -> Tensor:
    """A message's control: [kind, micro-batch, stage, step, dtype index, ndim, 6 sizes] of the tensor ``x`` that
    follows it, then ``width`` longs for tokens sent inline."""
    control = torch.zeros(_HEADER + width, dtype=torch.long, device=device)
    control[:4] = torch.tensor([kind, m, stage, step])
    if x is not None:
        control[4], control[5] = _DTYPES.index(x.dtype), x.dim()
        control[6:6 + x.dim()] = torch.tensor(x.shape, dtype=torch.long)
    return control


def _full(x: Tensor) -> Tensor:
    return (x.full_tensor() if isinstance(x, DTensor) else x).float()


class PipelineDecoder:
    """``decoder(ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache) -> logits [B, 1, V]`` (fp32,
    the last position only, the same on every pipeline rank), and :meth:`generate_rows` (micro-batches in flight).
    ``extra``: keyword inputs every stage receives (e.g. ``values=False`` for PPO's actor-critic)."""

    def __init__(self, *, stage_mods: Sequence[nn.Module], specs: Sequence[StageSpec], pp_group: Any,
                 pp_size: int, last_stage_rank: int, device: torch.device, microbatches: int = 1,
                 min_flops: float = MICROBATCH_MIN_FLOPS, extra: dict[str, Any] | None = None) -> None:
        self.stages = {s.index: mod for mod, s in zip(stage_mods, specs)}
        self.num_stages = specs[0].num_stages
        self.owners = stage_ranks(pp_size, self.num_stages // pp_size, style="loop")
        self.group, self.device, self.last_stage_rank = pp_group, device, last_stage_rank
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), pp_size
        self.microbatches = max(1, microbatches)
        self.min_flops = min_flops  # see MICROBATCH_MIN_FLOPS (0: always ``microbatches``)
        self._stage_numel: list[int] = []  # the largest stage's parameters on a rank (shared by with_inputs copies)
        self.extra = dict(extra or {})
        self._vocab: int | None = None  # the logits' width, sent once by the last stage
        self._pending: list[tuple[Any, Tensor]] = []  # isend works and the tensors they send

    def with_inputs(self, **extra: Any) -> PipelineDecoder:
        """The same decoder with keyword inputs every stage receives added (shares this one's state)."""
        other = object.__new__(PipelineDecoder)
        other.__dict__.update(self.__dict__)
        other.extra = {**self.extra, **extra}
        return other

    # ------------------------------------------------------------------------------------------ point to point
    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _post(self, pp_rank: int, *tensors: Tensor | None) -> None:
        """Asynchronous sends of ``tensors`` (``None`` skipped) to ``pp_rank``, kept alive until :meth:`_drain`."""
        for t in tensors:
            if t is not None:
                self._pending.append((dist.isend(t, self._peer(pp_rank), group=self.group), t))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _isend(self, pp_rank: int, x: Tensor) -> None:
        """Control (dtype, shape) and tensor ``x`` to ``pp_rank``."""
        local = (x.to_local() if isinstance(x, DTensor) else x).contiguous()
        self._post(pp_rank, _control(_HIDDEN, x=local, device=self.device), local)

    def _recv_message(self, pp_rank: int) -> Tensor:
        control = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(control, self._peer(pp_rank), group=self.group)
        dtype, ndim = control[4:6].tolist()
        out = torch.empty(control[6:6 + ndim].tolist(), dtype=_DTYPES[dtype], device=self.device)
        dist.recv(out, self._peer(pp_rank), group=self.group)
        return out

    def _drain(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def _send(self, x: Tensor, stage: int) -> None:
        self._isend(self.owners[stage], x)
        self._drain()

    def _recv(self, stage: int) -> Tensor:
        return self._recv_message(self.owners[stage])

    def _run(self, s: int, x: Tensor, kwargs: dict[str, Tensor], cache: KVCache | None, past: int) -> Tensor:
        """Stage ``s`` on ``x`` (ids or hidden states) from ``past`` cached columns."""
        cache_kw: dict[str, Any] = {}
        if cache is not None:
            cache.seq_len = past  # every stage of this call starts from the same cached length
            cache_kw["kv_cache"] = cache
        return self.stages[s](x, **kwargs, **cache_kw, **self.extra)

    # ------------------------------------------------------------------------------------------ lock-step
    @torch.no_grad()
    def __call__(self, input_ids: Tensor, *, attention_mask: Tensor, position_ids: Tensor,
                 kv_cache: KVCache | None = None, **extra: Any) -> Tensor:
        """``extra``: keyword inputs every stage receives as well (``logits_to_keep``, ...)."""
        x: Tensor | None = input_ids
        past = kv_cache.seq_len if kv_cache is not None else 0
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, **extra}
        for s in range(self.num_stages):
            if self.owners[s] != self.pp_rank:
                continue
            if s > 0 and self.owners[s - 1] != self.pp_rank:
                x = self._recv(s - 1)
            x = self._run(s, x, kwargs, kv_cache, past)
            if s < self.num_stages - 1 and self.owners[s + 1] != self.pp_rank:
                self._send(x, s + 1)
        b = input_ids.shape[0]
        last = _full(x[:, -1]).contiguous() if x is not None and self.owners[-1] == self.pp_rank \
            else torch.empty(0, device=self.device)
        if self._vocab is None:
            vocab = torch.tensor([last.shape[-1] if last.dim() == 2 else 0], device=self.device)
            dist.broadcast(vocab, self.last_stage_rank, group=self.group)
            self._vocab = int(vocab)
        if last.dim() != 2:
            last = torch.empty(b, self._vocab, dtype=torch.float32, device=self.device)
        dist.broadcast(last, self.last_stage_rank, group=self.group)
        return last.unsqueeze(1)

    # ------------------------------------------------------------------------------------------ micro-batches
    def microbatches_for(self, rows: int) -> int:
        """How many micro-batches ``rows`` decode in: ``microbatches`` when each one's step on the largest stage is
        at least ``min_flops`` of work (:data:`MICROBATCH_MIN_FLOPS`), else 1. Collective over the pipeline on the
        first call (the ranks agree on the largest stage); the tokens are the same either way."""
        if self.microbatches == 1 or self.min_flops <= 0:
            return self.microbatches
        if not self._stage_numel:
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                        for mod in self.stages.values() for p in mod.parameters())
            numel = torch.tensor([local], dtype=torch.long, device=self.device)
            dist.all_reduce(numel, op=dist.ReduceOp.MAX, group=self.group)
            self._stage_numel.append(int(numel))
        per_microbatch = 2 * self._stage_numel[0] * rows / self.microbatches
        return self.microbatches if per_microbatch >= self.min_flops else 1

    @torch.no_grad()
    def generate_rows(self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
                      choose: Any) -> Tensor:
        """New tokens [B, N] of left-padded prompts, decoded in micro-batches in flight (see the module docstring),
        the same on every pipeline rank; ``choose``: ``generate``'s :class:`~lightning_llm.generation.TokenChooser`
        (its choice for a row depends on that row alone)."""
        if choose.cfg.cache_implementation == "static" and not _LOGGED:
            _LOGGED.append(True)
            log.warning("generation: decoding through the pipeline stages uses the dynamic cache, eagerly (each token "
                        "crosses the stages); cache_implementation=static and compile apply to whole copies")
        ring = _Ring(self, input_ids, attention_mask, max_new=max_new_tokens, choose=choose,
                     microbatches=self.microbatches_for(input_ids.shape[0]))
        if self.pp_rank == self.owners[0]:
            for m in range(len(ring.parts)):  # every micro-batch's prompt enters the pipeline
                ring.advance(m, 0, 0, input_ids)
        while ring.active:
            kind, m, s, step, x = ring.receive()
            if kind == _END:
                if ring.next != self.owners[0] and not ring.pair:
                    ring.send(ring.next, _END)
                break
            if kind == _HIDDEN:
                assert x is not None
                ring.advance(m, step, s, x)
            elif kind == _TOKENS:  # the first stage's owner: the tokens micro-batch m continues with
                assert x is not None
                ring.rows[m].append(x)
                ring.advance(m, step, 0, x)
            else:  # _DONE: micro-batch m ended
                ring.done_one()
        self._drain()
        return ring.tokens(self.last_stage_rank)


class _Ring:
    """One generation's micro-batches on this rank of the ring (:meth:`PipelineDecoder.generate_rows`).

    Messages: a control tensor of ``12 + R`` longs (kind, micro-batch, stage, step, dtype, ndim, 6 sizes, then a
    micro-batch's tokens inline: ``R`` = the largest micro-batch), followed by the hidden states for ``_HIDDEN``. A
    ring of two ranks with one stage each sends the hidden states alone after the first: the last stage's owner knows
    which micro-batch and step comes next (its own decisions, in the order it sent them), so no control precedes
    them and no ``_END`` is needed."""

    def __init__(self, dec: PipelineDecoder, input_ids: Tensor, attention_mask: Tensor, *, max_new: int,
                 choose: Any, microbatches: int) -> None:
        b, width = input_ids.shape
        self.dec, self.max_new, self.choose, self.b = dec, max_new, choose, b
        self.parts = [(int(ix[0]), int(ix[-1]) + 1) for ix in torch.arange(b).tensor_split(min(microbatches, b))]
        self.rows = [DecodeRows(input_ids[lo:hi], attention_mask[lo:hi], max_new) for lo, hi in self.parts]
        self.caches = [KVCache(capacity=width + max_new) for _ in self.parts]
        self.finished = [torch.zeros(hi - lo, dtype=torch.bool, device=dec.device) for lo, hi in self.parts]
        self.width = max(hi - lo for lo, hi in self.parts)  # R
        self.active = len(self.parts)  # micro-batches not yet done (the first stage's owner counts them down)
        self.pair = dec.pp_size == 2 and dec.num_stages == 2
        self.expected: deque[tuple[int, int]] = deque((m, 0) for m in range(len(self.parts)))  # pair, last owner
        self.hidden: tuple[torch.dtype, int] | None = None  # the hidden states' dtype and size (pair: once known)
        self.prev, self.next = (dec.pp_rank - 1) % dec.pp_size, (dec.pp_rank + 1) % dec.pp_size

    # ------------------------------------------------------------------------------------------ messages
    def send(self, to: int, kind: int, m: int = 0, stage: int = 0, step: int = 0, x: Tensor | None = None) -> None:
        """Control (+ hidden states ``x``, or tokens ``x`` inline for ``_TOKENS``) to pipeline rank ``to``."""
        hidden = kind == _HIDDEN and x is not None
        payload = (x.to_local() if isinstance(x, DTensor) else x).contiguous() if hidden else None
        control = _control(kind, m, stage, step, x=payload, device=self.dec.device, width=self.width)
        if kind == _TOKENS and x is not None:
            control[_HEADER:_HEADER + x.shape[0]] = x
        if payload is not None:
            known = self.pair and self.hidden is not None  # the receiver knows what comes: the hidden states alone
            self.hidden = (payload.dtype, payload.shape[-1])
            if known:
                return self.dec._post(to, payload)
        return self.dec._post(to, control, payload)

    def receive(self) -> tuple[int, int, int, int, Tensor | None]:
        """The next message from the previous rank of the ring: (kind, micro-batch, stage, step, tensor)."""
        dec = self.dec
        if self.pair and dec.pp_rank == dec.owners[-1] and self.hidden is not None:
            if not self.expected:
                return _END, 0, 0, 0, None
            m, step = self.expected.popleft()
            lo, hi = self.parts[m]
            x = torch.empty(hi - lo, self.rows[m].prompt if step == 0 else 1, self.hidden[1], dtype=self.hidden[0],
                            device=dec.device)
            dist.recv(x, dec._peer(self.prev), group=dec.group)
            return _HIDDEN, m, dec.num_stages - 1, step, x
        control = torch.empty(_HEADER + self.width, dtype=torch.long, device=dec.device)
        dist.recv(control, dec._peer(self.prev), group=dec.group)
        kind, m, stage, step, dtype, ndim = control[:6].tolist()
        if kind == _TOKENS:
            lo, hi = self.parts[m]
            return kind, m, stage, step, control[_HEADER:_HEADER + hi - lo].clone()
        if kind != _HIDDEN:
            return kind, m, stage, step, None
        x = torch.empty(control[6:6 + ndim].tolist(), dtype=_DTYPES[dtype], device=dec.device)
        dist.recv(x, dec._peer(self.prev), group=dec.group)
        if self.pair:  # the first hidden states of a pair: the rest come without a control
            self.hidden = (x.dtype, x.shape[-1])
            self.expected.popleft()
        return kind, m, stage, step, x

    # ------------------------------------------------------------------------------------------ work
    def advance(self, m: int, step: int, s: int, x: Tensor) -> None:
        """Run this rank's stages from ``s`` on for micro-batch ``m`` at ``step``; hand on the result."""
        dec, r = self.dec, self.rows[m]
        while r.length < r.prompt + step:  # a rank without the tokens keeps the columns in step
            r.append(torch.zeros(r.ids.shape[0], dtype=torch.long, device=dec.device))
        ids, kwargs = r.prefill() if step == 0 else r.step()
        past = r.length - ids.shape[1]
        while True:
            x = dec._run(s, ids if s == 0 else x, {**kwargs, "logits_to_keep": 1}, self.caches[m], past)
            if s == dec.num_stages - 1:
                return self._choose(m, step, x)
            s += 1
            if dec.owners[s] != dec.pp_rank:
                return self.send(dec.owners[s], _HIDDEN, m, s, step, x)

    def _choose(self, m: int, step: int, x: Tensor) -> None:
        """The last stage's owner: micro-batch ``m``'s tokens of ``step`` from its logits ``x`` [R, 1, V], sent to
        the first stage's owner to continue with, or the micro-batch is done."""
        lo, hi = self.parts[m]
        r = self.rows[m]
        token, self.finished[m] = self.choose(_full(x[:, -1]), r.seqs, self.finished[m], step, rows=slice(lo, hi))
        r.append(token)
        first = self.dec.owners[0]
        if self.choose.all_ended(self.finished[m]) or step == self.max_new - 1:
            self.send(first, _DONE, m)
        else:
            self.send(first, _TOKENS, m, 0, step + 1, token)
            self.expected.append((m, step + 1))

    def done_one(self) -> None:
        """The first stage's owner: a micro-batch ended; when none is left, the other ranks are told (a pair's last
        owner knows it already)."""
        self.active -= 1
        if not self.active and not self.pair:
            self.send(self.next, _END)

    def tokens(self, last_stage_rank: int) -> Tensor:
        """Every row's tokens [B, N'] (``N'``: the longest micro-batch's; a micro-batch that ended earlier is padded,
        as rows that ended are in one batch), broadcast from the last stage's owner."""
        dec, n = self.dec, self.max_new
        out = torch.full((self.b, n + 1), self.choose.cfg.pad_token_id, dtype=torch.long, device=dec.device)
        if dec.pp_rank == dec.owners[-1]:
            for r, (lo, hi) in zip(self.rows, self.parts):
                out[lo:hi, :r.generated.shape[1]] = r.generated
            out[0, n] = max(r.generated.shape[1] for r in self.rows)  # the last column carries N'
        dist.broadcast(out, last_stage_rank, group=dec.group)
        return out[:, :int(out[0, n])].clone()
