"""HF ``config.json`` <-> :class:`ModelConfig` for the DeepSeek-style MoE decoders: DeepSeek-V2
(``DeepseekV2ForCausalLM``), DeepSeek-V3/R1 and Kimi-K2 (``DeepseekV3ForCausalLM``), GLM-4.5/4.6
(``Glm4MoeForCausalLM``).

They keep LLaMA's layout of a block (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) and
differ in:

===========  =========================================================================================================
deepseek_v2  Multi-head Latent Attention (``config.mla``; rotary dims in interleaved pairs); softmax routers, greedy
             or ``group_limited_greedy`` (groups ranked by their best score), no renormalisation
deepseek_v3  MLA (``rope_interleave``); sigmoid router with ``e_score_correction_bias`` (aux-free balancing) and
             group-limited choice (groups ranked by their two best scores), renormalised (``norm_topk_prob``)
glm4_moe     grouped-query attention with partial rotary (``partial_rotary_factor``, 0.5 when absent), q/k/v biases
             (``attention_bias``; o never), optional per-head ``q_norm``/``k_norm`` (``use_qk_norm``); V3's router
===========  =========================================================================================================

All three: the first ``first_k_dense_replace`` layers dense, the rest MoE with ``n_shared_experts`` shared experts
(one MLP of ``n_shared_experts x moe_intermediate_size``: ``mlp.shared_experts``) beside the routed ones, weights
times ``routed_scaling_factor``. transformers computes no load-balancing loss for them (``aux_loss_coef`` 0: a run may
add ours, ``--model.router_aux_loss_coef``), and builds no multi-token-prediction layers (``num_nextn_predict_layers``:
their checkpoint keys are ignored on load, as transformers ignores them; exports hold none).
"""

from __future__ import annotations

import logging
from typing import Any

from ...config import ModelConfig
from ...layers.configs import MLAConfig, MoEConfig
from ..options import refuse_unbuilt

log = logging.getLogger(__name__)

__all__ = ["DEEPSEEK_KINDS", "MLA_KINDS", "MTP_KINDS", "deepseek_from_hf", "deepseek_to_hf", "partial_rotary_factor"]

DEEPSEEK_KINDS = ("deepseek_v2", "deepseek_v3", "glm4_moe")
MLA_KINDS = ("deepseek_v2", "deepseek_v3")
MTP_KINDS = ("deepseek_v3", "glm4_moe")
"""Checkpoints that may hold multi-token-prediction layers after the last one (``num_nextn_predict_layers``)."""

# transformers' config-class defaults of the keys read here (a config.json may omit them)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, first_k_dense_replace=0,
                        routed_scaling_factor=1.0, topk_method="greedy", n_group=None, topk_group=None,
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, max_position_embeddings=2048),
    "deepseek_v3": dict(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3,
                        routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8,
                        norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True, max_position_embeddings=4096),
    "glm4_moe": dict(n_routed_experts=128, n_shared_experts=1, moe_intermediate_size=1408, first_k_dense_replace=1,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                     use_qk_norm=False, max_position_embeddings=131072),
}


def _get(hf: dict[str, Any], kind: str, key: str) -> Any:
    return hf[key] if key in hf else _DEFAULTS[kind][key]


def max_positions(hf: dict[str, Any], kind: str) -> int:
    return int(_get(hf, kind, "max_position_embeddings"))


