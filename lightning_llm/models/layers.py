"""Building blocks shared by the decoder and encoder families.

No parallel code lives here. The math of norms, rotary embeddings and activations is in small module-level
functions (``rms_norm``, ``layer_norm``, ``apply_rotary``, ``activation``) so that a fused-kernel integration can swap
them in one place; modules consult ``config.kernels`` (:func:`use_fused_kernel`) to call the fused Triton kernels of
:mod:`lightning_llm.kernels` instead.

Shape legend: B batch, S sequence, H hidden size, N query heads, K key/value heads, D head dim, I MLP width.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .config import ModelConfig

log = logging.getLogger(__name__)

__all__ = [
    "RMSNorm",
    "LayerNorm",
    "build_norm",
    "rms_norm",
    "layer_norm",
    "activation",
    "rope_inv_freq",
    "precompute_rope",
    "rotate_half",
    "apply_rotary",
    "Attention",
    "KVCache",
    "MLP",
    "TransformerBlock",
    "init_linear",
    "init_embedding",
    "causal_padding_mask",
    "key_padding_mask",
]


# --------------------------------------------------------------------------------------------------------------------
# Pure functions (the kernel swap points)
# --------------------------------------------------------------------------------------------------------------------


def use_fused_kernel(kernels: str, x: Tensor) -> bool:
    """Whether a module configured with ``kernels`` (auto|triton|torch) runs its fused Triton kernel on ``x``.

    DTensor activations (tensor/sequence parallel) keep the torch path: the kernels are plain autograd
    Functions over local tensors, and DTensor's sharding propagation needs aten ops.
    """
    if kernels == "torch" or isinstance(x, DTensor):
        return False
    from lightning_llm.kernels import resolve_backend

    return resolve_backend(kernels, x) == "triton"


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm exactly as HF LLaMA: statistics in fp32, scale applied in the input dtype. x [..., H] -> [..., H]."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim. x [..., H] -> [..., H]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def activation(name: str, x: Tensor) -> Tensor:
    """Elementwise activation by config name; gated names use their gate nonlinearity (swiglu->silu, geglu->gelu)."""
    if name in ("swiglu", "silu"):
        return F.silu(x)
    if name in ("gelu", "geglu"):
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation {name!r}")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> Tensor:
    """Inverse frequencies [D/2] in fp32, bit-identical to HF's default / linear / llama3 rope initialisation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def precompute_rope(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """cos, sin tables [max_positions, D] in fp32 (HF layout: frequencies repeated as cat(freqs, freqs))."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [D/2]
    t = torch.arange(max_positions, device=device, dtype=torch.float32)  # [P]
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    """HF LLaMA convention: [x1, x2] -> [-x2, x1] over the last dim halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate q [B, S, N, D] and k [B, S, K, D] with cos/sin [B, S, D] (already gathered by position)."""
    cos = cos.unsqueeze(2).to(q.dtype)  # [B, S, 1, D]
    sin = sin.unsqueeze(2).to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --------------------------------------------------------------------------------------------------------------------
# Init helpers
# --------------------------------------------------------------------------------------------------------------------


def init_linear(linear: nn.Linear, std: float) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def init_embedding(emb: nn.Embedding, std: float) -> None:
    nn.init.normal_(emb.weight, mean=0.0, std=std)


# --------------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale ``weight`` [H]."""

    def __init__(self, dim: int, eps: float = 1e-6, *, kernels: str = "torch") -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        if use_fused_kernel(self.kernels, x):
            from lightning_llm import kernels

            return kernels.rms_norm(x, self.weight, self.eps, backend="triton")
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm with ``weight`` and ``bias`` [H] (same parameter names as ``nn.LayerNorm``)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, kernels: str = "torch") -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        if use_fused_kernel(self.kernels, x):
            from lightning_llm import kernels

            return kernels.layer_norm(x, self.weight, self.bias, self.eps, backend="triton")
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm | LayerNorm:
    """The norm named by ``config.norm`` over ``dim`` (default ``hidden_size``)."""
    dim = config.hidden_size if dim is None else dim
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps, kernels=config.kernels)
    if config.norm == "layernorm":
        return LayerNorm(dim, config.norm_eps, kernels=config.kernels)
    raise ValueError(f"unknown norm {config.norm!r}")


