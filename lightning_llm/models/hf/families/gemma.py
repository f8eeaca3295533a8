"""Gemma 2 (``Gemma2ForCausalLM``, model type ``gemma2``) and Gemma 3's language model (``Gemma3ForCausalLM``,
``gemma3_text``; the ``text_config`` of ``Gemma3ForConditionalGeneration``, the class of every Gemma 3 checkpoint from
4B up, fine-tuned as text: :mod:`..convert.multimodal`; its SigLIP tower and projector copied at export).

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
                           ``Gemma3ForConditionalGeneration`` does not: :mod:`..convert.multimodal` drops it there)
GeGLU                      ``hidden_activation`` ``gelu_pytorch_tanh`` (``geglu_tanh``) or ``gelu``
tied head                  ``tie_word_embeddings`` (true by default: the 256k/262k vocabularies are one matrix)
=========================  ===========================================================================================

Refused in one line (``Family.unbuilt``): ``use_bidirectional_attention`` (EmbeddingGemma's encoder mode), a
``quantization_config``; and here: a scaled rope on the sliding layers, sliding layers without a window (Gemma 3).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from ...config import ModelConfig
from ..record.family import LLAMA_SIZE, Multimodal, NestedLM, decoder_classes
from ..record.options import PLAIN_WEIGHTS, Unbuilt
from ..record.readers import layer_types, rope_from_hf, rope_to_hf
from .llama import Llama

log = logging.getLogger(__name__)

__all__ = ["Gemma2", "Gemma3", "Gemma3Text", "RECORDS"]

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


_SHAPE = dict(LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
              intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, norm_offset=1.0,
              activation="geglu_tanh", tie_embeddings=True, scale_embeddings=True, branch_output_norm=True,
              sliding_window=8)
"""Gemma-shaped at test size: (1 + weight) norms, four per layer, the embedding scaled, GeGLU, sliding and full
layers, tied head."""


class Gemma2(Llama):
    model_type = "gemma2"
    label = "Gemma 2"
    chat_template = "gemma"
    classes = decoder_classes("Gemma2")
    guess_rank = 51  # sqrt(H) embeddings, four norms per layer
    unbuilt = (PLAIN_WEIGHTS, Unbuilt("use_bidirectional_attention", lambda v: not v, "causal attention (the "
                                      "bidirectional encoder mode of EmbeddingGemma is not built)"))
    norms = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_out_norm"),
             ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_out_norm"))
    defaults: ClassVar[dict[str, Any]] = _DEFAULTS["gemma2"]
    """transformers' config-class defaults of the keys read here (a config.json may omit them)."""
    qk_norm: ClassVar[bool] = False
    """Per-head q/k norms (Gemma 3)."""
    # soft-capped scores and logits (caps small enough to bite at this size)
    sizes = {"debug-gemma2": dict(
        _SHAPE, query_pre_attn_scalar=24.0, attn_logit_softcap=5.0, final_logit_softcap=10.0,
        layer_types=["sliding_attention", "full_attention"] * 2)}
    tiny = "debug-gemma2"

    def guess(self, c: ModelConfig) -> bool:
        return c.scale_embeddings

    def get(self, hf: dict[str, Any], key: str) -> Any:
        return hf[key] if key in hf else self.defaults[key]

    def layer_types(self, hf: dict[str, Any], layers: int) -> list[str]:
        """``layer_types`` as the config class resolves them: Gemma 2 slides on every other layer."""
        if hf.get("layer_types"):
            return list(hf["layer_types"])
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        theta, scaling = rope_from_hf(hf)
        return dict(rope_theta=theta, rope_scaling=scaling)

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        layers = int(self.get(hf, "num_hidden_layers"))
        heads = int(self.get(hf, "num_attention_heads"))
        act = self.get(hf, "hidden_activation")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{where}: hidden_activation={act!r} is not supported for {self.model_type} (supported: "
                             f"{', '.join(_ACTIVATIONS)})")
        window = self.get(hf, "sliding_window")
        types = self.layer_types(hf, layers)
        rope = self.rope_from_hf(hf, where)
        if window is None and "sliding_attention" in types and rope.get("sliding_rope") is not None:
            raise ValueError(f"{where}: sliding_window=null with sliding_attention layers is not supported for "
                             f"{self.model_type} (their rope is the local one, their mask would be undefined)")

        def cap(key: str) -> float | None:
            value = self.get(hf, key)
            return None if value is None else float(value)

        return ModelConfig(
            family="decoder", vocab_size=int(self.get(hf, "vocab_size")),
            hidden_size=int(self.get(hf, "hidden_size")), num_layers=layers, num_heads=heads,
            num_kv_heads=int(self.get(hf, "num_key_value_heads") or heads), head_dim=int(self.get(hf, "head_dim")),
            intermediate_size=int(self.get(hf, "intermediate_size")),
            max_position_embeddings=int(self.get(hf, "max_position_embeddings")), norm="rmsnorm",
            norm_eps=float(self.get(hf, "rms_norm_eps")), norm_offset=1.0, activation=_ACTIVATIONS[act],
            position="rope", **rope, attention_bias=bool(self.get(hf, "attention_bias")),
            qk_norm=self.qk_norm, sliding_window=None if window is None else int(window),
            layer_types=None if window is None else types, tie_embeddings=bool(self.get(hf, "tie_word_embeddings")),
            pre_norm=True, final_norm=True, scale_embeddings=True, branch_output_norm=True,
            query_pre_attn_scalar=float(self.get(hf, "query_pre_attn_scalar")),
            attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"),
            dropout=float(self.get(hf, "attention_dropout") or 0.0),
            initializer_range=float(self.get(hf, "initializer_range")), pad_token_id=pad, extra=extra,
        )

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        return dict(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            hidden_activation={v: k for k, v in _ACTIVATIONS.items()}.get(c.activation, c.activation),
            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
            tie_word_embeddings=c.tie_embeddings, attention_bias=c.attention_bias, attention_dropout=c.dropout,
            query_pre_attn_scalar=_number(c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None
                                          else c.head_dim),
            sliding_window=c.sliding_window if c.sliding_layers else None, layer_types=layer_types(c),
            final_logit_softcapping=c.final_logit_softcap, attn_logit_softcapping=c.attn_logit_softcap,
            use_bidirectional_attention=False, rope_parameters=self.rope_to_hf(c),
        )

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return rope_to_hf(c)


