"""Qwen2-MoE (``Qwen2MoeForCausalLM``, ``Qwen2MoeModel``, ``Qwen2MoeForSequenceClassification``): Qwen2's attention
(q/k/v biased by ``qkv_bias``) with MoE feed-forward layers (those outside ``mlp_only_layers`` and
``decoder_sparse_step``): softmax top-k (renormalised by ``norm_topk_prob``), experts of ``moe_intermediate_size``
stored per expert, a shared expert (``shared_expert``) gated by a sigmoid (``shared_expert_gate``); with
``use_sliding_window`` every other layer below ``max_window_layers`` slides (or as ``layer_types`` says).
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ..record.family import decoder_classes
from ..record.readers import layer_types
from .llama import Llama

__all__ = ["Qwen2Moe", "RECORDS"]


class Qwen2Moe(Llama):
    model_type = "qwen2_moe"
    label = "Qwen2-MoE"
    chat_template = "chatml"
    group = "moe"
    classes = decoder_classes("Qwen2Moe")
    max_positions = 32768
    moe_defaults = (60, 4, 1408, False)
    shared_expert_width = 5632
    """``shared_expert_intermediate_size`` when absent (0: no shared expert)."""
    alternate_sliding = True
    """Without ``layer_types``, every other layer below ``max_window_layers`` slides (else every layer)."""

    def sliding_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        window = hf.get("sliding_window", 4096)
        if not hf.get("use_sliding_window", False) or not window:
            return dict(sliding_window=None, layer_types=None)
        types = hf.get("layer_types")
        if types is None and self.alternate_sliding:
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
        return dict(sliding_window=int(window), layer_types=None if types is None else list(types))

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(self.sliding_from_hf(hf, num_layers), attention_bias=bool(hf.get("qkv_bias", True)), o_bias=False)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(qkv_bias=c.attention_bias, max_window_layers=c.num_layers, layer_types=layer_types(c),
                    use_sliding_window=bool(c.sliding_layers),
                    sliding_window=c.sliding_window if c.sliding_layers else None)

    def experts_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        _, _, width, norm = self.moe_defaults or (0, 0, None, False)
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        only = {int(i) for i in hf.get("mlp_only_layers") or []}
        kw: dict[str, Any] = dict(intermediate_size=int(hf.get("moe_intermediate_size", width)),
                                  norm_topk_prob=bool(hf.get("norm_topk_prob", norm)),
                                  dense_layers=[i for i in range(num_layers) if i in only or (i + 1) % step])
        if self.shared_expert_width:
            kw.update(shared_intermediate_size=int(hf.get("shared_expert_intermediate_size",
                                                          self.shared_expert_width)), shared_gate=True)
        return kw

    def experts_to_hf(self, m: MoEConfig) -> dict[str, Any]:
        hf: dict[str, Any] = dict(num_experts=m.num_experts, moe_intermediate_size=m.intermediate_size,
                                  norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                                  mlp_only_layers=list(m.dense_layers))
        if self.shared_expert_width:
            hf.update(shared_expert_intermediate_size=m.shared_intermediate_size)
        return hf


RECORDS = (Qwen2Moe(),)
