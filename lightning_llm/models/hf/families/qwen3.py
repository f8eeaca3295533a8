"""Qwen3 (``Qwen3ForCausalLM``, ``Qwen3Model``, ``Qwen3ForSequenceClassification``), and Qwen3-VL's language model
(``Qwen3VLForConditionalGeneration``, fine-tuned as text): Qwen2's layout with ``q_norm``/``k_norm`` (RMSNorm per
head over ``head_dim``), a ``head_dim`` that may differ from hidden/heads (128 when absent), biases from
``attention_bias``.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, Multimodal, NestedLM, decoder_classes
from .qwen2 import Qwen2, qwen_sliding_from_hf, qwen_sliding_to_hf

__all__ = ["Qwen3", "RECORDS"]


class Qwen3(Qwen2):
    model_type = "qwen3"
    label = "Qwen3"
    chat_template = "chatml"
    classes = decoder_classes("Qwen3")
    guess_rank = 70  # per-head q/k norms
    head_dim = 128
    sizes = {"debug-qwen3": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True)}

    def guess(self, c: ModelConfig) -> bool:
        return c.qk_norm

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(qwen_sliding_from_hf(hf, num_layers), attention_bias=bool(hf.get("attention_bias", False)),
                    qk_norm=True)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(qwen_sliding_to_hf(c), attention_bias=c.attention_bias)


class Qwen3_VL(Multimodal):
    """Qwen3-VL (``model.visual``, its deepstack mergers included, copied at export)."""

    model_type = "qwen3_vl"
    label = "Qwen3-VL"
    chat_template = "chatml"
    classes = {"Qwen3VLForConditionalGeneration": "lm"}
    text_kind = "qwen3"
    nested = NestedLM(("qwen3_vl_text",), tie_default=False, tie_from_text=True,
                      text_defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                         head_dim=128, rms_norm_eps=1e-6, rope_theta=500000.0,
                                         max_position_embeddings=128000))


RECORDS = (Qwen3(), Qwen3_VL())
