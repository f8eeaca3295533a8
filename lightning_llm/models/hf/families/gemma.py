"""HF ``config.json`` <-> :class:`ModelConfig` for Gemma 2 (``Gemma2ForCausalLM``, model type ``gemma2``) and
Gemma 3's language model (``Gemma3ForCausalLM``, ``gemma3_text``; the ``text_config`` of ``Gemma3ForConditionalGeneration``,
the class of every Gemma 3 checkpoint from 4B up: :mod:`..multimodal`).

Both keep LLaMA's module names for the projections (``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj`` ...) and
differ from it in switches of one :class:`~lightning_llm.models.DecoderLM`, as transformers' modeling files compute
them:

=========================  ===========================================================================================
RMSNorm ``(1 + weight)``   scale applied in fp32, then cast (``norm_offset=1``; q/k norms too)
embedding scale            ``embed_tokens(ids) * sqrt(hidden)`` rounded to the weight's dtype (``scale_embeddings``)
four norms per layer       ``input_layernorm`` (attn_norm), ``post_attention_layernorm`` (attn_out_norm: the
                           attention's *output*), ``pre_feedforward_layernorm`` (mlp_norm), ``post_feedforward_layernorm``
                           (mlp_out_norm): each branch's input and output normed (``branch_output_norm``)
softmax scale              ``query_pre_attn_scalar ** -0.5``
sliding / full layers      ``layer_types`` (Gemma 2: every other layer slides; Gemma 3: 5 of 6,
                           ``sliding_window_pattern``), window ``sliding_window``
Gemma 3 rope               full layers ``rope_parameters.full_attention`` (1e6, ``linear`` for 4B+), sliding layers
                           their own base (``sliding_attention``, legacy ``rope_local_base_freq``: ``sliding_rope``)
qk-norm                    Gemma 3 (per head, ``(1 + weight)``)
soft-capping               Gemma 2: ``attn_logit_softcapping`` (scores: the eager path) and
                           ``final_logit_softcapping`` (logits, the fused loss's chunks, generation); Gemma 3's
                           ``final_logit_softcapping`` when set (``Gemma3ForCausalLM`` applies it,
                           ``Gemma3ForConditionalGeneration`` does not: :mod:`..multimodal` drops it there)
GeGLU                      ``hidden_activation`` ``gelu_pytorch_tanh`` (``geglu_tanh``) or ``gelu``
tied head                  ``tie_word_embeddings`` (true by default: the 256k/262k vocabularies are one matrix)
=========================  ===========================================================================================

Refused in one line (:mod:`..options`): ``use_bidirectional_attention`` (EmbeddingGemma's encoder mode), a
``quantization_config``; and here: a scaled rope on the sliding layers, sliding layers without a window (Gemma 3).
"""

from __future__ import annotations

import logging
from typing import Any

from ...config import ModelConfig
from ..options import refuse_unbuilt
from .decoders import rope_from_hf

log = logging.getLogger(__name__)

__all__ = ["GEMMA_KINDS", "GEMMA_NORMS", "gemma_config_from_hf", "gemma_config_to_hf"]

GEMMA_KINDS = ("gemma2", "gemma3_text")
GEMMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_out_norm"),
               ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_out_norm"))
"""A Gemma block's four norms: (HF name, ours)."""

# transformers' config-class defaults of the keys read here (a config.json may omit them): Gemma2Config,
# Gemma3TextConfig (5.24)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   attention_bias=False, attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                        initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                        attention_dropout=0.0, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None),
}
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
"""Gemma3TextConfig's ``default_theta`` (global, local)."""
_ACTIVATIONS = {"gelu_pytorch_tanh": "geglu_tanh", "gelu": "geglu"}


def _get(hf: dict[str, Any], kind: str, key: str) -> Any:
    return hf[key] if key in hf else _DEFAULTS[kind][key]


