"""ERNIE 4.5, Baidu's dense decoders (``Ernie4_5ForCausalLM``, ``Ernie4_5Model``: ERNIE-4.5-0.3B; transformers has no
``Ernie4_5ForSequenceClassification``).

LLaMA's block and weight names with three differences (transformers' ``modular_ernie4_5.py``):

* one ``use_bias`` switches the biases of every projection, q/k/v/o and gate/up/down (false by default);
* rotary embedding over the whole head with its dims paired as ``(x0, x1), (x2, x3), ...`` (``rope_interleave``:
  GLM's ``rotate_half`` on each frequency repeated twice), ``rope_theta`` 500000 by default;
* no attention dropout (its attention's is fixed at 0).

Defaults: ``head_dim`` 128, ``max_position_embeddings`` 131072, ``rms_norm_eps`` 1e-5, a tied head.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE
from ..record.options import PLAIN_WEIGHTS
from .llama import Llama

__all__ = ["Ernie4_5", "RECORDS"]


class Ernie4_5(Llama):
    model_type = "ernie4_5"
    label = "ERNIE 4.5 (dense)"
    classes = {"Ernie4_5ForCausalLM": "lm", "Ernie4_5Model": "base"}
    unbuilt = (PLAIN_WEIGHTS,)
    max_positions = 131072
    norm_eps = 1e-5
    head_dim = 128
    rope_default = {"rope_theta": 500000.0}
    # every projection biased (use_bias), rotary pairs over the whole head, tied head
    sizes = {"debug-ernie4.5": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, rope_theta=500000.0, rope_interleave=True,
        attention_bias=True, mlp_bias=True, tie_embeddings=True)}
    tiny = "debug-ernie4.5"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        bias = bool(hf.get("use_bias", False))
        return dict(attention_bias=bias, o_bias=bias, mlp_bias=bias, rope_interleave=True, dropout=0.0,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)))

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        hf = super().config_to_hf(c, arch)
        del hf["attention_dropout"]  # not a key of Ernie4_5Config (its attention drops nothing)
        return hf

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(use_bias=c.attention_bias)  # one switch: a model with others is refused by the read-back check


RECORDS = (Ernie4_5(),)
