"""OLMoE (``OlmoeForCausalLM``, ``OlmoeModel``; transformers has no ``OlmoeForSequenceClassification``): the LLaMA
layout with ``q_norm``/``k_norm`` over the whole q / k projection and an MoE feed-forward on every layer (its
``intermediate_size`` the experts' width, stored per expert): softmax top-k without renormalisation (by default).
``clip_qkv`` is refused.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ..record.family import LLAMA_SIZE, decoder_classes
from .llama import Llama

__all__ = ["Olmoe", "RECORDS"]


class Olmoe(Llama):
    model_type = "olmoe"
    label = "OLMoE"
    group = "moe"
    classes = decoder_classes("Olmoe", classifier=False)
    guess_rank = 60  # q/k norms over the whole projection
    max_positions = 4096
    norm_eps = 1e-5
    moe_defaults = (64, 8, None, False)
    peft_reroutes_mlp = True
    sizes = {"debug-olmoe": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, qk_norm=True, qk_norm_over="projection",
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False, aux_loss_coef=0.01))}
    tiny = "debug-olmoe"

    def guess(self, c: ModelConfig) -> bool:
        return c.qk_norm and c.qk_norm_over == "projection"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        """q/k norms over the whole projections (sized ``hidden_size``, as its code sizes them, so ``head_dim`` must
        be ``hidden_size / heads``)."""
        if hf.get("clip_qkv") is not None:
            raise ValueError(f"OLMoE config: clip_qkv={hf['clip_qkv']} (q/k/v clamped in forward) is not supported; "
                             "set it to null")
        if hf.get("head_dim") not in (None, int(hf["hidden_size"]) // int(hf["num_attention_heads"])):
            raise ValueError(f"OLMoE config: head_dim={hf['head_dim']} != hidden_size / num_attention_heads is not "
                             "supported (OlmoeAttention sizes q_norm by hidden_size)")
        return dict(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, qk_norm_over="projection")

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias, clip_qkv=None)

    def experts_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        # every layer MoE, its intermediate_size the experts' width
        return dict(intermediate_size=int(hf.get("intermediate_size", 2048)),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)))

    def experts_to_hf(self, m: MoEConfig) -> dict[str, Any]:
        return dict(num_experts=m.num_experts, intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob)


RECORDS = (Olmoe(),)
