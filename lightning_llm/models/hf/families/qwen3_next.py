"""HF ``config.json`` and weights <-> ours for the hybrid decoders: Qwen3-Next (``Qwen3NextForCausalLM``, MoE), Qwen3.5
(``Qwen3_5ForCausalLM``, dense) and Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``).

They keep LLaMA's block layout and mix two token mixers, as ``layer_types`` lists them (by default three
``linear_attention`` layers, then one ``full_attention``: ``full_attention_interval`` 4):

* ``linear_attn``: Gated DeltaNet (``models/layers/deltanet.py``; our block's ``self_attn``): Qwen3-Next's fused
  ``in_proj_qkvz`` / ``in_proj_ba`` (rows per key head, stored as we hold them), Qwen3.5's ``in_proj_qkv``
  (``[q; k; v]`` rows, permuted to per key head ``[q_g; k_g; v_g]``: :func:`qkv_from_hf`), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``; ``conv1d.weight`` [C, 1, K] (channels ``[q; k; v]``, permuted likewise); ``A_log``,
  ``dt_bias`` (bare tensors; our ``A_log.weight``, ``dt_bias.weight``); ``norm`` (the gated RMSNorm), ``out_proj``;
* ``self_attn``: gated attention: ``q_proj`` holds per head ``[q_h; gate_h]`` (``attention_output_gate``), per-head
  ``q_norm``/``k_norm``, partial rotary (``partial_rotary_factor``, 0.25 when absent; Qwen3.5's multimodal rotary
  sections are plain rotary on text);

every RMSNorm but the gated one scales by ``1 + weight`` (``norm_offset`` 1). Qwen3-Next's MoE layers (those outside
``mlp_only_layers`` and ``decoder_sparse_step``) and Qwen3.5-MoE's (every layer) route by softmax top-k (renormalised:
``norm_topk_prob``, always for Qwen3.5-MoE) with a sigmoid-gated shared expert, as Qwen2-MoE; their experts are
stored per expert. Multi-token-prediction weights (``mtp.*``) are ignored on load, as transformers ignores them.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import Tensor

from ...config import ModelConfig
from ...layers.configs import LinearAttentionConfig, MoEConfig
from ..entries import Entry, lin

log = logging.getLogger(__name__)

__all__ = ["HYBRID_KINDS", "hybrid_adapter_tensor", "hybrid_attention_entries", "hybrid_from_hf", "hybrid_kind",
           "hybrid_module_name", "hybrid_to_hf", "qkv_from_hf", "qkv_to_hf"]

HYBRID_KINDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
"""HF model types of Gated DeltaNet + gated attention decoders."""
_SPLIT = ("qwen3_5_text", "qwen3_5_moe_text")  # in_proj_qkv / z / b / a (Qwen3-Next: in_proj_qkvz / ba)
_MOE_EVERYWHERE = ("qwen3_5_moe_text",)
_MOE_DEFAULTS = {"qwen3_next": (512, 10, 512, 512), "qwen3_5_moe_text": (256, 8, 512, 512)}
"""(experts, top-k, expert width, shared expert width) of transformers' config classes."""


def _linear(c: ModelConfig) -> LinearAttentionConfig:
    assert c.linear_attention is not None
    return c.linear_attention


# ---------------------------------------------------------------------------------------------------- config


