"""Triton rotary embedding for q and k in one launch (imported lazily by :mod:`lightning_llm.kernels.rope`).

Layout ``[B, S, H, D]`` (last dim contiguous, other strides free); ``cos``/``sin`` ``[Bc, S, D]`` with
``Bc`` in ``{1, B}`` (batch stride 0 when broadcast). One program per ``(b, s)`` rotates all ``Hq`` query
heads and all ``Hk`` key heads (GQA: ``Hq != Hk`` allowed) with the same cos/sin row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import next_pow2


@triton.jit
def _rotate_tile(X, Y, sxh, syh, H, c1, c2, s1, s2, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BACKWARD: tl.constexpr):
    # X/Y point at head 0 of one (b, s) position; tile [BLOCK_H, BLOCK_HALF] of first / second halves.
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (d < HALF)
    x1 = tl.load(X + h * sxh + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + h * sxh + d + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # transpose of the forward rotation
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(Y + h * syh + d, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + h * syh + d + HALF, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,
    sqb, sqs, sqh, skb, sks, skh, sob, sos, soh, spb, sps, sokb, soks, sokh,
    S, HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    cs = COS + b * spb + s * sps
    sn = SIN + b * spb + s * sps
    c1 = tl.load(cs + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cs + d + HALF, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sn + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sn + d + HALF, mask=dm, other=0.0).to(tl.float32)
    _rotate_tile(Q + b * sqb + s * sqs, QO + b * sob + s * sos, sqh, soh, HQ, c1, c2, s1, s2, HALF,
                 BLOCK_HQ, BLOCK_HALF, BACKWARD)
    _rotate_tile(K + b * skb + s * sks, KO + b * sokb + s * soks, skh, sokh, HK, c1, c2, s1, s2, HALF,
                 BLOCK_HK, BLOCK_HALF, BACKWARD)


def _launch(q, k, cos, sin, backward: bool):
    """Rotate q ``[B, S, Hq, D]`` and k ``[B, S, Hk, D]``; returns new contiguous tensors."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    B, S, HQ, D = q.shape
    HK = k.shape[2]
    qo = torch.empty((B, S, HQ, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, S, HK, D), dtype=k.dtype, device=k.device)
    spb = 0 if cos.shape[0] == 1 else cos.stride(0)
    BLOCK_HALF = next_pow2(D // 2)
    if B * S > 0:
        _rope_kernel[(B * S,)](
            q, k, qo, ko, cos, sin,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), spb, cos.stride(1),
            ko.stride(0), ko.stride(1), ko.stride(2),
            S, HQ, HK, D // 2,
            BLOCK_HQ=next_pow2(HQ), BLOCK_HK=next_pow2(HK), BLOCK_HALF=BLOCK_HALF, BACKWARD=backward,
        )
    return qo, ko


class TritonRotaryFunction(torch.autograd.Function):
    """Gradients flow to q and k only (cos/sin are treated as constants)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        # cos/sin already normalised by the caller to contiguous [Bc, S, D] with Bc in {1, B}.
        ctx.save_for_backward(cos, sin)
        return _launch(q, k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None
