"""DeBERTa-v2/v3 (``deberta-v2``: ``DebertaV2Model``, ``DebertaV2ForSequenceClassification``; Erlangshen-DeBERTa-v2 is
the Chinese one): ``config.json`` and weight names <-> an :class:`~lightning_llm.models.EncoderModel` with
``disentangled`` attention (``models/layers/deberta.py``).

transformers' keys (under ``deberta.`` in the head classes): ``embeddings.{word,position,token_type}_embeddings``,
``embeddings.LayerNorm``, ``encoder.layer.N.attention.self.{query,key,value}_proj`` (+ ``pos_key_proj``,
``pos_query_proj`` without ``share_att_key``), ``attention.output.{dense,LayerNorm}``, ``intermediate.dense``,
``output.{dense,LayerNorm}``, ``encoder.rel_embeddings``, ``encoder.LayerNorm`` (the relative table's norm),
``encoder.conv.{conv,LayerNorm}`` (DeBERTa-v2's convolution beside the first layer: our ``layers.0.conv``); the
classifier's ``pooler.dense`` (activation ``pooler_hidden_act``) and ``classifier`` at the top. A checkpoint without
absolute positions may still hold ``embeddings.position_embeddings``: ignored, as transformers does.
"""

from __future__ import annotations

import re
from typing import Any

from ...config import ModelConfig
from ...layers.configs import DisentangledConfig
from ..record.entries import Entry, Fused, Stacked, lin
from ..record.family import Family, encoder_classes
from ..record.options import Unbuilt
from ..record.readers import PLAIN_ACT_TO_HF, num_labels_of, plain_act

__all__ = ["DebertaV2", "RECORDS", "pooler_act", "pooler_act_to_hf"]

_NORM_REL = {"none": False, "layer_norm": True}


def pooler_act(name: str) -> str:
    """Our pooler activation for an HF name (``tanh`` or an MLP activation)."""
    return "tanh" if name == "tanh" else plain_act(name)


def pooler_act_to_hf(name: str) -> str:
    return PLAIN_ACT_TO_HF.get(name, name)


