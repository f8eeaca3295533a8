"""Attention sinks (gpt-oss): a learned logit per query head joins every query's softmax as one more column, whose
value is zero, so a query may give part of its attention to nothing::

    out_i = sum_j p_ij v_j,   p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)),   s_ij = q_i k_j / sqrt(D) + mask_ij

Computed exactly in one of two ways (``attention.DotProductAttention`` picks):

* **eager** (:func:`eager_sink_attention`): the scores materialised ``[B, N, S, T]``, the sink a last column, its
  probability dropped after the softmax (transformers' eager ``GptOssAttention``). The reference, and the path where
  no kernel gives its log-sum-exp: the CUDA mask path (KV-cache decoding, fp32), the meta device, the CPU's
  per-sequence varlen reference.
* **log-sum-exp correction of a flash kernel** (:class:`_SinkCorrected`): ``out, lse = kernel(q, k, v)``, then
  ``lse' = logaddexp(lse, sink)`` and ``O = out * exp(lse - lse')``. Backward calls the kernel's own backward with
  ``(O, lse')``: FlashAttention's backward recomputes ``P = exp(s - lse')``, which is now the sink-inclusive softmax,
  and ``D = rowsum(dO * O)``, which the sink's zero value leaves as it is, so ``dq, dk, dv`` are exact; the sink's
  gradient is ``-sum_i exp(sink - lse'_i) D_i``. No score matrix is kept. The kernels: the CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``, with the dense additive mask or causal: the CPU's mask path)
  and flash attention on cumulative sequence lengths on CUDA (``aten._flash_attention_forward``/``_backward``, what
  ``torch.nn.attention.varlen`` calls: the varlen path, sliding windows and GQA inside the kernel).

Shape legend: B batch, N query heads, K kv heads, S queries, T keys, D head dim, R rows of a flattened token stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

__all__ = ["AttentionSinks", "cpu_sink_attention", "eager_sink_attention", "varlen_sink_kernel",
           "sink_corrected", "varlen_sinks_supported"]

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


class AttentionSinks(nn.Module):
    """``self_attn.sinks``: one logit per query head, ``weight`` [N] (HF ``self_attn.sinks``). Called with no input,
    it returns the weight: a tensor-parallel plan shards it with the heads and hands the attention its local heads'
    logits (``parallel_spec``)."""

    param_inits = ("weight",)
    """Initialised normal(initializer_range), as transformers inits gpt-oss's sinks (read by the init plan)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads))

    def forward(self) -> Tensor:  # [N]
        return self.weight

    def extra_repr(self) -> str:
        return f"heads={self.weight.shape[0]}"


# ---------------------------------------------------------------------------------------------------- eager
def _repeat_kv(k: Tensor, v: Tensor, rep: int, dim: int) -> tuple[Tensor, Tensor]:
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=dim), v.repeat_interleave(rep, dim=dim)


def eager_sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, attn_mask: Tensor | None,
                         is_causal: bool) -> Tensor:
    """q [B, N, S, D], k/v [B, K, T, D], sinks [N], ``attn_mask`` bool (True = attend) or additive, broadcastable to
    [B, N, S, T] (``is_causal`` without one: the last S of T positions) -> [B, N, S, D]; the softmax in fp32 (or the
    inputs' float64)."""
    b, n, s, d = q.shape
    k, v = _repeat_kv(k, v, n // k.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, N, S, T]
    t = scores.shape[-1]
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.to(scores.dtype)
    work = torch.promote_types(scores.dtype, torch.float32)
    sink = sinks.to(work).view(1, n, 1, 1).expand(b, n, s, 1)
    probs = torch.softmax(torch.cat([scores.to(work), sink], dim=-1), dim=-1)[..., :-1]  # the sink dropped
    return torch.matmul(probs.to(v.dtype), v)


# ---------------------------------------------------------------------------------------------------- correction
class _FlashKernel(Protocol):
    """A flash kernel pair: ``forward(q, k, v) -> (out, lse)`` and its backward given an output and log-sum-exp.
    ``rows(t)`` turns an lse-shaped tensor into the output's layout without its last dim (``native`` back);
    ``heads_dim`` is the heads' dim there."""

    heads_dim: int

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]: ...

    def rows(self, t: Tensor) -> Tensor: ...

    def native(self, t: Tensor) -> Tensor: ...


def _sink_view(sinks: Tensor, like: Tensor, heads_dim: int) -> Tensor:
    shape = [1] * like.dim()
    shape[heads_dim] = -1
    return sinks.to(like.dtype).view(shape)


