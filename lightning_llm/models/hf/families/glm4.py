"""GLM-4 (``Glm4ForCausalLM``, ``Glm4Model``: GLM-4-9B-0414 and GLM-4-32B-0414): ``config.json`` <->
:class:`ModelConfig` and its block's weight names.

A GLM-4 block norms each branch's input and output (``branch_output_norm``)::

    x = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))

Its attention is grouped-query with q/k/v biases (``attention_bias``, true by default; ``o_proj`` never) and rotary
embedding on the first ``partial_rotary_factor`` (0.5 when absent) of each head, its dims paired as ``(x0, x1),
(x2, x3), ...`` (``rope_interleave``: transformers' ``modeling_glm4.apply_rotary_pos_emb`` repeats each frequency
twice and rotates neighbours), unlike GLM-4.5's halves. Its MLP stores gate and up as one ``gate_up_proj``
(Phi-3's layout: :func:`~.phi3.fused_mlp_entries`).
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.entries import Entry
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from ..record.readers import partial_rotary_factor
from .llama import Llama
from .phi3 import fused_mlp_entries

__all__ = ["Glm4", "RECORDS"]


class Glm4(Llama):
    model_type = "glm4"
    label = "GLM-4 (0414)"
    classes = decoder_classes("Glm4")
    unbuilt = (PLAIN_WEIGHTS,)
    fused_in_hf = {"gate_up_proj": ("gate_proj", "up_proj")}
    norms = (("input_layernorm", "attn_norm"), ("post_self_attn_layernorm", "attn_out_norm"),
             ("post_attention_layernorm", "mlp_norm"), ("post_mlp_layernorm", "mlp_out_norm"))
    head_dim = 128
    max_positions = 131072
    norm_eps = 0.00000015625
    partial_rotary = True
    # rotary pairs, q/k/v biases and norms on both sides of each branch
    sizes = {"debug-glm4": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5,
        rope_interleave=True, attention_bias=True, o_bias=False, branch_output_norm=True)}
    tiny = "debug-glm4"

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        return dict(attention_bias=bool(hf.get("attention_bias", True)), o_bias=False,
                    partial_rotary_factor=partial_rotary_factor(hf, 0.5), rope_interleave=True,
                    branch_output_norm=True, sliding_window=None, layer_types=None)

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """``partial_rotary_factor`` always written: its absence means 0.5."""
        return {"rope_type": "default", **dict(c.rope_scaling or {}), "rope_theta": c.rope_theta,
                "partial_rotary_factor": c.partial_rotary_factor}

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias)

    def mlp_entries(self, c: ModelConfig, p: str) -> list[Entry]:
        return fused_mlp_entries(c, p)


RECORDS = (Glm4(),)
