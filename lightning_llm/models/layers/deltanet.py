"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next (three of every four layers there), a
recurrent state per value head instead of a KV cache.

A layer (``GatedDeltaNet``, a block's ``self_attn`` where ``config.layer_types`` says ``"linear_attention"``; the
call of ``block.Attention``)::

    q, k, v, z, b, a = projections of x           (padding rows zeroed, as transformers zeroes them)
    q, k, v = silu(causal depthwise conv(q, k, v))  (kernel ``conv_kernel_size``, over the channels [q_g, k_g, v_g])
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   (fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, beta)        (``kernels/delta_rule.py``)
    out = out_proj(rmsnorm(o) * silu(z))                          (per value head; the norm's weight starts at 1)

**Layout.** The projections keep transformers' module names: Qwen3-Next's fused ``in_proj_qkvz`` (rows per key head
``g``: ``[q_g, k_g, v_g (r heads), z_g (r heads)]``, ``r = Hv / Hk``) and ``in_proj_ba`` (``[b_g, a_g]``), as its
checkpoints store them; Qwen3.5's ``in_proj_qkv`` (rows per key head ``[q_g, k_g, v_g]``: the checkpoint's
``[q; k; v]`` permuted at load), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``. The convolution's channels are per key
head too (``[q_g, k_g, v_g]``; the checkpoint's ``[q; k; v]`` permuted). So every output row block of a key head is
contiguous: a tensor-parallel row shard (or a LoRA's ``lora_B`` sharded so) holds whole key heads with their value
heads, for any degree dividing the key heads. ``A_log``, ``dt_bias`` and the convolution's weight are
:class:`HeadWeights` (called with nothing, they return their tensor: ``tp_plans.HeadSharded`` splits them with
the heads).

**Rows.** The decoder hands the layer a :class:`RecurrentRows` as its ``attn_mask``: padding (zeroed before the
convolution, so left padding leaves the state at zero) and packed rows' ``segment_ids`` (the convolution and the
state restart at each document). **Decoding**: the cache keeps per layer the last ``K - 1`` convolution inputs and the
state ``[B, Hv, Dk, Dv]`` (fp32) (``cache.state(owner)`` / ``cache.set_state(owner, states)``,
``models/decoding.py``); one new token takes the recurrent step.

Shapes: B batch, S tokens, H hidden, Hk key heads (``G`` groups), Hv value heads, Dk / Dv head widths, C = Hk *
(2 Dk + r Dv) convolution channels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_llm.kernels.delta_rule import (
    causal_conv1d,
    fla_applies,
    gated_delta_rule,
    recurrent_gated_delta_rule_step,
    sequence_starts,
)

from ..config import ModelConfig
from .configs import LinearAttentionConfig
from ..decoding import KVCache
from ..init import Init
from .block import RMSNorm, init_linear

__all__ = ["GatedDeltaNet", "HeadWeights", "RecurrentRows", "recurrent_rows"]


@dataclass
class RecurrentRows:
    """What a DeltaNet layer needs of a forward's rows (its ``attn_mask``): ``keep`` [B, S] (False = padding; None:
    every token is real) and ``segment_ids`` [B, S] of packed rows (the state restarts where they change)."""

    keep: Tensor | None = None
    segment_ids: Tensor | None = None
    _cu: list[Tensor] = field(default_factory=list, repr=False)

    def cu_seqlens(self) -> Tensor | None:
        """The documents' cumulative lengths over the flattened rows (fla's varlen kernels), computed once per
        forward (a host read) and shared by the layers; None without ``segment_ids``."""
        if self.segment_ids is None:
            return None
        if not self._cu:
            b, s = self.segment_ids.shape
            self._cu.append(sequence_starts(self.segment_ids, b, s))
        return self._cu[0]


def recurrent_rows(attention_mask: Tensor | None, segment_ids: Tensor | None, new: int) -> RecurrentRows | None:
    """The :class:`RecurrentRows` of a forward of ``new`` tokens (``attention_mask`` [B, T] covers cached + new
    columns; a new token of a decoding step is never padding), or None when every token is real."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("Gated DeltaNet layers take a [B, S] attention_mask (padding), not a 4-D mask")
    keep = None if attention_mask is None or new == 1 else attention_mask[:, -new:].bool()
    if segment_ids is not None:
        keep = segment_ids > 0 if keep is None else keep & (segment_ids > 0)
    return None if keep is None and segment_ids is None else RecurrentRows(keep, segment_ids)


class HeadWeights(nn.Module):
    """One parameter of per-head rows (``shape[0]`` over the heads), returned by calling the module with nothing, so
    a tensor-parallel layout hands the layer its heads' rows (``tp_plans.HeadSharded``). ``init(name, std)``
    declares how it starts (:func:`~lightning_llm.models.init.plan_for_modules` reads ``declared_inits``)."""

    def __init__(self, *shape: int, init: Callable[[str, float], Init]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))
        self.declared_inits = {"weight": init}

    def forward(self) -> Tensor:
        return self.weight


def _normal(name: str, std: float) -> Init:
    return Init.normal(std, key=name)


def _decay_rates(name: str, std: float) -> Init:
    return Init.log_uniform(0.01, 16.0, key=name)  # A = exp(A_log) in [0.01, 16], as transformers draws it


def _ones(name: str, std: float) -> Init:
    return Init.constant(1.0)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (the module docstring) with the call of ``block.Attention``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        la = config.linear_attention
        assert la is not None
        self.cfg: LinearAttentionConfig = la
        self.ratio = la.num_value_heads // la.num_key_heads  # value heads per key head
        self.group = 2 * la.key_head_dim + self.ratio * la.value_head_dim  # conv channels per key head
        h, hk, hv, dv = config.hidden_size, la.num_key_heads, la.num_value_heads, la.value_head_dim
        fused, split = la.fused_projections, not la.fused_projections

        def linear(out: int, built: bool) -> nn.Linear | None:
            return nn.Linear(h, out, bias=False) if built else None

        # Qwen3-Next: [q_g, k_g, v_g, z_g] and [b_g, a_g] per key head
        self.in_proj_qkvz = linear(hk * (self.group + self.ratio * dv), fused)
        self.in_proj_ba = linear(2 * hv, fused)
        # Qwen3.5: [q_g, k_g, v_g] per key head; z, b, a per value head
        self.in_proj_qkv, self.in_proj_z = linear(hk * self.group, split), linear(hv * dv, split)
        self.in_proj_b, self.in_proj_a = linear(hv, split), linear(hv, split)
        self.conv1d = HeadWeights(hk * self.group, 1, la.conv_kernel_size, init=_normal)  # [C, 1, K] depthwise
        self.A_log = HeadWeights(hv, init=_decay_rates)
        self.dt_bias = HeadWeights(hv, init=_ones)
        self.norm = RMSNorm(dv, config.norm_eps, kernels=config.kernels)  # the gated norm's: weight from 1
        self.out_proj = nn.Linear(hv * dv, h, bias=False)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.in_proj_qkvz, self.in_proj_ba, self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                    self.in_proj_a, self.out_proj):
            if lin is not None:
                init_linear(lin, std)
        with torch.no_grad():
            nn.init.normal_(self.conv1d.weight, std=std)
            self.A_log.weight.uniform_(0.01, 16.0).log_()
            self.dt_bias.weight.fill_(1.0)
        self.norm.reset_parameters()

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [B, S, H] -> the convolution's input [B, S, C] (per key head [q_g, k_g, v_g]), z [B, S, Hv', Dv], b and
        a [B, S, Hv'] (this rank's heads)."""
        b, s, _ = x.shape
        dv = self.cfg.value_head_dim
        if self.in_proj_qkvz is not None and self.in_proj_ba is not None:
            qkvz = self.in_proj_qkvz(x).view(b, s, -1, self.group + self.ratio * dv)  # [B, S, G, .]
            qkv, z = qkvz.split([self.group, self.ratio * dv], dim=-1)
            beta, a = self.in_proj_ba(x).view(b, s, -1, 2 * self.ratio).split(self.ratio, dim=-1)
            return qkv.reshape(b, s, -1), z.reshape(b, s, -1, dv), beta.reshape(b, s, -1), a.reshape(b, s, -1)
        assert self.in_proj_qkv is not None and self.in_proj_z is not None
        assert self.in_proj_b is not None and self.in_proj_a is not None
        return self.in_proj_qkv(x), self.in_proj_z(x).view(b, s, -1, dv), self.in_proj_b(x), self.in_proj_a(x)

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        rope: tuple[Tensor, Tensor] | None = None,  # unused: no positions in a recurrence
        attn_mask: object = None,  # RecurrentRows, or None (every token real, one row per sequence)
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        token_mask: object = None,
    ) -> Tensor:  # [B, S, H]
        rows = attn_mask if isinstance(attn_mask, RecurrentRows) else None
        b, s, _ = x.shape
        la, dk, dv = self.cfg, self.cfg.key_head_dim, self.cfg.value_head_dim
        qkv, z, beta, a = self._project(x)
        if rows is not None and rows.keep is not None:  # padding's inputs are zero (the projections have no bias)
            keep = rows.keep.to(qkv.dtype)  # [B, S]
            qkv, z, beta, a = qkv * keep[..., None], z * keep[..., None, None], beta * keep[..., None], \
                a * keep[..., None]
        seg = None if rows is None else rows.segment_ids
        cu = rows.cu_seqlens() if rows is not None and fla_applies(la.kernels, qkv) else None  # fla: a host read
        past = kv_cache.state(self) if kv_cache is not None else None
        conv_state, state = past if past is not None else (None, None)
        mixed, conv_state = causal_conv1d(qkv.transpose(1, 2), self.conv1d(), state=conv_state, segment_ids=seg,
                                          cu_seqlens=cu, backend=la.kernels)  # [B, C, S]
        q, k, v = mixed.transpose(1, 2).view(b, s, -1, self.group).split([dk, dk, self.ratio * dv], dim=-1)
        v = v.reshape(b, s, -1, dv)  # [B, S, Hv', Dv]
        beta = beta.sigmoid()
        g = -self.A_log().float().exp() * F.softplus(a.float() + self.dt_bias())  # [B, S, Hv'] log decay, fp32
        if state is not None and s == 1:
            o, state = recurrent_gated_delta_rule_step(q, k, v, g, beta, state)
        else:
            o, state = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=kv_cache is not None,
                                        segment_ids=seg, cu_seqlens=cu, backend=la.kernels)  # [B, S, Hv', Dv]
        if kv_cache is not None:
            kv_cache.set_state(self, (conv_state, state))
        o = (self.norm(o) * F.silu(z.float())).to(o.dtype)  # transformers' RMSNormGated
        return self.out_proj(o.reshape(b, s, -1))
