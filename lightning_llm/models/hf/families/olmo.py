"""OLMo 2 and OLMo 3 (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM`` and their ``...Model``): ``config.json`` <->
:class:`ModelConfig` and their blocks' norm names.

An OLMo 2/3 block norms each branch's output, not its input (``branch_input_norm=False``,
``branch_output_norm=True``)::

    x = x + post_attention_layernorm(attn(x))
    x = x + post_feedforward_layernorm(mlp(x))

Its attention norms q and k over the whole projection before splitting the heads (``q_norm`` [N*D], ``k_norm``
[K*D]: ``qk_norm_over="projection"``, as OLMoE), biases on q/k/v/o when ``attention_bias``; every RMSNorm multiplies
by its weight in fp32 before casting (``norm_weight_fp32``). ``clip_qkv`` is not read by transformers' OLMo 2/3 (it
is ignored here too, with a warning).

OLMo 3 adds sliding-window layers (``layer_types``: by default every fourth layer full, the others sliding over
``sliding_window``, 4096 by default) and rope parameters per layer type (``rope_parameters`` nested by
``full_attention`` / ``sliding_attention``; a legacy ``rope_scaling`` applies to the full layers only, the sliding
ones keeping plain RoPE): the full layers' are the model's, the sliding layers' ``sliding_rope`` where they differ
(read by ``decoders.layer_type_rope``). Its default ``rope_theta`` is 500000.
"""

from __future__ import annotations

import logging
from typing import Any

from ...config import ModelConfig

log = logging.getLogger(__name__)

__all__ = ["OLMO_KINDS", "OLMO_NORMS", "olmo_from_hf", "olmo_to_hf"]

OLMO_KINDS = ("olmo2", "olmo3")
OLMO_NORMS = (("post_attention_layernorm", "attn_out_norm"), ("post_feedforward_layernorm", "mlp_out_norm"))
"""An OLMo 2/3 block's norms: (HF name, ours)."""


def _layer_types(hf: dict[str, Any], num_layers: int) -> list[str]:
    """``Olmo3Config``'s layer types: as given, else every fourth layer full and the others sliding."""
    types = hf.get("layer_types")
    if types is None:
        return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
    return list(types)[:num_layers]


def olmo_from_hf(hf: dict[str, Any], kind: str, num_layers: int, *, where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of an ``olmo2`` / ``olmo3`` config beyond (and overriding) the LLaMA-layout
    ones; the rope parameters are the caller's (OLMo 3's per layer type)."""
    heads = int(hf["num_attention_heads"])
    if hf.get("clip_qkv") is not None:
        log.warning("%s: clip_qkv=%s is not read by transformers' %s (no clamping of q/k/v), nor here", where,
                    hf["clip_qkv"], kind)
    kw: dict[str, Any] = dict(
        head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, qk_norm_over="projection",
        branch_input_norm=False, branch_output_norm=True, norm_weight_fp32=True,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), sliding_window=None, layer_types=None)
    if kind == "olmo3" and hf.get("sliding_window", 4096) is not None:
        types = _layer_types(hf, num_layers)
        kw.update(sliding_window=int(hf.get("sliding_window", 4096)), layer_types=types)
    return kw


def olmo_to_hf(c: ModelConfig, kind: str) -> dict[str, Any]:
    """The ``config.json`` fields of ``olmo2`` / ``olmo3`` beyond the LLaMA-layout ones (OLMo 3's rope parameters
    nested by layer type)."""
    hf: dict[str, Any] = dict(attention_bias=c.attention_bias)
    if kind == "olmo3":
        full = {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta}
        sliding = dict(c.sliding_rope) if c.sliding_rope is not None else dict(full)
        sliding.setdefault("rope_type", "default")
        sliding.setdefault("rope_theta", c.rope_theta)
        sliding_layers = c.sliding_layers
        hf.update(sliding_window=c.sliding_window if sliding_layers else None,
                  layer_types=["sliding_attention" if i in sliding_layers else "full_attention"
                               for i in range(c.num_layers)],
                  rope_parameters={"full_attention": full, "sliding_attention": sliding})
    return hf
