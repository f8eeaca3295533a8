"""``config.json`` readers the families share: activations, rope parameters, the rotary share of a head, layer types,
a classifier's labels."""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ...layers.rope import ROPE_TYPES

__all__ = ["PLAIN_ACT_TO_HF", "GATED_ACT_TO_HF", "gated_act", "layer_types", "num_labels_of", "partial_rotary_factor",
           "plain_act", "rope_from_hf", "rope_to_hf"]

_GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
          "gelu_new": "geglu_tanh", "gelu_fast": "geglu_tanh"}
GATED_ACT_TO_HF = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}
"""Inverse of :func:`gated_act`."""
_PLAIN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
          "relu": "relu"}
PLAIN_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
"""Inverse of :func:`plain_act`."""


def gated_act(name: str) -> str:
    """Our activation for a gated MLP's ``hidden_act``."""
    if name not in _GATED:
        raise ValueError(f"unsupported gated activation hidden_act={name!r} (supported: {', '.join(_GATED)})")
    return _GATED[name]


def plain_act(name: str) -> str:
    """Our activation for a non-gated MLP's ``hidden_act`` / ``activation_function`` (GPT-2, the encoders)."""
    if name not in _PLAIN:
        raise ValueError(f"unsupported hidden activation {name!r} (supported: {', '.join(_PLAIN)})")
    return _PLAIN[name]


def rope_from_hf(hf: dict[str, Any], *, default: dict[str, Any] | None = None,
                 partial: bool = False) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or legacy ``rope_theta`` +
    ``rope_scaling`` (``default``: the family's parameters when the config has neither); ``original_max_position_
    embeddings`` defaults to ``max_position_embeddings`` as in transformers' ``standardize_rope_params``.
    ``partial``: the family reads ``partial_rotary_factor`` itself (else a value other than 1 is refused)."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**dict(legacy), **params}
    default = default or {}
    if not params.get("rope_type", params.get("type")) and "rope_type" in default:
        params = {**{k: v for k, v in default.items() if k != "rope_theta"}, **params}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default.get("rope_theta", 10000.0))))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    kind = params.get("rope_type", "default")
    if kind not in ROPE_TYPES or kind == "longrope":  # LongRoPE: Phi-3's (its own file reads it)
        supported = ", ".join(t for t in ROPE_TYPES if t != "longrope")
        raise ValueError(f"unsupported rope scaling rope_type={kind!r} for {hf.get('model_type')} (supported: "
                         f"{supported}; longrope for phi3)")
    factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not partial and float(factor or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={factor} (rotary on part of the head dim) is not supported for "
                         f"{hf.get('model_type')} (only Phi-3's, GLM-4's and GLM-4.5's)")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = hf.get("original_max_position_embeddings",
                                                            hf.get("max_position_embeddings"))
    if kind in ("linear", "dynamic") and params.get("factor") is None:
        raise ValueError(f"rope_type={kind!r} needs a 'factor'")
    return theta, params


def rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` of the model's rope (its base and scaling)."""
    if c.rope_scaling:
        return {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
    return {"rope_type": "default", "rope_theta": c.rope_theta}


def partial_rotary_factor(hf: dict[str, Any], default: float) -> float:
    """The rotary share of a head: ``rope_parameters`` (transformers 5), else the top-level key, else the family's
    ``default`` (its config class's)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default))
    return float(default if value is None else value)


def layer_types(c: ModelConfig) -> list[str]:
    """``layer_types`` of a model's sliding and full attention layers."""
    sliding = c.sliding_layers
    return ["sliding_attention" if i in sliding else "full_attention" for i in range(c.num_layers)]


def num_labels_of(hf: dict[str, Any]) -> int:
    """The classes of a ``...ForSequenceClassification`` ``config.json`` dict: ``id2label``'s size, else
    ``num_labels`` (2, transformers' default)."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))