def _moe(hf: dict[str, Any], kind: str, num_layers: int) -> MoEConfig:
    width = int(_get(hf, kind, "moe_intermediate_size"))
    groups, top_groups = _get(hf, kind, "n_group"), _get(hf, kind, "topk_group")
    kw: dict[str, Any] = dict(
        num_experts=int(_get(hf, kind, "n_routed_experts")), top_k=int(_get(hf, kind, "num_experts_per_tok")),
        intermediate_size=width, routed_scaling_factor=float(_get(hf, kind, "routed_scaling_factor")),
        shared_intermediate_size=int(_get(hf, kind, "n_shared_experts") or 0) * width, aux_loss_coef=0.0,
        dense_layers=list(range(min(int(_get(hf, kind, "first_k_dense_replace") or 0), num_layers))))
    if kind == "deepseek_v2":
        limited = _get(hf, kind, "topk_method") == "group_limited_greedy"
        kw.update(scoring="softmax", norm_topk_prob=False, score_bias=False, group_score="max",
                  num_groups=int(groups) if limited else 1, topk_groups=int(top_groups) if limited else 1)
    else:
        kw.update(scoring="sigmoid", norm_topk_prob=bool(_get(hf, kind, "norm_topk_prob")), score_bias=True,
                  num_groups=int(groups or 1), topk_groups=int(top_groups or 1))
    for key in ("aux_loss_alpha", "seq_aux"):
        if hf.get(key):
            log.warning("%s=%s (DeepSeek's sequence-wise balance loss) is not applied, as transformers does not apply "
                        "it: --model.router_aux_loss_coef adds transformers' load-balancing loss", key, hf[key])
    return MoEConfig(**kw)


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """GLM-4.5's rotary share of a head: ``rope_parameters`` (transformers 5), else the top-level key, else 0.5
    (``Glm4MoeConfig``'s default)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    return float(0.5 if value is None else value)


def deepseek_from_hf(hf: dict[str, Any], kind: str, num_layers: int, *, where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``kind`` config beyond the LLaMA-layout ones (overriding them)."""
    refuse_unbuilt(hf, kind, where)
    kw: dict[str, Any] = dict(moe=_moe(hf, kind, num_layers), max_position_embeddings=max_positions(hf, kind))
    if kind in MLA_KINDS:
        q_rank = _get(hf, kind, "q_lora_rank")
        kw.update(mla=MLAConfig(
            kv_lora_rank=int(_get(hf, kind, "kv_lora_rank")), q_lora_rank=None if q_rank is None else int(q_rank),
            qk_nope_head_dim=int(_get(hf, kind, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(hf, kind, "qk_rope_head_dim")), v_head_dim=int(_get(hf, kind, "v_head_dim")),
            rope_interleave=True if kind == "deepseek_v2" else bool(_get(hf, kind, "rope_interleave"))),
            head_dim=None, num_kv_heads=None, attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)) if kind == "deepseek_v2" else False)
    else:
        kw.update(attention_bias=bool(hf.get("attention_bias", False)), o_bias=False,
                  qk_norm=bool(_get(hf, kind, "use_qk_norm")), partial_rotary_factor=partial_rotary_factor(hf))
    return kw


def deepseek_to_hf(c: ModelConfig, kind: str) -> dict[str, Any]:
    """The ``config.json`` fields of ``kind`` beyond the LLaMA-layout ones (the caller checks representability)."""
    m = c.moe
    if m is None:
        raise ValueError(f"{kind} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
    first = len(m.dense_layers)
    shared, rest = divmod(m.shared_intermediate_size, m.intermediate_size)
    if m.dense_layers != list(range(first)) or rest:
        raise ValueError(f"config is not representable as {kind}: dense layers {m.dense_layers} (must be the first "
                         f"ones) / shared expert width {m.shared_intermediate_size} (a multiple of "
                         f"{m.intermediate_size})")
    hf: dict[str, Any] = dict(
        n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.intermediate_size,
        n_shared_experts=shared, first_k_dense_replace=first, routed_scaling_factor=m.routed_scaling_factor,
        n_group=m.num_groups, topk_group=m.topk_groups, norm_topk_prob=m.norm_topk_prob,
        attention_bias=c.attention_bias, output_router_logits=False)
    if kind == "deepseek_v2":
        hf.update(topk_method="group_limited_greedy" if m.num_groups > 1 else "greedy", mlp_bias=c.mlp_bias)
    else:
        hf.update(num_nextn_predict_layers=0)  # the export holds no multi-token-prediction layers
    if c.mla is not None:
        a = c.mla
        hf.update(kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, head_dim=a.qk_rope_head_dim,
                  num_key_value_heads=c.num_heads)
        if kind == "deepseek_v3":
            hf.update(rope_interleave=a.rope_interleave)
    else:
        hf.update(use_qk_norm=c.qk_norm)
    return hf
