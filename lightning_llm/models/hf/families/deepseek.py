"""DeepSeek-V2 (``DeepseekV2ForCausalLM``) and DeepSeek-V3/R1, Kimi-K2 (``DeepseekV3ForCausalLM``): the LLaMA layout of
a block (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``) with

===========  =========================================================================================================
deepseek_v2  Multi-head Latent Attention (``config.mla``; rotary dims in interleaved pairs); softmax routers, greedy
             or ``group_limited_greedy`` (groups ranked by their best score), no renormalisation
deepseek_v3  MLA (``rope_interleave``); sigmoid router with ``e_score_correction_bias`` (aux-free balancing) and
             group-limited choice (groups ranked by their two best scores), renormalised (``norm_topk_prob``)
===========  =========================================================================================================

Both (and GLM-4.5, :mod:`.glm4_moe`, derived from V3): the first ``first_k_dense_replace`` layers dense, the rest MoE
with ``n_shared_experts`` shared experts (one MLP of ``n_shared_experts x moe_intermediate_size``:
``mlp.shared_experts``) beside the routed ones, weights times ``routed_scaling_factor``. transformers computes no
load-balancing loss for them (``aux_loss_coef`` 0: a run may add ours, ``--model.router_aux_loss_coef``), and builds
no multi-token-prediction layers (``num_nextn_predict_layers``: their checkpoint keys are ignored on load, as
transformers ignores them; exports hold none).
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from ...config import ModelConfig
from ...layers.configs import MLAConfig, MoEConfig
from ..record.entries import Entry, lin
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS, Unbuilt, one_of
from .llama import Llama

log = logging.getLogger(__name__)

__all__ = ["DeepseekV2", "DeepseekV3", "RECORDS"]

_LAYER = re.compile(r"layers\.(\d+)\.")
_ROUTER = dict(scoring="sigmoid", num_groups=2, topk_groups=1, norm_topk_prob=True, score_bias=True,
               shared_intermediate_size=32, dense_layers=[0], aux_loss_coef=0.0)


class DeepseekV2(Llama):
    model_type = "deepseek_v2"
    label = "DeepSeek-V2"
    group = "moe"
    classes = decoder_classes("DeepseekV2")
    shared_expert = "shared_experts"
    module_renames = ((".mlp.shared_expert.", ".mlp.shared_experts."),)
    peft_reroutes_mlp = True
    unbuilt = (
        PLAIN_WEIGHTS,
        Unbuilt("scoring_func", one_of("softmax"), "DeepSeek-V2's routers score experts by softmax"),
        Unbuilt("topk_method", one_of("greedy", "group_limited_greedy"), "DeepSeek-V2's routers: greedy, "
                "group_limited_greedy"),
        Unbuilt("norm_topk_prob", one_of(False), "transformers' DeepseekV2 router never renormalises the top-k "
                "weights (they are the softmax scores times routed_scaling_factor)"),
        Unbuilt("moe_layer_freq", one_of(1), "every layer from first_k_dense_replace on is an MoE layer"),
        Unbuilt("num_experts_per_tok", lambda v: isinstance(v, int) and v >= 1, "a number of experts per token"),
    )
    defaults: ClassVar[dict[str, Any]] = dict(
        n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, first_k_dense_replace=0,
        routed_scaling_factor=1.0, topk_method="greedy", n_group=None, topk_group=None, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    """transformers' config-class defaults of the keys read here (a config.json may omit them)."""
    mtp_layers: ClassVar[bool] = False
    """Its checkpoints may hold multi-token-prediction layers after the last one (``num_nextn_predict_layers``)."""

    def get(self, hf: dict[str, Any], key: str) -> Any:
        return hf[key] if key in hf else self.defaults[key]

    # ------------------------------------------------------------------------------------------------ config

    def moe_from_hf(self, hf: dict[str, Any], num_layers: int) -> MoEConfig:
        width = int(self.get(hf, "moe_intermediate_size"))
        kw: dict[str, Any] = dict(
            num_experts=int(self.get(hf, "n_routed_experts")), top_k=int(self.get(hf, "num_experts_per_tok")),
            intermediate_size=width, routed_scaling_factor=float(self.get(hf, "routed_scaling_factor")),
            shared_intermediate_size=int(self.get(hf, "n_shared_experts") or 0) * width, aux_loss_coef=0.0,
            dense_layers=list(range(min(int(self.get(hf, "first_k_dense_replace") or 0), num_layers))))
        kw.update(self.router_from_hf(hf))
        for key in ("aux_loss_alpha", "seq_aux"):
            if hf.get(key):
                log.warning("%s=%s (DeepSeek's sequence-wise balance loss) is not applied, as transformers does not "
                            "apply it: --model.router_aux_loss_coef adds transformers' load-balancing loss", key,
                            hf[key])
        return MoEConfig(**kw)

    def router_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The router's :class:`MoEConfig` fields."""
        limited = self.get(hf, "topk_method") == "group_limited_greedy"
        return dict(scoring="softmax", norm_topk_prob=False, score_bias=False, group_score="max",
                    num_groups=int(self.get(hf, "n_group")) if limited else 1,
                    topk_groups=int(self.get(hf, "topk_group")) if limited else 1)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        q_rank = self.get(hf, "q_lora_rank")
        return dict(mla=MLAConfig(
            kv_lora_rank=int(self.get(hf, "kv_lora_rank")), q_lora_rank=None if q_rank is None else int(q_rank),
            qk_nope_head_dim=int(self.get(hf, "qk_nope_head_dim")),
            qk_rope_head_dim=int(self.get(hf, "qk_rope_head_dim")), v_head_dim=int(self.get(hf, "v_head_dim")),
            rope_interleave=self.rope_interleave(hf)),
            head_dim=None, num_kv_heads=None, attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=self.mlp_bias(hf))

    def rope_interleave(self, hf: dict[str, Any]) -> bool:
        """MLA's rotary dims in interleaved pairs (DeepSeek-V2: always)."""
        return True

    def mlp_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("mlp_bias", False))

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        m = c.moe
        if m is None:
            raise ValueError(f"{self.model_type} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
        first = len(m.dense_layers)
        shared, rest = divmod(m.shared_intermediate_size, m.intermediate_size)
        if m.dense_layers != list(range(first)) or rest:
            raise ValueError(f"config is not representable as {self.model_type}: dense layers {m.dense_layers} (must "
                             f"be the first ones) / shared expert width {m.shared_intermediate_size} (a multiple of "
                             f"{m.intermediate_size})")
        hf: dict[str, Any] = dict(
            n_routed_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.intermediate_size,
            n_shared_experts=shared, first_k_dense_replace=first, routed_scaling_factor=m.routed_scaling_factor,
            n_group=m.num_groups, topk_group=m.topk_groups, norm_topk_prob=m.norm_topk_prob,
            attention_bias=c.attention_bias, output_router_logits=False)
        hf.update(self.own_to_hf(c))
        a = c.mla
        if a is None:
            hf.update(use_qk_norm=c.qk_norm)
            return hf
        hf.update(kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim, head_dim=a.qk_rope_head_dim,
                  num_key_value_heads=c.num_heads)
        if "rope_interleave" in self.defaults:  # a key of its config (DeepSeek-V2's pairs are fixed)
            hf.update(rope_interleave=a.rope_interleave)
        return hf

    def own_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The family's own keys."""
        assert c.moe is not None
        return dict(topk_method="group_limited_greedy" if c.moe.num_groups > 1 else "greedy", mlp_bias=c.mlp_bias)

    # ------------------------------------------------------------------------------------------------ weights

    def attention_entries(self, c: ModelConfig, p: str, layer: int) -> list[Entry]:
        """Multi-head Latent Attention's projections and latent norms (``mla.LatentAttention``: transformers'
        names)."""
        if c.mla is None:
            return super().attention_entries(c, p, layer)
        bias = c.attention_bias  # on the down-projections from the hidden state (and o_proj: o_bias)
        names = [("q_proj", False)] if c.mla.q_lora_rank is None else [
            ("q_a_proj", bias), ("q_a_layernorm", False), ("q_b_proj", False)]
        names += [("kv_a_proj_with_mqa", bias), ("kv_a_layernorm", False), ("kv_b_proj", False)]
        e = [x for name, b in names for x in lin(f"{p}.self_attn.{name}", f"{p}.self_attn.{name}", b)]
        return e + lin(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", bool(c.o_bias))

    def ignored_key(self, c: ModelConfig, key: str) -> bool:
        m = _LAYER.match(key)
        return self.mtp_layers and m is not None and int(m.group(1)) >= c.num_layers


class DeepseekV3(DeepseekV2):
    model_type = "deepseek_v3"
    label = "DeepSeek-V3/R1, Kimi-K2"
    classes = decoder_classes("DeepseekV3")
    guess_rank = 10  # Multi-head Latent Attention
    unbuilt = (
        PLAIN_WEIGHTS,
        Unbuilt("scoring_func", one_of("sigmoid"), "DeepSeek-V3's router scores experts by sigmoid"),
        Unbuilt("topk_method", one_of("noaux_tc"), "DeepSeek-V3's router is noaux_tc: group-limited top-k on the "
                "sigmoid scores plus e_score_correction_bias"),
        Unbuilt("moe_layer_freq", one_of(1), "every layer from first_k_dense_replace on is an MoE layer"),
    )
    defaults = dict(n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3,
                    routed_scaling_factor=2.5, n_group=8, topk_group=4, num_experts_per_tok=8, norm_topk_prob=True,
                    kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    rope_interleave=True)
    max_positions = 4096
    mtp_layers = True
    # DeepSeek-V3-shaped at test size (MLA with a query low-rank path, sigmoid router with groups and a correction
    # bias, a shared expert, the first layer dense); the shape of DeepSeek-V3 itself (estimates: 671B parameters, 37B
    # active)
    sizes = {
        "debug-deepseek-v3": dict(
            LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128,
            max_position_embeddings=256, norm_eps=1e-6,
            mla=dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=dict(_ROUTER, num_experts=8, top_k=2, intermediate_size=32, routed_scaling_factor=2.5)),
        "deepseek-v3": dict(
            LLAMA_SIZE, vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, intermediate_size=18432,
            max_position_embeddings=163840, norm_eps=1e-6,
            rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
            moe=dict(num_experts=256, top_k=8, intermediate_size=2048, scoring="sigmoid", num_groups=8, topk_groups=4,
                     norm_topk_prob=True, routed_scaling_factor=2.5, score_bias=True, shared_intermediate_size=2048,
                     dense_layers=[0, 1, 2], aux_loss_coef=0.0)),
    }
    tiny = "debug-deepseek-v3"

    def guess(self, c: ModelConfig) -> bool:
        return c.mla is not None

    def router_from_hf(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(scoring="sigmoid", norm_topk_prob=bool(self.get(hf, "norm_topk_prob")), score_bias=True,
                    num_groups=int(self.get(hf, "n_group") or 1), topk_groups=int(self.get(hf, "topk_group") or 1))

    def rope_interleave(self, hf: dict[str, Any]) -> bool:
        return bool(self.get(hf, "rope_interleave"))

    def mlp_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def own_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(num_nextn_predict_layers=0)  # the export holds no multi-token-prediction layers


RECORDS = (DeepseekV2(), DeepseekV3())
