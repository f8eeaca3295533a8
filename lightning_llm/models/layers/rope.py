"""Rotary position embeddings: inverse frequencies of every supported HF ``rope_type``, cos/sin tables, rotation.

Supported ``rope_type`` (HF ``rope_parameters``): ``default``, ``linear``, ``llama3``, ``yarn`` (static frequencies
plus an attention factor that scales cos and sin), ``dynamic`` (NTK-aware: the base grows with the sequence length
once it exceeds ``max_position_embeddings``) and ``longrope`` (Phi-3's: per-frequency ``short_factor`` /
``long_factor`` divisors, the long ones for a forward whose longest position + 1 passes
``original_max_position_embeddings``, as transformers 5.24's ``dynamic_rope_update`` chooses per forward, and an
attention factor on cos and sin in both cases). Every formula is transformers' (``modeling_rope_utils``), written with
the same tensor operations in the same order so that the frequencies are bit-identical.

``dynamic`` is stateless here: the frequencies of a forward depend on that forward's longest position only
(``max(position_ids) + 1``). transformers caches the longest length seen so far and keeps its frequencies until a
call shorter than ``max_position_embeddings`` resets them; both agree on any single forward of a fresh model and on
a generation whose length only grows (what ``generate`` does).

Shape legend: B batch, S sequence, D head dim, P table positions.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = [
    "ROPE_TYPES",
    "rope_type",
    "rope_inv_freq",
    "rope_attention_factor",
    "longrope_original",
    "yarn_softmax_factor",
    "pairs_to_halves",
    "rotary_pairs_to_halves",
    "precompute_rope",
    "rope_from_positions",
    "rotate_half",
    "apply_rotary",
]

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The ``rope_type`` of a scaling dict (``None`` -> ``default``; the legacy key ``type`` is accepted)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _default_inv_freq(head_dim: int, theta: float | Tensor) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))


def _llama3(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_factor(s: dict[str, Any], max_positions: int) -> float:
    factor = s.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        return max_positions / float(s["original_max_position_embeddings"])
    return float(factor)


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_positions: int) -> Tensor:
    """YaRN (Peng et al. 2023) frequencies: interpolated below ``beta_slow`` rotations, extrapolated above
    ``beta_fast``, linearly ramped between (transformers' ``_compute_yarn_parameters``)."""
    dim = head_dim
    factor = _yarn_factor(s, max_positions)
    original = s.get("original_max_position_embeddings", max_positions)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _dynamic(head_dim: int, theta: float, s: dict[str, Any], max_positions: int, seq_len: int) -> Tensor:
    """NTK-aware base for a forward whose longest position is ``seq_len - 1`` (transformers'
    ``_compute_dynamic_ntk_parameters`` with a tensor ``seq_len``, as its ``dynamic_rope_update`` passes it)."""
    dim = head_dim
    factor = float(s["factor"])
    seq = torch.maximum(torch.tensor(seq_len), torch.tensor(max_positions))  # int64, as HF's max(position_ids) + 1
    base = theta * ((factor * seq / max_positions) - (factor - 1)) ** (dim / (dim - 2))  # fp32 tensor
    return _default_inv_freq(dim, base)


def longrope_original(scaling: dict[str, Any] | None) -> int:
    """LongRoPE's ``original_max_position_embeddings``: the longest position + 1 its short factors serve."""
    if not scaling or scaling.get("original_max_position_embeddings") is None:
        raise ValueError("rope_type='longrope' needs original_max_position_embeddings")
    return int(scaling["original_max_position_embeddings"])


def _longrope(head_dim: int, theta: float, s: dict[str, Any], seq_len: int | None) -> Tensor:
    """LongRoPE frequencies (transformers' ``_compute_longrope_parameters``): ``1 / (ext * theta^(2i/D))`` with
    ``ext`` the long factors for a forward of ``seq_len`` past the original length, else the short ones."""
    long = seq_len is not None and seq_len > longrope_original(s)
    factors = s.get("long_factor" if long else "short_factor")
    if factors is None or len(factors) != head_dim // 2:
        raise ValueError(f"rope_type='longrope': {'long' if long else 'short'}_factor must list {head_dim // 2} "
                         f"numbers (rotary dims / 2), got {None if factors is None else len(factors)}")
    ext = torch.tensor(factors, dtype=torch.float32)
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None, *,
                  max_positions: int | None = None, seq_len: int | None = None) -> Tensor:
    """Inverse frequencies [D/2] in fp32, bit-identical to transformers' for every type of :data:`ROPE_TYPES`.

    ``max_positions`` (the model's ``max_position_embeddings``) is needed by ``yarn`` (default factor / original
    length) and ``dynamic``; ``seq_len`` is the longest position + 1 of the forward (``dynamic``: at or below
    ``max_positions`` the frequencies are the plain ones; ``longrope``: past ``original_max_position_embeddings`` the
    long factors, else (and without it) the short ones).
    """
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    if scaling and float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"rope partial_rotary_factor={scaling['partial_rotary_factor']} is not supported (only 1.0)")
    if kind == "default":
        return _default_inv_freq(head_dim, theta)
    assert scaling is not None
    if kind == "linear":
        return _default_inv_freq(head_dim, theta) / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(_default_inv_freq(head_dim, theta), scaling)
    if kind == "longrope":
        return _longrope(head_dim, theta, scaling, seq_len)
    if max_positions is None:
        raise ValueError(f"rope_type={kind!r} needs max_positions (the model's max_position_embeddings)")
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_positions)
    if seq_len is None or seq_len <= max_positions:
        return _default_inv_freq(head_dim, theta)
    return _dynamic(head_dim, theta, scaling, max_positions, seq_len)


