"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) and its short causal convolution: a chunked torch form
everywhere, flash-linear-attention's kernels (the optional ``fla-core`` package) on CUDA.

For every value head ``h`` and token ``t`` (key head ``h // (Hv / Hk)``: grouped value heads), with ``q_t, k_t``
L2-normalised and ``q_t`` scaled by ``1 / sqrt(Dk)``::

    S_t = exp(g_t) * S_{t-1}                      # decay of the state [Dk, Dv]
    S_t = S_t + k_t (beta_t * (v_t - k_t^T S_t))^T  # delta rule: write the part of v_t the state does not predict
    o_t = S_t^T q_t

:func:`chunk_gated_delta_rule_torch` computes it by chunks of 64 tokens exactly as transformers' torch fallback
(``torch_chunk_gated_delta_rule``: the WY form inside a chunk by a triangular solve, a scan over the chunks), fp32
throughout; with ``segment_ids`` (packed rows) the state restarts where the segment changes (every cross-segment
term of a chunk is masked, so a document computes what it computes alone). :func:`recurrent_gated_delta_rule_step`
is one token from a state (decoding). :func:`causal_conv1d_torch` is the depthwise causal convolution with SiLU
before it, from a state of the previous ``K - 1`` inputs or zeros, restarting at segment starts too.

:func:`gated_delta_rule` and :func:`causal_conv1d` dispatch (:func:`kernel_choice`): fla's ``chunk_gated_delta_rule``
and ``causal_conv1d`` (with ``cu_seqlens`` for packed or padded rows: no state flows from one document into the next)
where the input is on CUDA in bf16/fp16 and ``fla`` is importable, else the torch forms; ``kernels=fla`` is fla or a
one-line error, ``auto`` logs what it chose (once per device and dtype). The same under ``torch.compile``
(``--model.compile``): the choice is made while dynamo traces (a constant of the graph, nothing checked per step),
and fla's kernels run between the compiled regions (``torch.compiler.disable``: a graph break around each call, as
fla's own host reads of ``cu_seqlens`` need). ``benchmarks/gpu/hybrid.py`` holds the two to each other on the GPU.

Shapes: B batch, S tokens, Hk key heads, Hv value heads, Dk / Dv head dims, C channels, K kernel width.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = ["CHUNK_SIZE", "causal_conv1d", "causal_conv1d_torch", "chunk_gated_delta_rule_torch", "fla_applies",
           "fla_available", "gated_delta_rule", "kernel_choice", "l2norm", "recurrent_gated_delta_rule_step",
           "sequence_starts"]

CHUNK_SIZE = 64
"""Tokens per chunk of the chunked form (transformers' and fla's)."""


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention (``pip install fla-core``, the ``[fla]`` extra) can be imported."""
    return importlib.util.find_spec("fla") is not None


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 ``[B, Hv, S, .]`` tensors, q and k repeated to the value heads, L2-normed, q scaled."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:  # value head h reads key head h // rep
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _segment_masks(segment_ids: Tensor, pad: int, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """Masks of packed rows per chunk [B, 1, N, C(, C)]: ``same`` (two positions in one segment), ``cont`` (a
    position in the segment that continues from before the chunk) and ``to_end`` (a position in the chunk's last
    position's segment)."""
    seg = F.pad(segment_ids, (0, pad), mode="replicate") if pad else segment_ids  # [B, S'] the tail continues
    seg = seg.reshape(seg.shape[0], 1, -1, chunk)  # [B, 1, N, C]
    before = torch.cat([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], dim=2)  # [B, 1, N, 1]: the previous chunk's last
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)
    return same, seg == before, seg == seg[..., -1:]


def chunk_gated_delta_rule_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *,
                                 chunk_size: int = CHUNK_SIZE, initial_state: Tensor | None = None,
                                 output_final_state: bool = False, segment_ids: Tensor | None = None,
                                 ) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule by chunks (module docstring). q, k [B, S, Hk, Dk]; v [B, S, Hv, Dv]; g (log decay,
    <= 0), beta [B, S, Hv]; ``initial_state`` [B, Hv, Dk, Dv]; ``segment_ids`` [B, S] (packed rows: the state
    restarts where they change). Returns the output [B, S, Hv, Dv] in q's dtype and the final state (fp32) when
    ``output_final_state``."""
    dtype, (b, s, _, dk), dv = q.dtype, k.shape, v.shape[-1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    pad = (chunk_size - s % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))  # [B, Hv, N, C, D]
    decay = g.reshape(g.shape[0], g.shape[1], -1, chunk_size).cumsum(dim=-1)  # [B, Hv, N, C] log decay in the chunk
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [.., C, C]
    start = decay.exp()  # decay from the chunk's start to each position
    to_end = (decay[..., -1:] - decay).exp()  # decay from each position to the chunk's end
    end = decay[..., -1].exp()  # the whole chunk's decay [B, Hv, N]
    if segment_ids is not None:  # no term between two segments; the state carried in reaches its own segment only
        same, cont, last = _segment_masks(segment_ids, pad, chunk_size)
        pairwise, start, to_end, end = pairwise * same, start * cont, to_end * last, end * cont[..., -1]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular system of the WY form [.., C, C]
    intra = (q @ k.transpose(-1, -2)) * pairwise  # attention inside the chunk (diagonal included)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * start.unsqueeze(-1), upper=False, unitriangular=True)
    state = (torch.zeros(b, v.shape[1], dk, dv, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.to(torch.float32))
    q, k = q * start.unsqueeze(-1), k * to_end.unsqueeze(-1)
    end = end[..., None, None]
    out = []
    for i in range(q.shape[2]):  # the scan over chunks: read the state, then fold the chunk into it
        v_new = new_values[:, :, i] - k_decayed[:, :, i] @ state
        out.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * end[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, v.shape[1], -1, dv)[:, :, :s]  # [B, Hv, S, Dv]
    return o.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state if output_final_state else None


def recurrent_gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
                                    ) -> tuple[Tensor, Tensor]:
    """One token per row from ``state`` [B, Hv, Dk, Dv] (decoding; transformers' recurrent form): q, k [B, 1, Hk,
    Dk], v [B, 1, Hv, Dv], g, beta [B, 1, Hv] -> output [B, 1, Hv, Dv] (q's dtype) and the new state (fp32)."""
    dtype = q.dtype
    q, k, v, g, beta = (x[:, :, 0] for x in _heads_first(q, k, v, g, beta))  # [B, Hv, D], [B, Hv]
    state = state.to(torch.float32) * g.exp()[..., None, None]
    delta = (v - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)  # [B, Hv, Dv]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (state * q.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, Dv]
    return o.unsqueeze(1).to(dtype), state


def causal_conv1d_torch(x: Tensor, weight: Tensor, *, state: Tensor | None = None,
                        segment_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution then SiLU: x [B, C, S], weight [C, 1, K], ``state`` [B, C, K - 1] (the inputs
    before x; zeros when None); ``segment_ids`` [B, S]: an output sees inputs of its own segment only. Returns the
    output [B, C, S] (x's dtype) and the new state (the last K - 1 inputs)."""
    width = weight.shape[-1]
    past = state if state is not None else x.new_zeros(*x.shape[:2], width - 1)
    full = torch.cat([past.to(x.dtype), x], dim=-1)  # [B, C, K - 1 + S]
    if segment_ids is None:
        out = F.conv1d(full.to(weight.dtype), weight, groups=x.shape[1])
    else:  # a sum over the K taps, each masked where its input lies in an earlier segment
        seg = F.pad(segment_ids, (width - 1, 0), value=-1)  # [B, K - 1 + S]
        s, taps = x.shape[-1], full.to(weight.dtype)
        out = sum(taps[..., j:j + s] * weight[:, 0, j, None] * (seg[:, None, j:j + s] == segment_ids[:, None])
                  for j in range(width))
    return F.silu(out).to(x.dtype), full[..., full.shape[-1] - (width - 1):]


def sequence_starts(segment_ids: Tensor, batch: int, seq: int) -> Tensor:
    """``cu_seqlens`` [N + 1] (int32) of the documents of packed ``[B, S]`` rows flattened: a new one at every row
    start and segment change (a padding run is one of its own; reads the host once)."""
    starts = torch.ones(batch, seq, dtype=torch.bool, device=segment_ids.device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    return torch.cat([first, first.new_full((1,), batch * seq)]).to(torch.int32)


def _fla_missing(device: str, dtype: torch.dtype) -> str | None:
    """Why fla's kernels cannot run on an input on ``device`` in ``dtype`` (``None``: they can)."""
    if not fla_available():
        return "flash-linear-attention is not installed (pip install fla-core)"
    if device != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return f"its kernels take CUDA inputs in bf16/fp16, got a {device} {str(dtype).replace('torch.', '')} input"
    return None


_SAID: set[tuple[str, torch.dtype]] = set()


@torch._dynamo.assume_constant_result  # under torch.compile: called while tracing, its answer a constant of the graph
def kernel_choice(backend: str, device: str, dtype: torch.dtype) -> str:
    """``fla`` or ``torch``: the kernels of the delta rule and the convolution for an input on ``device`` (its type)
    in ``dtype``. ``backend``: ``auto`` (fla where it runs; the choice and why logged once per device and dtype),
    ``fla`` (where it cannot run, fla's call refuses in one line: :func:`_check_fla`, at run time, so that the error
    also leaves a compiled region as it is) or ``torch``."""
    if backend in ("torch", "fla"):
        return backend
    if backend != "auto":
        raise ValueError(f"Gated DeltaNet kernels must be 'auto', 'fla' or 'torch', got {backend!r}")
    missing = _fla_missing(device, dtype)
    if (device, dtype) not in _SAID:
        _SAID.add((device, dtype))
        log.info("Gated DeltaNet kernels=auto on %s %s: %s", device, str(dtype).replace("torch.", ""),
                 f"the chunked torch form ({missing})" if missing else "flash-linear-attention's kernels")
    return "torch" if missing else "fla"


def _check_fla(x: Tensor) -> None:
    """``kernels='fla'`` where fla cannot run on ``x``: ``RuntimeError`` in one line."""
    missing = _fla_missing(x.device.type, x.dtype)
    if missing:
        raise RuntimeError(f"Gated DeltaNet kernels='fla': {missing}; use kernels='auto' or 'torch'")


def fla_applies(backend: str, x: Tensor) -> bool:
    """Whether the dispatch takes fla's kernels for ``x`` (:func:`kernel_choice`)."""
    return kernel_choice(backend, x.device.type, x.dtype) == "fla"


def _varlen(cu_seqlens: Tensor | None) -> dict[str, Tensor]:
    """fla's keyword arguments of flattened rows (its host copy too: fla reads the lengths on the host)."""
    if cu_seqlens is None:
        return {}
    return {"cu_seqlens": cu_seqlens.long(), "cu_seqlens_cpu": cu_seqlens.long().cpu()}


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor | None = None,
                     output_final_state: bool = False, segment_ids: Tensor | None = None,
                     cu_seqlens: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor | None]:
    """The chunked gated delta rule (shapes of :func:`chunk_gated_delta_rule_torch`; q and k are L2-normed inside):
    fla's kernel where :func:`fla_applies` says (``cu_seqlens`` from :func:`sequence_starts` for packed or padded rows),
    else the torch form (``segment_ids`` restart the state)."""
    if not fla_applies(backend, q):
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state, segment_ids=segment_ids)
    return _fla_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                                 cu_seqlens=cu_seqlens)


@torch.compiler.disable  # under torch.compile: run as it is, between the compiled regions
def _fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor | None,
                          output_final_state: bool, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor | None]:
    _check_fla(q)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, s = q.shape[:2]
    flat = cu_seqlens is not None  # the rows as one sequence of documents: [1, B * S, ...]
    args = [t.reshape(1, b * s, *t.shape[2:]) if flat else t for t in (q, k, v, g, beta)]
    o, state = chunk_gated_delta_rule(*args, initial_state=initial_state, output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=True, **_varlen(cu_seqlens))
    return o.reshape(b, s, *o.shape[2:]), state


