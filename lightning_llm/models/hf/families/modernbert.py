"""ModernBERT (``modernbert``: ``ModernBertModel``, ``ModernBertForSequenceClassification``): ``config.json`` and
weight names <-> a pre-norm :class:`~lightning_llm.models.EncoderModel` with rotary positions, global and
sliding-window layers (``layer_types``, ``local_attention``; each kind its own rope theta) and a GLU feed-forward.

transformers' keys (under ``model.`` in the head classes): ``embeddings.tok_embeddings``, ``embeddings.norm``,
``layers.N.attn_norm`` (none in layer 0: the embeddings arrive normed), ``layers.N.attn.Wqkv`` (rows ``[q; k; v]``,
split into our ``q_proj``/``k_proj``/``v_proj``), ``layers.N.attn.Wo``, ``layers.N.mlp_norm``, ``layers.N.mlp.Wi``
(rows ``[input; gate]``: the activated half is our ``gate_proj``, the other our ``up_proj``), ``layers.N.mlp.Wo``,
``final_norm``; the classifier's ``head.dense``, ``head.norm`` (our ``pooler``, ``pooler_norm``) and ``classifier``
at the top. Splitting the fused projections into row blocks keeps tensor parallelism's plain plan (whole heads, the
GLU's halves split alike) and lets a lazy load read only a rank's rows of each block.
"""

from __future__ import annotations

import re
from typing import Any

from ...config import ModelConfig
from ..record.entries import Entry, Fused, Stacked, lin, row_split
from ..record.family import Family, encoder_classes
from ..record.options import Unbuilt, one_of
from ..record.readers import num_labels_of
from .deberta import pooler_act, pooler_act_to_hf

__all__ = ["ModernBert", "RECORDS"]

