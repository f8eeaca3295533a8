"""Vocab-parallel (tensor-parallel) softmax cross-entropy on vocab shards.

Each rank holds ``local_logits`` ``[..., Vl]`` = the global logits' columns ``[vocab_start, vocab_start + Vl)``
(or a DTensor sharded on the last dim: its ``.to_local()`` is used) and the same global ``target`` ``[...]``.
Communication per call, on ``group``: one all-reduce(MAX) of the row maxima ``[N]`` and one all-reduce(SUM)
of ``[2, N]`` = (sum-exp, target logit) stacked. The returned loss is the full-vocab loss (identical on all
ranks); backward needs no communication and yields the gradient of the local shard only:
``scale_i * (softmax_ij - [j == t_i - vocab_start])``.

The local pieces (row max / sum-exp / target logit, and the gradient) run as Triton kernels or torch ops.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from ._backend import Backend, resolve_backend


def _stats_torch(x: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """(local row max, sum exp(x - local max), local target logit or 0), fp32 ``[N]`` each."""
    xf = x.float()
    m = xf.max(-1).values
    d = torch.exp(xf - m.unsqueeze(1)).sum(-1)
    t = target - vocab_start
    inside = (t >= 0) & (t < x.shape[1])
    xt = xf.gather(1, torch.where(inside, t, 0).unsqueeze(1)).squeeze(1)
    return m, d, torch.where(inside, xt, 0.0)


def _grad_torch(x, target, vocab_start, lse, scale):
    g = torch.exp(x.float() - lse.unsqueeze(1))
    t = target - vocab_start
    inside = (t >= 0) & (t < x.shape[1])
    rows = torch.nonzero(inside).squeeze(1)
    g[rows, t[rows]] -= 1.0
    return (g * scale.unsqueeze(1)).to(x.dtype)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, target, group, vocab_start, ignore_index, reduction, backend, grad_enabled):
        Vl = local_logits.shape[-1]
        x = local_logits.reshape(-1, Vl)
        x = x if x.stride(-1) == 1 else x.contiguous()
        t = target.reshape(-1).contiguous()
        if backend == "triton":
            from ._triton_cross_entropy import tp_local_grad, tp_local_stats

            stats, grad_fn = tp_local_stats, tp_local_grad
        else:
            stats, grad_fn = _stats_torch, _grad_torch
        distributed = dist.is_available() and dist.is_initialized()

        m_local, d_local, xt = stats(x, t, vocab_start)
        m = m_local.clone()
        if distributed:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        # rescale local sum-exp to the global max; guard -inf - -inf for empty shards
        packed = torch.stack([d_local * torch.exp(torch.where(torch.isinf(m_local), -torch.inf, m_local - m)), xt])
        if distributed:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        log_d = torch.log(packed[0])
        lse = m + log_d
        valid = t != ignore_index
        rows = torch.where(valid, log_d + (m - packed[1]), 0.0)  # = lse - x_t without cancellation

        n_valid = valid.sum()
        if grad_enabled and ctx.needs_input_grad[0]:
            scale = valid.float() / (n_valid.clamp_min(1).float() if reduction == "mean" else 1.0)
            grad = grad_fn(x, t, vocab_start, lse, scale)
        else:
            grad = None
        ctx.save_for_backward(grad)
        ctx.reduction, ctx.shape = reduction, local_logits.shape
        if reduction == "none":
            out = rows.view(target.shape)
        elif reduction == "sum":
            out = rows.sum()
        else:
            out = rows.sum() / n_valid
        return out.to(local_logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        g = grad_loss.reshape(-1, 1) if ctx.reduction == "none" else grad_loss
        return (grad * g.to(grad.dtype)).view(ctx.shape), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    backend: Backend = "auto",
) -> torch.Tensor:
    """Full-vocab cross-entropy from a vocab shard; see the module docstring.

    ``vocab_start`` defaults to ``rank * Vl`` (equal contiguous shards in rank order of ``group``). Without an
    initialised process group it degrades to the single-shard (ordinary) cross-entropy.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        DTensor = ()  # type: ignore[assignment]
    if isinstance(local_logits, DTensor):
        local_logits = local_logits.to_local()
    if isinstance(target, DTensor):
        target = target.full_tensor()
    if vocab_start is None:
        rank = dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
        vocab_start = rank * local_logits.shape[-1]
    b = resolve_backend(backend, local_logits)
    return VocabParallelCrossEntropyFunction.apply(local_logits, target, group, int(vocab_start), ignore_index,
                                                   reduction, b, torch.is_grad_enabled())
