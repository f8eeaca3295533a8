"""Hugging Face ``config.json`` <-> :class:`ModelConfig`: what every family shares (the class, its head, the token ids,
the labels, the options not built refused), each family's own conversion by its record, and the check that a written
config describes exactly the model."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ...config import ModelConfig
from ..record.options import refuse_unbuilt
from .architectures import DEFAULT_ARCHITECTURE, SUPPORTED_ARCHITECTURES, architecture_name, num_labels_of
from .multimodal import text_config_of
from .registry import family

log = logging.getLogger(__name__)

__all__ = ["architecture_diffs", "config_from_hf", "config_to_hf"]


def config_from_hf(hf_config: dict[str, Any], *, where: str = "config") -> ModelConfig:
    """Our :class:`ModelConfig` from a HF ``config.json`` dict (architecture from ``architectures`` / ``model_type``);
    ``where`` (the file) is named by the errors of unsupported architectures and options."""
    hf = hf_config
    arch = architecture_name(hf, where=where)
    a = SUPPORTED_ARCHITECTURES[arch]
    if a.nested is not None:  # a multimodal class: its language model's config, the outer class recorded
        config = config_from_hf(text_config_of(hf, arch, where=where), where=where)
        config.extra = {**config.extra, "hf_architecture": arch}
        return config
    extra: dict[str, Any] = {"hf_architecture": arch, "hf_model_type": a.kind}
    for k in ("bos_token_id", "eos_token_id"):
        if hf.get(k) is not None:
            extra[k] = hf[k]
    if a.head == "cls" and hf.get("id2label"):
        extra["id2label"] = {str(k): v for k, v in hf["id2label"].items()}
    pad = hf.get("pad_token_id")
    pad = 0 if pad is None else int(pad)
    record = family(a.kind)
    refuse_unbuilt(hf, a.kind, record.unbuilt, where)
    config = record.config_from_hf(hf, arch=arch, head=a.head, extra=extra, pad=pad, where=where)
    # A decoder's ...ForSequenceClassification: its `score` head (transformers' num_labels: id2label's size, else 2)
    return config.replace(num_labels=num_labels_of(hf)) if a.head == "cls" and record.family == "decoder" else config


_ARCH_FIELDS = (
    "family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "norm", "norm_eps", "norm_offset", "activation", "position", "rope_theta", "rope_scaling",
    "attention_bias", "o_bias", "mlp_bias", "qk_norm", "qk_norm_over", "attention_sinks", "qkv_packed", "norm_head",
    "tie_embeddings", "pre_norm",
    "embedding_norm", "final_norm", "type_vocab_size", "position_offset", "sliding_layers", "window", "moe", "mla",
    "partial_rotary_factor", "rope_interleave", "nope_layers", "sliding_rope", "branch_input_norm", "branch_output_norm",
    "norm_weight_fp32", "linear_layers", "linear_attention", "attention_output_gate", "disentangled", "norm_bias",
    "scale_embeddings", "query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
)


def _arch_value(c: ModelConfig, field: str) -> Any:
    if field == "window":  # the window only matters where some layer slides
        return c.sliding_window if c.sliding_layers else None
    if field == "moe":
        return _moe_architecture(c)
    if field == "sliding_rope":  # only matters where some layer slides
        return c.sliding_rope if c.sliding_layers else None
    if field == "linear_attention" and c.linear_attention is not None:  # its kernels are a training setting
        return dataclasses.replace(c.linear_attention, kernels="auto")
    if field == "qk_norm_over":  # only matters with qk_norm
        return c.qk_norm_over if c.qk_norm else None
    if field == "intermediate_size" and c.moe is not None and not c.moe.dense_layers:
        return None  # no dense layer uses it (Mixtral's intermediate_size is its experts' width)
    if field == "query_pre_attn_scalar":  # None is head_dim's scale
        return c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else float(c.head_dim or 0)
    return getattr(c, field)


def _moe_architecture(c: ModelConfig) -> tuple[Any, ...] | None:
    """What of ``c.moe`` an HF config must carry (training settings such as the bias update rate excluded)."""
    m = c.moe
    if m is None:
        return None
    return (m.num_experts, m.top_k, m.intermediate_size, m.scoring, m.norm_topk_prob, m.num_groups, m.topk_groups,
            m.group_score if m.num_groups > 1 else None, m.routed_scaling_factor, m.score_bias,
            m.shared_intermediate_size, m.shared_gate, tuple(m.dense_layers), m.router_bias, m.expert_bias,
            m.swiglu_limit, m.swiglu_alpha if m.swiglu_limit is not None else None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _labels_to_hf(c: ModelConfig, architecture: str) -> dict[str, Any]:
    if c.num_labels < 1:
        raise ValueError(f"{architecture} needs num_labels >= 1, got {c.num_labels}")
    id2label = (c.extra or {}).get("id2label")
    if not id2label or len(id2label) != c.num_labels:
        id2label = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
    return {"id2label": dict(id2label), "label2id": {v: int(k) for k, v in id2label.items()}}


def config_to_hf(config: ModelConfig, architecture: str, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """HF ``config.json`` dict for ``architecture``; raises ValueError if ``config`` is not representable there."""
    if architecture not in SUPPORTED_ARCHITECTURES or SUPPORTED_ARCHITECTURES[architecture].head == "mlm":
        savable = [n for n, a in SUPPORTED_ARCHITECTURES.items() if a.head != "mlm"]
        raise ValueError(f"cannot save as {architecture!r}; supported: {', '.join(savable)}")
    a = SUPPORTED_ARCHITECTURES[architecture]
    if a.nested is not None:
        raise ValueError(f"{architecture}'s config.json is the source checkpoint's, copied by save_hf (the model's "
                         f"own config is its language model's: {DEFAULT_ARCHITECTURE[a.nested]})")
    c = config
    if c.family == "decoder" and (c.num_labels > 0) != (a.head == "cls"):
        what = f"a sequence classifier (score head, num_labels={c.num_labels})" if c.num_labels else "a language model"
        raise ValueError(f"{what} is not representable as {architecture}: a decoder's score head is written as "
                         "...ForSequenceClassification, an LM head as ...ForCausalLM / ...Model")
    ex = c.extra or {}
    hf: dict[str, Any] = {"architectures": [architecture], "model_type": a.kind, "dtype": _dtype_name(dtype),
                          "initializer_range": c.initializer_range, "pad_token_id": c.pad_token_id}
    for k in ("bos_token_id", "eos_token_id"):
        if k in ex:
            hf[k] = ex[k]
    hf.update(family(a.kind).config_to_hf(c, architecture))
    if a.head == "cls":
        hf.update(_labels_to_hf(c, architecture))

    # The written config must describe exactly this model.
    diffs = architecture_diffs(c, config_from_hf(hf), architecture, labels=a.head == "cls")
    if diffs:
        raise ValueError(f"config is not representable as {architecture}: " + "; ".join(diffs))
    return hf


def architecture_diffs(ours: ModelConfig, theirs: ModelConfig, name: str, *, labels: bool = False) -> list[str]:
    """The architecture fields in which two configs differ (what a written config must not change), each as
    ``field: ours=... name=...``."""
    head_fields = ["num_labels", "pooler", "pooling", "pooler_activation", "pooler_bias", "pooler_norm"]
    fields = list(_ARCH_FIELDS) + (head_fields if labels else [])
    return [f"{f}: ours={_arch_value(ours, f)!r} {name}={_arch_value(theirs, f)!r}" for f in fields
            if _arch_value(ours, f) != _arch_value(theirs, f)]
