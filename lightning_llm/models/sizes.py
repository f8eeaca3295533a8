"""The named sizes: ``(family, name)`` -> the fields of a :class:`~lightning_llm.models.config.ModelConfig`
(``debug`` for both families, what tests use; the debug sizes of the other families; published sizes), and
:func:`named_config`."""

from __future__ import annotations

import copy
from typing import Any

from .config import Family, ModelConfig


_LLAMA = dict(family="decoder", norm="rmsnorm", activation="swiglu", position="rope", pre_norm=True)
_GPT2 = dict(
    family="decoder", norm="layernorm", norm_eps=1e-5, activation="gelu_tanh", position="learned",
    attention_bias=True, mlp_bias=True, tie_embeddings=True, pre_norm=True,
)
_BERT = dict(
    family="encoder", norm="layernorm", norm_eps=1e-12, activation="gelu", position="learned",
    attention_bias=True, mlp_bias=True, pre_norm=False, embedding_norm=True, final_norm=False,
    type_vocab_size=2, pooler=True, dropout=0.1,
)
_MEGATRON_BERT = dict(_BERT, pre_norm=True, embedding_norm=False, final_norm=True)
_DEBERTA_V3 = dict(_BERT, norm_eps=1e-7, position="none", type_vocab_size=0, pooler_activation="gelu",
                   disentangled=dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256,
                                     share_att_key=True, rel_norm=True), extra={"hf_model_type": "deberta-v2"})
_MODERNBERT = dict(family="encoder", norm="layernorm", norm_eps=1e-5, norm_bias=False, activation="geglu",
                   position="rope", rope_theta=160000.0, sliding_window=128,
                   sliding_rope={"rope_type": "default", "rope_theta": 10000.0},
                   pre_norm=True, embedding_norm=True, final_norm=True, pooler=True, pooler_activation="gelu",
                   pooler_bias=False, pooler_norm=True, extra={"hf_model_type": "modernbert"})

