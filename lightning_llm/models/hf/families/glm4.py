"""GLM-4 (``Glm4ForCausalLM``, ``Glm4Model``: GLM-4-9B-0414 and GLM-4-32B-0414): ``config.json`` <->
:class:`ModelConfig` and its block's weight names.

A GLM-4 block norms each branch's input and output (``branch_output_norm``)::

    x = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))

Its attention is grouped-query with q/k/v biases (``attention_bias``, true by default; ``o_proj`` never) and rotary
embedding on the first ``partial_rotary_factor`` (0.5 when absent) of each head, its dims paired as ``(x0, x1),
(x2, x3), ...`` (``rope_interleave``: transformers' ``modeling_glm4.apply_rotary_pos_emb`` repeats each frequency
twice and rotates neighbours), unlike GLM-4.5's halves. Its MLP stores gate and up as one ``gate_up_proj``
(Phi-3's layout: :func:`~.phi3.phi3_mlp_entries`).
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from .deepseek import partial_rotary_factor

__all__ = ["GLM4_FUSED", "GLM4_NORMS", "glm4_from_hf", "glm4_to_hf"]

GLM4_FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}
"""GLM-4's fused HF projection -> our projections it holds (in row order)."""

GLM4_NORMS = (("input_layernorm", "attn_norm"), ("post_self_attn_layernorm", "attn_out_norm"),
              ("post_attention_layernorm", "mlp_norm"), ("post_mlp_layernorm", "mlp_out_norm"))
"""A GLM-4 block's norms: (HF name, ours)."""


def glm4_from_hf(hf: dict[str, Any], kind: str, num_layers: int, *, where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a ``glm4`` config beyond (and overriding) the LLaMA-layout ones
    (``Glm4Config``'s defaults for absent keys)."""
    return dict(head_dim=int(hf.get("head_dim", 128)), attention_bias=bool(hf.get("attention_bias", True)),
                o_bias=False, partial_rotary_factor=partial_rotary_factor(hf), rope_interleave=True,
                branch_output_norm=True, max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
                norm_eps=float(hf.get("rms_norm_eps", 0.00000015625)), sliding_window=None, layer_types=None)


def glm4_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of ``glm4`` beyond the LLaMA-layout ones."""
    rope = {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor}  # always written: its absence means 0.5
    return dict(attention_bias=c.attention_bias, rope_parameters=rope)
