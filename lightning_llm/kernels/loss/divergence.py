"""Token divergences between a student's and a teacher's next-token distributions (distillation), computed from the
two models' last hidden states and LM heads in chunks of tokens: neither ``[N, V]`` logits tensor is ever whole
(Liger's fused linear JSD is the model of it).

Per token, with ``p = softmax(student logits / T)`` and ``q = softmax(teacher logits / T)`` over the vocabulary:

* ``forward_kl``: ``KL(q || p) = sum q (log q - log p)``;
* ``reverse_kl``: ``KL(p || q) = sum p (log p - log q)`` (the on-policy distillation default);
* ``jsd`` with ``beta``: ``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = (1 - beta) p + beta q``: trl's
  ``generalized_jsd_loss``, which takes ``beta = 0`` as the forward KL and ``beta = 1`` as the reverse KL.

The gradient with respect to the student's logits ``z`` (of ``z / T``: the temperature is divided out of the hidden
states before the chunks, so autograd applies it): forward KL ``p - q``; reverse KL ``p (g - <p, g>)`` with
``g = log p - log q``; JSD ``(1 - beta) p (g - <p, g>)`` with ``g = log p - log m`` (a softmax's Jacobian times the
divergence's derivative in ``p``, which for the JSD is ``(1 - beta)(log p - log m)``). As in the fused
cross-entropy, each chunk's gradient is computed in the forward pass while its logits are at hand and contracted into
the hidden states' and the head's gradients; backward only scales them. The teacher gets no gradient.

Memory per chunk: the reverse KL holds two ``[C, V]`` fp32 buffers, the forward KL three, the JSD four (the
student's logits and the teacher's, log-softmaxed in place, and the mixture's), so the chunks are a quarter of the
cross-entropy's (:func:`divergence_chunk_size`).

Tensor parallelism: each rank holds the same vocabulary shard of both heads (``[C, V/tp]`` logits per chunk); the
log-sum-exps are combined with two all-reduces of ``[2, C]`` per chunk and the per-token sums with one, and the
hidden states' gradient is all-reduced once in backward (as :mod:`.tp_cross_entropy` does for the cross-entropy).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .cross_entropy import (MIN_CHUNK, SoftCap, _grad_buffers, _ScaledOnce, chunk_logits, chunk_size_for,
                            compute_operands, contract_chunk, softcap_chunk, softcap_grad)

__all__ = ["DIVERGENCES", "Divergence", "divergence_chunk_size", "fused_linear_divergence", "token_divergence"]

Divergence = Literal["reverse_kl", "forward_kl", "jsd"]
DIVERGENCES: tuple[str, ...] = ("reverse_kl", "forward_kl", "jsd")


def _kind(kind: str, beta: float) -> str:
    """The divergence computed: trl's JSD at ``beta`` 0 and 1 is the forward and the reverse KL."""
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {kind!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if kind == "jsd" and beta in (0.0, 1.0):
        return "forward_kl" if beta == 0.0 else "reverse_kl"
    return kind


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, kind: Divergence = "reverse_kl",
                     beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Per-token divergence ``[...]`` (fp32, differentiable in the student's logits) from whole logits ``[..., V]``:
    the path of a head the chunks cannot read (a LoRA-wrapped head), and the math written plainly."""
    kind = _kind(kind, beta)
    dtype = torch.promote_types(torch.float32, student_logits.dtype)
    ls = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    lt = F.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    if kind == "forward_kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    if kind == "reverse_kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def divergence_chunk_size(n: int, vocab: int, hidden: int, device: torch.device) -> int:
    """Tokens per chunk: a quarter of the fused cross-entropy's (:func:`~.cross_entropy.chunk_size_for`), since a
    chunk holds up to four ``[C, V]`` fp32 buffers where the cross-entropy holds about one; at least
    ``MIN_CHUNK / 4`` tokens (fewer: the per-chunk overheads dominate)."""
    return max(1, min(n, max(MIN_CHUNK // 4, chunk_size_for(n, vocab, hidden, device) // 4)))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``[C, V]`` tensors, ``[C]``, without a ``[C, V]`` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _log_softmax_(s: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Both ``[C, V]`` chunks log-softmaxed in place over the whole vocabulary (over the shards under ``group``)."""
    lse = torch.stack([torch.logsumexp(s, -1), torch.logsumexp(t, -1)])  # [2, C] (this shard's)
    if group is not None:
        top = _all_reduce(lse.clone(), group, dist.ReduceOp.MAX)
        # exp(-inf - top) = 0 for a shard that holds no column (a vocabulary torch.chunk leaves short)
        lse = top + _all_reduce((lse - top).exp(), group, dist.ReduceOp.SUM).log()
    s.sub_(lse[0].unsqueeze(1))
    t.sub_(lse[1].unsqueeze(1))


def divergence_rows(s: torch.Tensor, t: torch.Tensor, *, kind: str, beta: float, group: dist.ProcessGroup | None,
                    need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(divergence [C], d divergence / d s [C, V] or None)`` of one chunk of student logits ``s`` and teacher
    logits ``t`` (fp32 ``[C, V]``, already divided by the temperature and soft-capped; both overwritten: the gradient
    is returned in one of them)."""
    _log_softmax_(s, t, group)  # s = log p, t = log q
    if kind == "reverse_kl":
        g = t.sub_(s).neg_()  # log p - log q
        p = s.exp_()
        rows = _all_reduce(_rowdot(p, g), group, dist.ReduceOp.SUM)
        return rows, (g.sub_(rows.unsqueeze(1)).mul_(p) if need_grad else None)
    if kind == "forward_kl":
        q = t.exp()
        rows = _all_reduce(_rowdot(q, t.sub_(s)), group, dist.ReduceOp.SUM)  # sum q (log q - log p)
        return rows, (s.exp_().sub_(q) if need_grad else None)
    lm = torch.add(s, math.log1p(-beta))  # log m = logaddexp(log p + log(1 - beta), log q + log beta)
    torch.logaddexp(lm, torch.add(t, math.log(beta)), out=lm)
    kl = torch.stack([_rowdot(t.exp(), t.sub_(lm)), _rowdot(s.exp(), torch.sub(s, lm, out=t))])  # [KL(q||m), KL(p||m)]
    del lm
    kl = _all_reduce(kl, group, dist.ReduceOp.SUM)
    rows = beta * kl[0] + (1 - beta) * kl[1]
    if not need_grad:
        return rows, None
    return rows, t.sub_(kl[1].unsqueeze(1)).mul_(s.exp_()).mul_(1 - beta)  # t = log p - log m


def _chunks(h2, w, b, th2, tw, tb, valid, *, kind, beta, softcap, teacher_softcap, chunk, group, grads):
    """Per-token fp32 divergences ``[N]`` (0 where not ``valid``) over token chunks; each chunk's gradient (rows not
    ``valid`` weigh 0) is contracted into ``grads`` = (dh, dW, db) buffers or Nones."""
    need_grad = any(g is not None for g in grads)
    n = h2.shape[0]
    math_dtype = torch.promote_types(torch.float32, h2.dtype)  # fp32, or fp64 for fp64 operands (tests)
    rows = torch.empty(n, dtype=math_dtype, device=h2.device)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        logits = chunk_logits(h2[s:e], w, b)  # [C, V] in the compute dtype
        compute_dtype, zs = logits.dtype, logits.to(math_dtype)  # the same buffer when the dtypes agree
        del logits  # a bf16 chunk is not held beside its fp32 copy (the chunk size counts fp32 buffers only)
        tanh = softcap_chunk(zs, softcap) if softcap is not None else None
        with torch.no_grad():
            zt = chunk_logits(th2[s:e], tw, tb).to(math_dtype)
            if teacher_softcap is not None:
                softcap_chunk(zt, teacher_softcap)
        rows[s:e], grad = divergence_rows(zs, zt, kind=kind, beta=beta, group=group, need_grad=need_grad)
        del zt
        if grad is not None:
            grad.masked_fill_(~valid[s:e].unsqueeze(1), 0.0)  # rows outside the responses weigh nothing
            if tanh is not None:
                softcap_grad(grad, tanh, softcap)
            contract_chunk(grad.to(compute_dtype), h2[s:e], w, grads, s, e)
    return torch.where(valid, rows, 0.0)


class FusedLinearDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, labels, kind, beta, softcap,
                teacher_softcap, chunk, group, grad_enabled):
        h2 = hidden.reshape(-1, hidden.shape[-1])
        th2 = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
        valid = labels.reshape(-1) != -100
        need = [grad_enabled and x for x in ctx.needs_input_grad]
        grads = _grad_buffers(h2, weight, bias, [need[0], need[1], False, need[2]])
        if weight.dtype == torch.float64:  # fp64 operands (tests): their sums in fp64, not the fp32 of low precision
            grads = tuple(g if g is None or g is grads[0] else g.double() for g in grads)
        wc, bc = compute_operands(hidden, weight, bias)  # an fp32 master: cast once, its gradient summed in fp32
        twc, tbc = compute_operands(teacher_hidden, teacher_weight, teacher_bias)
        rows = _chunks(h2, wc, bc, th2, twc, tbc, valid, kind=kind, beta=beta, softcap=softcap,
                       teacher_softcap=teacher_softcap, chunk=chunk, group=group, grads=grads)
        ctx.save_for_backward(*grads)
        ctx.args = (group, hidden.shape, weight.dtype)
        return rows.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        _ScaledOnce.check(ctx)
        group, shape, wdtype = ctx.args
        dh, dw, db = ctx.saved_tensors
        for g in (dh, dw, db):
            if g is not None:
                g.mul_(grad_loss.to(g.dtype))
        if dh is not None and group is not None:
            dist.all_reduce(dh, group=group)  # each vocabulary shard contributes its columns' part
        dw, db = (None if g is None else g.to(wdtype) for g in (dw, db))
        return (None if dh is None else dh.view(shape)), dw, db, *([None] * 11)


def fused_linear_divergence(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    kind: Divergence = "reverse_kl",
    beta: float = 0.5,
    bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    softcap: SoftCap | None = None,
    teacher_softcap: SoftCap | None = None,
    chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    reduction: Literal["sum", "none"] = "sum",
) -> torch.Tensor:
    """The sum over the tokens whose label is not -100 of the divergence ``kind`` between ``softmax(hidden @
    weight.T + bias)`` (the student: ``hidden [..., H]``, ``weight [V, H]``) and ``softmax(teacher_hidden @
    teacher_weight.T + teacher_bias)`` (the teacher: ``[..., Ht]``, ``[V, Ht]``, no gradient), without either
    ``[N, V]`` logits tensor; fp32 scalar. A temperature is applied by the caller (hidden states divided by it, or a
    soft-cap's factor: :data:`~.cross_entropy.SoftCap`). ``labels`` only marks the tokens (their ids are not read).

    ``group``: the heads are this rank's vocabulary shard (the same rows of both) of a tensor-parallel group whose
    every rank passes the same hidden states and labels; ``chunk_size`` must then be equal on every rank.
    ``reduction="none"``: the per-token divergences ``[...]`` instead (0 where the label is -100), without gradient
    (evaluation: a pipeline concatenates its micro-batches' outputs)."""
    kind_run = _kind(kind, beta)
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's head has {weight.shape[0]} vocabulary rows and the teacher's "
                         f"{teacher_weight.shape[0]}: distillation needs one vocabulary")
    if hidden.shape[:-1] != teacher_hidden.shape[:-1] or hidden.shape[:-1] != labels.shape:
        raise ValueError(f"student hidden {tuple(hidden.shape)}, teacher hidden {tuple(teacher_hidden.shape)} and "
                         f"labels {tuple(labels.shape)} must cover the same tokens")
    n = labels.numel()
    chunk = chunk_size or divergence_chunk_size(n, weight.shape[0], max(hidden.shape[-1], teacher_hidden.shape[-1]),
                                                hidden.device)
    if reduction == "none":
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            raise ValueError("fused_linear_divergence(reduction='none') gives no gradient: use reduction='sum'")
        wc, bc = compute_operands(hidden, weight, bias)
        twc, tbc = compute_operands(teacher_hidden, teacher_weight, teacher_bias)
        rows = _chunks(hidden.reshape(-1, hidden.shape[-1]), wc, bc,
                       teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), twc, tbc, labels.reshape(-1) != -100,
                       kind=kind_run, beta=float(beta), softcap=softcap, teacher_softcap=teacher_softcap, chunk=chunk,
                       group=group, grads=(None, None, None))
        return rows.view(labels.shape)
    if reduction != "sum":
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    return FusedLinearDivergenceFunction.apply(hidden, weight, bias, teacher_hidden.detach(), teacher_weight.detach(),
                                               None if teacher_bias is None else teacher_bias.detach(), labels,
                                               kind_run, float(beta), softcap, teacher_softcap, chunk, group,
                                               torch.is_grad_enabled())
