"""Work on whole copies shared out over the ranks that hold the same batch (a replica's pipeline and tensor-parallel
ranks, :mod:`.copies`): each rank computes a contiguous share of the rows and one all-gather gives every rank all of
them. A model's rows are independent (attention stays within a row), so every row's result is what the whole batch
computes at once, up to the rounding of a smaller matmul."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["RowShare", "share_bounds"]


def share_bounds(rows: int, size: int) -> list[int]:
    """Where each of ``size`` contiguous shares of ``rows`` begins, and the end: shares differ by at most one row."""
    return [r * rows // size for r in range(size + 1)]


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The rows of a forward call: the first dimension every tensor input with one shares, else ``None``."""
    firsts = {t.shape[0] for t in (*args, *kwargs.values()) if isinstance(t, Tensor) and t.dim() >= 1}
    return firsts.pop() if len(firsts) == 1 else None


def _gather_rows(out: Any, bounds: list[int], group: Any, device: torch.device) -> Any | None:
    """Every rank's share of ``out`` (a pytree whose leaves are this share's per-row tensors) joined in row order,
    in one all-gather of bytes; ``None`` where a leaf is not per-row (every rank sees the same structure)."""
    rank, size = dist.get_rank(group), len(bounds) - 1
    mine, per = bounds[rank + 1] - bounds[rank], max(bounds[r + 1] - bounds[r] for r in range(size))
    leaves, spec = tree_flatten(out)
    per_row = all(isinstance(t, Tensor) and t.dim() >= 1 and t.shape[0] == mine for t in leaves)
    if bounds[-1] % size:  # shares of two sizes: a leaf of one share's size is not per-row; the ranks agree
        flag = torch.tensor([int(per_row)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        per_row = bool(flag)
    if not per_row:
        return None
    padded = [torch.nn.functional.pad(t.detach().contiguous(), (0, 0) * (t.dim() - 1) + (0, per - mine))
              if per > mine else t.detach().contiguous() for t in leaves]
    sizes = [t.numel() * t.element_size() for t in padded]
    flat = torch.cat([torch.nn.functional.pad(t.reshape(-1).view(torch.uint8), (0, -n % 8))
                      for t, n in zip(padded, sizes)])
    every = torch.empty(size * flat.numel(), dtype=torch.uint8, device=flat.device)
    dist.all_gather_into_tensor(every, flat, group=group)
    every = every.view(size, -1)
    joined, offset = [], 0
    for t, n in zip(padded, sizes):
        parts = [every[r, offset:offset + n].view(t.dtype).view(t.shape)[:bounds[r + 1] - bounds[r]]
                 for r in range(size)]
        joined.append(torch.cat(parts))
        offset += n + (-n % 8)
    return tree_unflatten(joined, spec)


class RowShare:
    """A whole copy (``model``) whose work the ranks of ``group`` share by rows:

    * a forward call (an RL rollout's old and reference log-probs, values): each rank runs its share of the rows,
      and the outputs are all-gathered (a call whose output is not per-row runs whole);
    * ``generate``'s row-wise loop (greedy or per-row draws with the KV cache: a row's tokens depend on its own
      logits and draws alone, ``TokenChooser.rowwise``): each rank decodes its share, the tokens are all-gathered;
    * ``generate``'s decoding steps otherwise (a ``kv_cache`` keyword: beam search, one generator's draws, decoding
      without a cache) run the whole batch on every rank, as one device, without a collective per token."""

    def __init__(self, model: Any, group: Any, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device
        self.size = dist.get_world_size(group)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.size == 1 or "kv_cache" in kwargs:  # a decoding step (every token): straight to the copy
            return self.model(*args, **kwargs)
        rows = _batch_rows(args, kwargs)
        if rows is None or rows < self.size:
            return self.model(*args, **kwargs)
        bounds = share_bounds(rows, self.size)
        lo, hi = bounds[dist.get_rank(self.group)], bounds[dist.get_rank(self.group) + 1]

        def share(x: Any) -> Any:
            return x[lo:hi] if isinstance(x, Tensor) and x.dim() >= 1 else x

        out = _gather_rows(self.model(*map(share, args), **{k: share(v) for k, v in kwargs.items()}), bounds,
                           self.group, self.device)
        return out if out is not None else self.model(*args, **kwargs)

    def generate_rows(self, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
                      choose: Any) -> Tensor:
        """New tokens [B, N'] of every row, the same on every rank of the group (``N'``: the longest share's; a
        share that ended earlier is padded, as rows that ended are in one batch)."""
        b = input_ids.shape[0]
        if self.size == 1 or b < self.size:
            return choose.generate_rows(self.model, input_ids, attention_mask, slice(None))
        bounds = share_bounds(b, self.size)
        lo, hi = bounds[dist.get_rank(self.group)], bounds[dist.get_rank(self.group) + 1]
        mine = choose.generate_rows(self.model, input_ids, attention_mask, slice(lo, hi))
        out = torch.full((hi - lo, max_new_tokens + 1), choose.cfg.pad_token_id, dtype=torch.long,
                         device=self.device)
        out[:, :mine.shape[1]] = mine
        out[:, -1] = mine.shape[1]  # the last column carries the share's N'
        every = _gather_rows(out, bounds, self.group, self.device)
        return every[:, :int(every[:, -1].max())].clone()
