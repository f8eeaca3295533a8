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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm.models.decoding import DecodeRows, KVCache
from lightning_llm.strategies.pipeline.split import StageSpec, stage_ranks

log = logging.getLogger(__name__)

__all__ = ["PipelineDecoder"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEADER = 12  # kind, micro-batch, stage, step, dtype index, ndim, up to 6 sizes
_HIDDEN, _TOKENS, _DONE, _END = 1, 2, 3, 4  # message kinds of the ring


def _full(x: Tensor) -> Tensor:
    return (x.full_tensor() if isinstance(x, DTensor) else x).float()


class PipelineDecoder:
    """``decoder(ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache) -> logits [B, 1, V]`` (fp32,
    the last position only, the same on every pipeline rank), and :meth:`generate_rows` (micro-batches in flight).
    ``extra``: keyword inputs every stage receives (e.g. ``values=False`` for PPO's actor-critic)."""

    def __init__(self, *, stage_mods: Sequence[nn.Module], specs: Sequence[StageSpec], pp_group: Any,
                 pp_size: int, last_stage_rank: int, device: torch.device, microbatches: int = 1,
                 extra: dict[str, Any] | None = None) -> None:
        self.stages = {s.index: mod for mod, s in zip(stage_mods, specs)}
        self.num_stages = specs[0].num_stages
        self.owners = stage_ranks(pp_size, self.num_stages // pp_size, style="loop")
        self.group, self.device, self.last_stage_rank = pp_group, device, last_stage_rank
        self.pp_rank, self.pp_size = dist.get_rank(pp_group), pp_size
        self.microbatches = max(1, microbatches)
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

    def _header(self, kind: int, m: int = 0, stage: int = 0, step: int = 0, x: Tensor | None = None) -> Tensor:
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        header[:4] = torch.tensor([kind, m, stage, step])
        if x is not None:
            header[4], header[5] = _DTYPES.index(x.dtype), x.dim()
            header[6:6 + x.dim()] = torch.tensor(x.shape, dtype=torch.long)
        return header

    def _isend(self, pp_rank: int, kind: int, m: int = 0, stage: int = 0, step: int = 0,
               x: Tensor | None = None) -> None:
        """Asynchronous header (+ tensor) to ``pp_rank``; kept alive until :meth:`_drain`."""
        local = None if x is None else (x.to_local() if isinstance(x, DTensor) else x).contiguous()
        for t in (self._header(kind, m, stage, step, local), local):
            if t is not None:
                self._pending.append((dist.isend(t, self._peer(pp_rank), group=self.group), t))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def _recv_message(self, pp_rank: int) -> tuple[int, int, int, int, Tensor | None]:
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, self._peer(pp_rank), group=self.group)
        kind, m, stage, step, dtype, ndim = header[:6].tolist()
        if not ndim:
            return kind, m, stage, step, None
        out = torch.empty(header[6:6 + ndim].tolist(), dtype=_DTYPES[dtype], device=self.device)
        dist.recv(out, self._peer(pp_rank), group=self.group)
        return kind, m, stage, step, out

    def _drain(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []

    def _send(self, x: Tensor, stage: int) -> None:
        self._isend(self.owners[stage], _HIDDEN, stage=stage, x=x)
        self._drain()

    def _recv(self, stage: int) -> Tensor:
        out = self._recv_message(self.owners[stage])[4]
        assert out is not None
        return out

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
    @torch.no_grad()
    def generate_rows(self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
                       choose: Any) -> Tensor:
        """New tokens [B, N] of left-padded prompts, decoded in micro-batches in flight (see the module docstring),
        the same on every pipeline rank; ``choose``: ``generate``'s :class:`~lightning_llm.generation.TokenChooser`
        (its choice for a row depends on that row alone)."""
        b = input_ids.shape[0]
        parts = [(int(ix[0]), int(ix[-1]) + 1) for ix in torch.arange(b).tensor_split(min(self.microbatches, b))]
        rows = [DecodeRows(input_ids[lo:hi], attention_mask[lo:hi], max_new_tokens) for lo, hi in parts]
        caches = [KVCache(capacity=input_ids.shape[1] + max_new_tokens) for _ in parts]
        finished = [torch.zeros(hi - lo, dtype=torch.bool, device=self.device) for lo, hi in parts]
        last_owner, nxt = self.owners[-1], (self.pp_rank + 1) % self.pp_size
        prev = (self.pp_rank - 1) % self.pp_size

        def advance(m: int, step: int, s: int, x: Tensor) -> None:
            """Run this rank's stages from ``s`` on for micro-batch ``m`` at ``step``; hand on the result."""
            r = rows[m]
            while r.length < r.prompt + step:  # a rank without the tokens keeps the columns in step
                r.append(torch.zeros(r.ids.shape[0], dtype=torch.long, device=self.device))
            ids, kwargs = r.prefill() if step == 0 else r.step()
            past = r.length - ids.shape[1]
            while True:
                x = self._run(s, ids if s == 0 else x, {**kwargs, "logits_to_keep": 1}, caches[m], past)
                if s == self.num_stages - 1:
                    return self._choose(m, step, x, r, finished, parts, choose, max_new_tokens)
                s += 1
                if self.owners[s] != self.pp_rank:
                    return self._isend(self.owners[s], _HIDDEN, m, s, step, x)

        if self.pp_rank == self.owners[0]:
            for m in range(len(parts)):  # every micro-batch's prompt enters the pipeline
                advance(m, 0, 0, input_ids)
        active = len(parts)
        while active:
            kind, m, s, step, x = self._recv_message(prev)
            if kind == _END:
                if nxt != self.owners[0]:
                    self._isend(nxt, _END)
                break
            if kind == _HIDDEN:
                assert x is not None
                advance(m, step, s, x)
            elif kind == _TOKENS:  # the first stage's owner: the tokens micro-batch m continues with
                assert x is not None
                rows[m].append(x)
                advance(m, step, 0, x)
            elif kind == _DONE:
                active -= 1
                if active == 0 and self.pp_size > 1:
                    self._isend(nxt, _END)
        self._drain()
        return self._gather_tokens(rows, parts, b, max_new_tokens, choose.cfg.pad_token_id, last_owner)

    def _choose(self, m: int, step: int, x: Tensor, r: DecodeRows, finished: list[Tensor],
                parts: list[tuple[int, int]], choose: Any, max_new: int) -> None:
        """The last stage's owner: micro-batch ``m``'s tokens of ``step`` from its logits ``x`` [R, 1, V], sent to
        the first stage's owner to continue with, or the micro-batch is done."""
        lo, hi = parts[m]
        token, finished[m] = choose(_full(x[:, -1]), r.seqs, finished[m], step, rows=slice(lo, hi))
        r.append(token)
        if choose.all_ended(finished[m]) or step == max_new - 1:
            self._isend(self.owners[0], _DONE, m)
        else:
            self._isend(self.owners[0], _TOKENS, m, 0, step + 1, token)

    def _gather_tokens(self, rows: list[DecodeRows], parts: list[tuple[int, int]], b: int, max_new: int, pad: int,
                       last_owner: int) -> Tensor:
        """Every row's tokens [B, N'] (``N'``: the longest micro-batch's; a micro-batch that ended earlier is padded,
        as rows that ended are in one batch), broadcast from the last stage's owner."""
        out = torch.full((b, max_new + 1), pad, dtype=torch.long, device=self.device)  # last column: N'
        if self.pp_rank == last_owner:
            for r, (lo, hi) in zip(rows, parts):
                out[lo:hi, :r.generated.shape[1]] = r.generated
            out[0, max_new] = max(r.generated.shape[1] for r in rows)
        dist.broadcast(out, self.last_stage_rank, group=self.group)
        return out[:, :int(out[0, max_new])].clone()