def hybrid_from_hf(hf: dict[str, Any], kind: str, num_layers: int) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``kind`` config beyond the LLaMA-layout ones (overriding them)."""
    types = hf.get("layer_types")
    if types is None:  # Qwen3NextConfig: every full_attention_interval-th layer is full attention
        every = int(hf.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise ValueError(f"{kind} config: layer_types {bad} are not built (linear_attention, full_attention)")
    kw: dict[str, Any] = dict(
        head_dim=int(hf.get("head_dim") or 256), max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, norm_offset=1.0,
        attention_output_gate=True, partial_rotary_factor=_partial_rotary(hf), layer_types=list(types),
        linear_attention=None if "linear_attention" not in types else LinearAttentionConfig(
            num_key_heads=int(hf.get("linear_num_key_heads", 16)),
            num_value_heads=int(hf.get("linear_num_value_heads", 32)),
            key_head_dim=int(hf.get("linear_key_head_dim", 128)),
            value_head_dim=int(hf.get("linear_value_head_dim", 128)),
            conv_kernel_size=int(hf.get("linear_conv_kernel_dim", 4)), fused_projections=kind not in _SPLIT))
    if kind in _MOE_DEFAULTS:
        kw["moe"] = _moe(hf, kind, num_layers)
        if kind in _MOE_EVERYWHERE:  # no dense layer: intermediate_size is absent (not an attribute of its config)
            kw["intermediate_size"] = kw["moe"].intermediate_size
    return kw


def _partial_rotary(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return float(0.25 if value is None else value)


def _moe(hf: dict[str, Any], kind: str, num_layers: int) -> MoEConfig:
    experts, top_k, width, shared = _MOE_DEFAULTS[kind]
    if kind in _MOE_EVERYWHERE:
        dense: list[int] = []
    else:
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        only = {int(i) for i in hf.get("mlp_only_layers") or []}
        dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
    return MoEConfig(num_experts=int(hf.get("num_experts", experts)), top_k=int(hf.get("num_experts_per_tok", top_k)),
                     intermediate_size=int(hf.get("moe_intermediate_size", width)),
                     norm_topk_prob=True if kind in _MOE_EVERYWHERE else bool(hf.get("norm_topk_prob", True)),
                     shared_intermediate_size=int(hf.get("shared_expert_intermediate_size", shared)),
                     shared_gate=True, aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), dense_layers=dense)


def hybrid_to_hf(c: ModelConfig, kind: str, hf: dict[str, Any]) -> None:
    """Complete the LLaMA-layout fields ``hf`` of a ``kind`` ``config.json`` (the caller checks representability)."""
    hf.update(head_dim=c.head_dim, attention_bias=c.attention_bias,
              layer_types=list(c.layer_types or ["full_attention"] * c.num_layers))
    la = c.linear_attention
    if la is not None:
        hf.update(linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads,
                  linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                  linear_conv_kernel_dim=la.conv_kernel_size)
    m = c.moe
    if kind in _MOE_DEFAULTS:
        if m is None:
            raise ValueError(f"{kind} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
        hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.intermediate_size,
                  shared_expert_intermediate_size=m.shared_intermediate_size,
                  router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
        if kind not in _MOE_EVERYWHERE:
            hf.update(norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers))
        else:  # no dense layer: its config class has no intermediate_size
            hf.pop("intermediate_size", None)


def hybrid_kind(c: ModelConfig) -> str:
    """The HF family a hybrid decoder of no recorded origin is saved as."""
    if c.moe is None:
        return "qwen3_5_text"
    return "qwen3_next" if _linear(c).fused_projections or c.moe.dense_layers else "qwen3_5_moe_text"


# ---------------------------------------------------------------------------------------------------- weights


def _qkv_sizes(c: ModelConfig) -> tuple[int, int, int]:
    """(key heads, key head width, value rows per key head)."""
    la = _linear(c)
    return la.num_key_heads, la.key_head_dim, la.num_value_heads // la.num_key_heads * la.value_head_dim


def qkv_from_hf(t: Tensor, c: ModelConfig) -> Tensor:
    """Rows (dim 0) ``[q; k; v]`` of a checkpoint's ``in_proj_qkv`` / ``conv1d`` -> ours per key head
    ``[q_g; k_g; v_g]``."""
    hk, dk, vg = _qkv_sizes(c)
    q, k, v = t.split([hk * dk, hk * dk, hk * vg])
    rest = t.shape[1:]
    return torch.cat([q.reshape(hk, dk, *rest), k.reshape(hk, dk, *rest), v.reshape(hk, vg, *rest)], dim=1) \
        .reshape(t.shape).contiguous()


def qkv_to_hf(t: Tensor, c: ModelConfig) -> Tensor:
    """Inverse of :func:`qkv_from_hf`."""
    hk, dk, vg = _qkv_sizes(c)
    rest = t.shape[1:]
    q, k, v = t.reshape(hk, 2 * dk + vg, *rest).split([dk, dk, vg], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]).contiguous()


def _permuted(hf: str, ours: str, c: ModelConfig) -> Entry:
    return Entry(hf, (ours,), split=lambda w: (qkv_from_hf(w, c),), merge=lambda ws: qkv_to_hf(ws[0], c))


def hybrid_attention_entries(c: ModelConfig, p: str) -> list[Entry]:
    """A Gated DeltaNet layer's weights (``p``: ``layers.N``): HF ``linear_attn`` <-> our ``self_attn``."""
    hf, ours = f"{p}.linear_attn", f"{p}.self_attn"
    if _linear(c).fused_projections:
        e = [*lin(f"{hf}.in_proj_qkvz", f"{ours}.in_proj_qkvz", False), *lin(f"{hf}.in_proj_ba", f"{ours}.in_proj_ba",
                                                                               False)]
    else:
        e = [_permuted(f"{hf}.in_proj_qkv.weight", f"{ours}.in_proj_qkv.weight", c)]
        e += [x for name in ("in_proj_z", "in_proj_b", "in_proj_a") for x in lin(f"{hf}.{name}", f"{ours}.{name}",
                                                                                   False)]
    e += [_permuted(f"{hf}.conv1d.weight", f"{ours}.conv1d.weight", c),
          Entry(f"{hf}.A_log", (f"{ours}.A_log.weight",)), Entry(f"{hf}.dt_bias", (f"{ours}.dt_bias.weight",)),
          *lin(f"{hf}.norm", f"{ours}.norm", False), *lin(f"{hf}.out_proj", f"{ours}.out_proj", False)]
    return e


_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.(self_attn|linear_attn)\.")


def hybrid_module_name(c: ModelConfig, name: str, *, to_hf: bool) -> str:
    """A module path of ours <-> the HF model's: a DeltaNet layer's ``self_attn`` is HF's ``linear_attn``."""
    linear = set(c.linear_layers)

    def rename(m: re.Match[str]) -> str:
        kind = "linear_attn" if to_hf and int(m.group(2)) in linear else "self_attn"
        return f"{m.group(1)}layers.{m.group(2)}.{kind}."

    return _LAYER.sub(rename, name)


def hybrid_adapter_tensor(c: ModelConfig, name: str, t: Tensor, *, to_hf: bool) -> Tensor:
    """An adapter tensor (our peft name) in the checkpoint's row order: a LoRA ``lora_B`` on Qwen3.5's
    ``in_proj_qkv`` is permuted as the weight's rows are."""
    atoms = name.split(".")
    if c.linear_attention is not None and "in_proj_qkv" in atoms and "lora_B" in atoms[atoms.index("in_proj_qkv"):]:
        return qkv_to_hf(t, c) if to_hf else qkv_from_hf(t, c)
    return t