class _SinkCorrected(torch.autograd.Function):
    """Flash attention with a sink column, by log-sum-exp correction (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, kernel: _FlashKernel) -> Tensor:
        out, lse = kernel.forward(q, k, v)
        rows_lse = kernel.rows(lse)  # [..., N, ...] without D, fp32 (fp64 for fp64 inputs)
        total = torch.logaddexp(rows_lse, _sink_view(sinks, rows_lse, kernel.heads_dim))
        work = torch.promote_types(out.dtype, rows_lse.dtype)
        o = (out.to(work) * (rows_lse - total).exp().unsqueeze(-1)).to(out.dtype)
        ctx.kernel, ctx.sink_dtype = kernel, sinks.dtype
        ctx.save_for_backward(q, k, v, o, total, sinks)
        return o

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, total, sinks = ctx.saved_tensors
        kernel: _FlashKernel = ctx.kernel
        grad = grad.contiguous()
        dq, dk, dv = kernel.backward(grad, q, k, v, o, kernel.native(total))
        work = total.dtype
        d = (grad.to(work) * o.to(work)).sum(-1)  # [rows] rowsum(dO * O)
        p_sink = (_sink_view(sinks, total, kernel.heads_dim) - total).exp()
        dims = [i for i in range(d.dim()) if i != kernel.heads_dim]
        dsink = -(p_sink * d).sum(dim=dims)
        return dq, dk, dv, dsink.to(ctx.sink_dtype), None


def sink_corrected(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, kernel: _FlashKernel) -> Tensor:
    """Attention of ``kernel``'s layout with the sink column, exact forward and backward (:class:`_SinkCorrected`)."""
    return _SinkCorrected.apply(q, k, v, sinks, kernel)


@dataclass(frozen=True)
class _CpuFlash:
    """The CPU flash kernel on [B, N, S, D] with a dense additive mask (or causal, top-left aligned); kv heads
    repeated for it, their gradient summed over the query heads each serves."""

    mask: Tensor | None
    is_causal: bool
    rep: int
    heads_dim: int = 1

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k, v = _repeat_kv(k, v, self.rep, dim=1)
        return _cpu_flash(q, k, v, 0.0, self.is_causal, attn_mask=self.mask)  # out [B, N, S, D], lse [B, N, S]

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        kr, vr = _repeat_kv(k, v, self.rep, dim=1)
        dq, dk, dv = _cpu_flash_backward(grad, q, kr, vr, out.contiguous(), lse, 0.0, self.is_causal,
                                         attn_mask=self.mask)
        if self.rep > 1:
            b, kh, t, d = k.shape
            dk, dv = (g.view(b, kh, self.rep, t, d).sum(2) for g in (dk, dv))
        return dq, dk, dv

    def rows(self, t: Tensor) -> Tensor:
        return t

    def native(self, t: Tensor) -> Tensor:
        return t


def cpu_sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, *, attn_mask: Tensor | None,
                       is_causal: bool) -> Tensor | None:
    """The CPU's sink attention through its flash kernel (None where that kernel does not apply: another device or
    dtype)."""
    if q.device.type != "cpu" or q.dtype not in _CPU_FLASH_DTYPES:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(q.dtype)
    kernel = _CpuFlash(attn_mask, is_causal and attn_mask is None, q.shape[1] // k.shape[1])
    return sink_corrected(q, k, v, sinks, kernel)


# ---------------------------------------------------------------------------------------------------- CUDA varlen
def _op_params(op: Any) -> set[str]:
    try:
        return {a.name for a in op.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return set()


_HAS_VARLEN_SINKS = {"window_size_left", "window_size_right"} <= _op_params(torch.ops.aten._flash_attention_forward) \
    and {"window_size_left", "window_size_right"} <= _op_params(torch.ops.aten._flash_attention_backward)


def varlen_sinks_supported() -> bool:
    """Whether torch has the flash kernel pair this module corrects: ``aten._flash_attention_forward`` on cumulative
    sequence lengths, returning its log-sum-exp, with a window (GQA is native to the kernel), and its backward (torch
    2.11 on; what ``torch.nn.attention.varlen`` calls)."""
    return _HAS_VARLEN_SINKS


@dataclass(frozen=True)
class _VarlenFlash:
    """Flash attention on one :class:`~.attention.VarlenCall` (q [Rq, N, D], k/v [Rk, K, D]; lse [N, Rq]): causal from
    the bottom right, within ``window``; no dropout (so no random state: zeros, as ``torch.nn.attention.varlen``)."""

    call: Any
    window: int | None
    heads_dim: int = 1

    def _args(self) -> tuple[Any, ...]:
        c = self.call
        return c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, self.window is None

    def _window(self) -> dict[str, int]:
        return {"window_size_left": -1 if self.window is None else self.window - 1, "window_size_right": 0}

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, *self._args(), False, **self._window())
        return out, lse

    def backward(self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor]:
        rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(grad, q, k, v, out, lse, *self._args(), rng, unused,
                                                        **self._window())

    def rows(self, t: Tensor) -> Tensor:  # lse [N, Rq] -> [Rq, N]
        return t.transpose(0, 1)

    def native(self, t: Tensor) -> Tensor:  # [Rq, N] -> lse [N, Rq]
        return t.transpose(0, 1).contiguous()


def varlen_sink_kernel(call: Any, window: int | None) -> _VarlenFlash:
    return _VarlenFlash(call, window)
