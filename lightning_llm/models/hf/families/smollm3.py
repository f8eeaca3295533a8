"""SmolLM3 (``SmolLM3ForCausalLM``, ``SmolLM3Model``): ``config.json`` <-> :class:`ModelConfig`.

LLaMA's block and weight names, with layers that apply no rotary embedding: ``no_rope_layers`` lists one 0/1 per layer
(1: RoPE, 0: none; by default every ``no_rope_layer_interval``-th layer, 4, has none), our ``nope_layers`` the indices
of the zeros. A sliding window applies to the layers ``layer_types`` marks ``sliding_attention`` (by default, with
``use_sliding_window`` and a ``sliding_window``, the NoPE layers): transformers' SmolLM3Model builds their sliding mask
whatever ``use_sliding_window`` says. Defaults: ``rope_theta`` 2000000, a tied head.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from ..record.readers import layer_types
from .llama import Llama

__all__ = ["RECORDS", "SmolLM3"]


def _rope_flags(hf: dict[str, Any], num_layers: int, where: str) -> list[int]:
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        return [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"{where}: no_rope_layers={flags} must list a 0 or 1 for each of the {num_layers} layers")
    return [int(f) for f in flags[:num_layers]]


class SmolLM3(Llama):
    model_type = "smollm3"
    label = "SmolLM3"
    classes = decoder_classes("SmolLM3")
    unbuilt = (PLAIN_WEIGHTS,)
    rope_default = {"rope_theta": 2000000.0}
    # a layer without rotary embedding and a tied head
    sizes = {"debug-smollm3": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=2000000.0, nope_layers=[3], tie_embeddings=True)}
    tiny = "debug-smollm3"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        rope = _rope_flags(hf, num_layers, where)
        window = hf.get("sliding_window")
        types = hf.get("layer_types")
        if types is None:
            slides = bool(hf.get("use_sliding_window", False)) and window is not None
            types = ["sliding_attention" if slides and not r else "full_attention" for r in rope]
        types = list(types)[:num_layers]
        if "sliding_attention" in types and window is None:
            raise ValueError(f"{where}: layer_types marks sliding_attention layers but sliding_window is null")
        return dict(nope_layers=[i for i, r in enumerate(rope) if not r],
                    sliding_window=int(window) if "sliding_attention" in types else None,
                    layer_types=types if "sliding_attention" in types else None,
                    attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                    max_position_embeddings=int(hf.get("max_position_embeddings", 32768)))

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        sliding = c.sliding_layers
        return dict(no_rope_layers=[0 if i in c.nope_layers else 1 for i in range(c.num_layers)],
                    use_sliding_window=bool(sliding), sliding_window=c.sliding_window if sliding else None,
                    layer_types=layer_types(c), attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)


RECORDS = (SmolLM3(),)