def _pos_att_type(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = value.lower().split("|")
    return [str(t).strip().lower() for t in value if str(t).strip()]


class DebertaV2(Family):
    model_type = "deberta-v2"
    label = "DeBERTa-v2/v3 (Erlangshen-DeBERTa-v2)"
    group = "encoder"
    family = "encoder"
    classes = encoder_classes("DebertaV2")
    default_class = "DebertaV2Model"
    base_prefix = "deberta."
    # DeBERTa's masked-LM heads (legacy and new); a checkpoint without absolute positions may keep their table
    head_keys = re.compile(r"^(cls|lm_predictions|mask_predictions|pooler|classifier)\.|"
                           r"^embeddings\.position_embeddings\.")
    unbuilt = (Unbuilt("conv_kernel_size", lambda v: v is None or (isinstance(v, int) and (v == 0 or v % 2 == 1)),
                       "0 or an odd kernel (the convolution keeps the sequence length)"),)
    guess_rank = 0  # disentangled attention
    # DeBERTa-v3-shaped at test size (relative positions with log buckets)
    sizes = {"debug-deberta-v3": dict(
        family="encoder", norm="layernorm", norm_eps=1e-7, activation="gelu", position="none", attention_bias=True,
        mlp_bias=True, pre_norm=False, embedding_norm=True, final_norm=False, type_vocab_size=0, pooler=True,
        pooler_activation="gelu", disentangled=dict(relative_attention=True, pos_att_type=["p2c", "c2p"],
                                                    position_buckets=256, share_att_key=True, rel_norm=True),
        vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position_embeddings=512, dropout=0.0)}

    def guess(self, c: ModelConfig) -> bool:
        return c.disentangled is not None

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        num_labels = num_labels_of(hf) if head == "cls" else 0
        h = int(hf.get("hidden_size", 1536))
        emb = hf.get("embedding_size", h)
        heads = int(hf.get("num_attention_heads", 24))
        bad = []
        if emb is not None and int(emb) != h:
            bad.append(f"embedding_size={emb} (built: embeddings of hidden_size={h}, no embed_proj)")
        if hf.get("attention_head_size") is not None and int(hf["attention_head_size"]) * heads != h:
            bad.append(f"attention_head_size={hf['attention_head_size']} (built: hidden_size / num_attention_heads)")
        norm_rel = [x.strip() for x in str(hf.get("norm_rel_ebd", "none")).lower().split("|")]
        if not set(norm_rel) <= set(_NORM_REL):
            bad.append(f"norm_rel_ebd={hf['norm_rel_ebd']!r} (built: none, layer_norm)")
        if bad:
            raise ValueError(f"{where}: {'; '.join(bad)} is not supported for deberta-v2")
        dropout = float(hf.get("hidden_dropout_prob", 0.1))
        cls_drop = hf.get("cls_dropout")
        dis = DisentangledConfig(relative_attention=bool(hf.get("relative_attention", False)),
                                 pos_att_type=_pos_att_type(hf.get("pos_att_type")),
                                 position_buckets=int(hf.get("position_buckets", -1)),
                                 max_relative_positions=int(hf.get("max_relative_positions", -1)),
                                 share_att_key=bool(hf.get("share_att_key", False)), rel_norm="layer_norm" in norm_rel,
                                 conv_kernel_size=int(hf.get("conv_kernel_size") or 0),
                                 conv_groups=int(hf.get("conv_groups", 1)),
                                 conv_activation=pooler_act(hf.get("conv_act", "tanh")))
        return ModelConfig(
            family="encoder", vocab_size=int(hf.get("vocab_size", 128100)), hidden_size=h,
            num_layers=int(hf.get("num_hidden_layers", 24)), num_heads=heads,
            intermediate_size=int(hf.get("intermediate_size", 6144)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)), norm="layernorm",
            norm_eps=float(hf.get("layer_norm_eps", 1e-7)),
            activation=plain_act(hf.get("hidden_act", "gelu")),  # type: ignore[arg-type]
            position="learned" if hf.get("position_biased_input", True) else "none", attention_bias=True, mlp_bias=True,
            tie_embeddings=False, pre_norm=False, embedding_norm=True, final_norm=False,
            type_vocab_size=int(hf.get("type_vocab_size", 0)), disentangled=dis,
            pooler=head == "cls", pooler_activation=pooler_act(hf.get("pooler_hidden_act", "gelu")),
            pooler_dropout=float(hf.get("pooler_dropout", 0.0)), num_labels=num_labels, dropout=dropout,
            classifier_dropout=None if cls_drop is None else float(cls_drop),
            initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
        )

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        dis = c.disentangled
        if dis is None:
            raise ValueError("deberta-v2 needs disentangled attention (ModelConfig.disentangled)")
        cls_dropout = c.dropout if c.classifier_dropout is None else c.classifier_dropout
        hf: dict[str, Any] = dict(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
            hidden_act=PLAIN_ACT_TO_HF.get(c.activation, c.activation), hidden_dropout_prob=c.dropout,
            attention_probs_dropout_prob=c.dropout, max_position_embeddings=c.max_position_embeddings,
            type_vocab_size=c.type_vocab_size, layer_norm_eps=c.norm_eps, position_biased_input=c.position == "learned",
            relative_attention=dis.relative_attention, pos_att_type=list(dis.pos_att_type),
            position_buckets=dis.position_buckets, max_relative_positions=dis.max_relative_positions,
            share_att_key=dis.share_att_key, norm_rel_ebd="layer_norm" if dis.rel_norm else "none",
            **({"conv_kernel_size": dis.conv_kernel_size, "conv_groups": dis.conv_groups,
                "conv_act": pooler_act_to_hf(dis.conv_activation)} if dis.conv_kernel_size else {}),
            pooler_hidden_act=pooler_act_to_hf(c.pooler_activation),
            pooler_dropout=cls_dropout if c.pooler_dropout is None else c.pooler_dropout, pooler_hidden_size=c.hidden_size,
            cls_dropout=c.classifier_dropout,
            tie_word_embeddings=False,
        )
        return hf

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        dis = c.disentangled
        assert dis is not None
        e: list[Entry | Stacked | Fused] = list(lin("embeddings.word_embeddings", "embed_tokens", False))
        if c.position == "learned":
            e += lin("embeddings.position_embeddings", "embed_positions", False)
        if c.type_vocab_size > 0:
            e += lin("embeddings.token_type_embeddings", "embed_token_types", False)
        e += lin("embeddings.LayerNorm", "embed_norm", True)
        own = dis.relative_attention and not dis.share_att_key
        for i in range(c.num_layers):
            p, q = f"encoder.layer.{i}", f"layers.{i}"
            for hn, n in (("query_proj", "q_proj"), ("key_proj", "k_proj"), ("value_proj", "v_proj")):
                e += lin(f"{p}.attention.self.{hn}", f"{q}.self_attn.{n}", True)
            if own and "c2p" in dis.pos_att_type:
                e += lin(f"{p}.attention.self.pos_key_proj", f"{q}.self_attn.pos_key_proj", True)
            if own and "p2c" in dis.pos_att_type:
                e += lin(f"{p}.attention.self.pos_query_proj", f"{q}.self_attn.pos_query_proj", True)
            e += lin(f"{p}.attention.output.dense", f"{q}.self_attn.o_proj", True)
            e += lin(f"{p}.attention.output.LayerNorm", f"{q}.attn_norm", True)
            e += lin(f"{p}.intermediate.dense", f"{q}.mlp.up_proj", True)
            e += lin(f"{p}.output.dense", f"{q}.mlp.down_proj", True)
            e += lin(f"{p}.output.LayerNorm", f"{q}.mlp_norm", True)
        if dis.conv_kernel_size and c.num_layers:
            e += lin("encoder.conv.conv", "layers.0.conv.conv", True)
            e += lin("encoder.conv.LayerNorm", "layers.0.conv.norm", True)
        if dis.relative_attention:
            e += lin("encoder.rel_embeddings", "rel_embeddings", False)
            if dis.rel_norm:
                e += lin("encoder.LayerNorm", "rel_norm", True)
        if c.pooler and head == "cls":  # a base class has no pooler (a classification run's is fresh)
            e += lin("pooler.dense", "pooler", c.pooler_bias, group="pooler", top=True)
        if c.num_labels > 0 and head == "cls":
            e += lin("classifier", "classifier", True, group="classifier", top=True)
        return e


RECORDS = (DebertaV2(),)