class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    label = "Gemma 3 (1B, 270M: text only)"
    chat_template = "gemma"
    classes = {"Gemma3ForCausalLM": "lm", "Gemma3TextModel": "base"}  # 4B+ are Gemma3ForConditionalGeneration
    guess_rank = 50  # Gemma's embeddings and norms with q/k norms
    defaults = _DEFAULTS["gemma3_text"]
    qk_norm = True
    # q/k norms, the local rope base and a linearly scaled global rope
    sizes = {"debug-gemma3": dict(
        _SHAPE, query_pre_attn_scalar=16.0, qk_norm=True, rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_rope={"rope_type": "default", "rope_theta": 1e4},
        layer_types=["sliding_attention"] * 3 + ["full_attention"])}

    def guess(self, c: ModelConfig) -> bool:
        return c.scale_embeddings and c.qk_norm

    def layer_types(self, hf: dict[str, Any], layers: int) -> list[str]:
        """Gemma 3 slides on all but every ``sliding_window_pattern``-th layer (6)."""
        if hf.get("layer_types"):
            return list(hf["layer_types"])
        every = int(hf.get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The full layers' rope and the sliding layers' base, from ``rope_parameters`` per layer type or the legacy
        ``rope_theta`` / ``rope_scaling`` (the full layers') / ``rope_local_base_freq``, as
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
            raise ValueError(f"{where}: rope_parameters.sliding_attention.rope_type={local_scaling['rope_type']!r} is "
                             "not supported for gemma3_text (built: the default rope on the sliding layers)")
        return dict(rope_theta=theta, rope_scaling=scaling,
                    sliding_rope={"rope_type": "default", "rope_theta": local_theta})

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        local = float((c.sliding_rope or {}).get("rope_theta", c.rope_theta))
        return {"full_attention": rope_to_hf(c), "sliding_attention": {"rope_type": "default", "rope_theta": local}}


class Gemma3(Multimodal):
    """Gemma 3 4B, 12B, 27B (``model.vision_tower``, SigLIP, and ``model.multi_modal_projector`` copied at
    export)."""

    model_type = "gemma3"
    label = "Gemma 3 4B/12B/27B"
    chat_template = "gemma"
    classes = {"Gemma3ForConditionalGeneration": "lm"}
    text_kind = "gemma3_text"
    nested = NestedLM(("gemma3_text",), tie_default=True, logit_softcap=False)
    tiny = "debug-gemma3"

    def tiny_config(self, hf: dict[str, Any]) -> Any:
        """A ``Gemma3Config`` around the text config: a one-layer SigLIP tower of 16x16 images in 4x4 patches, pooled
        to 4 image tokens (ids inside the vocabulary)."""
        import transformers

        text = {k: v for k, v in hf.items() if k not in ("architectures", "dtype")}
        vocab = text["vocab_size"]
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=4)
        return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                         boi_token_index=vocab - 3, eoi_token_index=vocab - 2,
                                         image_token_index=vocab - 1, tie_word_embeddings=text["tie_word_embeddings"])


def _number(x: float) -> int | float:
    """An integral value as an int (transformers' strict config fields type ``query_pre_attn_scalar`` as int)."""
    return int(x) if float(x).is_integer() else float(x)


RECORDS = (Gemma2(), Gemma3Text(), Gemma3())