def _layer_types(hf: dict[str, Any], kind: str, layers: int) -> list[str]:
    """``layer_types`` as the config classes resolve them: Gemma 2 slides on every other layer, Gemma 3 on all but
    every ``sliding_window_pattern``-th (6)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = 2 if kind == "gemma2" else int(hf.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]


def _gemma3_rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None, float]:
    """``(theta, scaling)`` of the full layers and the sliding layers' base, from ``rope_parameters`` per layer type
    or the legacy ``rope_theta`` / ``rope_scaling`` (the full layers') / ``rope_local_base_freq``, as
    ``Gemma3TextConfig.convert_rope_params_to_dict`` reads them."""
    params = dict(hf.get("rope_parameters") or {})
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", _THETA["full_attention"]))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", _THETA["sliding_attention"]))
    positions = {"max_position_embeddings": hf.get("max_position_embeddings", 131072)}
    theta, scaling = rope_from_hf({**positions, "rope_parameters": full})
    local_theta, local_scaling = rope_from_hf({**positions, "rope_parameters": local})
    if local_scaling is not None:
        raise ValueError(f"{where}: rope_parameters.sliding_attention.rope_type={local_scaling['rope_type']!r} is not "
                         "supported for gemma3_text (built: the default rope on the sliding layers)")
    return theta, scaling, local_theta


def gemma_config_from_hf(hf: dict[str, Any], kind: str, *, extra: dict[str, Any], pad: int,
                         where: str = "config") -> ModelConfig:
    """:class:`ModelConfig` of a Gemma 2 / Gemma 3 text ``config.json`` (``kind`` in :data:`GEMMA_KINDS`)."""
    refuse_unbuilt(hf, kind, where)
    layers = int(_get(hf, kind, "num_hidden_layers"))
    heads = int(_get(hf, kind, "num_attention_heads"))
    act = _get(hf, kind, "hidden_activation")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{where}: hidden_activation={act!r} is not supported for {kind} (supported: "
                         f"{', '.join(_ACTIVATIONS)})")
    window = _get(hf, kind, "sliding_window")
    types = _layer_types(hf, kind, layers)
    if kind == "gemma3_text":
        theta, scaling, local_theta = _gemma3_rope(hf, where)
        if window is None and "sliding_attention" in types:
            raise ValueError(f"{where}: sliding_window=null with sliding_attention layers is not supported for "
                             "gemma3_text (their rope is the local one, their mask would be undefined)")
    else:
        theta, scaling = rope_from_hf(hf)
        local_theta = None

    def cap(key: str) -> float | None:
        value = _get(hf, kind, key)
        return None if value is None else float(value)

    return ModelConfig(
        family="decoder", vocab_size=int(_get(hf, kind, "vocab_size")), hidden_size=int(_get(hf, kind, "hidden_size")),
        num_layers=layers, num_heads=heads, num_kv_heads=int(_get(hf, kind, "num_key_value_heads") or heads),
        head_dim=int(_get(hf, kind, "head_dim")), intermediate_size=int(_get(hf, kind, "intermediate_size")),
        max_position_embeddings=int(_get(hf, kind, "max_position_embeddings")), norm="rmsnorm",
        norm_eps=float(_get(hf, kind, "rms_norm_eps")), norm_offset=1.0, activation=_ACTIVATIONS[act],
        position="rope", rope_theta=theta, rope_scaling=scaling,
        sliding_rope=None if local_theta is None else {"rope_type": "default", "rope_theta": local_theta},
        attention_bias=bool(_get(hf, kind, "attention_bias")), qk_norm=kind == "gemma3_text",
        sliding_window=None if window is None else int(window), layer_types=None if window is None else types,
        tie_embeddings=bool(_get(hf, kind, "tie_word_embeddings")), pre_norm=True, final_norm=True,
        scale_embeddings=True, branch_output_norm=True,
        query_pre_attn_scalar=float(_get(hf, kind, "query_pre_attn_scalar")),
        attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"),
        dropout=float(_get(hf, kind, "attention_dropout") or 0.0),
        initializer_range=float(_get(hf, kind, "initializer_range")), pad_token_id=pad, extra=extra,
    )


def _number(x: float) -> int | float:
    """An integral value as an int (transformers' strict config fields type ``query_pre_attn_scalar`` as int)."""
    return int(x) if float(x).is_integer() else float(x)


def gemma_config_to_hf(c: ModelConfig, kind: str) -> dict[str, Any]:
    """The architecture fields of a Gemma 2 / Gemma 3 text ``config.json`` (the caller checks representability)."""
    sliding = c.sliding_layers
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope = {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
    hf: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, hidden_activation={v: k for k, v in _ACTIVATIONS.items()}.get(c.activation, c.activation),
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings, attention_bias=c.attention_bias, attention_dropout=c.dropout,
        query_pre_attn_scalar=_number(c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None
                                      else c.head_dim),
        sliding_window=c.sliding_window if sliding else None,
        layer_types=["sliding_attention" if i in sliding else "full_attention" for i in range(c.num_layers)],
        final_logit_softcapping=c.final_logit_softcap, attn_logit_softcapping=c.attn_logit_softcap,
        use_bidirectional_attention=False,
    )
    if kind == "gemma3_text":
        local = float((c.sliding_rope or {}).get("rope_theta", c.rope_theta))
        hf["rope_parameters"] = {"full_attention": rope,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    else:
        hf["rope_parameters"] = rope
    return hf