class KVCache:
    """Keys/values of the tokens seen so far, per attention module, for incremental decoding.

    Each :class:`Attention` appends its new keys/values [B, K, S_new, D] (after rotary) under its own identity,
    so one cache object serves a whole model without layer indices. ``reorder`` selects batch rows (beam search).
    """

    def __init__(self) -> None:
        self._kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.seq_len = 0
        """Tokens cached so far (set by the model after each forward)."""

    def update(self, owner: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v [B, K, S_new, D] for ``owner``; returns all keys/values [B, K, S_past + S_new, D]."""
        past = self._kv.get(id(owner))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        self._kv[id(owner)] = (k, v)
        return k, v

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` [B'] (in that order) of every cached tensor."""
        self._kv = {key: (k.index_select(0, index), v.index_select(0, index)) for key, (k, v) in self._kv.items()}


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with separate q/k/v/o projections.

    Head counts are derived from the tensors at runtime (``view(B, S, -1, D)``), never from the config, so a
    tensor-parallel plan that shards q/k/v column-wise and o row-wise works unchanged.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.head_dim is not None and config.num_kv_heads is not None
        self.head_dim: int = config.head_dim
        self.dropout: float = config.dropout
        self.kernels: str = config.kernels
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.attention_bias)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            init_linear(lin, std)

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,  # cos, sin [B, S, D]
        attn_mask: Tensor | None = None,  # bool, broadcastable to [B, N, S, T]; True = attend (T = past + S)
        is_causal: bool = False,
        kv_cache: KVCache | None = None,  # incremental decoding: past keys/values, appended in place
    ) -> Tensor:  # [B, S, H]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # [B, S, N, D]
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # [B, S, K, D]
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # [B, S, K, D]
        if rope is not None and use_fused_kernel(self.kernels, q):
            from lightning_llm import kernels

            q, k = kernels.apply_rotary(q, k, rope[0].to(q.dtype), rope[1].to(q.dtype), backend="triton")
        elif rope is not None:
            q, k = apply_rotary(q, k, rope[0], rope[1])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N|K, S, D]
        if kv_cache is not None:
            k, v = kv_cache.update(self, k, v)  # [B, K, T, D]
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # GQA: kv head j serves query heads j*n_rep .. (j+1)*n_rep-1 (HF repeat_kv)
            k = k.repeat_interleave(n_rep, dim=1)  # [B, N, S, D]
            v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and attn_mask is None,
        )  # [B, N, S, D]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [B, S, N*D]
        return self.o_proj(out)


class MLP(nn.Module):
    """Gated (``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``) feed-forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.act: str = config.activation
        self.kernels: str = config.kernels
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias) if config.gated else None
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            if lin is not None:
                init_linear(lin, std)

    def forward(self, x: Tensor) -> Tensor:  # [B, S, H] -> [B, S, H]
        if self.gate_proj is not None and use_fused_kernel(self.kernels, x):
            from lightning_llm import kernels

            fused = kernels.swiglu if self.act == "swiglu" else kernels.geglu
            h = fused(self.gate_proj(x), self.up_proj(x), backend="triton")  # [B, S, I]
        elif self.gate_proj is not None:
            h = activation(self.act, self.gate_proj(x)) * self.up_proj(x)  # [B, S, I]
        else:
            h = activation(self.act, self.up_proj(x))  # [B, S, I]
        return self.down_proj(h)


class TransformerBlock(nn.Module):
    """One layer. pre_norm: x + attn(norm(x)), x + mlp(norm(x)); post_norm (BERT): norm(x + attn(x)), norm(x + mlp(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.pre_norm: bool = config.pre_norm
        self.attn_norm = build_norm(config)
        self.self_attn = Attention(config)
        self.mlp_norm = build_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self, std: float) -> None:
        self.attn_norm.reset_parameters()
        self.self_attn.reset_parameters(std)
        self.mlp_norm.reset_parameters()
        self.mlp.reset_parameters(std)

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
    ) -> Tensor:  # [B, S, H]
        attn = dict(rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        if kv_cache is not None:  # only passed when decoding, so wrapped/patched attention modules keep working
            attn["kv_cache"] = kv_cache
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.attn_norm(x), **attn))
            x = x + self.dropout(self.mlp(self.mlp_norm(x)))
        else:
            x = self.attn_norm(x + self.dropout(self.self_attn(x, **attn)))
            x = self.mlp_norm(x + self.dropout(self.mlp(x)))
        return x


# --------------------------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------------------------


def causal_padding_mask(attention_mask: Tensor, seq_len: int) -> Tensor:
    """Boolean attend-mask [B, 1, S, T] = causal AND key-not-padding, from a padding mask [B, T] (1/True = token).

    ``T`` may exceed ``S`` when decoding with a KV cache: the S queries are then the last S of the T positions.
    Query rows that would attend to nothing (left-padded positions) are allowed to attend to themselves, so SDPA
    never produces NaN; their outputs are meaningless and should be ignored by the loss.
    """
    device = attention_mask.device
    total = attention_mask.shape[-1]
    offset = total - seq_len  # cached positions before the first query
    keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
    causal = torch.ones(seq_len, total, dtype=torch.bool, device=device).tril(diagonal=offset)  # [S, T]
    mask = causal[None, None] & keep  # [B, 1, S, T]
    empty = ~mask.any(dim=-1, keepdim=True)  # [B, 1, S, 1]
    rows = torch.arange(seq_len, device=device)
    eye = torch.zeros(seq_len, total, dtype=torch.bool, device=device)
    eye[rows, rows + offset] = True  # each query's own position
    eye = eye[None, None]  # [1, 1, S, T]
    return mask | (empty & eye)


def key_padding_mask(attention_mask: Tensor) -> Tensor:
    """Boolean attend-mask [B, 1, 1, S] from a padding mask [B, S]; an all-padding row attends everywhere (no NaN)."""
    keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]
    return keep | ~keep.any(dim=-1, keepdim=True)
