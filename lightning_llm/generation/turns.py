"""Several turns of the same rows decoded with one KV cache (:class:`TurnDecoder`): a multi-turn rollout (an RL
environment or tool loop, :mod:`lightning_llm.rl.multiturn.episodes`) appends each turn's context (an environment's messages,
a tool's result) to rows whose keys and values are cached, so each turn prefills only the appended tokens.

Columns of the cache are never rewritten; what a row must not see again is masked instead:

* a turn's appended block is LEFT-padded to the longest row's (its padding masked), so every row's last token sits in
  the last column and the rows decode in lock-step, as prompts do in :func:`~.loop.generate`;
* a generated token is attended only where its row had not ended before it (the stop token itself is attended, the
  padding fed after it is not), so the next turn continues right after the stop token;
* positions count attended columns only (``cumsum(mask) - 1``), so every row's logits are those of its tokens laid
  out without gaps (the whole conversation in one forward, as the training forward computes it).

Rows may be dropped between turns (episodes that ended: :meth:`TurnDecoder.keep`, the cache's rows selected). A model
whose ranks must run the same forwards (``all_ended``: ZeRO-3's per-layer fallback) keeps every row, ended ones
masked, and agrees on when each turn stops. The model protocol is :func:`~.loop.generate`'s (``kv_cache=``,
``logits_to_keep=1``), which every layout's decoder takes (a whole copy, a pipeline's lock-step decoder).

Shape legend: R rows, A appended columns, T columns so far, N new tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_llm.models.decoding import KVCache

from .config import GenerationConfig
from .loop import TokenChooser
from .sampling import STOP_CHECK_EVERY, last_logits
from .static import all_ended, log_once

__all__ = ["TurnDecoder"]


class TurnDecoder:
    """Decodes turns of ``rows`` rows with one dynamic KV cache (see the module docstring). ``model``: what
    :func:`~.loop.generate` would be given (its ``all_ended``, when it has one, is asked where a turn stops)."""

    def __init__(self, model: Any, rows: int, *, device: torch.device, capacity: int = 256) -> None:
        self.model = model
        self.agree = getattr(model, "all_ended", None)
        self.cache = KVCache(capacity=capacity)
        # [R, capacity] buffers written in place (doubled when a forward would pass them), as the KV cache's are:
        # a token's forward copies no earlier column
        self._ids = torch.zeros(rows, capacity, dtype=torch.long, device=device)
        self._mask = torch.zeros(rows, capacity, dtype=torch.bool, device=device)
        self.length = 0  # T: columns fed so far
        self.count = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, 1] attended columns so far
        self.pending: tuple[Tensor, Tensor] | None = None  # the last turn's last token [R, 1] and its mask, not fed
        self.prefilled = 0  # prefill forwards run (one per turn)
        self.decoded = 0  # one-token forwards run

    @property
    def ids(self) -> Tensor:
        """Every column fed so far [R, T]."""
        return self._ids[:, :self.length]

    @property
    def mask(self) -> Tensor:
        """Which columns fed so far are attended [R, T] bool."""
        return self._mask[:, :self.length]

    @property
    def lockstep(self) -> bool:
        """Whether the ranks decode together (rows are then kept: :meth:`keep` is not called)."""
        return self.agree is not None

    def keep(self, index: Tensor) -> None:
        """Keep rows ``index`` [R'] (in that order) of the cache and the buffers."""
        self.cache.reorder(index)
        self._ids, self._mask, self.count = self._ids[index], self._mask[index], self.count[index]
        if self.pending is not None:
            self.pending = (self.pending[0][index], self.pending[1][index])

    def _forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """Feed ``ids`` [R, S] whose own mask is ``mask`` [R, S]; next-token logits [R, V] fp32 of the last column."""
        positions = (self.count + mask.long().cumsum(-1) - 1).clamp(min=0)
        end = self.length + ids.shape[1]
        if end > self._ids.shape[1]:
            size = max(end, 2 * self._ids.shape[1])
            self._ids = torch.cat([self.ids, self._ids.new_zeros(self._ids.shape[0], size - self.length)], dim=1)
            self._mask = torch.cat([self.mask, self._mask.new_zeros(self._mask.shape[0], size - self.length)], dim=1)
        self._ids[:, self.length:end], self._mask[:, self.length:end] = ids, mask.bool()
        self.length = end
        self.count = self.count + mask.long().sum(-1, keepdim=True)
        return last_logits(self.model(ids, attention_mask=self.mask, position_ids=positions, kv_cache=self.cache,
                                      logits_to_keep=1))

    @torch.no_grad()
    def turn(self, block: Tensor, block_mask: Tensor, cfg: GenerationConfig, *, uniforms: Tensor | None = None,
             generator: torch.Generator | None = None, limits: Tensor | None = None,
             active: Tensor | None = None) -> Tensor:
        """Append ``block`` [R, A] (left-padded, ``block_mask`` 0 on its padding) and decode one turn: the new tokens
        [R, N'] (N' <= ``cfg.max_new_tokens``; after a row's stop token, ``cfg.pad_token_id``).

        ``uniforms`` [R, max_new_tokens] / ``generator``: the draws, as :func:`~.loop.generate` takes them; ``limits``
        [R] long: the most tokens each row may add this turn (a token budget: a row that reaches it ends, cut);
        ``active`` [R] bool: the rows that take part (the others are fed masked padding: the lock-step rows of
        episodes that ended). The previous turn's last token is fed in front of ``block`` (a turn's last token needs
        no forward of its own)."""
        if cfg.cache_implementation == "static" or cfg.num_beams != 1:
            log_once("multi-turn rollouts decode with the dynamic cache, eagerly (cache_implementation=static, "
                     "compile and beam search apply to single-turn generation)")
        choose = TokenChooser(cfg, device=block.device, generator=generator, uniforms=uniforms)
        finished = torch.zeros(block.shape[0], dtype=torch.bool, device=block.device)
        if active is not None:
            finished, block_mask = ~active, block_mask.bool() & active[:, None]
        if limits is not None:
            finished = finished | (limits <= 0)
        if self.pending is not None:
            block, block_mask = torch.cat([self.pending[0], block], 1), torch.cat([self.pending[1], block_mask.bool()], 1)
        logits = self._forward(block, block_mask)
        self.prefilled += 1
        out: list[Tensor] = []
        for step in range(cfg.max_new_tokens):
            token, ended = choose(logits, self.ids, finished, step)
            out.append(token)
            if limits is not None:
                ended = ended | (limits <= step + 1)
            real = ~finished[:, None]  # the token is attended where its row had not ended before it
            if step == cfg.max_new_tokens - 1 or ((step + 1) % STOP_CHECK_EVERY == 0 and all_ended(ended, self.agree)):
                self.pending = (token[:, None], real)
                break
            logits = self._forward(token[:, None], real)
            self.decoded += 1
            finished = ended
        return torch.stack(out, dim=1)
