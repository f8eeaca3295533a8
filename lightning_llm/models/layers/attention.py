"""The attention core and its two paths: SDPA over a dense mask, and varlen flash attention without one.

Both compute the same attention: causal, a key only if it is a real token (``keep``) of the query's packed example
(``segment_ids``), within the sliding window where a layer has one.

* **mask path** (every device; the CPU's exact path): the decoder builds one boolean/additive mask ``[B, 1, S, T]``
  per forward (``masks.causal_padding_mask``) and each layer calls SDPA with it; plain rows (no padding, no packing,
  no window) call SDPA ``is_causal`` with no mask. With a mask SDPA cannot take the flash kernel, and the mask is S^2
  per row (a 32k-token row: 2 GiB in bf16).
* **varlen path** (``ModelConfig.attention``: ``auto`` takes it on CUDA in fp16/bf16; ``varlen`` everywhere): no
  mask. The decoder builds one :class:`VarlenLayout` per forward on the host from the padding and segment ids (which
  rows of the flattened ``[B*S, heads, D]`` queries/keys each call takes, and the sequences' cumulative lengths, as
  transformers' ``flash_attention_2`` unpads) and every layer calls ``torch.nn.attention.varlen.varlen_attn`` (flash
  varlen, GQA heads not repeated, its own backward) on it. Rows without padding are views, not copies; padded rows are
  gathered into the call and scattered back (padding outputs are 0: nothing reads them, as with every padding output).
  Plain rows keep SDPA ``is_causal`` (cuDNN/flash, ``enable_gqa``). On the CPU the same layout runs
  :func:`reference_varlen` (per sequence, float math), the reference the tests hold against the mask path.

The flash kernel aligns a causal mask to the bottom right when a sequence has more keys than queries (query ``t`` of
``Lq`` sees keys up to ``t + Lk - Lq``), so one call attends a chunk of queries to every earlier key of its example:
what context parallelism needs (a slice's chunk against the gathered keys before it,
``strategies/context/attention.py``), with no mask and no merge of partial results.

Shape legend: B batch, N query heads, K key/value heads, S query tokens, T key tokens, D head dim; R rows of a
flattened token stream.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .sinks import (cpu_sink_attention, eager_sink_attention, sink_corrected, varlen_sink_kernel,
                    varlen_sinks_supported)

try:  # torch >= 2.9; sliding windows and GQA arguments in the versions this project pins (2.13)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # an older torch: the mask path only
    varlen_attn = None

log = logging.getLogger(__name__)

__all__ = ["AttentionMask", "DotProductAttention", "TokenMask", "VarlenCall", "VarlenLayout", "attention_path",
           "contiguous_sequences", "describe_attention", "reference_varlen", "softcapped_attention", "uses_varlen",
           "values_as_keys", "varlen_attention", "varlen_layout"]

AttentionPath = Literal["varlen", "sdpa"]
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_VARLEN_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
_HAS_VARLEN = "is_causal" in _VARLEN_PARAMS or "window_size" in _VARLEN_PARAMS
"""torch has flash varlen attention (2.10 on: causal from the bottom right, as ``is_causal`` or ``window_size``)."""
_HAS_WINDOW_GQA = {"window_size", "enable_gqa"} <= _VARLEN_PARAMS
"""It also takes a sliding window and grouped kv heads (torch 2.13); before, kv heads are repeated for it and sliding
windows take the mask path."""


# ---------------------------------------------------------------------------------------------------- the layout
Rows = slice | Tensor
"""Rows of a flattened token stream: a contiguous range (a view) or an index [R] (a copy)."""


@dataclass(frozen=True)
class VarlenCall:
    """One varlen kernel call: sequence ``i`` is query rows ``cu_q[i]:cu_q[i+1]`` of the selected queries and key rows
    ``cu_k[i]:cu_k[i+1]`` of the selected keys (its last queries are its last keys: causal from the bottom right)."""

    q: Rows
    """Which rows of the flattened queries ``[B*S, N, D]`` the call takes, in sequence order."""
    k: Rows
    """Which rows of the flattened keys/values ``[B*T, K, D]``."""
    cu_q: Tensor
    """[n + 1] int32 cumulative query lengths (on the attention's device)."""
    cu_k: Tensor
    """[n + 1] int32 cumulative key lengths."""
    max_q: int
    max_k: int


@dataclass(frozen=True)
class VarlenLayout:
    """What every attention layer of one forward needs instead of a mask: its kernel calls and where their outputs
    go. Built once per forward on the host (:func:`varlen_layout`); holds no ``[S, S]`` tensor."""

    calls: tuple[VarlenCall, ...]
    rows: int
    """Rows of the flattened output ``[B*S, N, D]``."""
    scatter: Tensor | None
    """[R] the output rows of the calls' concatenated outputs; None: they are rows ``0..rows-1`` in order."""
    window: int | None = None
    """Sliding window: a query sees the ``window`` most recent keys of its sequence, itself included."""

    def with_window(self, window: int | None) -> VarlenLayout:
        return dataclasses.replace(self, window=window)


AttentionMask = Tensor | VarlenLayout | None
"""What a layer's attention receives: a boolean/additive mask, the varlen layout, or None (plain causal rows)."""


def _rows(index: Tensor, device: torch.device) -> Rows:
    """A slice where ``index`` [R] is a contiguous ascending range (no copy), else the index on ``device``."""
    n = index.numel()
    start = int(index[0]) if n else 0
    if torch.equal(index, torch.arange(start, start + n)):
        return slice(start, start + n)
    return index.to(device, non_blocking=True)


def _cumulative(lengths: Tensor, device: torch.device) -> Tensor:
    return F.pad(lengths.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32, non_blocking=True)


def _sequences(keep: Tensor | None, segment_ids: Tensor | None, batch: int, seq: int) -> tuple[Tensor, Tensor]:
    """On the host: ``real`` [B, S] (a real token of an example) and ``sid`` [B, S] (one id per (row, example),
    increasing with the row)."""
    if any(t is not None and t.is_meta for t in (keep, segment_ids)):
        raise ValueError("the varlen attention layout reads the batch's padding and segment ids: they must hold "
                         "values (not meta tensors)")
    real = torch.ones(batch, seq, dtype=torch.bool) if keep is None else keep.cpu().bool()
    seg = torch.zeros(batch, seq, dtype=torch.long) if segment_ids is None else segment_ids.cpu().long()
    if segment_ids is not None:
        real = real & (seg > 0)
    return real, torch.arange(batch)[:, None] * (int(seg.max()) + 1) + seg


def varlen_layout(keep: Tensor | None, segment_ids: Tensor | None, *, batch: int, seq: int, device: torch.device,
                  chunks: Sequence[tuple[int, int]] | None = None) -> VarlenLayout:
    """The layout of a forward whose rows are ``keep`` [B, S] (True = a real token; None: all) and ``segment_ids``
    [B, S] (packed rows: 1..k per example, 0 padding; None: one sequence per row), in global column order.

    ``chunks``: the query columns this rank holds, ``[lo, hi)`` ranges of global columns in its local order (context
    parallelism: two chunks of a row); default the whole row. Each chunk is one kernel call: its real queries, grouped
    by (row, example), against every real key of the same example in columns before ``hi``. Sequences are ordered by
    (row, segment id), tokens by column, so an example's tokens are consecutive even across padding.
    """
    real, sid = _sequences(keep, segment_ids, batch, seq)
    row = torch.arange(batch)[:, None]
    col = torch.arange(seq)[None, :]
    order = sid * seq + col  # [B, S] sort key: by sequence, then by column
    chunks = [(0, seq)] if chunks is None else list(chunks)
    local = sum(hi - lo for lo, hi in chunks)
    calls, outputs, offset = [], [], 0
    for lo, hi in chunks:
        in_q = real & (col >= lo) & (col < hi)
        seqs, n_q = torch.unique(sid[in_q], return_counts=True)  # sorted: the sequences with queries here
        if seqs.numel():
            in_k = real & (col < hi) & torch.isin(sid, seqs)
            n_k = torch.unique(sid[in_k], return_counts=True)[1]  # the same sequences, in the same order
            q_rows = (row * local + offset + col - lo).expand(batch, seq)[in_q]
            k_rows = (row * seq + col).expand(batch, seq)[in_k]
            q_rows = q_rows[order[in_q].argsort()]
            calls.append(VarlenCall(q=_rows(q_rows, device), k=_rows(k_rows[order[in_k].argsort()], device),
                                    cu_q=_cumulative(n_q, device), cu_k=_cumulative(n_k, device),
                                    max_q=int(n_q.max()), max_k=int(n_k.max())))
            outputs.append(q_rows)
        offset += hi - lo
    every = torch.cat(outputs) if outputs else torch.zeros(0, dtype=torch.long)
    in_order = torch.equal(every, torch.arange(batch * local))
    return VarlenLayout(tuple(calls), rows=batch * local, scatter=None if in_order else every.to(device))


def contiguous_sequences(keep: Tensor | None, segment_ids: Tensor | None) -> bool:
    """Whether every example's real tokens are adjacent columns (no padding inside an example, no segment id used
    twice in a row): then distances in a varlen sequence are column distances, as a sliding window counts them."""
    given = keep if keep is not None else segment_ids
    if given is None:
        return True
    b, s = given.shape
    real, sid = _sequences(keep, segment_ids, b, s)
    sid = sid[real]
    cols = torch.arange(s).expand(b, s)[real]
    n = int(sid.max()) + 1 if sid.numel() else 0
    first = torch.full((n,), s, dtype=torch.long).scatter_reduce(0, sid, cols, "amin")
    last = torch.full((n,), -1, dtype=torch.long).scatter_reduce(0, sid, cols, "amax")
    count = torch.zeros(n, dtype=torch.long).scatter_add(0, sid, torch.ones_like(sid))
    used = count > 0
    return bool(((last - first + 1)[used] == count[used]).all())


# ---------------------------------------------------------------------------------------------------- the kernels
def reference_varlen(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, *,
                     window: int | None, sinks: Tensor | None = None, scale: float | None = None) -> Tensor:
    """What the varlen kernel computes, one sequence at a time with SDPA and an explicit mask: q [Rq, N, D], k/v
    [Rk, K, D] -> [Rq, N, D]; causal from the bottom right, within ``window``; GQA heads repeated; with ``sinks``
    [N] the sink column of every head (``sinks.eager_sink_attention``); softmax scale ``scale`` (default
    ``1/sqrt(D)``; with sinks only the default)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    bounds = zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:], strict=True)
    for a, b, c, d in bounds:
        qi = q[a:b].transpose(0, 1)  # [N, Lq, D]
        ki, vi = (t[c:d].transpose(0, 1).repeat_interleave(rep, dim=0) for t in (k, v))  # [N, Lk, D]
        last = torch.arange(b - a, device=q.device)[:, None] + (d - c) - (b - a)  # each query's own key column
        cols = torch.arange(d - c, device=q.device)[None, :]
        allowed = cols <= last
        if window is not None:
            allowed = allowed & (cols > last - window)
        if sinks is not None:
            outs.append(eager_sink_attention(qi[None], ki[None], vi[None], sinks, attn_mask=allowed,
                                             is_causal=False)[0].transpose(0, 1))
        else:
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def _varlen_kernel(q: Tensor, k: Tensor, v: Tensor, call: VarlenCall, window: int | None,
                   sinks: Tensor | None = None, scale: float | None = None) -> Tensor:
    """flash varlen on CUDA (and on the meta device, which runs its shape function), the reference elsewhere; with
    ``sinks`` the flash output corrected by its log-sum-exp (``sinks.py``; the meta device: the reference)."""
    if sinks is not None:
        if q.device.type == "cuda":
            if not varlen_sinks_supported():
                raise RuntimeError(f"attention sinks on the varlen path need aten._flash_attention_forward with a "
                                   f"window (torch 2.11); torch {torch.__version__} has not: use attention=sdpa")
            return sink_corrected(q, k, v, sinks, varlen_sink_kernel(call, window))
        return reference_varlen(q, k, v, call.cu_q.cpu(), call.cu_k.cpu(), window=window, sinks=sinks)
    if q.device.type in ("cuda", "meta"):
        if not _HAS_VARLEN or (window is not None and not _HAS_WINDOW_GQA):
            raise RuntimeError(f"attention=varlen needs torch.nn.attention.varlen.varlen_attn (torch 2.10; with a "
                               f"sliding window 2.13); torch {torch.__version__} has not: use attention=sdpa")
        scaled: dict[str, float] = {}
        if scale is not None and "scale" in _VARLEN_PARAMS:
            scaled = {"scale": scale}
        elif scale is not None:  # a torch whose kernel takes no scale: the queries carry its ratio to 1/sqrt(D)
            q = q * (scale * q.shape[-1] ** 0.5)
        if _HAS_WINDOW_GQA:
            return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k,
                               window_size=(-1 if window is None else window - 1, 0),
                               enable_gqa=k.shape[1] != q.shape[1], **scaled)
        rep = q.shape[1] // k.shape[1]  # [T, K, D]: torch < 2.13 takes as many kv heads as query heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
        return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, **causal, **scaled)
    return reference_varlen(q, k, v, call.cu_q.cpu(), call.cu_k.cpu(), window=window, scale=scale)


def values_as_keys(v: Tensor, width: int) -> Tensor:
    """Values ``[..., Dv]`` zero-padded to the keys' head width ``[..., width]`` for a kernel that takes one head size
    (flash varlen; the context-parallel blocks): the attention of the padded values is the real one followed by
    zeros, which the caller cuts off (MLA: values of ``v_head_dim`` beside query/key heads of ``qk_head_dim``)."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def _take(t: Tensor, rows: Rows) -> Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


@torch.compiler.disable  # a layout's ints and ranges change every batch: a compiled block would recompile each time
def varlen_attention(q: Tensor, k: Tensor, v: Tensor, layout: VarlenLayout, sinks: Tensor | None = None, *,
                     scale: float | None = None) -> Tensor:
    """Attention of q [B, N, S, D] on k [B, K, T, D] and v [B, K, T, Dv] (Dv <= D) as ``layout`` says -> [B, N, S, Dv]
    (0 for a query in no call: padding); ``sinks`` [N]: each head's sink logit; softmax scale ``scale`` (default
    ``1/sqrt(D)``)."""
    b, n, s, d = q.shape
    dv = v.shape[-1]
    qf = q.transpose(1, 2).reshape(b * s, n, d)  # a view of the projections' [B, S, N, D]
    kf = k.transpose(1, 2).reshape(-1, k.shape[1], d)
    vf = values_as_keys(v.transpose(1, 2).reshape(-1, v.shape[1], dv), d)
    outs = [_varlen_kernel(_take(qf, c.q), _take(kf, c.k), _take(vf, c.k), c, layout.window, sinks, scale)
            for c in layout.calls]
    out = torch.cat(outs) if len(outs) > 1 else outs[0] if outs else qf.new_zeros(0, n, d)
    if layout.scatter is not None:
        out = qf.new_zeros(layout.rows, n, d).index_copy(0, layout.scatter, out)
    return out.view(b, s, n, d)[..., :dv].transpose(1, 2)


# ---------------------------------------------------------------------------------------------------- the choice
def _compute_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    return torch.get_autocast_dtype(device) if autocast else x.dtype


@functools.cache
def _flash_device(device: torch.device) -> bool:
    """CUDA with torch's flash kernels (Ampere or newer)."""
    return device.type == "cuda" and torch.backends.cuda.is_flash_attention_available() \
        and torch.cuda.get_device_capability(device) >= (8, 0)


def attention_path(config: ModelConfig, *, device: torch.device, dtype: torch.dtype) -> tuple[AttentionPath, str]:
    """Which path a forward on ``device`` computing in ``dtype`` takes, and why."""
    if config.attention == "sdpa":
        return "sdpa", "attention=sdpa"
    if config.attention == "varlen":
        return "varlen", "attention=varlen"
    if getattr(config, "attn_logit_softcap", None) is not None:
        return "sdpa", "attention logit soft-capping: the eager scores (no flash kernel soft-caps them)"
    if not _flash_device(device):
        return "sdpa", "no CUDA flash kernel" if device.type == "cuda" else f"{device.type} device"
    if config.attention_sinks:  # every layer takes the sink kernel (sinks.py), whose flash call takes the window
        if not varlen_sinks_supported():
            return "sdpa", f"attention sinks: torch {torch.__version__}'s flash kernel takes no window"
    elif not _HAS_VARLEN:
        return "sdpa", f"torch {torch.__version__} has no varlen_attn"
    elif config.sliding_layers and not _HAS_WINDOW_GQA:
        return "sdpa", f"sliding window: torch {torch.__version__}'s varlen_attn takes no window_size"
    if dtype not in _FLASH_DTYPES:
        return "sdpa", f"{dtype} (flash takes fp16/bf16)"
    if (config.head_dim or 0) > _FLASH_MAX_HEAD_DIM or (config.head_dim or 0) % 8:
        return "sdpa", f"head_dim {config.head_dim} (flash: a multiple of 8 up to {_FLASH_MAX_HEAD_DIM})"
    if config.dropout:
        return "sdpa", f"attention dropout {config.dropout}"
    return "varlen", "CUDA, fp16/bf16"


def uses_varlen(config: ModelConfig, x: Tensor) -> bool:
    """Whether a whole-sequence forward of hidden states ``x`` takes the varlen path."""
    return attention_path(config, device=x.device, dtype=_compute_dtype(x))[0] == "varlen"


def describe_attention(config: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                       context_parallel: int = 1) -> str:
    """One line for the run summary: the kernel each kind of batch takes."""
    path, why = attention_path(config, device=device, dtype=dtype)
    gqa = (config.num_kv_heads or config.num_heads) < config.num_heads
    if context_parallel > 1:
        if path == "varlen":
            return (f"context parallel x{context_parallel}: keys/values all-gathered, flash varlen per local chunk "
                    f"(torch.nn.attention.varlen.varlen_attn, causal from the bottom right; no [S/cp, S] mask) ({why})")
        return (f"context parallel x{context_parallel}: keys/values all-gathered; plain rows: CPU flash blocks merged "
                f"by log-sum-exp on the CPU; padded/packed rows (and other devices): SDPA with a [B, 1, S/cp, S] mask "
                f"({why})")
    heads = ("; GQA: kv heads not repeated" if _HAS_WINDOW_GQA else "; GQA: kv heads repeated for torch's varlen_attn") \
        if gqa and path == "varlen" else ""
    if config.attention_sinks:
        return _describe_sinks(path, why)
    if getattr(config, "attn_logit_softcap", None) is not None:
        return (f"eager attention: the scores [B, N, S, T] soft-capped (cap {config.attn_logit_softcap:g}) with a "
                f"[B, 1, S, T] mask, softmax in fp32 ({why})")
    if path == "varlen":
        return (f"flash varlen (torch.nn.attention.varlen.varlen_attn) for padded, packed and sliding-window rows, "
                f"no [S, S] mask; plain rows: SDPA is_causal{heads} ({why})")
    return f"SDPA with a [B, 1, S, S] mask for padded, packed and sliding-window rows; plain rows: is_causal ({why})"


def _describe_sinks(path: AttentionPath, why: str) -> str:
    if path == "varlen":
        return (f"attention sinks: flash varlen (aten._flash_attention_forward) on every row, its output corrected by "
                f"its log-sum-exp and the sink, the kernel's backward given the corrected output ({why})")
    return (f"attention sinks: on the CPU its flash kernel with a [B, 1, S, S] mask (or causal), corrected by its "
            f"log-sum-exp; elsewhere the scores materialised with the sink as a column ({why})")


# ---------------------------------------------------------------------------------------------------- the core
@dataclass(frozen=True)
class TokenMask:
    """What a causal decoder's attention mask is made of, per token of this forward (a core that holds keys beyond
    this forward's own tokens rebuilds its mask from it: context parallelism's attention across sequence slices).

    Causal by column order, a key attends only if it is a real token (``keep``) of the query's segment
    (``segment_ids``); a query with no such key attends to itself (as ``masks.causal_padding_mask``)."""

    keep: Tensor | None = None
    """[B, S] bool, True = a real token; None: every token is."""
    segment_ids: Tensor | None = None
    """[B, S] packed rows (1..k per example, 0 padding); None: one sequence per row."""
    varlen: bool = False
    """The forward takes the varlen path (:func:`uses_varlen`): a core attends through the varlen kernel, no mask."""


def max_logits(q: Tensor, k: Tensor, *, attn_mask: Tensor | None, is_causal: bool, scale: float | None = None,
               rows: int = 256) -> Tensor:
    """The largest pre-softmax logit ``q k^T x scale`` of each query head over the pairs the mask lets attend, in
    fp32, without gradient (QK-Clip reads it): q [B, N, S, D], k [B, K, T, D] (GQA: query head h reads kv head
    h // (N / K)), ``attn_mask`` bool (True = attend) or additive, broadcastable to [B, N, S, T]; computed ``rows``
    queries at a time (no [S, T] scores of all heads at once). -> [N]."""
    if isinstance(attn_mask, VarlenLayout):
        raise ValueError("QK-Clip (--model.optim.qk_clip_tau) reads the attention logits through a dense mask; the "
                         "varlen path has none: train with --model.attention=sdpa")
    with torch.no_grad():
        (batch, n, s, d), (kv, t) = q.shape, k.shape[1:3]
        keys = k.float().transpose(-1, -2)  # [B, K, D, T]: each kv head once, its query heads' rows stacked on it
        scale = d ** -0.5 if scale is None else scale
        out = torch.full((n,), float("-inf"), device=q.device)
        for a in range(0, s, rows):
            b = min(s, a + rows)
            grouped = q[:, :, a:b].float().reshape(batch, kv, n // kv * (b - a), d)  # [B, K, G * (b - a), D]
            scores = (grouped @ keys).view(batch, n, b - a, t) * scale  # [B, N, b - a, T]
            if attn_mask is not None:
                mask = attn_mask[..., a:b, :] if attn_mask.shape[-2] == s else attn_mask
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            elif is_causal:  # bottom-right aligned, as SDPA's is_causal with a cache: query i sees keys <= i + t - s
                allowed = (torch.arange(t, device=q.device)[None, :]
                           <= torch.arange(a, b, device=q.device)[:, None] + (t - s))
                scores = scores.masked_fill(~allowed, float("-inf"))
            out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
        return out


class DotProductAttention(nn.Module):
    """The attention core of ``block.Attention`` (no parameters): ``softmax(q k^T / sqrt(D)) v`` by SDPA (GQA kv
    heads repeated on the CPU under autograd, ``enable_gqa`` elsewhere), or by the varlen kernel when given a
    :class:`VarlenLayout`. A layer may pass its own softmax ``scale`` and values narrower than the keys (MLA: zero-padded
    to the keys' width for the fused kernels, the output cut back). A declared hook (``ParallelSpec.attention_cores``): a layout that splits the sequence
    replaces this module by its attention across the slices, with the same call."""

    needs_token_mask: bool = False
    """Whether the model must pass ``token_mask``: a module that rebuilds the mask from it (in place of this core)
    sets True."""

    def max_logits(self, q: Tensor, k: Tensor, v: Tensor, *, attn_mask: AttentionMask, is_causal: bool,
                   scale: float | None = None, **_: object) -> Tensor:
        """Each query head's largest logit of this call (the core's own arguments; QK-Clip): :func:`max_logits`."""
        return max_logits(q, k, attn_mask=attn_mask, is_causal=is_causal, scale=scale)

    def forward(
        self,
        q: Tensor,  # [B, N, S, D]
        k: Tensor,  # [B, K, T, D] (K divides N)
        v: Tensor,  # [B, K, T, Dv] (Dv: the values' head width, D unless MLA)
        *,
        attn_mask: AttentionMask,  # bool (True = attend) or additive, broadcastable to [B, N, S, T]; or the layout
        is_causal: bool,
        dropout_p: float,
        token_mask: TokenMask | None = None,  # the mask's ingredients (unused here: attn_mask is built from them)
        sinks: Tensor | None = None,  # [N] each head's sink logit (models/layers/sinks.py)
        scale: float | None = None,  # softmax scale; None: 1/sqrt(D) (a layer with another one passes it: MLA)
        softcap: float | None = None,  # scores soft-capped to cap * tanh(scores / cap) (Gemma 2)
    ) -> Tensor:  # [B, N, S, Dv]
        if softcap is not None:
            if sinks is not None or isinstance(attn_mask, VarlenLayout):
                raise ValueError("soft-capped attention scores take the eager path: no sinks, no varlen layout "
                                 "(attention=sdpa)")
            return softcapped_attention(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale,
                                        softcap=softcap)
        if sinks is not None:
            if scale is not None or v.shape[-1] != q.shape[-1]:
                raise ValueError("attention sinks with a softmax scale of the layer's own or values narrower than "
                                 "the keys (MLA) are not supported")
            return _sink_attention(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p, sinks=sinks)
        dv = v.shape[-1]
        if dv != q.shape[-1]:  # the fused kernels take one head width: else SDPA's math path keeps [S, T] scores
            return self(q, k, values_as_keys(v, q.shape[-1]), attn_mask=attn_mask, is_causal=is_causal,
                        dropout_p=dropout_p, token_mask=token_mask, scale=scale)[..., :dv]
        if isinstance(attn_mask, VarlenLayout):
            if dropout_p:
                raise ValueError(f"attention=varlen has no attention dropout (dropout={dropout_p}): use "
                                 "attention=sdpa or dropout 0")
            return varlen_attention(q, k, v, attn_mask, scale=scale)
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != q.dtype:
            attn_mask = attn_mask.to(q.dtype)  # built for another compute dtype than this layer's (rare)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1 and q.device.type == "cpu" and torch.is_grad_enabled():
            # The CPU's exact path under autograd: kv head j serves query heads j*n_rep .. (its dK/dV sums the query
            # heads as HF's repeat_kv does). Decoding and other no-grad forwards keep enable_gqa: the CPU kernel
            # reads each kv head for its query heads itself, the same values without copying K/V every step.
            k = k.repeat_interleave(n_rep, dim=1)  # [B, N, T, D] (HF repeat_kv)
            v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal and attn_mask is None,
                                              enable_gqa=k.shape[1] != q.shape[1], scale=scale)


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, *, is_causal: bool,
                         dropout_p: float, scale: float | None, softcap: float) -> Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2 attention computes it: ``scores = q k^T *
    scale`` [B, N, S, T], ``cap * tanh(scores / cap)``, the mask added (causal from the top left when ``is_causal``
    and no mask, as SDPA), softmax in fp32 cast to q's dtype, dropout, times v. q [B, N, S, D], k/v [B, K, T, D|Dv]
    (GQA heads repeated) -> [B, N, S, Dv]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, N, T, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is None and is_causal:
        s, t = scores.shape[-2:]
        attn_mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


def _sink_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: AttentionMask, *, is_causal: bool, dropout_p: float,
                    sinks: Tensor) -> Tensor:
    """:class:`DotProductAttention` with a sink logit per head: the varlen layout's calls corrected by their
    log-sum-exp, the CPU's flash kernel corrected likewise, else the eager scores (``sinks.py``)."""
    if dropout_p:
        raise ValueError(f"attention sinks with attention dropout ({dropout_p}) are not supported: set dropout 0")
    if isinstance(attn_mask, VarlenLayout):
        return varlen_attention(q, k, v, attn_mask, sinks=sinks)
    out = cpu_sink_attention(q, k, v, sinks, attn_mask=attn_mask, is_causal=is_causal)
    if out is None:
        out = eager_sink_attention(q, k, v, sinks, attn_mask=attn_mask, is_causal=is_causal)
    return out
