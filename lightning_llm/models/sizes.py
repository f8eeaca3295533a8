"""The named sizes: ``(family, name)`` -> the fields of a :class:`~lightning_llm.models.config.ModelConfig`
(``debug`` for both families, what tests use; small and published sizes; each HF family's own sizes, which its record
in ``models/hf/families/`` holds), and :func:`named_config`."""

from __future__ import annotations

import copy
from typing import Any

from .config import Family, ModelConfig
from .hf.convert.registry import named_sizes

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

NAMED_SIZES: dict[tuple[str, str], dict[str, Any]] = {
    ("decoder", "debug"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=256,
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
    ("encoder", "bert-base"): dict(
        _BERT, vocab_size=21128, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=512,
    ),
    ("encoder", "erlangshen-1.3b"): dict(
        _MEGATRON_BERT, vocab_size=21248, hidden_size=2048, num_layers=24, num_heads=32,
        intermediate_size=8192, max_position_embeddings=512,
    ),
    # The families' own sizes (their debug sizes, published shapes), from their records in models/hf/families/:
    # their HF class is the default save target
    **named_sizes(),
}
"""Named sizes: (family, name) -> fields. ``debug`` exists for both families and is what tests use."""


def named_config(name: str, *, family: Family, **overrides: Any) -> ModelConfig:
    """Config of a named size (``debug``, ``bert-base``, ...) for ``family``, with field overrides."""
    key = (family, name)
    if key not in NAMED_SIZES:
        known = sorted(n for f, n in NAMED_SIZES if f == family)
        raise ValueError(f"unknown {family} model size {name!r}; known sizes: {', '.join(known)}")
    return ModelConfig(**copy.deepcopy({**NAMED_SIZES[key], **overrides}))  # no config shares the table's dicts
