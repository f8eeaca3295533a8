"""Seed-OSS, ByteDance's dense decoders (``SeedOssForCausalLM``, ``SeedOssModel``, ``SeedOssForSequenceClassification``:
Seed-OSS-36B).

LLaMA's block and weight names (transformers' ``modular_seed_oss.py``) with the biases of its attention switched
apart: ``attention_bias`` on q/k/v (true by default), ``attention_out_bias`` on o_proj (false by default), ``mlp_bias``
on gate/up/down (false by default); ``attention_dropout`` on the attention probabilities and ``residual_dropout`` on
both branches' outputs (0.1 each by default), which are our one ``dropout`` when equal (it also drops out the
embeddings, as it does for every LLaMA-layout family; different values are refused by name).

Defaults: ``head_dim`` 128, ``max_position_embeddings`` 524288, ``rms_norm_eps`` 1e-6, an untied head.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from .llama import Llama

__all__ = ["RECORDS", "SeedOss"]


class SeedOss(Llama):
    model_type = "seed_oss"
    label = "Seed-OSS"
    classes = decoder_classes("SeedOss")
    unbuilt = (PLAIN_WEIGHTS,)
    max_positions = 524288
    head_dim = 128
    # q/k/v biased, o not (as published), a large rope base
    sizes = {"debug-seed-oss": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e7, attention_bias=True,
        o_bias=False)}
    tiny = "debug-seed-oss"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        drop = {k: float(hf.get(k, 0.1) or 0.0) for k in ("attention_dropout", "residual_dropout")}
        if drop["attention_dropout"] != drop["residual_dropout"]:
            raise ValueError(f"{where}: {', '.join(f'{k}={v}' for k, v in drop.items())} is not supported for seed_oss "
                             "(built: one dropout on the embeddings, attention probabilities and residual branches; "
                             "set them equal)")
        return dict(attention_bias=bool(hf.get("attention_bias", True)),
                    o_bias=bool(hf.get("attention_out_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
                    dropout=drop["attention_dropout"])

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias, attention_out_bias=bool(c.o_bias), mlp_bias=c.mlp_bias,
                    residual_dropout=c.dropout)


RECORDS = (SeedOss(),)
