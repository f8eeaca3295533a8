"""Triton softmax cross-entropy kernels (imported lazily by ``loss/cross_entropy.py``, ``loss/tp_cross_entropy.py``).

Full-vocab CE (one program per row of ``logits [N, V]``, looping over V in ``BLOCK_V`` chunks):
  pass 1: online max / sum-exp (and sum of logits for label smoothing) -> ``lse``;
  loss_i = lse - (1 - eps) x_t - eps/V sum_j x_j + z lse^2   (0 where target == ignore_index)
  pass 2 (optional): dlogits_ij = scale_i * (softmax_ij (1 + 2 z lse) - eps/V - (1 - eps) [j == t])
The gradient may be written in place of the logits (``GRAD is LOGITS``): pass 2 reads each block before
overwriting it, so the softmax is never held twice. ``scale_i = SCALE[i * scale_stride]`` (stride 0: one
scalar, e.g. 1/n_valid for mean; stride 1: per-row, e.g. the upstream gradient of reduction="none").

Vocab-parallel pieces (logits shard ``[N, Vl]`` covering global ids ``[vocab_start, vocab_start + Vl)``):
  ``_tp_stats_kernel``: local max, sum exp(x - local max), target logit (0 when the target is elsewhere);
  ``_tp_grad_kernel``: dlogits = scale_i * (exp(x - lse_global) - [j == t - vocab_start]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import next_pow2


@triton.jit
def _ce_fwd_kernel(
    LOGITS, GRAD, TARGET, LOSS, LSE, SCALE,  # [N, V], [N, V] (may alias LOGITS), [N], [N] f32, [N] f32, [*] f32
    stride_l, stride_g, scale_stride, V, ignore_index, label_smoothing, z_loss,
    HAS_GRAD: tl.constexpr, HAS_SMOOTH: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = LOGITS + row * stride_l
    g_row = GRAD + row * stride_g
    t = tl.load(TARGET + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    if t == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + row, 0.0)
        if HAS_GRAD:
            for start in range(0, V, BLOCK_V):
                offs = start + cols
                tl.store(g_row + offs, tl.zeros([BLOCK_V], dtype=GRAD.dtype.element_ty), mask=offs < V)
        return

    m = float("-inf")
    d = 0.0
    sum_x = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if HAS_SMOOTH:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    log_d = tl.log(d)
    lse = m + log_d
    x_t = tl.load(x_row + t).to(tl.float32)
    # lse - x_t written as log(d) + (m - x_t): no cancellation when |logits| is large
    if HAS_SMOOTH:
        loss = log_d + (1.0 - label_smoothing) * (m - x_t) + label_smoothing * (m - sum_x / V)
    else:
        loss = log_d + (m - x_t)
    loss += z_loss * lse * lse
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)

    if HAS_GRAD:
        scale = tl.load(SCALE + row * scale_stride)
        coef = 1.0 + 2.0 * z_loss * lse
        smooth = label_smoothing / V
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
            g = tl.exp((x - m) - log_d) * coef - smooth
            g = tl.where(offs == t, g - (1.0 - label_smoothing), g)
            tl.store(g_row + offs, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


def _block_v(t: torch.Tensor, V: int) -> tuple[int, int]:
    if t.is_cuda:
        block = min(next_pow2(V), 16384)
        return block, 16 if block >= 8192 else 8
    return min(next_pow2(V), 128), 1  # interpreter: small block so the V loop is exercised


def ce_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    scale: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and lse (fp32 ``[N]``) of ``logits [N, V]`` (last dim contiguous).

    When ``grad`` (``[N, V]``, may be ``logits`` itself) is given, writes ``scale * dloss_i/dlogits`` into it;
    ``scale`` is an fp32 tensor of 1 element or ``[N]``.
    """
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    lse = torch.empty(N, dtype=torch.float32, device=logits.device)
    has_grad = grad is not None
    if scale is None:
        scale = torch.ones(1, dtype=torch.float32, device=logits.device)
    block, warps = _block_v(logits, V)
    if N:
        _ce_fwd_kernel[(N,)](
            logits, grad if has_grad else logits, target, loss, lse, scale,
            logits.stride(0), grad.stride(0) if has_grad else 0, 1 if scale.numel() > 1 else 0,
            V, ignore_index, float(label_smoothing), float(z_loss),
            HAS_GRAD=has_grad, HAS_SMOOTH=label_smoothing > 0, BLOCK_V=block, num_warps=warps,
        )
    return loss, lse


@triton.jit
def _tp_stats_kernel(LOGITS, TARGET, MAX, SUMEXP, XT, stride_l, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = LOGITS + row * stride_l
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, d)
    t = tl.load(TARGET + row).to(tl.int64) - vocab_start
    inside = (t >= 0) & (t < V)
    x_t = tl.load(x_row + tl.where(inside, t, 0)).to(tl.float32)
    tl.store(XT + row, tl.where(inside, x_t, 0.0))


@triton.jit
def _tp_grad_kernel(LOGITS, GRAD, TARGET, LSE, SCALE, stride_l, stride_g, V, vocab_start, BLOCK_V: tl.constexpr):
    # SCALE [N] fp32: 0 for ignored rows, else e.g. 1/n_valid
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(TARGET + row).to(tl.int64) - vocab_start
    lse = tl.load(LSE + row)
    scale = tl.load(SCALE + row)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        mask = offs < V
        x = tl.load(LOGITS + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        g = tl.exp(x - lse) - tl.where(offs == t, 1.0, 0.0)
        tl.store(GRAD + row * stride_g + offs, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


def tp_local_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """(local max, sum exp(x - local max), local target logit or 0), each fp32 ``[N]``."""
    N, V = logits.shape
    out = [torch.empty(N, dtype=torch.float32, device=logits.device) for _ in range(3)]
    block, warps = _block_v(logits, V)
    if N:
        _tp_stats_kernel[(N,)](logits, target, *out, logits.stride(0), V, vocab_start, BLOCK_V=block, num_warps=warps)
    return tuple(out)


def tp_local_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """``scale_i * (softmax - onehot)`` restricted to this shard, dtype of ``logits``."""
    N, V = logits.shape
    grad = torch.empty_like(logits)
    block, warps = _block_v(logits, V)
    if N:
        _tp_grad_kernel[(N,)](logits, grad, target, lse, scale, logits.stride(0), grad.stride(0), V, vocab_start,
                              BLOCK_V=block, num_warps=warps)
    return grad
