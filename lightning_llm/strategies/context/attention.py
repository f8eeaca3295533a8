"""Attention across the sequence slices of a context-parallel group: all-gather of keys and values.

Each rank holds the queries, keys and values of its own tokens (:mod:`.sharding`). Every attention layer all-gathers
the keys and values of the group (``[B, K, S/cp, D]`` per rank: the kv heads only, so grouped-query attention moves
``K/N`` of what the query heads would) and attends its local queries to the whole sequence. The gather is
differentiable (:class:`_GatherSequence`): its backward sums every rank's gradient of a chunk's keys/values onto the
rank that owns the chunk (a reduce-scatter), so the parameters' gradients on each rank are those of its own tokens and
their sum over cp is the whole sequence's. (``torch.distributed.nn.functional.all_gather`` emulates that backward on
gloo by scatters addressed with group ranks as global ranks: it fails on any cp group but the whole world.) This is Llama 3's choice (Dubey et al. 2024, 3.3.2):
exact for any mask, one collective per layer and direction, the gathered K/V ``2 S K D`` per layer the only extra
memory; a ring with online softmax would overlap its ``cp - 1`` steps with compute but needs the softmax merge in
backward too, and on 2 CPU cores there is no communication to hide.

Why not torch's own (``torch.distributed.tensor.experimental.context_parallel``): it dispatches only the CUDA SDPA
kernels and flex attention, whose backward raises on the CPU, so it cannot train here (``shared/notes``).

The attention computations, all exact:

* the varlen path (the model's choice, ``models/layers/attention.py``: CUDA in fp16/bf16 by default): per local query chunk
  one flash varlen call (``torch.nn.attention.varlen.varlen_attn``) of its real queries, grouped by example, on the
  gathered real keys of the same example up to the chunk's end; the kernel aligns causality to the bottom right, so
  the diagonal block and every earlier chunk are one call, softmax-merged inside the kernel, and its backward is the
  kernel's. No ``[S/cp, S]`` mask or score matrix exists; the layout (which rows, the cumulative lengths) is built
  once per forward from the gathered keep and segment ids and shared by every layer;
* causal rows (no padding, no packing) otherwise: on the CPU per local query chunk ``j``, two calls of the CPU flash
  kernel (its causal mask is aligned top-left, so the diagonal block and the earlier chunks are separate calls),
  the diagonal block (causal) and the chunks before it (dense), merged by their log-sum-exp; backward calls the
  kernel's backward on each block with the merged output and log-sum-exp (what FlashAttention's backward needs), so
  no ``[S/cp, S]`` mask or score matrix is ever held and the work is the causal half;
* padded or packed rows (:class:`~lightning_llm.models.layers.attention.TokenMask`: keep and segment ids, all-gathered) and
  other devices: one SDPA call of the local queries on the gathered keys with the boolean mask ``[B, 1, S/cp, S]``
  (causal by global column, same segment, real keys; an empty row attends to itself), as the decoder builds at
  ``cp = 1``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llm.models.layers.attention import (VarlenLayout, max_logits, values_as_keys, varlen_attention,
                                                  varlen_layout)
from lightning_llm.models.layers.masks import additive_mask
from lightning_llm.strategies.context.sharding import local_columns, order_gathered

log = logging.getLogger(__name__)

__all__ = ["ContextParallelAttention", "SharedMask"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _merge(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmax attentions over disjoint keys -> the one over their union. o [B, N, L, D], lse [B, N, L] fp32."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp().unsqueeze(-1), (lse2 - lse).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


class _GatherSequence(torch.autograd.Function):
    """All-gather of this rank's tensor over the cp group -> ``[cp, *shape]`` (rank order); backward: the
    reduce-scatter (sum) of the gathered gradient, each rank receiving its own tensor's."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any, cp: int) -> Tensor:
        ctx.group = group
        out = t.new_empty((cp * t.shape[0], *t.shape[1:]))  # gloo wants the ranks' tensors stacked on dim 0
        dist.all_gather_single(out, t.contiguous(), group=group)
        return out.view(cp, *t.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None, None


class _CausalChunks(torch.autograd.Function):
    """Causal attention of two local query chunks (global chunk ids ``chunks``, ``c`` rows each) on the whole
    sequence's keys/values, block by block with the CPU flash kernel (no mask, no score matrix kept). Keys/values
    stay at their kv heads (saved for backward as gathered); each block repeats them for its grouped query heads."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, chunks: tuple[int, int], c: int,
                scale: float | None) -> Tensor:
        # q [B, N, 2c, D]; k, v [B, K, S, D] in column order
        rep = q.shape[1] // k.shape[1]
        outs, lses = [], []
        for i, j in enumerate(chunks):
            qj = q[:, :, i * c:(i + 1) * c]
            o, lse = _flash(qj, *_heads(k, v, slice(j * c, (j + 1) * c), rep), 0.0, True, scale=scale)
            if j:  # the chunks before: every key visible
                o_prev, lse_prev = _flash(qj, *_heads(k, v, slice(0, j * c), rep), 0.0, False, scale=scale)
                o, lse = _merge(o, lse, o_prev, lse_prev)
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, dim=2)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.chunks, ctx.c, ctx.rep, ctx.scale = chunks, c, rep, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, *lses = ctx.saved_tensors
        c, rep = ctx.c, ctx.rep
        # partial gradients summed in fp32 (one device's flash backward sums them in fp32 inside the kernel)
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        grad = grad.contiguous()
        b, kv_heads, _, d = k.shape
        for i, j in enumerate(ctx.chunks):
            rows = slice(i * c, (i + 1) * c)
            g, qj, oj, lse = grad[:, :, rows], q[:, :, rows], out[:, :, rows].contiguous(), lses[i]
            # Each block's gradient from the merged output and log-sum-exp: P = exp(q k^T / sqrt(D) - lse) is the
            # global softmax restricted to the block, rowsum(dO * O) the global one.
            blocks = [(slice(j * c, (j + 1) * c), True)] + ([(slice(0, j * c), False)] if j else [])
            for cols, causal in blocks:
                a, gk, gv = _flash_backward(g, qj, *_heads(k, v, cols, rep), oj, lse, 0.0, causal, scale=ctx.scale)
                dq[:, :, rows] += a
                # a kv head's gradient: the sum over the query heads it serves ([B, K, rep, L, D])
                dk[:, :, cols] += gk.view(b, kv_heads, rep, -1, d).sum(2)
                dv[:, :, cols] += gv.view(b, kv_heads, rep, -1, d).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _heads(k: Tensor, v: Tensor, cols: slice, rep: int) -> tuple[Tensor, Tensor]:
    """Keys/values of columns ``cols`` repeated for the query heads (GQA: kv head j serves heads j*rep..)."""
    kb, vb = k[:, :, cols], v[:, :, cols]
    if rep > 1:
        kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
    return kb, vb


class SharedMask:
    """The mask (or varlen layout) across slices, shared by every attention core of a model: one forward's layers
    receive the same :class:`~lightning_llm.models.layers.attention.TokenMask`, so the mask (and the gathers of its keep and
    segment ids) is built once per forward, not per layer, and every layer's SDPA saves that one additive tensor for
    backward instead of its own ``[B, 1, S/cp, S]`` conversion of a boolean mask. Keyed by the token mask's identity
    (a weak reference) and ``kind`` (the mask's dtype, or the layout); dropped with the token mask."""

    def __init__(self) -> None:
        self._key: Callable[[], Any] = lambda: None
        self._kind: Any = None
        self._mask: Any = None

    def get(self, token_mask: Any, kind: Any, build: Callable[[], Any]) -> Any:
        """What ``build()`` makes of ``token_mask`` as ``kind``: built for a new one, else the one built for it."""
        if self._key() is not token_mask or self._mask is None or self._kind != kind:
            self._mask, self._kind = build(), kind
            self._key = weakref.ref(token_mask)
            weakref.finalize(token_mask, self._drop, self._key)
        return self._mask

    def _drop(self, key: Any) -> None:
        if self._key is key:  # not a newer forward's
            self._mask = None


class ContextParallelAttention(nn.Module):
    """Replaces a family's attention core (``ParallelSpec.attention_cores``) under context parallelism: the same
    call (``q`` [B, N, S/cp, D], ``k``/``v`` [B, K, S/cp, D] of this rank's tokens), attending to the whole
    sequence of the cp group. Rebuilds the causal mask from global columns and the model's
    :class:`~lightning_llm.models.layers.attention.TokenMask`, so the model passes it (``needs_token_mask``)."""

    needs_token_mask = True

    def __init__(self, *, group: Any, cp: int, rank: int, shared: SharedMask | None = None) -> None:
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank
        self.shared = shared if shared is not None else SharedMask()

    def extra_repr(self) -> str:
        return f"cp={self.cp}, rank={self.rank}, all-gather of keys/values"

    def _gather(self, t: Tensor, *, dim: int, differentiable: bool) -> Tensor:
        """This rank's ``t`` with its sequence on ``dim`` -> the whole sequence, in column order."""
        t = t.contiguous()
        if differentiable:
            parts = _GatherSequence.apply(t, self.group, self.cp).unbind(0)
        else:
            parts = [torch.empty_like(t) for _ in range(self.cp)]
            dist.all_gather(parts, t, group=self.group)
        return order_gathered(parts, dim=dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: Tensor | None, is_causal: bool,
                dropout_p: float, token_mask: Any = None, scale: float | None = None) -> Tensor:  # [B, N, S/cp, Dv]
        if token_mask is None:
            raise ValueError("context parallelism: the model called its attention core without a token_mask (the "
                             "mask's ingredients), so the mask across slices cannot be built")
        if dropout_p:
            raise ValueError(f"context parallelism: attention dropout ({dropout_p}) is not supported (the dropout "
                             "pattern of a slice would differ from one device's)")
        s_local, dv = q.shape[2], v.shape[-1]
        seq = s_local * self.cp
        # one collective for both: [2, B, S/cp, K, D] -> [2, B, S, K, D] (only the kv heads travel), seen as
        # [B, K, S, D]; token-major, so the varlen path takes its rows as views. Values narrower than the keys (MLA)
        # travel zero-padded to their width and the output is cut back to Dv.
        v = values_as_keys(v, k.shape[-1])
        kv = self._gather(torch.stack([k.transpose(1, 2), v.transpose(1, 2)]), dim=2, differentiable=True)
        k_all, v_all = kv.transpose(2, 3).unbind(0)
        if token_mask.varlen:
            layout = self.shared.get(token_mask, VarlenLayout, lambda: self._layout(
                token_mask, seq=seq, batch=q.shape[0], device=q.device))
            return varlen_attention(q, k_all, v_all, layout, scale=scale)[..., :dv]
        plain = token_mask.keep is None and token_mask.segment_ids is None
        if plain and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
            c = s_local // 2
            return _CausalChunks.apply(q, k_all, v_all, (self.rank, 2 * self.cp - 1 - self.rank), c, scale)[..., :dv]
        # [B, 1, S/cp, S] additive (0 / -inf) in q's dtype, built by this forward's first layer: SDPA would turn a
        # boolean mask into such a tensor in every layer and save each for backward
        mask = self.shared.get(token_mask, q.dtype, lambda: additive_mask(
            self._mask(token_mask, seq=seq, batch=q.shape[0], device=q.device), q.dtype))
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, *_heads(k_all, v_all, slice(None), rep), attn_mask=mask,
                                              scale=scale)[..., :dv]

    def max_logits(self, q: Tensor, k: Tensor, v: Tensor, *, token_mask: Any = None, scale: float | None = None,
                   **_: Any) -> Tensor:
        """Each query head's largest logit of this rank's queries against the whole rows' keys (gathered without
        gradient; the mask by global column, as :meth:`forward`'s): the maximum over the cp group is one device's
        (QK-Clip). -> [N]."""
        if token_mask is None:
            raise ValueError("context parallelism: QK-Clip needs the model's token_mask to mask the logits")
        seq = q.shape[2] * self.cp
        k_all = self._gather(k.transpose(1, 2), dim=1, differentiable=False).transpose(1, 2)  # [B, K, S, D]
        return max_logits(q, k_all, attn_mask=self._mask(token_mask, seq=seq, batch=q.shape[0], device=q.device),
                          is_causal=False, scale=scale)

    def _layout(self, token_mask: Any, *, seq: int, batch: int, device: torch.device) -> VarlenLayout:
        """The varlen layout of this rank's two chunks against the whole rows' keys (keep and segment ids
        gathered)."""
        c = seq // (2 * self.cp)
        tail = 2 * self.cp - 1 - self.rank
        chunks = [(self.rank * c, (self.rank + 1) * c), (tail * c, (tail + 1) * c)]  # local_columns' order
        keep, seg = token_mask.keep, token_mask.segment_ids
        if keep is not None:
            keep = self._gather(keep.to(torch.uint8), dim=1, differentiable=False).bool()
        if seg is not None:
            seg = self._gather(seg, dim=1, differentiable=False)
        return varlen_layout(keep, seg, batch=batch, seq=seq, device=device, chunks=chunks)

    def _mask(self, token_mask: Any, *, seq: int, batch: int, device: torch.device) -> Tensor:
        """Boolean [B, 1, S/cp, S]: causal by global column, a real key of the query's segment; an empty row attends
        to itself (no NaN), as ``masks.causal_padding_mask``."""
        q_cols = local_columns(seq, self.cp, self.rank, device=device)  # [S/cp]
        k_cols = torch.arange(seq, device=device)  # [S]
        mask = (k_cols[None, :] <= q_cols[:, None])[None, None]  # [1, 1, S/cp, S]
        seg = token_mask.segment_ids
        keep = token_mask.keep
        if seg is not None:  # padding of a packed row (segment 0) is no key
            keep = seg > 0 if keep is None else keep & (seg > 0)
        if keep is not None:
            mask = mask & self._gather(keep.to(torch.uint8), dim=1, differentiable=False).bool()[:, None, None, :]
        if seg is not None:
            mask = mask & (seg[:, None, :, None] == self._gather(seg, dim=1, differentiable=False)[:, None, None, :])
        mask = mask.expand(batch, 1, -1, -1)
        empty = ~mask.any(dim=-1, keepdim=True)  # [B, 1, S/cp, 1]
        eye = (k_cols[None, :] == q_cols[:, None])[None, None]
        return mask | (empty & eye)
