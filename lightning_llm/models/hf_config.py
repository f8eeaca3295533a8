"""Hugging Face ``config.json`` <-> :class:`ModelConfig`, and the table of supported HF architectures."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .config import ModelConfig
from .hf_decoders import DECODER_KINDS, decoder_config_from_hf, decoder_config_to_hf, moe_architecture

log = logging.getLogger(__name__)

__all__ = ["config_from_hf", "config_to_hf", "SUPPORTED_ARCHITECTURES"]

@dataclass(frozen=True)
class _Arch:
    kind: str  # llama | qwen2 | ... | qwen3_moe | olmoe | gpt_oss | gpt2 | bert | ...
    head: str  # base | lm | cls | mlm (mlm: load source only, its head is ignored)


SUPPORTED_ARCHITECTURES: dict[str, _Arch] = {
    "LlamaForCausalLM": _Arch("llama", "lm"),
    "LlamaModel": _Arch("llama", "base"),
    "Qwen2ForCausalLM": _Arch("qwen2", "lm"),
    "Qwen2Model": _Arch("qwen2", "base"),
    "Qwen3ForCausalLM": _Arch("qwen3", "lm"),
    "Qwen3Model": _Arch("qwen3", "base"),
    "MistralForCausalLM": _Arch("mistral", "lm"),
    "MistralModel": _Arch("mistral", "base"),
    "BaichuanForCausalLM": _Arch("baichuan", "lm"),  # Baichuan2-7B (trust_remote_code; not in transformers)
    "MixtralForCausalLM": _Arch("mixtral", "lm"),
    "MixtralModel": _Arch("mixtral", "base"),
    "Qwen2MoeForCausalLM": _Arch("qwen2_moe", "lm"),
    "Qwen2MoeModel": _Arch("qwen2_moe", "base"),
    "Qwen3MoeForCausalLM": _Arch("qwen3_moe", "lm"),
    "Qwen3MoeModel": _Arch("qwen3_moe", "base"),
    "OlmoeForCausalLM": _Arch("olmoe", "lm"),
    "OlmoeModel": _Arch("olmoe", "base"),
    "GptOssForCausalLM": _Arch("gpt_oss", "lm"),
    "GptOssModel": _Arch("gpt_oss", "base"),
    "DeepseekV2ForCausalLM": _Arch("deepseek_v2", "lm"),
    "DeepseekV2Model": _Arch("deepseek_v2", "base"),
    "DeepseekV3ForCausalLM": _Arch("deepseek_v3", "lm"),  # DeepSeek-V3/R1, Kimi-K2
    "DeepseekV3Model": _Arch("deepseek_v3", "base"),
    "Glm4MoeForCausalLM": _Arch("glm4_moe", "lm"),  # GLM-4.5/4.6
    "Glm4MoeModel": _Arch("glm4_moe", "base"),
    "GPT2LMHeadModel": _Arch("gpt2", "lm"),
    "GPT2Model": _Arch("gpt2", "base"),
    "BertModel": _Arch("bert", "base"),
    "BertForSequenceClassification": _Arch("bert", "cls"),
    "BertForMaskedLM": _Arch("bert", "mlm"),
    "BertForPreTraining": _Arch("bert", "mlm"),
    "MegatronBertModel": _Arch("megatron-bert", "base"),
    "MegatronBertForSequenceClassification": _Arch("megatron-bert", "cls"),
    "MegatronBertForMaskedLM": _Arch("megatron-bert", "mlm"),
    "MegatronBertForPreTraining": _Arch("megatron-bert", "mlm"),
    "RobertaModel": _Arch("roberta", "base"),
    "RobertaForSequenceClassification": _Arch("roberta", "cls"),
    "RobertaForMaskedLM": _Arch("roberta", "mlm"),
}
_DEFAULT_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "baichuan": "BaichuanForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertModel",
    "megatron-bert": "MegatronBertModel",
    "roberta": "RobertaModel",
}


# ====================================================================================================================
# Config conversion
# ====================================================================================================================


def _architecture_name(hf: dict[str, Any], where: str = "config") -> str:
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        mt = hf.get("model_type")
        if mt not in _DEFAULT_ARCH:
            raise ValueError(
                f"{where}: unsupported model_type {mt!r} and no 'architectures'; supported model types: "
                f"{', '.join(sorted(_DEFAULT_ARCH))}"
            )
        arch = _DEFAULT_ARCH[mt]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _num_labels(hf: dict[str, Any]) -> int:
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def _plain_act(name: str) -> str:
    table = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "relu": "relu"}
    if name not in table:
        raise ValueError(f"unsupported hidden activation {name!r} (supported: {', '.join(table)})")
    return table[name]


def config_from_hf(hf_config: dict[str, Any], *, where: str = "config") -> ModelConfig:
    """Our :class:`ModelConfig` from a HF ``config.json`` dict (architecture from ``architectures`` / ``model_type``);
    ``where`` (the file) is named by the errors of unsupported architectures and options."""
    hf = hf_config
    arch = _architecture_name(hf, where=where)
    a = SUPPORTED_ARCHITECTURES[arch]
    extra: dict[str, Any] = {"hf_architecture": arch, "hf_model_type": a.kind}
    for k in ("bos_token_id", "eos_token_id"):
        if hf.get(k) is not None:
            extra[k] = hf[k]
    if a.head == "cls" and hf.get("id2label"):
        extra["id2label"] = {str(k): v for k, v in hf["id2label"].items()}
    pad = hf.get("pad_token_id")
    pad = 0 if pad is None else int(pad)

    if a.kind in DECODER_KINDS:
        return decoder_config_from_hf(hf, a.kind, extra=extra, pad=pad, where=where)

    if a.kind == "gpt2":
        if hf.get("scale_attn_by_inverse_layer_idx", False) or not hf.get("scale_attn_weights", True):
            raise ValueError("GPT-2 configs with scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False "
                             "are not supported")
        if hf.get("add_cross_attention", False):
            raise ValueError("GPT-2 with cross attention is not supported")
        h = int(hf.get("n_embd", 768))
        return ModelConfig(
            family="decoder", vocab_size=int(hf.get("vocab_size", 50257)), hidden_size=h,
            num_layers=int(hf.get("n_layer", 12)), num_heads=int(hf.get("n_head", 12)),
            intermediate_size=int(hf.get("n_inner") or 4 * h),
            max_position_embeddings=int(hf.get("n_positions", 1024)), norm="layernorm",
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            activation=_plain_act(hf.get("activation_function", "gelu_new")),  # type: ignore[arg-type]
            position="learned", attention_bias=True, mlp_bias=True,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pre_norm=True, embedding_norm=False,
            final_norm=True, dropout=float(hf.get("resid_pdrop", 0.1)),
            initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
        )

    # encoders
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported position_embedding_type {hf['position_embedding_type']!r}")
    if hf.get("is_decoder", False) or hf.get("add_cross_attention", False):
        raise ValueError(f"{arch} configured as a decoder is not supported")
    megatron = a.kind == "megatron-bert"
    roberta = a.kind == "roberta"
    dropout = float(hf.get("hidden_dropout_prob", 0.1))
    cls_drop = hf.get("classifier_dropout")
    num_labels = _num_labels(hf) if a.head == "cls" else 0
    # BertModel / ...ForSequenceClassification / ...ForPreTraining carry a pooler; MaskedLM heads do not.
    pooler = not (a.head == "mlm" and not arch.endswith("ForPreTraining"))
    return ModelConfig(
        family="encoder", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]), num_heads=int(hf["num_attention_heads"]),
        intermediate_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 512)), norm="layernorm",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        activation=_plain_act(hf.get("hidden_act", "gelu")),  # type: ignore[arg-type]
        position="learned", attention_bias=True, mlp_bias=True, tie_embeddings=False,
        pre_norm=megatron, embedding_norm=not megatron, final_norm=megatron,
        type_vocab_size=int(hf.get("type_vocab_size", 2)), position_offset=pad + 1 if roberta else 0,
        pooler=pooler, num_labels=num_labels, dropout=dropout,
        classifier_dropout=None if cls_drop is None else float(cls_drop),
        initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
    )


_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
_ARCH_FIELDS = (
    "family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "max_position_embeddings", "norm", "norm_eps", "activation", "position", "rope_theta", "rope_scaling",
    "attention_bias", "o_bias", "mlp_bias", "qk_norm", "qk_norm_over", "attention_sinks", "qkv_packed", "norm_head",
    "tie_embeddings", "pre_norm",
    "embedding_norm", "final_norm", "type_vocab_size", "position_offset", "sliding_layers", "window", "moe", "mla",
    "partial_rotary_factor",
)


def _arch_value(c: ModelConfig, field: str) -> Any:
    if field == "window":  # the window only matters where some layer slides
        return c.sliding_window if c.sliding_layers else None
    if field == "moe":
        return moe_architecture(c)
    if field == "qk_norm_over":  # only matters with qk_norm
        return c.qk_norm_over if c.qk_norm else None
    if field == "intermediate_size" and c.moe is not None and not c.moe.dense_layers:
        return None  # no dense layer uses it (Mixtral's intermediate_size is its experts' width)
    return getattr(c, field)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_to_hf(config: ModelConfig, architecture: str, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """HF ``config.json`` dict for ``architecture``; raises ValueError if ``config`` is not representable there."""
    if architecture not in SUPPORTED_ARCHITECTURES or SUPPORTED_ARCHITECTURES[architecture].head == "mlm":
        savable = [n for n, a in SUPPORTED_ARCHITECTURES.items() if a.head != "mlm"]
        raise ValueError(f"cannot save as {architecture!r}; supported: {', '.join(savable)}")
    a = SUPPORTED_ARCHITECTURES[architecture]
    c = config
    ex = c.extra or {}
    hf: dict[str, Any] = {"architectures": [architecture], "model_type": a.kind, "dtype": _dtype_name(dtype),
                          "initializer_range": c.initializer_range, "pad_token_id": c.pad_token_id}
    for k in ("bos_token_id", "eos_token_id"):
        if k in ex:
            hf[k] = ex[k]
    if a.kind in DECODER_KINDS:
        hf.update(decoder_config_to_hf(c, a.kind))
    elif a.kind == "gpt2":
        hf.update(
            vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
            n_head=c.num_heads, n_inner=c.intermediate_size, activation_function=_HF_ACT.get(c.activation, c.activation),
            resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=c.norm_eps,
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
            tie_word_embeddings=c.tie_embeddings,
        )
    else:
        if c.type_vocab_size < 1:
            raise ValueError(f"{architecture} needs type_vocab_size >= 1, got {c.type_vocab_size}")
        hf.update(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
            hidden_act=_HF_ACT.get(c.activation, c.activation), hidden_dropout_prob=c.dropout,
            attention_probs_dropout_prob=c.dropout, max_position_embeddings=c.max_position_embeddings,
            type_vocab_size=c.type_vocab_size, layer_norm_eps=c.norm_eps, position_embedding_type="absolute",
            classifier_dropout=c.classifier_dropout,
        )
        if a.kind == "roberta":
            hf["pad_token_id"] = c.position_offset - 1
    if a.head == "cls":
        if c.num_labels < 1:
            raise ValueError(f"{architecture} needs num_labels >= 1, got {c.num_labels}")
        id2label = ex.get("id2label")
        if not id2label or len(id2label) != c.num_labels:
            id2label = {str(i): f"LABEL_{i}" for i in range(c.num_labels)}
        hf["id2label"] = dict(id2label)
        hf["label2id"] = {v: int(k) for k, v in id2label.items()}

    # The written config must describe exactly this model.
    back = config_from_hf(hf)
    fields = list(_ARCH_FIELDS) + (["num_labels", "pooler"] if a.head == "cls" else [])
    diffs = [f"{f}: ours={_arch_value(c, f)!r} {architecture}={_arch_value(back, f)!r}" for f in fields
             if _arch_value(c, f) != _arch_value(back, f)]
    if diffs:
        raise ValueError(f"config is not representable as {architecture}: " + "; ".join(diffs))
    return hf

