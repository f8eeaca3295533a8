"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2): one of the decoder's attention layers, no parallel code.

Module tree of ``self_attn`` (transformers' names, so checkpoints map one to one)::

    q_proj              Linear [N*Dqk, H]                   (without a query low-rank path: q_lora_rank None)
    q_a_proj            Linear [Rq, H] (bias: attention_bias) (with one: x -> q_a_proj -> q_a_layernorm -> q_b_proj)
    q_a_layernorm       RMSNorm [Rq]
    q_b_proj            Linear [N*Dqk, Rq]
    kv_a_proj_with_mqa  Linear [Rkv + Dr, H] (bias: attention_bias): the latent and the shared rotary key
    kv_a_layernorm      RMSNorm [Rkv]
    kv_b_proj           Linear [N*(Dn + Dv), Rkv]: the latent -> per head its key's non-rotary part and its value
    o_proj              Linear [H, N*Dv] (bias: o_bias)
    rope_key            identity on the rotary key shared by the heads (a tensor-parallel plan sums its gradient)
    core                the attention core (``attention.DotProductAttention``; replaced under context parallelism)

A query head is ``[q_nope (Dn), q_rot (Dr)]``, a key head ``[k_nope (Dn), k_rot (Dr)]`` with ``k_rot`` one rotary key
per token shared by every head, a value head ``Dv`` wide (``Dv`` may differ from ``Dqk = Dn + Dr``: the cores take
values of their own width). The softmax scale is ``Dqk**-0.5`` times DeepSeek's YaRN ``mscale**2``
(``rope.yarn_softmax_factor``). Rows of ``q_proj``/``q_b_proj`` and ``kv_b_proj`` are head-major, so a tensor-parallel
plan splits heads after the up-projections (``parallel_spec``): each rank computes the (small) latents whole and
expands its heads. Head counts are read from the tensors, never from the config.

Decoding caches the **compressed latent** (``[B, 1, T, Rkv]`` normed, and the rotated ``k_rot`` ``[B, 1, T, Dr]``)
through the model's :class:`~lightning_llm.models.decoding.KVCache` (one entry per layer, as transformers' MLA caches it): ``Rkv + Dr``
numbers per token and layer instead of ``N * (Dqk + Dv)`` (DeepSeek-V3: 576 against 40,960); each step expands the
cached latents through ``kv_b_proj``.

Shape legend: B batch, S new tokens, T cached + new tokens, H hidden, N heads (this rank's), Rq/Rkv the ranks.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from ..decoding import KVCache
from .attention import AttentionMask, DotProductAttention, TokenMask
from .block import RMSNorm, init_linear
from .rope import apply_rotary, pairs_to_halves, yarn_softmax_factor

log = logging.getLogger(__name__)

__all__ = ["LatentAttention", "SharedAcrossHeads"]


class SharedAcrossHeads(nn.Identity):
    """The rotary key: one per token, shared by every head. Identity; a declared hook (``ParallelSpec`` tp plan): a
    layout that splits the heads sums this tensor's gradient over the ranks holding them (each computes its heads'
    part), as a column-parallel up-projection's input gradient is summed."""


class LatentAttention(nn.Module):
    """``self_attn`` of an MLA model (see the module docstring); the call of :class:`~.block.Attention`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_rank, self.interleaved = mla.kv_lora_rank, mla.rope_interleave
        self.dropout: float = config.dropout
        h, n, qk = config.hidden_size, config.num_heads, mla.qk_head_dim
        bias = config.attention_bias
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps, kernels=config.kernels)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps, kernels=config.kernels)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * mla.v_head_dim, h, bias=bool(config.o_bias))
        self.scale: float = qk ** -0.5 * yarn_softmax_factor(config.rope_scaling)
        self.rope_key = SharedAcrossHeads()
        self.core = DotProductAttention()

    def reset_parameters(self, std: float) -> None:
        for lin in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            if lin is not None:
                init_linear(lin, std)
        for norm in (self.q_a_layernorm, self.kv_a_layernorm):
            if norm is not None:
                norm.reset_parameters()

    def _queries(self, x: Tensor) -> Tensor:  # [B, S, H] -> [B, S, N, Dqk]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], -1, self.nope + self.rope_dim)

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,  # cos, sin [B, S, Dr]
        attn_mask: AttentionMask = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,  # incremental decoding: the compressed latents, appended in place
        token_mask: TokenMask | None = None,
    ) -> Tensor:  # [B, S, H]
        b, s, _ = x.shape
        q_nope, q_rot = self._queries(x).split([self.nope, self.rope_dim], dim=-1)  # [B, S, N, Dn|Dr]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)  # [B, S, Rkv|Dr]
        latent = self.kv_a_layernorm(latent)
        k_rot = k_rot.unsqueeze(2)  # [B, S, 1, Dr]: one rotary key for every head
        if self.interleaved:
            q_rot, k_rot = pairs_to_halves(q_rot), pairs_to_halves(k_rot)
        if rope is not None:
            q_rot, k_rot = apply_rotary(q_rot, k_rot, rope[0], rope[1])
        latent, k_rot = latent.unsqueeze(1), self.rope_key(k_rot.transpose(1, 2))  # [B, 1, S, Rkv], [B, 1, S, Dr]
        if kv_cache is not None:
            latent, k_rot = kv_cache.update(self, latent, k_rot)  # [B, 1, T, Rkv], [B, 1, T, Dr]
        t = latent.shape[2]
        kv = self.kv_b_proj(latent.squeeze(1)).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)  # [B, N, T, .]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # [B, N, T, Dqk]
        q = torch.cat((q_nope, q_rot), dim=-1).transpose(1, 2)  # [B, N, S, Dqk]
        core_kw = {} if token_mask is None else {"token_mask": token_mask}
        out = self.core(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                        dropout_p=self.dropout if self.training else 0.0, **core_kw)  # [B, N, S, Dv]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def extra_repr(self) -> str:
        return (f"qk_nope={self.nope}, qk_rope={self.rope_dim}, v={self.v_dim}, kv_lora_rank={self.kv_rank}, "
                f"scale={self.scale:.6g}, rope_interleave={self.interleaved}")
