"""Building blocks shared by the decoder and encoder families.

No parallel code lives here. The math of norms, rotary embeddings and activations is in small module-level
functions (``rms_norm``, ``layer_norm``, ``apply_rotary``, ``activation``) so that a fused-kernel integration can swap
them in one place; modules consult ``config.kernels`` (:func:`use_fused_kernel`) to call the fused Triton kernels of
:mod:`lightning_llm.kernels` instead.

Shape legend: B batch, S sequence, H hidden size, N query heads, K key/value heads, D head dim, I MLP width.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm import kernels as fused
from lightning_llm.kernels import resolve_backend

from ..config import ModelConfig
from ..decoding import KVCache
from .attention import AttentionMask, DotProductAttention, TokenMask
from .rope import apply_rotary, precompute_rope, rope_inv_freq, rotary_pairs_to_halves, rotate_half
from .sinks import AttentionSinks

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
    "DotProductAttention",
    "TokenMask",
    "KVCache",
    "MLP",
    "TransformerBlock",
    "init_linear",
    "init_embedding",
    "NormHead",
    "ScaledEmbedding",
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
    """Elementwise activation by config name; gated names use their gate nonlinearity (swiglu->silu, geglu->gelu,
    geglu_tanh->tanh-approximated gelu, HF's ``gelu_pytorch_tanh``)."""
    if name in ("swiglu", "silu"):
        return F.silu(x)
    if name in ("gelu", "geglu"):
        return F.gelu(x)
    if name in ("gelu_tanh", "geglu_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise ValueError(f"unknown activation {name!r}")


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
    """Root-mean-square norm with a learned scale ``weight`` [H]; with ``offset`` the scale is ``offset + weight``
    taken in fp32 (Gemma's and Qwen3-Next's ``(1 + weight)``: ``offset=1``, the weight starting at 0); with
    ``weight_fp32`` the scale is applied in fp32 before the cast (OLMo 2/3's norm), as it is with an offset."""

    def __init__(self, dim: int, eps: float = 1e-6, *, kernels: str = "torch", offset: float = 0.0,
                 weight_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.offset = float(offset)
        self.weight_fp32 = bool(weight_fp32)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))

    @property
    def initial_weight(self) -> float:
        """The weight's initial value: the scale starts at 1."""
        return 1.0 - self.offset

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.initial_weight)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        if not self.offset and not self.weight_fp32:
            if use_fused_kernel(self.kernels, x):
                return fused.rms_norm(x, self.weight, self.eps, backend="triton")
            return rms_norm(x, self.weight, self.eps)
        # as Gemma's norm: the scale applied in fp32, then cast (LLaMA's casts first, then scales)
        backend = "triton" if use_fused_kernel(self.kernels, x) else "torch"
        scale = self.weight.float() + self.offset if self.offset else self.weight.float()
        return fused.rms_norm(x, scale, self.eps, backend=backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (f", offset={self.offset:g}" if self.offset else "")


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
            return fused.layer_norm(x, self.weight, self.bias, self.eps, backend="triton")
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm | LayerNorm:
    """The norm named by ``config.norm`` over ``dim`` (default ``hidden_size``)."""
    dim = config.hidden_size if dim is None else dim
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps, kernels=config.kernels, offset=config.norm_offset,
                       weight_fp32=config.norm_weight_fp32)
    if config.norm == "layernorm":
        return LayerNorm(dim, config.norm_eps, bias=config.norm_bias, kernels=config.kernels)
    raise ValueError(f"unknown norm {config.norm!r}")


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention: q/k/v/o projections, or one fused ``W_pack`` for q, k, v.

    Head counts are derived from the tensors at runtime (``view(B, S, -1, D)``), never from the config, so a
    tensor-parallel plan that shards q/k/v (or W_pack) column-wise over whole heads and o row-wise works unchanged.

    ``W_pack`` (Baichuan, ``config.qkv_packed``) is a real ``nn.Linear`` [3*N*D, H] (so a LoRA on it is peft's LoRA on
    one fused linear), but its rows are stored **head-interleaved**: ``[q_h0, k_h0, v_h0, q_h1, k_h1, v_h1, ...]``
    (each block D rows) instead of the checkpoint's ``[q; k; v]``. The HF mapping permutes the rows on load and
    un-permutes them on save (``hf.families.baichuan.wpack_from_hf`` / ``wpack_to_hf``), as Meta->HF conversion permutes
    rotary rows. Why: any contiguous row shard over whole heads (tensor-parallel ``Shard(0)``, a LoRA ``lora_B``
    sharded the same way) then holds each of its heads' q, k and v, for every degree dividing the heads; a plain
    row shard of ``[q; k; v]`` would give rank 0 all of q and part of k. Checkpoints of every layout hold the one
    interleaved order, so they reshard freely.

    ``rope_interleave`` (GLM-4): the rotary dims of q and k are reordered from pairs to halves before the rotation
    (:func:`~.rope.rotary_pairs_to_halves`), which rotates each pair by its frequency.

    ``q_norm``/``k_norm`` (``config.qk_norm``): RMSNorm of q and k before rotary, over the head dim of every head
    (Qwen3) or over the whole projection, every head at once (OLMoE, ``qk_norm_over="projection"``: weights [N*D],
    [K*D]). ``sinks`` (gpt-oss, ``config.attention_sinks``): a learned logit per query head in the softmax
    (:mod:`.sinks`), handed to the core.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.head_dim is not None and config.num_kv_heads is not None
        self.head_dim: int = config.head_dim
        self.output_gate: bool = config.attention_output_gate
        self.dropout: float = config.dropout
        self.kernels: str = config.kernels
        h, d = config.hidden_size, config.head_dim
        self.W_pack: nn.Linear | None = None
        self.q_proj: nn.Linear | None = None
        self.k_proj: nn.Linear | None = None
        self.v_proj: nn.Linear | None = None
        if config.qkv_packed:
            self.W_pack = nn.Linear(h, 3 * config.num_heads * d, bias=config.attention_bias)  # rows [N, 3, D]
        else:  # with the output gate, each head's rows are [q_h; gate_h] (Qwen3.5, Qwen3-Next)
            self.q_proj = nn.Linear(h, config.num_heads * d * (2 if config.attention_output_gate else 1),
                                    bias=config.attention_bias)
            self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
            self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        whole = config.qk_norm_over == "projection"
        self.norm_heads: bool = not whole  # q_norm/k_norm over each head (else over the whole projection)
        q_dim, k_dim = (config.num_heads * d, config.num_kv_heads * d) if whole else (d, d)
        qk = dict(kernels=config.kernels, offset=config.norm_offset, weight_fp32=config.norm_weight_fp32)
        self.q_norm = RMSNorm(q_dim, config.norm_eps, **qk) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.norm_eps, **qk) if config.qk_norm else None
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=bool(config.o_bias))
        self.sinks = AttentionSinks(config.num_heads) if config.attention_sinks else None
        self.rope_interleave: bool = config.rope_interleave  # GLM-4's rotary pairs (x0, x1), (x2, x3), ...
        self.scale: float | None = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
        self.softcap: float | None = config.attn_logit_softcap
        self.core = DotProductAttention()

    def reset_parameters(self, std: float) -> None:
        for lin in (self.W_pack, self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            if lin is not None:
                init_linear(lin, std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        if self.sinks is not None:
            nn.init.normal_(self.sinks.weight, std=std)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # x [B, S, H] -> q [B, S, N, D], k, v [B, S, K, D]
        b, s, _ = x.shape
        if self.W_pack is not None:
            qkv = self.W_pack(x).view(b, s, -1, 3, self.head_dim)  # [B, S, N, 3, D]: head-interleaved rows
            q, k, v = qkv.unbind(3)
        elif not self.norm_heads and self.q_norm is not None and self.k_norm is not None:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = self.q_norm(self.q_proj(x)).view(b, s, -1, self.head_dim)  # normed over [N*D], then split
            k = self.k_norm(self.k_proj(x)).view(b, s, -1, self.head_dim)
            return q, k, self.v_proj(x).view(b, s, -1, self.head_dim)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q = self.q_proj(x).view(b, s, -1, self.head_dim)
            k = self.k_proj(x).view(b, s, -1, self.head_dim)
            v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,  # cos, sin [B, S, R] (R = config.rotary_dim <= D)
        attn_mask: AttentionMask = None,  # bool [B, N, S, T]-broadcastable (True = attend; T = past + S), or a layout
        is_causal: bool = False,
        kv_cache: KVCache | None = None,  # incremental decoding: past keys/values, appended in place
        token_mask: TokenMask | None = None,  # what attn_mask is made of (for a core replacing the mask)
    ) -> Tensor:  # [B, S, H]
        b, s, _ = x.shape
        gate = None
        if self.output_gate:  # q_proj's rows per head: [q_h; gate_h] (the gate scales the output)
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, gate = self.q_proj(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)  # [B, S, N, D] each
            k = self.k_proj(x).view(b, s, -1, self.head_dim)
            v = self.v_proj(x).view(b, s, -1, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
        else:
            q, k, v = self._qkv(x)  # [B, S, N|K, D]
        if rope is not None and self.rope_interleave:  # pairs -> halves, q and k alike: their dot product is kept
            q, k = rotary_pairs_to_halves(q, rope[0].shape[-1]), rotary_pairs_to_halves(k, rope[0].shape[-1])
        if rope is not None and use_fused_kernel(self.kernels, q) and rope[0].shape[-1] == q.shape[-1]:
            q, k = fused.apply_rotary(q, k, rope[0].to(q.dtype), rope[1].to(q.dtype), backend="triton")
        elif rope is not None:
            q, k = apply_rotary(q, k, rope[0], rope[1])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, N|K, S, D]
        if kv_cache is not None:
            k, v = kv_cache.update(self, k, v)  # [B, K, T, D]
        core_kw: dict[str, Any] = {} if token_mask is None else {"token_mask": token_mask}
        if self.sinks is not None:  # only passed where the layer has sinks, so other cores keep their call
            core_kw["sinks"] = self.sinks()
        if self.scale is not None:  # likewise: a softmax scale of the layer's own (Gemma's query_pre_attn_scalar)
            core_kw["scale"] = self.scale
        if self.softcap is not None:  # Gemma 2's soft-capped scores
            core_kw["softcap"] = self.softcap
        out = self.core(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                        dropout_p=self.dropout if self.training else 0.0, **core_kw)  # [B, N, S, D]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [B, S, N*D]
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o_proj(out)


class MLP(nn.Module):
    """Gated (``down(act(gate(x)) * up(x))``) or plain (``down(act(up(x)))``) feed-forward (of ``intermediate_size``,
    default the config's: a shared expert of an MoE layer has its own)."""

    def __init__(self, config: ModelConfig, *, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.act: str = config.activation
        self.kernels: str = config.kernels
        h = config.hidden_size
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias) if config.gated else None
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            if lin is not None:
                init_linear(lin, std)

    def forward(self, x: Tensor) -> Tensor:  # [B, S, H] -> [B, S, H]
        if self.gate_proj is not None and use_fused_kernel(self.kernels, x):
            gate, up = self.gate_proj(x), self.up_proj(x)
            if self.act == "swiglu":
                h = fused.swiglu(gate, up, backend="triton")  # [B, S, I]
            else:
                approximate = "tanh" if self.act == "geglu_tanh" else "none"
                h = fused.geglu(gate, up, approximate=approximate, backend="triton")
        elif self.gate_proj is not None:
            h = activation(self.act, self.gate_proj(x)) * self.up_proj(x)  # [B, S, I]
        else:
            h = activation(self.act, self.up_proj(x))  # [B, S, I]
        return self.down_proj(h)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (what multiplying by a 0-dim tensor of that dtype multiplies by)."""
    return float(torch.tensor(value, dtype=dtype))


class ScaledEmbedding(nn.Embedding):
    """Token embedding whose rows are multiplied by ``scale`` rounded to the weight's dtype (Gemma's
    ``embed_scale = sqrt(hidden_size)``, ``config.scale_embeddings``): ``embedding(ids) * dtype(scale)``, as
    transformers' ``Gemma*TextScaledWordEmbedding`` computes it. Still an ``nn.Embedding`` (a tensor-parallel plan
    shards its rows as any embedding's: the product is taken on the partial rows, zero where a rank holds none)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)

    def forward(self, input: Tensor) -> Tensor:  # [B, S] -> [B, S, H]
        # the scale rounded to the weight's dtype, as a Python number (no tensor made per call)
        return super().forward(input) * _rounded(self.scale, self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"


class NormHead(nn.Linear):
    """LM head whose weight rows are L2-normalised in forward (Baichuan2 ``NormHead``): ``x @ normalize(W).T``.

    The stored weight [V, H] stays the raw parameter (what Baichuan2 checkpoints hold and what is trained); the
    normalisation is per vocabulary row, so it runs unchanged on a vocab-sharded weight (tensor parallelism).
    """

    def effective_weight(self) -> Tensor:
        """The weight the input is multiplied by: rows L2-normalised [V, H] (what a fused LM-head loss reads)."""
        return F.normalize(self.weight, dim=-1)

    def forward(self, x: Tensor) -> Tensor:  # [B, S, H] -> [B, S, V]
        return F.linear(x, self.effective_weight(), self.bias)


def _same(x: Tensor) -> Tensor:
    return x


def _normed(norm: nn.Module | None, x: Tensor) -> Tensor:
    return x if norm is None else norm(x)


class TransformerBlock(nn.Module):
    """One layer. pre_norm: x + attn(norm(x)), x + mlp(norm(x)); post_norm (BERT): norm(x + attn(x)), norm(x + mlp(x)).
    Pre-LN blocks may also norm each branch's output (``branch_output_norm``: x + out_norm(attn(norm(x))), GLM-4) and
    leave its input unnormed (``branch_input_norm=False``: x + out_norm(attn(x)), OLMo 2/3); absent norms are None.

    ``mlp``: the feed-forward, default a dense :class:`MLP`; a decoder's MoE layers pass their
    :class:`~lightning_llm.models.layers.moe.MoEBlock`, which takes the forward's ``routing=`` input. ``attn``: the attention
    layer, default :class:`Attention`; a decoder passes another kind (``mla.LatentAttention``) with the same call."""

    def __init__(self, config: ModelConfig, *, mlp: nn.Module | None = None, attn: nn.Module | None = None) -> None:
        super().__init__()
        self.pre_norm: bool = config.pre_norm
        inputs = config.branch_input_norm or not config.pre_norm
        self.attn_norm: nn.Module | None = build_norm(config) if inputs else None
        self.self_attn = Attention(config) if attn is None else attn
        self.attn_out_norm: nn.Module | None = build_norm(config) if config.branch_output_norm else None
        self.mlp_norm: nn.Module | None = build_norm(config) if inputs else None
        self.mlp = MLP(config) if mlp is None else mlp
        self.mlp_out_norm: nn.Module | None = build_norm(config) if config.branch_output_norm else None
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self, std: float) -> None:
        for norm in (self.attn_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm):
            if norm is not None:
                norm.reset_parameters()
        self.self_attn.reset_parameters(std)
        self.mlp.reset_parameters(std)

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        attn_mask: AttentionMask = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        token_mask: TokenMask | None = None,
        routing: Any = None,  # an MoE feed-forward's RoutingInput (only passed to a block whose mlp takes it)
    ) -> Tensor:  # [B, S, H]
        attn = dict(rope=rope, attn_mask=attn_mask, is_causal=is_causal)
        mlp = dict(routing=routing) if routing is not None else {}
        if kv_cache is not None:  # only passed when decoding, so wrapped/patched attention modules keep working
            attn["kv_cache"] = kv_cache
        if token_mask is not None:  # likewise: only a decoder forward with a declared mask passes it
            attn["token_mask"] = token_mask
        drop = self.dropout if self.training else _same  # eval (decoding): no module call for an identity
        if self.pre_norm:
            x = x + drop(_normed(self.attn_out_norm, self.self_attn(_normed(self.attn_norm, x), **attn)))
            x = x + drop(_normed(self.mlp_out_norm, self.mlp(_normed(self.mlp_norm, x), **mlp)))
        else:
            assert self.attn_norm is not None and self.mlp_norm is not None
            x = self.attn_norm(x + drop(self.self_attn(x, **attn)))
            x = self.mlp_norm(x + drop(self.mlp(x, **mlp)))
        return x
