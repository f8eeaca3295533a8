"""Mistral (``MistralForCausalLM``, ``MistralModel``, ``MistralForSequenceClassification``), and Mistral Small 3.1/3.2's
language model (``Mistral3ForConditionalGeneration``, fine-tuned as text): the LLaMA layout with ``sliding_window`` on
every layer (4096 when the key is absent, off when null).
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, Multimodal, NestedLM, decoder_classes
from .llama import Llama

__all__ = ["Mistral", "RECORDS"]


class Mistral(Llama):
    model_type = "mistral"
    label = "Mistral"
    chat_template = "mistral"
    classes = decoder_classes("Mistral")
    guess_rank = 90  # a sliding window
    max_positions = 131072
    window: int | None = 4096
    """``sliding_window`` when absent (an explicit null disables it)."""
    sizes = {"debug-mistral": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, sliding_window=8)}

    def guess(self, c: ModelConfig) -> bool:
        return bool(c.sliding_layers)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        window = hf.get("sliding_window", self.window)
        return dict(sliding_window=None if window is None else int(window), layer_types=None)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(sliding_window=c.sliding_window if c.sliding_layers else None)


class Mistral3(Multimodal):
    """Mistral Small 3.1/3.2 (``model.vision_tower``, Pixtral, and ``model.multi_modal_projector`` copied at
    export)."""

    model_type = "mistral3"
    label = "Mistral Small 3.1/3.2"
    classes = {"Mistral3ForConditionalGeneration": "lm"}
    text_kind = "mistral"
    nested = NestedLM(("mistral",), tie_default=True)


RECORDS = (Mistral(), Mistral3())