# Named sizes: (family, name) -> fields. `debug` exists for both families and is what tests use.
NAMED_SIZES: dict[tuple[str, str], dict[str, Any]] = {
    ("decoder", "debug"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=256,
    ),
    # Debug sizes of the other decoder families (tests; their HF architecture is the default save target).
    ("decoder", "debug-qwen2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, attention_bias=True, o_bias=False,
        tie_embeddings=True, extra={"hf_model_type": "qwen2"},
    ),
    ("decoder", "debug-qwen3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        extra={"hf_model_type": "qwen3"},
    ),
    ("decoder", "debug-mistral"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, sliding_window=8, extra={"hf_model_type": "mistral"},
    ),
    ("decoder", "debug-baichuan2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, qkv_packed=True, norm_head=True,
        extra={"hf_model_type": "baichuan"},
    ),
    # Qwen3-MoE-shaped (q/k norms, no biases, MoE on every layer, renormalised top-k) at test and CPU sizes, and the
    # shape of Qwen3-30B-A3B (estimates, GPU benchmarks with fewer layers through model_overrides).
    ("decoder", "debug-moe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    # gpt-oss- and OLMoE-shaped at test size: sinks, alternating sliding (window 8) and full layers, YaRN, biased
    # router with a softmax over the chosen top-k, biased experts with the clamped SwiGLU; q/k norms over the whole
    # projection and softmax top-k without renormalisation.
    ("decoder", "debug-gpt-oss"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 64},
        attention_bias=True, attention_sinks=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="softmax_topk", norm_topk_prob=False,
                 router_bias=True, expert_bias=True, swiglu_limit=7.0, aux_loss_coef=0.001),
        extra={"hf_model_type": "gpt_oss"},
    ),
    ("decoder", "debug-olmoe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, qk_norm=True, qk_norm_over="projection",
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False, aux_loss_coef=0.01),
        extra={"hf_model_type": "olmoe"},
    ),
    # Phi-3-, GLM-4-, OLMo-3- and SmolLM3-shaped at test size: Phi-4-mini's partial rotary with LongRoPE whose short
    # range (16) the 32-token blocks pass; GLM-4's rotary pairs, q/k/v biases and norms on both sides of each branch;
    # OLMo 3's output norms, q/k norms over the projection, sliding layers (window 8) with plain RoPE beside YaRN on
    # the full one; SmolLM3's layer without rotary embedding and tied head.
    ("decoder", "debug-phi3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]},
        extra={"hf_model_type": "phi3"},
    ),
    ("decoder", "debug-glm4"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5,
        rope_interleave=True, attention_bias=True, o_bias=False, branch_output_norm=True,
        extra={"hf_model_type": "glm4"},
    ),
    ("decoder", "debug-olmo3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, rope_theta=500000.0, qk_norm=True, qk_norm_over="projection",
        branch_input_norm=False, branch_output_norm=True, norm_weight_fp32=True, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        sliding_rope={"rope_type": "default", "rope_theta": 500000.0}, extra={"hf_model_type": "olmo3"},
    ),
    ("decoder", "debug-smollm3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=2000000.0, nope_layers=[3], tie_embeddings=True,
        extra={"hf_model_type": "smollm3"},
    ),
    # Qwen3.5- and Qwen3-Next-shaped hybrids at test size: three Gated DeltaNet layers, then one gated attention layer
    # (q/k norms, partial rotary 0.25, (1 + weight) norms); Qwen3.5's split projections and dense MLPs, Qwen3-Next's
    # fused projections and MoE with a sigmoid-gated shared expert.
    ("decoder", "debug-qwen3.5"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        norm_offset=1.0, attention_output_gate=True, partial_rotary_factor=0.25,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                              conv_kernel_size=4, fused_projections=False),
        extra={"hf_model_type": "qwen3_5_text"},
    ),
    ("decoder", "debug-qwen3-next"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        norm_offset=1.0, attention_output_gate=True, partial_rotary_factor=0.25,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                              conv_kernel_size=4, fused_projections=True),
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, shared_intermediate_size=32,
                 shared_gate=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_next"},
    ),
    ("decoder", "small-moe"): dict(
        _LLAMA, vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
        intermediate_size=688, max_position_embeddings=1024, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=16, top_k=4, intermediate_size=128, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    ("decoder", "qwen3-30b-a3b"): dict(
        _LLAMA, vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        intermediate_size=6144, max_position_embeddings=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    # DeepSeek-V3-shaped (MLA with a query low-rank path, sigmoid router with groups and a correction bias, a shared
    # expert, the first layer dense) and GLM-4.5-shaped (partial rotary, q/k norms, q/k/v biases, the same router) at
    # test sizes; the shape of DeepSeek-V3 itself (estimates: 671B parameters, 37B active).
    ("decoder", "debug-deepseek-v3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6,
        mla=dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid", num_groups=2, topk_groups=1,
                 norm_topk_prob=True, routed_scaling_factor=2.5, score_bias=True, shared_intermediate_size=32,
                 dense_layers=[0], aux_loss_coef=0.0),
        extra={"hf_model_type": "deepseek_v3"},
    ),
    ("decoder", "debug-glm4-moe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5, qk_norm=True,
        attention_bias=True, o_bias=False,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid", num_groups=2, topk_groups=1,
                 norm_topk_prob=True, routed_scaling_factor=1.0, score_bias=True, shared_intermediate_size=32,
                 dense_layers=[0], aux_loss_coef=0.0),
        extra={"hf_model_type": "glm4_moe"},
    ),
    ("decoder", "deepseek-v3"): dict(
        _LLAMA, vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, intermediate_size=18432,
        max_position_embeddings=163840, norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=dict(num_experts=256, top_k=8, intermediate_size=2048, scoring="sigmoid", num_groups=8, topk_groups=4,
                 norm_topk_prob=True, routed_scaling_factor=2.5, score_bias=True, shared_intermediate_size=2048,
                 dense_layers=[0, 1, 2], aux_loss_coef=0.0),
        extra={"hf_model_type": "deepseek_v3"},
    ),
    # Gemma 2- and Gemma 3-shaped at test size: (1 + weight) norms, four per layer, the embedding scaled, GeGLU, a
    # softmax scale of its own, sliding and full layers, tied head; Gemma 2's soft-capped scores and logits (caps
    # small enough to bite at this size), Gemma 3's q/k norms, local rope base and linearly scaled global rope.
    ("decoder", "debug-gemma2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, norm_offset=1.0, activation="geglu_tanh",
        tie_embeddings=True, scale_embeddings=True, branch_output_norm=True, query_pre_attn_scalar=24.0,
        attn_logit_softcap=5.0, final_logit_softcap=10.0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, extra={"hf_model_type": "gemma2"},
    ),
    ("decoder", "debug-gemma3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, norm_offset=1.0, activation="geglu_tanh",
        tie_embeddings=True, scale_embeddings=True, branch_output_norm=True, query_pre_attn_scalar=16.0,
        qk_norm=True, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_rope={"rope_type": "default", "rope_theta": 1e4}, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], extra={"hf_model_type": "gemma3_text"},
    ),
    ("decoder", "small"): dict(
        _LLAMA, vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
        intermediate_size=688, max_position_embeddings=1024,
    ),
    ("decoder", "gpt2"): dict(
        _GPT2, vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=1024,
    ),
    ("decoder", "llama-1b"): dict(
        _LLAMA, vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
        intermediate_size=5632, max_position_embeddings=2048,
    ),
    ("decoder", "llama2-7b"): dict(
        _LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        intermediate_size=11008, max_position_embeddings=4096,
    ),
    ("encoder", "debug"): dict(
        _BERT, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position_embeddings=512, dropout=0.0,
    ),
    # DeBERTa-v3- and ModernBERT-shaped encoders at test size (relative positions with log buckets; global and
    # sliding layers with their own rope theta, the GLU feed-forward and the prediction head)
    ("encoder", "debug-deberta-v3"): dict(
        _DEBERTA_V3, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position_embeddings=512, dropout=0.0,
    ),
    ("encoder", "debug-modernbert"): dict(
        _MODERNBERT, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96,
        max_position_embeddings=8192, layer_types=["full_attention", "sliding_attention"],
    ),
    ("encoder", "bert-base"): dict(
        _BERT, vocab_size=21128, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=512,
    ),
    ("encoder", "erlangshen-1.3b"): dict(
        _MEGATRON_BERT, vocab_size=21248, hidden_size=2048, num_layers=24, num_heads=32,
        intermediate_size=8192, max_position_embeddings=512,
    ),
}


def named_config(name: str, *, family: Family, **overrides: Any) -> ModelConfig:
    """Config of a named size (``debug``, ``bert-base``, ...) for ``family``, with field overrides."""
    key = (family, name)
    if key not in NAMED_SIZES:
        known = sorted(n for f, n in NAMED_SIZES if f == family)
        raise ValueError(f"unknown {family} model size {name!r}; known sizes: {', '.join(known)}")
    return ModelConfig(**copy.deepcopy({**NAMED_SIZES[key], **overrides}))  # no config shares the table's dicts
