"""Options of an HF family's ``config.json`` that this package does not build: refused in one line naming the file and
the option (when the config is read: ``load_hf``, ``estimate``, and a decoder task's constructor through
``models.backbone_config``, before any data is prepared), never loaded into a model that computes something else.

A family adds its entries to :data:`UNBUILT_OPTIONS` (model type -> :class:`Unbuilt`); :func:`refuse_unbuilt` is
called by its config conversion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["UNBUILT_OPTIONS", "Unbuilt", "refuse_unbuilt"]


@dataclass(frozen=True)
class Unbuilt:
    """``key`` of a config.json is refused unless absent or ``built(value)``; ``what`` says what is built instead."""

    key: str
    built: Callable[[Any], bool]
    what: str


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


_PLAIN_WEIGHTS = Unbuilt("quantization_config", lambda v: not v, "bf16/fp16/fp32 weights; a block-quantized FP8 "
                         "checkpoint (weight_scale_inv tensors) must be dequantized to bf16 first")

UNBUILT_OPTIONS: dict[str, tuple[Unbuilt, ...]] = {
    "deepseek_v3": (
        _PLAIN_WEIGHTS,
        Unbuilt("scoring_func", _one_of("sigmoid"), "DeepSeek-V3's router scores experts by sigmoid"),
        Unbuilt("topk_method", _one_of("noaux_tc"), "DeepSeek-V3's router is noaux_tc: group-limited top-k on the "
                "sigmoid scores plus e_score_correction_bias"),
        Unbuilt("moe_layer_freq", _one_of(1), "every layer from first_k_dense_replace on is an MoE layer"),
    ),
    "deepseek_v2": (
        _PLAIN_WEIGHTS,
        Unbuilt("scoring_func", _one_of("softmax"), "DeepSeek-V2's routers score experts by softmax"),
        Unbuilt("topk_method", _one_of("greedy", "group_limited_greedy"), "DeepSeek-V2's routers: greedy, "
                "group_limited_greedy"),
        Unbuilt("norm_topk_prob", _one_of(False), "transformers' DeepseekV2 router never renormalises the top-k "
                "weights (they are the softmax scores times routed_scaling_factor)"),
        Unbuilt("moe_layer_freq", _one_of(1), "every layer from first_k_dense_replace on is an MoE layer"),
        Unbuilt("num_experts_per_tok", lambda v: isinstance(v, int) and v >= 1, "a number of experts per token"),
    ),
    "glm4_moe": (_PLAIN_WEIGHTS,),
    **{kind: (_PLAIN_WEIGHTS,) for kind in ("phi3", "glm4", "olmo2", "olmo3", "smollm3")},
    "deberta-v2": (
        Unbuilt("conv_kernel_size", lambda v: v is None or (isinstance(v, int) and (v == 0 or v % 2 == 1)),
                "0 or an odd kernel (the convolution keeps the sequence length)"),
    ),
    "modernbert": tuple(
        Unbuilt(key, _one_of(0, 0.0, None), "ModernBERT without dropout, as published (--model.dropout sets the "
                "encoder's one dropout: embeddings, attention, residual branches)")
        for key in ("embedding_dropout", "attention_dropout", "mlp_dropout")
    ) + (Unbuilt("classifier_pooling", _one_of("cls", "mean"), "cls or mean pooling"),),
    **{kind: (_PLAIN_WEIGHTS,
              Unbuilt("use_bidirectional_attention", lambda v: not v, "causal attention (the bidirectional encoder "
                      "mode of EmbeddingGemma is not built)"))
       for kind in ("gemma2", "gemma3_text")},
}
"""HF model type -> its options that are not built."""


def refuse_unbuilt(hf: dict[str, Any], kind: str, where: str) -> None:
    """Raise ``ValueError`` (one line: ``where``, the option, its value, what is built) for the first option of
    ``hf`` that :data:`UNBUILT_OPTIONS` lists for ``kind`` with a value that is not built."""
    for option in UNBUILT_OPTIONS.get(kind, ()):
        if option.key in hf and not option.built(hf[option.key]):
            raise ValueError(f"{where}: {option.key}={hf[option.key]!r} is not supported for {kind} (built: "
                             f"{option.what})")
