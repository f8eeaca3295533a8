"""The BERT-style encoders: BERT, RoBERTa, XLM-R, MegatronBERT (Erlangshen): ``config.json`` and weight names <->
:class:`~lightning_llm.models.EncoderModel`.

``...Model``, ``...ForSequenceClassification`` (a pooler and a classifier), and the masked-LM / pre-training classes
as load sources (their heads ignored). MegatronBERT is pre-norm with a final LayerNorm; RoBERTa offsets positions by
``pad_token_id + 1`` and keeps its classifier's dense layer where BERT keeps the pooler, with a dropout before it;
XLM-R is RoBERTa's layout under its own names (``XLMRoberta...``, ``model_type`` ``xlm-roberta``).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from ...config import ModelConfig
from ..record.entries import Entry, Fused, Stacked, lin
from ..record.family import Family, encoder_classes
from ..record.readers import PLAIN_ACT_TO_HF, num_labels_of, plain_act

__all__ = ["Bert", "MegatronBert", "RECORDS", "Roberta", "XLMRoberta"]


class Bert(Family):
    model_type = "bert"
    label = "BERT"
    group = "encoder"
    family = "encoder"
    classes = encoder_classes("Bert", pretraining=True)
    default_class = "BertModel"
    base_prefix = "bert."
    head_keys = re.compile(r"^(cls|classifier|pooler)\.")
    guess_rank = 100  # an encoder of no recorded family that no other family claims
    megatron: ClassVar[bool] = False
    """Pre-norm with a final LayerNorm (``attention.ln``, ``ln``, ``encoder.ln``)."""
    roberta: ClassVar[bool] = False
    """RoBERTa's layout: positions offset by the padding id, ``classifier.dense`` / ``classifier.out_proj``."""

    def guess(self, c: ModelConfig) -> bool:
        return True

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        num_labels = num_labels_of(hf) if head == "cls" else 0
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
        if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
            raise ValueError(f"{arch} configured as a decoder is not supported")
        megatron, roberta = self.megatron, self.roberta
        dropout = float(hf.get("hidden_dropout_prob", 0.1))
        cls_drop = hf.get("classifier_dropout")
        # BertModel / ...ForSequenceClassification / ...ForPreTraining carry a pooler; MaskedLM heads do not.
        pooler = not (head == "mlm" and not arch.endswith("ForPreTraining"))
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

    def config_to_hf(self, c: ModelConfig, architecture: str) -> dict[str, Any]:
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
        if self.roberta:
            hf["pad_token_id"] = c.position_offset - 1
        return hf

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        megatron = self.megatron
        ab, mb = c.attention_bias, c.mlp_bias
        e: list[Entry | Stacked | Fused] = list(lin("embeddings.word_embeddings", "embed_tokens", False))
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
            if self.roberta and head == "cls":
                e += lin("classifier.dense", "pooler", True, group="pooler", top=True)
            else:
                e += lin("pooler.dense", "pooler", True, group="pooler")
        if c.num_labels > 0 and head in ("cls", "base", "mlm"):
            name = "classifier.out_proj" if self.roberta else "classifier"
            e += lin(name, "classifier", True, group="classifier", top=True)
        return e


class MegatronBert(Bert):
    model_type = "megatron-bert"
    label = "MegatronBERT (Erlangshen)"
    classes = encoder_classes("MegatronBert", pretraining=True)
    default_class = "MegatronBertModel"
    guess_rank = 2  # pre-norm
    megatron = True

    def guess(self, c: ModelConfig) -> bool:
        return c.pre_norm


class Roberta(Bert):
    model_type = "roberta"
    label = "RoBERTa"
    classes = encoder_classes("Roberta")
    default_class = "RobertaModel"
    base_prefix = "roberta."
    head_keys = re.compile(r"^(lm_head|classifier|pooler)\.")
    guess_rank = 3  # positions offset by the padding id
    roberta = True

    def guess(self, c: ModelConfig) -> bool:
        return c.position_offset > 0


class XLMRoberta(Roberta):
    model_type = "xlm-roberta"
    label = "XLM-R"
    classes = encoder_classes("XLMRoberta")
    default_class = "XLMRobertaModel"


RECORDS = (Bert(), MegatronBert(), Roberta(), XLMRoberta())