def rope_attention_factor(scaling: dict[str, Any] | None, max_positions: int | None = None) -> float:
    """Factor multiplying cos and sin: YaRN's ``attention_factor`` (``0.1 ln(factor) + 1`` unless given, or the
    ratio of the two mscales when ``mscale`` and ``mscale_all_dim`` are set), LongRoPE's (``sqrt(1 + ln(factor) /
    ln(original))`` unless given, ``factor`` defaulting to ``max_positions / original``); 1.0 for the other types."""
    if rope_type(scaling) == "longrope":
        assert scaling is not None
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = longrope_original(scaling)
        factor = scaling.get("factor")
        factor = float(factor) if factor is not None else (max_positions or original) / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if rope_type(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_positions if max_positions is not None else 0)

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def yarn_softmax_factor(scaling: dict[str, Any] | None) -> float:
    """Factor on the attention's softmax scale that DeepSeek's MLA adds with scaled RoPE: ``mscale(factor,
    mscale_all_dim)**2`` when the rope type is not ``default`` and ``mscale_all_dim`` is set, else 1.0
    (transformers' ``yarn_apply_mscale`` in ``modeling_deepseek_v3``; the cos/sin factor is
    :func:`rope_attention_factor`)."""
    if rope_type(scaling) == "default" or not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    m = 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
    return m * m


def _cos_sin(freqs: Tensor, attention_factor: float) -> tuple[Tensor, Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]: HF layout, frequencies repeated
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def precompute_rope(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin tables [max_positions, D] in fp32 (YaRN's attention factor applied; ``dynamic``: the plain
    frequencies, valid while the forward's length stays within ``max_positions``)."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions=max_positions).to(device)  # [D/2]
    t = torch.arange(max_positions, device=device, dtype=torch.float32)  # [P]
    return _cos_sin(torch.outer(t, inv_freq), rope_attention_factor(scaling, max_positions))  # [P, D] each


def rope_from_positions(
    position_ids: Tensor, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None,
    *, seq_len: int, inv_freq: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, S, D] in fp32 computed for ``position_ids`` [B, S] (positions beyond the precomputed table, and
    ``dynamic`` frequencies for a forward of length ``seq_len`` = its longest position + 1). ``inv_freq``: the
    frequencies already on the positions' device (not ``dynamic``), which spares a copy from the host."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling, max_positions=max_positions, seq_len=seq_len)
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # [B, S, D/2], HF's product
    return _cos_sin(freqs, rope_attention_factor(scaling, max_positions))


def rotate_half(x: Tensor) -> Tensor:
    """HF LLaMA convention: [x1, x2] -> [-x2, x1] over the last dim halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def pairs_to_halves(x: Tensor) -> Tensor:
    """Rotary dims stored as interleaved pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek) -> LLaMA's halves ``[x0, x2, ...,
    x1, x3, ...]`` over the last dim, so :func:`apply_rotary` rotates each pair by its frequency. Queries and keys
    both permuted: their dot product is unchanged (the result is transformers' ``apply_rotary_pos_emb_interleave``)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotary_pairs_to_halves(x: Tensor, rotary: int) -> Tensor:
    """:func:`pairs_to_halves` of the first ``rotary`` dims of ``x`` [..., D], the rest unchanged (GLM-4's partial
    rotary: transformers' ``apply_rotary_pos_emb`` of ``modeling_glm4`` rotates those pairs)."""
    if rotary == x.shape[-1]:
        return pairs_to_halves(x)
    return torch.cat((pairs_to_halves(x[..., :rotary]), x[..., rotary:]), dim=-1)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q [B, S, N, D] and k [B, S, K, D] with cos/sin [B, S, R] (already gathered by position): all D dims when
    R == D, else the first R (partial rotary, transformers' ``apply_rotary_pos_emb`` of GLM), the rest unchanged."""
    cos = cos.unsqueeze(2).to(q.dtype)  # [B, S, 1, R]
    sin = sin.unsqueeze(2).to(q.dtype)
    r = cos.shape[-1]
    if r < q.shape[-1]:
        (q_rot, q_pass), (k_rot, k_pass) = q.split([r, q.shape[-1] - r], -1), k.split([r, k.shape[-1] - r], -1)
        return (torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), -1),
                torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), -1))
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
