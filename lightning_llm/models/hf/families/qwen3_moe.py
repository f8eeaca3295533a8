"""Qwen3-MoE (``Qwen3MoeForCausalLM``, ``Qwen3MoeModel``, ``Qwen3MoeForSequenceClassification``): Qwen2-MoE's layout
with Qwen3's attention (per-head ``q_norm``/``k_norm``, biases from ``attention_bias``) and no shared expert; with
``use_sliding_window`` the layers ``layer_types`` marks slide (every layer when it is absent).
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, decoder_classes
from .qwen2_moe import Qwen2Moe

__all__ = ["Qwen3Moe", "RECORDS"]

_SHAPE = dict(LLAMA_SIZE, norm_eps=1e-6, rope_theta=1e6, qk_norm=True)


class Qwen3Moe(Qwen2Moe):
    model_type = "qwen3_moe"
    label = "Qwen3-MoE"
    chat_template = "chatml"
    classes = decoder_classes("Qwen3Moe")
    moe_defaults = (128, 8, 768, False)
    shared_expert_width = 0
    alternate_sliding = False
    peft_reroutes_mlp = True
    # Qwen3-MoE-shaped (q/k norms, no biases, MoE on every layer, renormalised top-k) at test and CPU sizes, and the
    # shape of Qwen3-30B-A3B (estimates, GPU benchmarks with fewer layers through model_overrides).
    sizes = {
        "debug-moe": dict(_SHAPE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                          head_dim=16, intermediate_size=128, max_position_embeddings=256,
                          moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                   aux_loss_coef=0.001)),
        "small-moe": dict(_SHAPE, vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
                          head_dim=32, intermediate_size=688, max_position_embeddings=1024,
                          moe=dict(num_experts=16, top_k=4, intermediate_size=128, norm_topk_prob=True,
                                   aux_loss_coef=0.001)),
        "qwen3-30b-a3b": dict(_SHAPE, vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                              num_kv_heads=4, head_dim=128, intermediate_size=6144, max_position_embeddings=40960,
                              moe=dict(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True,
                                       aux_loss_coef=0.001)),
    }

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(self.sliding_from_hf(hf, num_layers), attention_bias=bool(hf.get("attention_bias", False)),
                    qk_norm=True)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias, use_sliding_window=bool(c.sliding_layers),
                    sliding_window=c.sliding_window if c.sliding_layers else None)


RECORDS = (Qwen3Moe(),)
