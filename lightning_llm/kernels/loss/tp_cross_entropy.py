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

from .._backend import Backend, resolve_backend
from .cross_entropy import (SoftCap, _grad_buffers, _mean_scale, chunk_logits, chunk_size_for, compute_operands,
                            contract_chunk, softcap_chunk, softcap_grad)


def _stats_torch(x: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """(local row max, sum exp(x - local max), local target logit or 0), fp32 ``[N]`` each."""
    xf = x.float()
    m = xf.max(-1).values
    d = (xf - m.unsqueeze(1)).exp_().sum(-1)  # one [N, Vl] fp32 temporary
    t = target - vocab_start
    inside = (t >= 0) & (t < x.shape[1])
    xt = xf.gather(1, torch.where(inside, t, 0).unsqueeze(1)).squeeze(1)
    return m, d, torch.where(inside, xt, 0.0)


def _grad_torch(x, target, vocab_start, lse, scale):
    g = (x.float() - lse.unsqueeze(1)).exp_()  # softmax, one [N, Vl] fp32 buffer updated in place
    t = target - vocab_start
    inside = (t >= 0) & (t < x.shape[1])
    # -1 at each row's target column held by this rank (adding 0 elsewhere): no value-dependent shape to read
    g.scatter_add_(1, torch.where(inside, t, 0).unsqueeze(1), -inside.to(g.dtype).unsqueeze(1))
    return g.mul_(scale.unsqueeze(1)).to(x.dtype)


def _local_fns(backend: str):
    """(local stats, local gradient) implementations of ``backend``."""
    if backend == "triton":
        from ..triton.cross_entropy import tp_local_grad, tp_local_stats

        return tp_local_stats, tp_local_grad
    return _stats_torch, _grad_torch


def _global_rows(x, t, vocab_start, group, ignore_index, stats):
    """Full-vocab (per-row loss, lse) fp32 ``[N]`` of the shard ``x`` ``[N, Vl]``: one all-reduce(MAX) of the row
    maxima and one all-reduce(SUM) of (sum-exp, target logit) on ``group``; loss 0 where the target is ignored."""
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
    rows = torch.where(t != ignore_index, log_d + (m - packed[1]), 0.0)  # = lse - x_t without cancellation
    return rows, m + log_d


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, target, group, vocab_start, ignore_index, reduction, backend, grad_enabled):
        Vl = local_logits.shape[-1]
        x = local_logits.reshape(-1, Vl)
        x = x if x.stride(-1) == 1 else x.contiguous()
        t = target.reshape(-1).contiguous()
        stats, grad_fn = _local_fns(backend)
        rows, lse = _global_rows(x, t, vocab_start, group, ignore_index, stats)
        valid = t != ignore_index
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


