"""BERT-style encoders (BERT, RoBERTa, MegatronBERT / Erlangshen): ``config.json`` and weight names <->
:class:`~lightning_llm.models.EncoderModel`.

``...Model``, ``...ForSequenceClassification`` (a pooler and a classifier), and the masked-LM / pre-training classes
as load sources (their heads ignored). MegatronBERT is pre-norm with a final LayerNorm; RoBERTa offsets positions by
``pad_token_id + 1`` and keeps its classifier's dense layer where BERT keeps the pooler.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .architectures import Arch, num_labels_of
from .decoders import PLAIN_ACT_TO_HF, plain_act
from .entries import Entry, lin

__all__ = ["ENCODER_KINDS", "encoder_config_from_hf", "encoder_config_to_hf", "encoder_entries"]

ENCODER_KINDS = ("bert", "megatron-bert", "roberta")


def encoder_config_from_hf(hf: dict[str, Any], arch: str, a: Arch, *, extra: dict[str, Any],
                           pad: int) -> ModelConfig:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
    if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
        raise ValueError(f"{arch} configured as a decoder is not supported")
    megatron = a.kind == "megatron-bert"
    roberta = a.kind == "roberta"
    dropout = float(hf.get("hidden_dropout_prob", 0.1))
    cls_drop = hf.get("classifier_dropout")
    num_labels = num_labels_of(hf) if a.head == "cls" else 0
    # BertModel / ...ForSequenceClassification / ...ForPreTraining carry a pooler; MaskedLM heads do not.
    pooler = not (a.head == "mlm" and not arch.endswith("ForPreTraining"))
    return ModelConfig(
        family="encoder", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
        intermediate_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 512)), norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        activation=plain_act(hf.get("hidden_act", "gelu")),  # type: ignore[arg-type]
        position="learned", attention_bias=True, mlp_bias=True, tie_embeddings=False,
        pre_norm=megatron, embedding_norm=not megatron, final_norm=megatron,
        type_vocab_size=int(hf.get("type_vocab_size", 2)), position_offset=pad + 1 if roberta else 0,
        pooler=pooler, num_labels=num_labels, dropout=dropout,
        classifier_dropout=None if cls_drop is None else float(cls_drop),
        initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
    )


def encoder_config_to_hf(c: ModelConfig, architecture: str, a: Arch) -> dict[str, Any]:
    if c.type_vocab_size < 1:
        raise ValueError(f"{architecture} needs type_vocab_size >= 1, got {c.type_vocab_size}")
    hf: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
        hidden_act=PLAIN_ACT_TO_HF.get(c.activation, c.activation), hidden_dropout_prob=c.dropout,
        attention_probs_dropout_prob=c.dropout, max_position_embeddings=c.max_position_embeddings,
        type_vocab_size=c.type_vocab_size, layer_norm_eps=c.norm_eps, position_embedding_type="absolute",
        classifier_dropout=c.classifier_dropout,
    )
    if a.kind == "roberta":
        hf["pad_token_id"] = c.position_offset - 1
    return hf


def encoder_entries(c: ModelConfig, a: Arch) -> list[Entry]:
    megatron = a.kind == "megatron-bert"
    ab, mb = c.attention_bias, c.mlp_bias
    e = lin("embeddings.word_embeddings", "embed_tokens", False)
    e += lin("embeddings.position_embeddings", "embed_positions", False)
    if c.type_vocab_size > 0:
        e += lin("embeddings.token_type_embeddings", "embed_token_types", False)
    if c.embedding_norm:
        e += lin("embeddings.LayerNorm", "embed_norm", True)
    for i in range(c.num_layers):
        p, q = f"encoder.layer.{i}", f"layers.{i}"
        for hn, n in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            e += lin(f"{p}.attention.self.{hn}", f"{q}.self_attn.{n}", ab)
        e += lin(f"{p}.attention.output.dense", f"{q}.self_attn.o_proj", ab)
        e += lin(f"{p}.intermediate.dense", f"{q}.mlp.up_proj", mb)
        e += lin(f"{p}.output.dense", f"{q}.mlp.down_proj", mb)
        if megatron:
            e += lin(f"{p}.attention.ln", f"{q}.attn_norm", True)
            e += lin(f"{p}.ln", f"{q}.mlp_norm", True)
        else:
            e += lin(f"{p}.attention.output.LayerNorm", f"{q}.attn_norm", True)
            e += lin(f"{p}.output.LayerNorm", f"{q}.mlp_norm", True)
    if megatron and c.final_norm:
        e += lin("encoder.ln", "final_norm", True)
    if c.pooler:
        if a.kind == "roberta" and a.head == "cls":
            e += lin("classifier.dense", "pooler", True, group="pooler", top=True)
        else:
            e += lin("pooler.dense", "pooler", True, group="pooler")
    if c.num_labels > 0 and a.head in ("cls", "base", "mlm"):
        name = "classifier.out_proj" if a.kind == "roberta" else "classifier"
        e += lin(name, "classifier", True, group="classifier", top=True)
    return e
