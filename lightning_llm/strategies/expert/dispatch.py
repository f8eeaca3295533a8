"""Token dispatch of expert parallelism: each rank's tokens to the ranks holding their experts and back, by two
all-to-alls with uneven splits (torchtitan's and Megatron's dispatch, written on torch's collectives).

A rank's MoE layer sorts its ``M`` assignments by global expert (``moe.dispatch_to_experts``); with ``E`` experts over
``ep`` ranks, rank ``r`` holds experts ``r*E/ep .. (r+1)*E/ep - 1`` (``E_l = E/ep`` of them), so the sorted rows go to
the ranks in order. :func:`dispatch`:

1. exchange the rows per (destination rank, its local expert) [ep, E_l] (one all-to-all of ``E`` counts);
2. send the rows (all-to-all, uneven splits): what arrives is grouped by source rank, then by local expert;
3. regroup by local expert (a permutation), so the experts' grouped GEMMs see each expert's rows together.

:func:`combine` inverts 3 and 2. Both are differentiable (the backward of an all-to-all is the all-to-all with the
splits swapped). A rank that receives no row (every token routed elsewhere) runs its experts on ``[0, H]`` rows and
still takes part in every collective, so nothing waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Dispatched", "combine", "dispatch"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class Dispatched:
    """What :func:`combine` needs to send the experts' outputs back."""

    send: list[int]  # rows this rank sent to each rank
    recv: list[int]  # rows it received from each rank
    order: Tensor  # [R] received row -> its position when grouped by local expert


def dispatch(tokens: Tensor, counts: Tensor, *, group: Any, ep: int) -> tuple[Tensor, Tensor, Dispatched]:
    """``tokens`` [M, H] sorted by global expert with ``counts`` [E] rows each -> (this rank's experts' rows [R, H]
    grouped by local expert, their counts [E_l], the state :func:`combine` needs)."""
    e_local = counts.shape[0] // ep
    send_counts = counts.reshape(ep, e_local)  # [ep, E_l] rows for each rank's each expert
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # [ep, E_l]: from each source rank
    # the split sizes on the host: the layer's one read (the rows' all-to-all needs them)
    sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    send, recv = sizes[:ep], sizes[ep:]
    received = _AllToAll.apply(tokens, recv, send, group)  # [R, H] by source rank, then local expert
    expert = torch.arange(e_local, device=counts.device).repeat(ep)  # the expert of each (source, expert) block
    # output_size: known on the host already (without it, the device's repeat_interleave reads the sum again)
    rows = expert.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv))
    order = torch.argsort(rows, stable=True)
    return received.index_select(0, order), recv_counts.sum(0), Dispatched(send, recv, order)


def combine(out: Tensor, state: Dispatched, *, group: Any) -> Tensor:
    """The experts' outputs [R, H] (grouped by local expert) back to the ranks and rows they came from: [M, H] in
    the order :func:`dispatch` was given."""
    by_source = torch.empty_like(out).index_copy(0, state.order, out)  # undo the grouping by expert
    return _AllToAll.apply(by_source, state.send, state.recv, group)
