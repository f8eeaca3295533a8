"""Mixtral (``MixtralForCausalLM``, ``MixtralModel``, ``MixtralForSequenceClassification``): Mistral's layout with an
MoE feed-forward on every layer (``block_sparse_moe``: the router ``gate``, experts ``w1`` gate, ``w3`` up, ``w2``
down, stored per expert); softmax top-k, renormalised; its ``intermediate_size`` is the experts' width; no sliding
window unless ``sliding_window`` sets one.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ..record.entries import Entry, Fused, Stacked, experts_entries
from ..record.family import decoder_classes
from .mistral import Mistral

__all__ = ["Mixtral", "RECORDS"]


class Mixtral(Mistral):
    model_type = "mixtral"
    label = "Mixtral"
    chat_template = "mistral"
    group = "moe"
    classes = decoder_classes("Mixtral")
    window = None
    moe_defaults = (8, 2, None, True)

    def experts_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(intermediate_size=int(hf.get("intermediate_size", 14336)), norm_topk_prob=True)

    def experts_to_hf(self, m: MoEConfig) -> dict[str, Any]:
        # its intermediate_size is the experts' width (it has no dense layer)
        return dict(num_local_experts=m.num_experts, router_jitter_noise=0.0, intermediate_size=m.intermediate_size)

    def moe_entries(self, c: ModelConfig, layer: int) -> list[Entry | Stacked | Fused]:
        return experts_entries(c, f"layers.{layer}.block_sparse_moe", f"layers.{layer}.mlp", names=("w1", "w3", "w2"))


RECORDS = (Mixtral(),)
