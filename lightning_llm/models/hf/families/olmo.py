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
(:func:`layer_type_rope`). Its default ``rope_theta`` is 500000.
"""

from __future__ import annotations

import logging
from typing import Any

from ...config import ModelConfig
from ...layers.rope import rope_type
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from ..record.readers import layer_types, rope_from_hf
from .llama import Llama

log = logging.getLogger(__name__)

__all__ = ["Olmo2", "Olmo3", "RECORDS", "layer_type_rope"]


def layer_type_rope(hf: dict[str, Any], kind: str, *, default_theta: float,
                    where: str) -> tuple[float, dict[str, Any] | None, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling, sliding_rope)`` of a config whose ``rope_parameters`` are nested by layer type
    (``full_attention`` / ``sliding_attention``, OLMo 3's; a legacy top-level ``rope_scaling`` applies to the full
    layers, the sliding ones keeping plain RoPE, as ``Olmo3Config`` reads it): the full layers' are the model's, the
    sliding layers' are ``sliding_rope`` where they differ."""
    nested = hf.get("rope_parameters") or {}
    default = {"rope_theta": default_theta}
    if nested and not {"full_attention", "sliding_attention"} & set(nested):
        raise ValueError(f"{where}: rope_parameters={nested} is not nested by layer type (full_attention, "
                         f"sliding_attention), as {kind} reads them")
    full_params = nested.get("full_attention") or {**dict(hf.get("rope_scaling") or {}),
                                                   "rope_theta": hf.get("rope_theta", default_theta)}
    sliding_params = nested.get("sliding_attention") or {"rope_theta": hf.get("rope_theta", default_theta)}
    ropes = []
    for params in (full_params, sliding_params):
        flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        theta, scaling = rope_from_hf({**flat, "rope_parameters": dict(params)}, default=default)
        if rope_type(scaling) in ("dynamic", "longrope"):  # Olmo3RotaryEmbedding never updates its frequencies
            raise ValueError(f"{where}: rope_type={rope_type(scaling)!r} is not supported for {kind} (its rotary "
                             "embedding keeps the frequencies it starts with)")
        ropes.append((theta, scaling))
    (theta, scaling), sliding = ropes
    if sliding == ropes[0]:
        return theta, scaling, None
    return theta, scaling, {"rope_theta": sliding[0], **(sliding[1] or {"rope_type": "default"})}


class Olmo2(Llama):
    model_type = "olmo2"
    label = "OLMo 2"
    classes = decoder_classes("Olmo2")
    unbuilt = (PLAIN_WEIGHTS,)
    norms = (("post_attention_layernorm", "attn_out_norm"), ("post_feedforward_layernorm", "mlp_out_norm"))

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        heads = int(hf["num_attention_heads"])
        if hf.get("clip_qkv") is not None:
            log.warning("%s: clip_qkv=%s is not read by transformers' %s (no clamping of q/k/v), nor here", where,
                        hf["clip_qkv"], self.model_type)
        return dict(
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, qk_norm_over="projection",
            branch_input_norm=False, branch_output_norm=True, norm_weight_fp32=True,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)), sliding_window=None, layer_types=None)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias)


class Olmo3(Olmo2):
    model_type = "olmo3"
    label = "OLMo 3"
    classes = decoder_classes("Olmo3")
    # output norms, q/k norms over the projection, sliding layers (window 8) with plain RoPE beside YaRN on the full
    # one
    sizes = {"debug-olmo3": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, rope_theta=500000.0, qk_norm=True, qk_norm_over="projection",
        branch_input_norm=False, branch_output_norm=True, norm_weight_fp32=True, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        sliding_rope={"rope_type": "default", "rope_theta": 500000.0})}
    tiny = "debug-olmo3"

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        theta, scaling, sliding = layer_type_rope(hf, self.model_type, default_theta=500000.0, where=where)
        return dict(rope_theta=theta, rope_scaling=scaling, sliding_rope=sliding)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        kw = super().fields_from_hf(hf, num_layers, where)
        if hf.get("sliding_window", 4096) is not None:  # Olmo3Config: every fourth layer full, the others sliding
            types = hf.get("layer_types")
            if types is None:
                types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
            kw.update(sliding_window=int(hf.get("sliding_window", 4096)), layer_types=list(types)[:num_layers])
        return kw

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """Its rope parameters nested by layer type."""
        full = {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta}
        sliding = dict(c.sliding_rope) if c.sliding_rope is not None else dict(full)
        sliding.setdefault("rope_type", "default")
        sliding.setdefault("rope_theta", c.rope_theta)
        return dict(attention_bias=c.attention_bias, sliding_window=c.sliding_window if c.sliding_layers else None,
                    layer_types=layer_types(c), rope_parameters={"full_attention": full, "sliding_attention": sliding})


RECORDS = (Olmo2(), Olmo3())