def _vocab_parallel_chunks(h2, weight, bias, t, vocab_start, group, ignore_index, chunk, backend, scale, grads,
                           softcap=None):
    """Per-row fp32 losses of ``h2 [N, H] @ weight.T [H, Vl]`` (this rank's vocab shard) in token chunks, the
    softmax statistics all-reduced per chunk. ``grads`` = (dh, dW, db) buffers or Nones: dW/db receive this shard's
    gradients, dh this shard's partial sum (the caller all-reduces it); ``scale``: 1 element or ``[N]``;
    ``softcap``: the logits soft-capped first (``cross_entropy.SoftCap``: elementwise, so per shard)."""
    stats, grad_fn = _local_fns(backend)
    need_grad = any(g is not None for g in grads)
    n = h2.shape[0]
    rows = torch.empty(n, dtype=torch.float32, device=h2.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h, tc = h2[s:e], t[s:e]  # [C, H], [C]
        logits = chunk_logits(h, weight, bias)  # [C, Vl]
        tanh = softcap_chunk(logits, softcap) if softcap is not None else None
        rows[s:e], lse = _global_rows(logits, tc, vocab_start, group, ignore_index, stats)
        if need_grad:
            sc = (scale[s:e] if scale.numel() > 1 else scale.expand(e - s)) * (tc != ignore_index)
            g = grad_fn(logits, tc, vocab_start, lse, sc.float())  # [C, Vl] dloss/dlogits, logits dtype
            if tanh is not None:
                softcap_grad(g, tanh, softcap)
            contract_chunk(g, h, weight, grads, s, e)
    return rows


class VocabParallelFusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, group, vocab_start, ignore_index, reduction, chunk_size, backend,
                grad_enabled, softcap=None):
        h2, t = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).contiguous()
        chunk = chunk_size  # the same on every rank (see vocab_parallel_fused_linear_cross_entropy)
        n_valid, scale = _mean_scale(t, ignore_index, reduction)
        need = [grad_enabled and x for x in ctx.needs_input_grad]
        # reduction "none": per-row upstream gradients are unknown yet, the chunks are recomputed in backward
        grads = (None, None, None) if reduction == "none" else _grad_buffers(h2, weight, bias, need)
        wc, bc = compute_operands(hidden, weight, bias)  # an fp32 master shard: cast once, gradients in fp32
        rows = _vocab_parallel_chunks(h2, wc, bc, t, vocab_start, group, ignore_index, chunk, backend, scale, grads,
                                      softcap)
        ctx.args = (group, vocab_start, ignore_index, reduction, chunk, backend, hidden.shape, weight.dtype, softcap)
        if reduction == "none":
            ctx.save_for_backward(h2, wc, bc, t)
            return rows.view(target.shape)
        ctx.save_for_backward(*grads)
        return rows.sum() / n_valid[0] if reduction == "mean" else rows.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        group, vocab_start, ignore_index, reduction, chunk, backend, shape, wdtype, softcap = ctx.args
        if reduction == "none":
            h2, weight, bias, t = ctx.saved_tensors
            grads = _grad_buffers(h2, weight, bias, ctx.needs_input_grad)
            _vocab_parallel_chunks(h2, weight, bias, t, vocab_start, group, ignore_index, chunk, backend,
                                   grad_loss.reshape(-1).float().contiguous(), grads, softcap)
        else:
            grads = ctx.saved_tensors
            for g in grads:
                if g is not None:
                    g.mul_(grad_loss.to(g.dtype))
        dh, dw, db = grads
        if dh is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(dh, group=group)  # each shard contributes dlogits[:, shard] @ W[shard]
        dw, db = (None if g is None else g.to(wdtype) for g in (dw, db))
        return (None if dh is None else dh.view(shape)), dw, None, db, *([None] * 8)


def vocab_parallel_fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Literal["mean", "sum", "none"] = "mean",
    chunk_size: int | None = None,
    backend: Backend = "auto",
    softcap: SoftCap | None = None,
) -> torch.Tensor:
    """Full-vocab cross-entropy of ``hidden @ W.T + b`` (soft-capped: ``softcap``) from this rank's vocab shard ``weight`` ``[Vl, H]`` (rows
    ``[vocab_start, vocab_start + Vl)`` of ``W``) without materialising logits: chunks of ``[C, Vl]``, per chunk
    the two all-reduces of :func:`vocab_parallel_cross_entropy`. ``chunk_size`` must be equal on every rank (default:
    sized by the widest shard, one small all-reduce). ``hidden`` ``[..., H]`` is the full (replicated)
    input on every rank of ``group``; its gradient is all-reduced over ``group`` in backward, the weight's is the
    shard's own. Returns the fp32 loss, identical on every rank."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if chunk_size is None:
        # Every rank must loop over the same chunks (each one all-reduces): size them by the widest shard.
        width = torch.tensor([weight.shape[0]], device=hidden.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        chunk_size = chunk_size_for(hidden.numel() // hidden.shape[-1], int(width), hidden.shape[-1], hidden.device)
    return VocabParallelFusedLinearCrossEntropyFunction.apply(
        hidden, weight, target, bias, group, int(vocab_start), ignore_index, reduction, chunk_size,
        resolve_backend(backend, hidden), torch.is_grad_enabled(), softcap)
