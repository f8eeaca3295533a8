"""Which tokens of a sequence a context-parallel rank holds, and the batch slice it trains on.

Load-balanced causal sharding (Megatron-LM's and torchtitan's head-tail split): a sequence of ``S`` columns is cut
into ``2 x cp`` chunks of ``c = S / (2 cp)``; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so every rank's
queries see the same number of causal keys (``(2 cp + 1) c^2 / 2`` query-key pairs each).

Every rank of a cp group receives the whole batch (the sampler is keyed by the data-parallel rank); the engine keeps
this rank's columns of every per-token tensor (``[B, S, ...]``: input ids, labels, attention mask, segment ids,
position ids) and adds the global positions first when the batch has none, so RoPE and learned positions see each
token's place in the whole sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["local_columns", "chunk_size", "shard_batch", "order_gathered"]

PositionsFn = Callable[[Tensor], Tensor]
"""``segment_ids [B, S] -> position_ids [B, S]``: a family's positions of packed rows (restarting per example)."""


def chunk_size(seq_len: int, cp: int) -> int:
    """``S / (2 cp)``; refuses a length the load-balanced split cannot cut evenly."""
    if seq_len % (2 * cp):
        raise ValueError(f"context_parallel_size={cp}: the sequence length {seq_len} must be divisible by 2 x "
                         f"context_parallel_size = {2 * cp} (load-balanced causal chunks); pad the rows to a multiple "
                         f"(e.g. --data.max_length / --data.block_size)")
    return seq_len // (2 * cp)


def local_columns(seq_len: int, cp: int, rank: int, *, device: torch.device | None = None) -> Tensor:
    """Global columns [S / cp] of rank ``rank``'s tokens, in its local order: chunk ``rank`` then chunk
    ``2 cp - 1 - rank``."""
    c = chunk_size(seq_len, cp)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([head, tail])


def order_gathered(parts: list[Tensor] | tuple[Tensor, ...], *, dim: int) -> Tensor:
    """The whole sequence in column order from every rank's local tensor (``parts[r]``: rank r's ``[..., 2c, ...]``
    along ``dim``, as :func:`local_columns` orders them): chunks ``0..cp-1`` are the ranks' heads, ``cp..2cp-1`` their
    tails in reverse rank order."""
    c = parts[0].shape[dim] // 2
    heads = [p.narrow(dim, 0, c) for p in parts]
    tails = [p.narrow(dim, c, c) for p in reversed(parts)]
    return torch.cat(heads + tails, dim=dim)


def shard_batch(batch: Any, *, cp: int, rank: int, positions: PositionsFn | None) -> Any:
    """This rank's slice of a batch dict: every tensor with the input ids' ``[B, S]`` leading shape keeps the columns
    of :func:`local_columns`; ``position_ids`` (global) are added when absent (``arange(S)``, or per packed example
    by ``positions``). Other entries (per-row values) pass unchanged."""
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        raise ValueError("context parallelism needs dict batches with `input_ids` [B, S] (the per-token tensors are "
                         f"cut along the sequence); got {type(batch).__name__}")
    ids = batch["input_ids"]
    b, s = ids.shape[0], ids.shape[1]
    out = dict(batch)
    if out.get("position_ids") is None:
        seg = out.get("segment_ids")
        if seg is not None:
            if positions is None:
                raise ValueError("context parallelism: a packed batch (`segment_ids`) without `position_ids`, and the "
                                 "model family declares no segment_positions; add position_ids to the batch")
            out["position_ids"] = positions(seg)
        else:
            out["position_ids"] = torch.arange(s, device=ids.device).expand(b, s)
    cols = local_columns(s, cp, rank, device=ids.device)
    for key, value in out.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == b and value.shape[1] == s:
            out[key] = value.index_select(1, cols)
    return out
