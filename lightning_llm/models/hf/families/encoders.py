"""The encoders: ``config.json`` and weight names <-> :class:`~lightning_llm.models.EncoderModel`. BERT-style ones
(BERT, RoBERTa, XLM-R, MegatronBERT / Erlangshen) here; DeBERTa-v2/v3 in :mod:`.deberta`, ModernBERT in
:mod:`.modernbert`, dispatched from here.

``...Model``, ``...ForSequenceClassification`` (a pooler and a classifier), and the masked-LM / pre-training classes
as load sources (their heads ignored). MegatronBERT is pre-norm with a final LayerNorm; RoBERTa offsets positions by
``pad_token_id + 1`` and keeps its classifier's dense layer where BERT keeps the pooler, with a dropout before it;
XLM-R is RoBERTa's layout under its own names (``XLMRoberta...``, ``model_type`` ``xlm-roberta``).
"""

from __future__ import annotations

import re
from typing import Any

from ...config import ModelConfig
from ..architectures import Arch, num_labels_of
from ..entries import Entry, lin
from ..options import refuse_unbuilt
from .deberta import deberta_config_from_hf, deberta_config_to_hf, deberta_entries
from .decoders import PLAIN_ACT_TO_HF, plain_act
from .modernbert import modernbert_config_from_hf, modernbert_config_to_hf, modernbert_entries

__all__ = ["ENCODER_KINDS", "ENCODER_PREFIX", "ENCODER_HEAD_KEYS", "encoder_config_from_hf", "encoder_config_to_hf",
           "encoder_entries"]

ENCODER_KINDS = ("bert", "megatron-bert", "roberta", "xlm-roberta", "deberta-v2", "modernbert")
ROBERTA_KINDS = ("roberta", "xlm-roberta")
"""RoBERTa's weight layout (positions offset by the padding id, ``classifier.dense`` / ``classifier.out_proj``)."""

ENCODER_PREFIX = {"bert": "bert.", "megatron-bert": "bert.", "roberta": "roberta.", "xlm-roberta": "roberta.",
                  "deberta-v2": "deberta.", "modernbert": "model."}
"""The base model's prefix of each encoder's keys in its head classes."""

ENCODER_HEAD_KEYS = {
    "bert": re.compile(r"^(cls|classifier|pooler)\."),
    "megatron-bert": re.compile(r"^(cls|classifier|pooler)\."),
    "roberta": re.compile(r"^(lm_head|classifier|pooler)\."),
    "xlm-roberta": re.compile(r"^(lm_head|classifier|pooler)\."),
    # DeBERTa's masked-LM heads (legacy and new); a checkpoint without absolute positions may keep their table
    "deberta-v2": re.compile(r"^(cls|lm_predictions|mask_predictions|pooler|classifier)\.|"
                             r"^embeddings\.position_embeddings\."),
    "modernbert": re.compile(r"^(head|decoder|classifier)\."),
}
"""Head weights of other tasks: dropped with a warning (e.g. an MLM head when loading a backbone)."""


def encoder_config_from_hf(hf: dict[str, Any], arch: str, a: Arch, *, extra: dict[str, Any], pad: int,
                           where: str = "config") -> ModelConfig:
    refuse_unbuilt(hf, a.kind, where)
    num_labels = num_labels_of(hf) if a.head == "cls" else 0
    if a.kind == "deberta-v2":
        return deberta_config_from_hf(hf, arch, a, extra=extra, pad=pad, num_labels=num_labels, where=where)
    if a.kind == "modernbert":
        return modernbert_config_from_hf(hf, arch, a, extra=extra, pad=pad, num_labels=num_labels, where=where)
    return _bert_config_from_hf(hf, arch, a, extra=extra, pad=pad, num_labels=num_labels)


def _bert_config_from_hf(hf: dict[str, Any], arch: str, a: Arch, *, extra: dict[str, Any], pad: int,
                         num_labels: int) -> ModelConfig:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
    if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
        raise ValueError(f"{arch} configured as a decoder is not supported")
    megatron = a.kind == "megatron-bert"
    roberta = a.kind in ROBERTA_KINDS
    dropout = float(hf.get("hidden_dropout_prob", 0.1))
    cls_drop = hf.get("classifier_dropout")
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
        pooler_dropout=None if roberta else 0.0,  # RoBERTa: the classifier's dropout, before its dense layer too
        classifier_dropout=None if cls_drop is None else float(cls_drop),
        initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
    )


def encoder_config_to_hf(c: ModelConfig, architecture: str, a: Arch) -> dict[str, Any]:
    if a.kind == "deberta-v2":
        return deberta_config_to_hf(c)
    if a.kind == "modernbert":
        return modernbert_config_to_hf(c)
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
    if a.kind in ROBERTA_KINDS:
        hf["pad_token_id"] = c.position_offset - 1
    return hf


def encoder_entries(c: ModelConfig, a: Arch) -> list[Entry]:
    if a.kind == "deberta-v2":
        return deberta_entries(c, a)
    if a.kind == "modernbert":
        return modernbert_entries(c, a)
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
        if a.kind in ROBERTA_KINDS and a.head == "cls":
            e += lin("classifier.dense", "pooler", True, group="pooler", top=True)
        else:
            e += lin("pooler.dense", "pooler", True, group="pooler")
    if c.num_labels > 0 and a.head in ("cls", "base", "mlm"):
        name = "classifier.out_proj" if a.kind in ROBERTA_KINDS else "classifier"
        e += lin(name, "classifier", True, group="classifier", top=True)
    return e
