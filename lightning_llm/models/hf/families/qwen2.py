"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``, ``Qwen2Model``, ``Qwen2ForSequenceClassification``), and Qwen2.5-VL's
language model (``Qwen2_5_VLForConditionalGeneration``, fine-tuned as text): the LLaMA layout with q/k/v biased and
o not (hard-coded in transformers), ``use_sliding_window`` + ``sliding_window`` on the layers ``>= max_window_layers``
(or the explicit ``layer_types``), a tied or untied head.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, Multimodal, NestedLM, decoder_classes
from ..record.readers import layer_types
from .llama import Llama

__all__ = ["Qwen2", "RECORDS", "qwen_sliding_from_hf", "qwen_sliding_to_hf"]


def qwen_sliding_from_hf(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as Qwen2's and Qwen3's configs resolve them: with ``use_sliding_window``
    the layers from ``max_window_layers`` (28) on slide, unless ``layer_types`` says otherwise."""
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
        return dict(sliding_window=None, layer_types=None)
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return dict(sliding_window=int(hf.get("sliding_window", 4096)), layer_types=list(types))


def qwen_sliding_to_hf(c: ModelConfig) -> dict[str, Any]:
    """Inverse of :func:`qwen_sliding_from_hf`."""
    sliding = c.sliding_layers
    return dict(use_sliding_window=bool(sliding), sliding_window=c.sliding_window if sliding else None,
                max_window_layers=min(sliding) if sliding else c.num_layers, layer_types=layer_types(c))


class Qwen2(Llama):
    model_type = "qwen2"
    label = "Qwen2, Qwen2.5"
    chat_template = "chatml"
    classes = decoder_classes("Qwen2")
    guess_rank = 80  # q/k/v biased, o not
    max_positions = 32768
    sizes = {"debug-qwen2": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, attention_bias=True, o_bias=False,
        tie_embeddings=True)}

    def guess(self, c: ModelConfig) -> bool:
        return c.attention_bias and not c.o_bias

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(qwen_sliding_from_hf(hf, num_layers), attention_bias=True, o_bias=False)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return qwen_sliding_to_hf(c)


class Qwen2_5_VL(Multimodal):
    """Qwen2.5-VL (``model.visual`` copied at export)."""

    model_type = "qwen2_5_vl"
    label = "Qwen2.5-VL"
    chat_template = "chatml"
    classes = {"Qwen2_5_VLForConditionalGeneration": "lm"}
    text_kind = "qwen2"
    nested = NestedLM(("qwen2_5_vl_text", "qwen2_5_vl"), tie_default=False, flat=True, tie_from_text=True,
                      text_defaults=dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                                         rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
                                         max_window_layers=80))


RECORDS = (Qwen2(), Qwen2_5_VL())
