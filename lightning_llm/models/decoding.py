"""What incremental decoding hands a decoder: the KV cache and the inputs of each step.

The decoder's call protocol for decoding (``DecoderLM.forward``, the prompt-learning wrappers)::

    model(input_ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache, logits_to_keep=1)
        -> logits [B, 1, V] of the last position

``T`` = the key columns the attention sees (``kv_cache.columns(S)``). Prompts are LEFT-padded (``attention_mask`` 0
on the left), so every row's last prompt token sits in the last column and new tokens are appended in lock-step;
positions are counted over real tokens only (``cumsum(mask) - 1``), so a padded row produces exactly what it
produces alone.

**The cache interface** (what a decoder and its attention layers call; a new attention layer, e.g. Multi-head
Latent Attention, plugs in through it):

* ``cache.columns(S) -> (T, first)``: before a forward of ``S`` new tokens, the key columns ``T`` its attention will
  see and the column of its first new token (an ``int``, or a 0-dim long tensor for :class:`StaticKVCache`'s
  decoding steps). The model builds its causal mask from them (the new tokens' queries sit at columns
  ``first .. first + S - 1``; ``attention_mask`` covers the ``T`` columns).
* ``cache.update(owner, a, b) -> (a_all, b_all)``: a layer appends two tensors ``[B, X, S, Y]`` (the sequence on
  dimension 2) under its own identity and gets back all ``T`` cached columns of both: an attention's keys and values
  ``[B, K, S, D]`` after rotary, or a latent attention's compressed latent and rotary key. Columns not yet written
  (a static cache's tail) are zero; the mask hides them.
* ``cache.state(owner) -> states | None`` and ``cache.set_state(owner, states)``: a recurrent layer's states (Gated
  DeltaNet's convolution inputs and delta-rule state, ``models/layers/deltanet.py``) after the tokens so far, kept per layer
  beside the attention layers' keys and values (None before its first forward); a static cache writes them into
  buffers of fixed addresses.
* ``cache.advance(S)``: the forward is done (the model calls it after its layers).
* ``cache.reorder(index)``: keep batch rows ``index`` (beam search; :class:`KVCache` only).

Two implementations: :class:`KVCache` (``cache_implementation="dynamic"``: columns grow with the tokens, a Python
``seq_len``) and :class:`StaticKVCache` (``"static"``: ``[B, X, C, Y]`` buffers of a fixed capacity ``C``, the write
position a device tensor, so every decoding step has the same shapes and can be one compiled graph). Both
preallocate and write each step in place: no tensor grows by concatenation per token. No parallel code lives here.

Shape legend: B batch (R: some of its rows), S prompt length, N new tokens, K kv heads, D head dim, T columns so far,
C a static cache's capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DecodeRows", "KVCache", "StaticKVCache", "positions"]


def positions(mask: Tensor) -> Tensor:
    """Position of every column counted over real tokens: [B, T] (padding gets 0; it is masked anyway)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class KVCache:
    """Keys/values of the tokens seen so far, per attention module, for incremental decoding (the dynamic cache).

    Each :class:`~lightning_llm.models.layers.block.Attention` appends its new keys/values [B, K, S_new, D] (after rotary)
    under its own identity, so one cache object serves a whole model without layer indices. ``reorder`` selects batch
    rows (beam search). With ``capacity`` each module's keys and values live in one [B, K, capacity, D] buffer
    written in place (a step that would pass it doubles it); without, they are concatenated per call.
    """

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}  # id(owner) -> keys, values [B, K, filled, D]
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # id(owner) -> [B, K, capacity, D] (capacity only)
        self._states: dict[int, tuple[Tensor, ...]] = {}  # id(owner) -> a recurrent layer's states [B, ...]
        self.seq_len = 0
        """Tokens cached so far (advanced by the model after each forward)."""

    def columns(self, new: int) -> tuple[int, int | Tensor]:
        """``(T, first)`` of a forward of ``new`` tokens: cached + new columns, and the first new token's column."""
        return self.seq_len + new, self.seq_len

    def advance(self, new: int) -> None:
        """A forward of ``new`` tokens is done."""
        self.seq_len += new

    def _allocate(self, k: Tensor, v: Tensor, size: int) -> tuple[Tensor, Tensor]:
        return k.new_empty(*k.shape[:2], size, k.shape[3]), v.new_empty(*v.shape[:2], size, v.shape[3])

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
            kb, vb = self._allocate(k, v, max(end, self.capacity if kb is None else 2 * kb.shape[2]))
            if past is not None:
                kb[:, :, :filled], vb[:, :, :filled] = past
            self._buffers[key] = (kb, vb)
        kb[:, :, filled:end], vb[:, :, filled:end] = k, v
        self._kv[key] = (kb[:, :, :end], vb[:, :, :end])
        return self._kv[key]

    def state(self, owner: nn.Module) -> tuple[Tensor, ...] | None:
        """A recurrent layer's states after the tokens so far (None before its first forward)."""
        return self._states.get(id(owner))

    def set_state(self, owner: nn.Module, states: tuple[Tensor, ...]) -> None:
        """Keep ``owner``'s states [B, ...] after this forward's tokens."""
        self._states[id(owner)] = states

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` [B'] (in that order) of every cached tensor."""
        self._states = {key: tuple(t.index_select(0, index) for t in states) for key, states in self._states.items()}
        if self.capacity is None:
            self._kv = {key: (k.index_select(0, index), v.index_select(0, index)) for key, (k, v) in self._kv.items()}
            return
        for key, (kb, vb) in self._buffers.items():
            filled = self._kv[key][0].shape[2]
            kb, vb = kb.index_select(0, index), vb.index_select(0, index)
            self._buffers[key] = (kb, vb)
            self._kv[key] = (kb[:, :, :filled], vb[:, :, :filled])


class StaticKVCache(KVCache):
    """A cache of fixed ``capacity`` C: per module one zero-filled [B, K, C, D] buffer for keys and one for values,
    reused by every generation of the same shapes (:meth:`reset`).

    The prompt is prefilled as by :class:`KVCache` (``seq_len`` a Python int, the attention over the first columns:
    the same numbers as the dynamic cache). :meth:`start_steps` then switches to decoding steps: the write position
    is the 0-dim device tensor :attr:`position`, ``update`` writes the new column there (``index_copy_``) and returns
    the whole buffers, and ``columns`` reports ``(C, position)``; the mask [B, C] hides the columns not yet written.
    Every step thus has the same shapes and no host value, so it can be compiled once per (B, C) and replayed
    (CUDA graphs); the buffers and :attr:`position` keep their addresses (``torch._dynamo.mark_static_address``)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.position: Tensor | None = None
        """Decoding steps: the column the next token's keys/values are written to (0-dim long); None while
        prefilling."""
        self._position: Tensor | None = None  # the tensor behind ``position``, kept across generations
        self._state_buffers: dict[int, tuple[Tensor, ...]] = {}  # id(owner) -> recurrent states, fixed addresses

    def reset(self) -> None:
        """Start a new generation (the buffers are kept: their stale columns are hidden by the mask, the recurrent
        states are overwritten by the prefill)."""
        self._kv, self._states, self.seq_len, self.position = {}, {}, 0, None

    def set_state(self, owner: nn.Module, states: tuple[Tensor, ...]) -> None:
        """Copy ``states`` into ``owner``'s buffers (allocated by the prefill, kept across generations of the same
        shapes), so a compiled step reads and writes the same addresses."""
        key = id(owner)
        kept = self._state_buffers.get(key)
        if kept is None or any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                               for a, b in zip(kept, states)):
            if self.position is not None:
                raise ValueError("StaticKVCache: a recurrent layer's states change shape in a decoding step")
            kept = tuple(t.detach().clone() for t in states)
            for t in kept:
                torch._dynamo.mark_static_address(t, guard=False)
            self._state_buffers[key] = kept
        else:
            for buf, t in zip(kept, states):
                buf.copy_(t)
        self._states[key] = kept

    def _allocate(self, k: Tensor, v: Tensor, size: int) -> tuple[Tensor, Tensor]:
        kb = k.new_zeros(*k.shape[:2], size, k.shape[3])  # zeros: masked columns must be finite (0 x NaN is NaN)
        vb = v.new_zeros(*v.shape[:2], size, v.shape[3])
        torch._dynamo.mark_static_address(kb, guard=False)
        torch._dynamo.mark_static_address(vb, guard=False)
        return kb, vb

    def update(self, owner: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        key = id(owner)
        if self.position is None:  # prefill: as the dynamic cache, in this cache's buffers
            kept = self._buffers.get(key)
            if kept is not None and (kept[0].shape[:2] != k.shape[:2] or kept[0].shape[3] != k.shape[3]
                                     or kept[0].dtype != k.dtype or kept[0].device != k.device):
                del self._buffers[key]  # kept for another batch, head count, dtype or device
            past = self._kv.get(key)
            if (past[0].shape[2] if past is not None else 0) + k.shape[2] > self.capacity:  # type: ignore[operator]
                raise ValueError(f"StaticKVCache: {k.shape[2]} more columns pass its capacity {self.capacity}")
            return super().update(owner, k, v)
        kb, vb = self._buffers[key]
        columns = self.position.view(1) if k.shape[2] == 1 else self.position + torch.arange(
            k.shape[2], device=k.device)
        kb.index_copy_(2, columns, k)
        vb.index_copy_(2, columns, v)
        return kb, vb

    def start_steps(self) -> None:
        """Switch from the prefill to decoding steps: the next write goes to column ``seq_len``."""
        if self._position is None or self._position.device != self._device():
            self._position = torch.zeros((), dtype=torch.long, device=self._device())
            torch._dynamo.mark_static_address(self._position, guard=False)
        self._position.fill_(self.seq_len)
        self.position = self._position

    def _device(self) -> torch.device:
        return next(iter((*self._buffers.values(), *self._state_buffers.values())))[0].device

    def columns(self, new: int) -> tuple[int, int | Tensor]:
        if self.position is None:
            return super().columns(new)
        assert self.capacity is not None
        return self.capacity, self.position

    def advance(self, new: int) -> None:
        if self.position is None:
            super().advance(new)
        else:
            self.position.add_(new)

    def reorder(self, index: Tensor) -> None:
        raise NotImplementedError("StaticKVCache does not reorder rows (beam search decodes with KVCache)")


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
