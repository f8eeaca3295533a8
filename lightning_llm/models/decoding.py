"""What incremental decoding hands a decoder: the KV cache and the inputs of each step.

The decoder's call protocol for decoding (``DecoderLM.forward``, the prompt-learning wrappers)::

    model(input_ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache, logits_to_keep=1)
        -> logits [B, 1, V] of the last position

``T`` = cached + new columns. Prompts are LEFT-padded (``attention_mask`` 0 on the left), so every row's last prompt
token sits in the last column and new tokens are appended in lock-step; positions are counted over real tokens only
(``cumsum(mask) - 1``), so a padded row produces exactly what it produces alone.

Both objects preallocate for the whole generation (``capacity`` columns) and write each step in place: no tensor
grows by concatenation per token, and a step's inputs are views. No parallel code lives here.

Shape legend: B batch (R: some of its rows), S prompt length, N new tokens, K kv heads, D head dim, T columns so far.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DecodeRows", "KVCache", "positions"]


def positions(mask: Tensor) -> Tensor:
    """Position of every column counted over real tokens: [B, T] (padding gets 0; it is masked anyway)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class KVCache:
    """Keys/values of the tokens seen so far, per attention module, for incremental decoding.

    Each :class:`~lightning_llm.models.layers.Attention` appends its new keys/values [B, K, S_new, D] (after rotary)
    under its own identity, so one cache object serves a whole model without layer indices. ``reorder`` selects batch
    rows (beam search). With ``capacity`` each module's keys and values live in one [B, K, capacity, D] buffer
    written in place (a step that would pass it doubles it); without, they are concatenated per call.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}  # id(owner) -> keys, values [B, K, filled, D]
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # id(owner) -> [B, K, capacity, D] (capacity only)
        self.seq_len = 0
        """Tokens cached so far (set by the model after each forward)."""

    def update(self, owner: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v [B, K, S_new, D] for ``owner``; returns all keys/values [B, K, S_past + S_new, D]."""
        key = id(owner)
        past = self._kv.get(key)
        if self.capacity is None:
            if past is not None:
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            self._kv[key] = (k, v)
            return k, v
        filled = past[0].shape[2] if past is not None else 0
        end = filled + k.shape[2]
        kb, vb = self._buffers.get(key) or (None, None)
        if kb is None or vb is None or end > kb.shape[2]:
            size = max(end, self.capacity if kb is None else 2 * kb.shape[2])
            kb, vb = k.new_empty(*k.shape[:2], size, k.shape[3]), v.new_empty(*v.shape[:2], size, v.shape[3])
            if past is not None:
                kb[:, :, :filled], vb[:, :, :filled] = past
            self._buffers[key] = (kb, vb)
        kb[:, :, filled:end], vb[:, :, filled:end] = k, v
        self._kv[key] = (kb[:, :, :end], vb[:, :, :end])
        return self._kv[key]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` [B'] (in that order) of every cached tensor."""
        if self.capacity is None:
            self._kv = {key: (k.index_select(0, index), v.index_select(0, index)) for key, (k, v) in self._kv.items()}
            return
        for key, (kb, vb) in self._buffers.items():
            filled = self._kv[key][0].shape[2]
            kb, vb = kb.index_select(0, index), vb.index_select(0, index)
            self._buffers[key] = (kb, vb)
            self._kv[key] = (kb[:, :, :filled], vb[:, :, :filled])


class DecodeRows:
    """The token ids, attention mask and next positions of rows being decoded, in buffers of ``S + max_new``
    columns: :meth:`prefill` and :meth:`step` give a forward's inputs as views, :meth:`append` writes a token.

    Every appended token is real (mask 1: a row that ended is fed padding tokens that stay attended, as a batch
    decoded in lock-step does), so a new token's position is the row's count of real tokens so far."""

    def __init__(self, input_ids: Tensor, attention_mask: Tensor, max_new: int) -> None:
        r, self.prompt = input_ids.shape
        self.ids = input_ids.new_zeros(r, self.prompt + max_new)  # [R, S + N]
        self.ids[:, :self.prompt] = input_ids
        self.mask = torch.ones(r, self.prompt + max_new, dtype=torch.bool, device=input_ids.device)
        self.mask[:, :self.prompt] = attention_mask.bool()
        self.next_pos = self.mask[:, :self.prompt].sum(-1, keepdim=True)  # [R, 1] position of the next token
        self.length = self.prompt  # T: columns so far

    @property
    def seqs(self) -> Tensor:
        """Every token so far [R, T] (prompt included)."""
        return self.ids[:, :self.length]

    @property
    def generated(self) -> Tensor:
        """The appended tokens [R, T - S]."""
        return self.ids[:, self.prompt:self.length]

    def prefill(self) -> tuple[Tensor, dict[str, Tensor]]:
        """``(input_ids [R, S], {attention_mask, position_ids})`` of the prompt."""
        mask = self.mask[:, :self.prompt]
        return self.ids[:, :self.prompt], {"attention_mask": mask, "position_ids": positions(mask)}

    def step(self) -> tuple[Tensor, dict[str, Tensor]]:
        """``(input_ids [R, 1], {attention_mask [R, T], position_ids [R, 1]})`` of the last appended token."""
        t = self.length
        return self.ids[:, t - 1:t], {"attention_mask": self.mask[:, :t], "position_ids": self.next_pos - 1}

    def whole(self) -> tuple[Tensor, dict[str, Tensor]]:
        """``(input_ids [R, T], {attention_mask, position_ids})`` of everything so far (decoding without a cache)."""
        mask = self.mask[:, :self.length]
        return self.seqs, {"attention_mask": mask, "position_ids": positions(mask)}

    def append(self, token: Tensor) -> None:
        """Write ``token`` [R] into the next column."""
        self.ids[:, self.length] = token
        self.length += 1
        self.next_pos = self.next_pos + 1

    def reorder(self, index: Tensor) -> None:
        """Keep rows ``index`` [R'] (beam search)."""
        self.ids, self.mask, self.next_pos = self.ids[index], self.mask[index], self.next_pos[index]
