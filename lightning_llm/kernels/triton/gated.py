"""Triton SwiGLU / GeGLU: ``out = act(gate) * up`` (imported lazily by :mod:`lightning_llm.kernels.gated`).

``gate``/``up``/``out`` are flattened to ``[N]`` (same shape, contiguous); math in fp32. The backward
recomputes the activation from the saved inputs instead of storing it. ACT: 0 = silu, 1 = exact gelu
(``tl.math.erf``; works in the interpreter and lowers to the CUDA erf on GPU), 2 = tanh-approximate gelu
(written as ``g * sigmoid(2u)``, which equals ``0.5 g (1 + tanh(u))``, so no tanh intrinsic is needed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import next_pow2

_ACT = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """Return (act(g), act'(g)) for fp32 ``g``."""
    if ACT == 0:
        sg = tl.sigmoid(g)
        a = g * sg
        da = sg * (1.0 + g * (1.0 - sg))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        u2 = 2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g)
        sg = tl.sigmoid(u2)
        a = g * sg
        da = sg + g * sg * (1.0 - sg) * (2.0 * 0.7978845608028654) * (1.0 + 3.0 * 0.044715 * g * g)
    return a, da


@triton.jit
def _glu_fwd_kernel(GATE, UP, OUT, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_grad(g, ACT)
    tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(GATE, UP, DOUT, DGATE, DUP, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DOUT + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DGATE + offs, (dy * u * da).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (dy * a).to(DUP.dtype.element_ty), mask=mask)


def _block(t: torch.Tensor, n: int) -> int:
    return 1024 if t.is_cuda else min(next_pow2(n), 4096)


class TritonGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act: str):
        if gate.shape != up.shape:
            raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        n = gate.numel()
        BLOCK = _block(gate, n)
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, ACT=_ACT[act], BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        BLOCK = _block(gate, n)
        if n:
            _glu_bwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, dout, dgate, dup, n, ACT=_ACT[ctx.act], BLOCK=BLOCK)
        return dgate, dup, None