def causal_conv1d(x: Tensor, weight: Tensor, *, state: Tensor | None = None, segment_ids: Tensor | None = None,
                  cu_seqlens: Tensor | None = None, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """:func:`causal_conv1d_torch`'s convolution (x [B, C, S]), by fla's ``causal_conv1d`` where :func:`fla_applies`
    says and no state is carried in (training, a prefill: the new state is then taken from x here)."""
    if state is not None or not fla_applies(backend, x):
        return causal_conv1d_torch(x, weight, state=state, segment_ids=segment_ids)
    return _fla_causal_conv1d(x, weight, cu_seqlens=cu_seqlens)


@torch.compiler.disable  # under torch.compile: run as it is, between the compiled regions
def _fla_causal_conv1d(x: Tensor, weight: Tensor, *, cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
    _check_fla(x)
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    b, c, s = x.shape
    width = weight.shape[-1]
    rows = x.transpose(1, 2)  # [B, S, C]
    if cu_seqlens is not None:
        rows = rows.reshape(1, b * s, c)
    out, _ = fla_conv(rows, weight[:, 0], activation="silu", **_varlen(cu_seqlens))
    tail = F.pad(x, (width - 1, 0))[..., s:]  # the last K - 1 inputs (zeros before the row)
    return out.reshape(b, s, c).transpose(1, 2), tail