_GLU = {"gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "silu": "swiglu"}
_GLU_TO_HF = {"geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh", "swiglu": "silu"}
_DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # transformers' default_theta


def _layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = int(hf.get("global_attn_every_n_layers", 3))
    return ["sliding_attention" if i % every else "full_attention" for i in range(layers)]


def _thetas(hf: dict[str, Any], where: str) -> dict[str, float]:
    """Each layer kind's rope theta: ``rope_parameters`` (per kind), else ``global_rope_theta``/``local_rope_theta``;
    any rope type but ``default`` (and a legacy ``rope_scaling``) is refused."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = {"full_attention": hf.get("global_rope_theta"), "sliding_attention": hf.get("local_rope_theta")}
    if hf.get("rope_scaling"):
        raise ValueError(f"{where}: rope_scaling={hf['rope_scaling']!r} is not supported for modernbert (built: "
                         "default rope)")
    out = {}
    for kind, default in _DEFAULT_THETA.items():
        p = dict(params.get(kind) or {})
        kind_type = p.get("rope_type", p.get("type", "default"))
        if kind_type != "default":
            raise ValueError(f"{where}: rope_parameters[{kind!r}] rope_type={kind_type!r} is not supported for "
                             "modernbert (built: default rope)")
        theta = p.get("rope_theta", legacy[kind])
        out[kind] = float(default if theta is None else theta)
    return out


class ModernBert(Family):
    model_type = "modernbert"
    label = "ModernBERT"
    group = "encoder"
    family = "encoder"
    classes = encoder_classes("ModernBert")
    default_class = "ModernBertModel"
    head_keys = re.compile(r"^(head|decoder|classifier)\.")
    unbuilt = tuple(
        Unbuilt(key, one_of(0, 0.0, None), "ModernBERT without dropout, as published (--model.dropout sets the "
                "encoder's one dropout: embeddings, attention, residual branches)")
        for key in ("embedding_dropout", "attention_dropout", "mlp_dropout")
    ) + (Unbuilt("classifier_pooling", one_of("cls", "mean"), "cls or mean pooling"),)
    guess_rank = 1  # rotary positions
    # global and sliding layers with their own rope theta, the GLU feed-forward and the prediction head, at test size
    sizes = {"debug-modernbert": dict(
        family="encoder", norm="layernorm", norm_eps=1e-5, norm_bias=False, activation="geglu", position="rope",
        rope_theta=160000.0, sliding_window=128, sliding_rope={"rope_type": "default", "rope_theta": 10000.0},
        pre_norm=True, embedding_norm=True, final_norm=True, pooler=True, pooler_activation="gelu",
        pooler_bias=False, pooler_norm=True, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4,
        intermediate_size=96, max_position_embeddings=8192, layer_types=["full_attention", "sliding_attention"])}

    def guess(self, c: ModelConfig) -> bool:
        return c.position == "rope"

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        num_labels = num_labels_of(hf) if head == "cls" else 0
        layers = int(hf.get("num_hidden_layers", 22))
        act = hf.get("hidden_activation", "gelu")
        if act not in _GLU:
            raise ValueError(f"{where}: hidden_activation={act!r} is not supported for modernbert (built: "
                             f"{', '.join(_GLU)})")
        types = _layer_types(hf, layers)
        thetas = _thetas(hf, where)
        sliding = any(t == "sliding_attention" for t in types)
        norm_bias = bool(hf.get("norm_bias", False))
        return ModelConfig(
            family="encoder", vocab_size=int(hf.get("vocab_size", 50368)), hidden_size=int(hf.get("hidden_size", 768)),
            num_layers=layers, num_heads=int(hf.get("num_attention_heads", 12)),
            intermediate_size=int(hf.get("intermediate_size", 1152)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)), norm="layernorm",
            norm_eps=float(hf.get("norm_eps", 1e-5)), norm_bias=norm_bias, activation=_GLU[act],  # type: ignore[arg-type]
            position="rope", rope_theta=thetas["full_attention"],
            sliding_rope={"rope_type": "default", "rope_theta": thetas["sliding_attention"]} if sliding else None,
            sliding_window=int(hf.get("local_attention", 128)) if sliding else None, layer_types=types if sliding else None,
            attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
            tie_embeddings=False, pre_norm=True, embedding_norm=True, final_norm=True, type_vocab_size=0,
            pooler=head == "cls", pooling=hf.get("classifier_pooling", "cls"),
            pooler_activation=pooler_act(hf.get("classifier_activation", "gelu")),
            pooler_bias=bool(hf.get("classifier_bias", False)), pooler_norm=True, num_labels=num_labels,
            dropout=float(hf.get("attention_dropout", 0.0)), classifier_dropout=float(hf.get("classifier_dropout", 0.0)),
            initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
        )

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        if not c.gated or c.activation not in _GLU_TO_HF:
            raise ValueError(f"modernbert needs a GLU feed-forward (geglu, geglu_tanh, swiglu), got {c.activation!r}")
        types = list(c.layer_types) if c.layer_types is not None and c.sliding_window is not None \
            else ["full_attention"] * c.num_layers
        local = float((c.sliding_rope or {}).get("rope_theta", c.rope_theta))
        return dict(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, hidden_activation=_GLU_TO_HF[c.activation],
            max_position_embeddings=c.max_position_embeddings, norm_eps=c.norm_eps, norm_bias=c.norm_bias,
            attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, layer_types=types,
            local_attention=c.sliding_window if c.sliding_window is not None else 128,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta": local}},
            classifier_pooling=c.pooling, classifier_bias=c.pooler_bias,
            classifier_activation=pooler_act_to_hf(c.pooler_activation),
            classifier_dropout=c.dropout if c.classifier_dropout is None else c.classifier_dropout,
            attention_dropout=c.dropout, embedding_dropout=0.0, mlp_dropout=0.0, tie_word_embeddings=False,
        )

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        nb = c.norm_bias
        e: list[Entry | Stacked | Fused] = list(lin("embeddings.tok_embeddings", "embed_tokens", False))
        e += lin("embeddings.norm", "embed_norm", nb)
        for i in range(c.num_layers):
            p, q = f"layers.{i}", f"layers.{i}"
            if i > 0:
                e += lin(f"{p}.attn_norm", f"{q}.attn_norm", nb)
            qkv = tuple(f"{q}.self_attn.{n}_proj" for n in "qkv")
            e.append(row_split(f"{p}.attn.Wqkv.weight", tuple(f"{n}.weight" for n in qkv)))
            if c.attention_bias:
                e.append(row_split(f"{p}.attn.Wqkv.bias", tuple(f"{n}.bias" for n in qkv)))
            e += lin(f"{p}.attn.Wo", f"{q}.self_attn.o_proj", bool(c.o_bias))
            e += lin(f"{p}.mlp_norm", f"{q}.mlp_norm", nb)
            glu = (f"{q}.mlp.gate_proj", f"{q}.mlp.up_proj")  # Wi = [input (activated); gate]
            e.append(row_split(f"{p}.mlp.Wi.weight", tuple(f"{n}.weight" for n in glu)))
            if c.mlp_bias:
                e.append(row_split(f"{p}.mlp.Wi.bias", tuple(f"{n}.bias" for n in glu)))
            e += lin(f"{p}.mlp.Wo", f"{q}.mlp.down_proj", c.mlp_bias)
        e += lin("final_norm", "final_norm", nb)
        if c.pooler and head == "cls":  # a base class has no pooler (a classification run's is fresh)
            e += lin("head.dense", "pooler", c.pooler_bias, group="pooler", top=True)
            if c.pooler_norm:
                e += lin("head.norm", "pooler_norm", nb, group="pooler", top=True)
        if c.num_labels > 0 and head == "cls":
            e += lin("classifier", "classifier", True, group="classifier", top=True)
        return e


RECORDS = (ModernBert(),)
