"""Triton RMSNorm / LayerNorm (imported lazily by :mod:`lightning_llm.kernels.norms`).

Shapes: ``x`` is viewed as ``[M, D]`` (all leading dims flattened), ``weight``/``bias`` ``[D]``. One row
is held in registers (``BLOCK_D = next_pow2(D)``), which covers LLM hidden sizes (<= 64K). Statistics and
the affine are computed in fp32; the output is cast to ``x.dtype``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import next_pow2, num_programs


def _warps(block_d: int) -> int:
    """Warps per row program of the backward: enough threads that a row of ``block_d`` fp32 values, times the three or four row
    vectors the backward keeps (x, dy, w, the dW partial), stays in registers (16 warps at 32768 columns spilled:
    the H200's rms_norm backward ran at 8% of copy bandwidth); Liger-Kernel's measured thresholds."""
    return 32 if block_d >= 32768 else 16 if block_d >= 8192 else 8 if block_d >= 2048 else 4


@triton.jit
def _norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,  # X/Y [M, D] (row stride given), W/B [D], MEAN/RSTD [M] fp32
    stride_x, stride_y, D, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(MEAN + row, mean)
    var = tl.sum(xc * xc, axis=0) / D
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART,  # DW_PART/DB_PART [G, D] fp32 partial sums
    stride_x, stride_dy, stride_dx, M, D, rows_per_prog,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Program `pid` handles rows [pid * rows_per_prog, min(M, (pid + 1) * rows_per_prog)) and writes its
    # partial dW (and dB) row; the host sums the G partial rows (stage two of the reduction).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    for row in range(row_start, row_end):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(MEAN + row64)) * rstd, 0.0)
        wdy = dy * w
        c1 = tl.sum(xhat * wdy, axis=0) / D
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / D
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PART + pid * D + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid * D + cols, db, mask=mask)


class TritonNormFunction(torch.autograd.Function):
    """``y = norm(x) * weight (+ bias)``; ``is_rms`` selects RMSNorm (no centering, no bias)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, is_rms: bool):
        shape = x.shape
        D = shape[-1]
        x2 = x.reshape(-1, D)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        mean = torch.empty(M if not is_rms else 1, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        weight = weight.contiguous()
        has_bias = bias is not None
        BLOCK_D = next_pow2(D)
        num_warps = min(max(BLOCK_D // 256, 1), 16)  # the forward keeps one row vector: at Liger's speed (H200)
        if M > 0:
            _norm_fwd_kernel[(M,)](
                x2, weight, bias.contiguous() if has_bias else weight, y, mean, rstd,
                x2.stride(0), y.stride(0), D, eps,
                IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_D=BLOCK_D, num_warps=num_warps,
            )
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.is_rms, ctx.has_bias, ctx.shape, ctx.bias_dtype = is_rms, has_bias, shape, (
            bias.dtype if has_bias else None
        )
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        M, D = x2.shape
        dy2 = dy.reshape(-1, D)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        G = num_programs(x2, M, per_sm=1)  # one resident program per SM, each looping over its rows
        dw_part = torch.empty((G, D), dtype=torch.float32, device=x2.device)
        db_part = torch.empty((G, D) if ctx.has_bias else (1,), dtype=torch.float32, device=x2.device)
        BLOCK_D = next_pow2(D)
        if M > 0:
            _norm_bwd_kernel[(G,)](
                x2, weight, dy2, dx, mean, rstd, dw_part, db_part,
                x2.stride(0), dy2.stride(0), dx.stride(0), M, D, triton.cdiv(M, G),
                IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, BLOCK_D=BLOCK_D, num_warps=_warps(BLOCK_D),
            )
        else:
            dw_part.zero_()
            db_part.zero_()
        dw = dw_part.sum(0).to(weight.dtype)
        db = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None
