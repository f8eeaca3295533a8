"""Attention masks of the mask path (:mod:`.attention`): boolean attend-masks from padding masks, causal and within a
sliding window or a packed row's segment; SDPA's additive form of one; the position ids of packed rows.

Shape legend: B batch, S queries, T keys (cached and new).
"""

from __future__ import annotations

import torch
from torch import Tensor


def causal_padding_mask(attention_mask: Tensor, seq_len: int, sliding_window: int | None = None, *,
                        segment_ids: Tensor | None = None, offset: Tensor | None = None) -> Tensor:
    """Boolean attend-mask [B, 1, S, T] = causal AND key-not-padding (AND within the sliding window) (AND same
    segment), from a padding mask [B, T] (1/True = token).

    ``T`` may exceed ``S`` when decoding with a KV cache: the S queries are then the last S of the T positions.
    ``sliding_window``: a query at column i attends to columns j with ``i - j < sliding_window`` (HF's
    ``kv_idx > q_idx - sliding_window``; columns, not position ids, as transformers' masks; within one segment of a
    packed row columns and positions differ by the same offset).
    ``segment_ids`` [B, S] (packed rows, ``T == S``): a query attends only to keys of its own segment, so the mask is
    block-diagonal (one causal block per example).
    ``offset`` (a 0-dim long tensor: a static KV cache's decoding step): the column of the first query, where the S
    queries are not the last S of the T columns (the columns after them are not written yet).
    Query rows that would attend to nothing (left-padded positions, padding of a packed row) are allowed to attend
    to themselves, so SDPA never produces NaN; their outputs are meaningless and should be ignored by the loss.
    """
    device = attention_mask.device
    total = attention_mask.shape[-1]
    if offset is not None:  # by comparisons with the device-side column: no host value, one shape per (S, T)
        cols = torch.arange(total, device=device)  # [T]
        rows = offset + torch.arange(seq_len, device=device)  # [S] the queries' columns
        mask = cols <= rows[:, None]  # [S, T]
        if sliding_window is not None:
            mask = mask & (cols > rows[:, None] - sliding_window)
        mask = mask[None, None] & attention_mask.bool()[:, None, None, :]  # [B, 1, S, T]
        return mask | (~mask.any(dim=-1, keepdim=True) & (cols == rows[:, None])[None, None])
    offset = total - seq_len  # cached positions before the first query
    keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
    mask = causal_mask(seq_len, total, sliding_window, device=device)[None, None] & keep  # [B, 1, S, T]
    if segment_ids is not None:
        if offset:
            raise ValueError("segment_ids (packed rows) cannot be combined with cached keys (a KV cache)")
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])  # [B, 1, S, S]
    empty = ~mask.any(dim=-1, keepdim=True)  # [B, 1, S, 1]
    rows = torch.arange(seq_len, device=device)
    eye = torch.zeros(seq_len, total, dtype=torch.bool, device=device)
    eye[rows, rows + offset] = True  # each query's own position
    eye = eye[None, None]  # [1, 1, S, T]
    return mask | (empty & eye)


def additive_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean attend-mask as SDPA's additive one in ``dtype``: 0 where attending, -inf elsewhere (what SDPA
    makes of a boolean mask itself, in every call). Built once per forward and given to every layer, it is one
    tensor that each layer's attention saves for backward, instead of one conversion per layer."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def segment_positions(segment_ids: Tensor) -> Tensor:
    """Position ids [B, S] restarting at 0 where ``segment_ids`` [B, S] changes (each packed example's own
    positions; a padding run counts from its start)."""
    s = segment_ids.shape[-1]
    cols = torch.arange(s, device=segment_ids.device).expand_as(segment_ids)  # [B, S]
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(starts, cols, torch.zeros_like(cols)).cummax(dim=-1).values  # column of the segment's start
    return cols - first


def causal_mask(seq_len: int, total: int, sliding_window: int | None = None, *,
                device: torch.device | str | None = None) -> Tensor:
    """Boolean attend-mask [S, T] of the last S of T positions: causal, and within ``sliding_window`` if given."""
    offset = total - seq_len
    mask = torch.ones(seq_len, total, dtype=torch.bool, device=device).tril(diagonal=offset)  # key j <= query i
    if sliding_window is not None:
        mask = mask.triu(diagonal=offset - sliding_window + 1)  # key j > query i - window
    return mask


def key_padding_mask(attention_mask: Tensor) -> Tensor:
    """Boolean attend-mask [B, 1, 1, S] from a padding mask [B, S]; an all-padding row attends everywhere (no NaN)."""
    keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return keep | ~keep.any(dim=-1, keepdim=True)
