"""GLM-4.5/4.6 (``Glm4MoeForCausalLM``, ``Glm4MoeModel``; transformers has no ``Glm4MoeForSequenceClassification``):
DeepSeek-V3's router, shared experts and dense first layers (:mod:`.deepseek`) with grouped-query attention: partial
rotary (``partial_rotary_factor``, 0.5 when absent), q/k/v biases (``attention_bias``; o never), optional per-head
``q_norm``/``k_norm`` (``use_qk_norm``).
"""

from __future__ import annotations

from typing import Any

from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from ..record.readers import partial_rotary_factor
from .deepseek import _ROUTER, DeepseekV3

__all__ = ["Glm4Moe", "RECORDS"]


class Glm4Moe(DeepseekV3):
    model_type = "glm4_moe"
    label = "GLM-4.5/4.6"
    classes = decoder_classes("Glm4Moe", classifier=False)
    unbuilt = (PLAIN_WEIGHTS,)
    defaults = dict(n_routed_experts=128, n_shared_experts=1, moe_intermediate_size=1408, first_k_dense_replace=1,
                    routed_scaling_factor=1.0, n_group=1, topk_group=1, num_experts_per_tok=8, norm_topk_prob=True,
                    use_qk_norm=False)
    max_positions = 131072
    partial_rotary = True
    write_partial_rotary = True  # its absence means 0.5
    # partial rotary, q/k norms, q/k/v biases with DeepSeek-V3's router at test size
    sizes = {"debug-glm4-moe": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5, qk_norm=True,
        attention_bias=True, o_bias=False,
        moe=dict(_ROUTER, num_experts=8, top_k=2, intermediate_size=32, routed_scaling_factor=1.0))}
    tiny = "debug-glm4-moe"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(attention_bias=bool(hf.get("attention_bias", False)), o_bias=False,
                    qk_norm=bool(self.get(hf, "use_qk_norm")), partial_rotary_factor=partial_rotary_factor(hf, 0.5))


RECORDS = (Glm4Moe(),)
