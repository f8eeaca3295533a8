"""HF ``config.json`` <-> :class:`ModelConfig` for the LLaMA-layout decoders: llama, qwen2, qwen3, mistral, baichuan,
and the Mixture-of-Experts ones: mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss.

They share LLaMA's module names (``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm`` ...)
and differ by switches of one :class:`~lightning_llm.models.DecoderLM`:

=========  ==========================================================================================================
llama      biases from ``attention_bias``/``mlp_bias``; rope types default, linear, llama3, dynamic, yarn
qwen2      q/k/v biased, o not (hard-coded in transformers); ``use_sliding_window`` + ``sliding_window`` on the layers
           ``>= max_window_layers`` (or the explicit ``layer_types``); tied or untied head
qwen3      ``q_norm``/``k_norm`` (RMSNorm per head over ``head_dim``); ``head_dim`` may differ from hidden/heads
           (transformers' default 128 when absent); sliding window as qwen2; biases from ``attention_bias``
mistral    ``sliding_window`` on every layer (transformers' default 4096 when the key is absent, off when null)
baichuan   Baichuan2-7B (``BaichuanForCausalLM``, trust_remote_code): fused ``W_pack`` [3H, H] = q, k, v rows;
           ``NormHead`` (lm_head rows L2-normalised in forward); RoPE with base 10000 (hard-coded by its code);
           no biases; multi-head attention. The 13B layout (ALiBi, no ``max_position_embeddings``) is refused.
olmoe      ``q_norm``/``k_norm`` over the whole q / k projection; softmax top-k without renormalisation (by default);
           MoE on every layer; ``clip_qkv`` refused
gpt_oss    attention sinks, q/k/v/o biases, sliding and full layers alternating (``layer_types``, ``sliding_window``),
           YaRN (its defaults when absent); router with a bias, softmax over the chosen top-k logits; experts with
           biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), stored fused (or MXFP4: ``entries``)
phi3       fused ``qkv_proj`` / ``gate_up_proj``, LongRoPE, partial rotary: :mod:`.phi3`
glm4       norms on each branch's input and output, rotary pairs, fused ``gate_up_proj``: :mod:`.glm4`
olmo2/3    norms on each branch's output only, q/k norms over the projection; OLMo 3's sliding layers and rope per
           layer type: :mod:`.olmo`
smollm3    layers without rotary embedding (``no_rope_layers``): :mod:`.smollm3`
=========  ==========================================================================================================

``W_pack`` is stored head-interleaved in our model (see :class:`~lightning_llm.models.layers.block.Attention`):
:func:`wpack_from_hf` / :func:`wpack_to_hf` permute its rows (weight, bias, and a LoRA ``lora_B``: :mod:`..adapters`) at
the boundary.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ...layers.rope import ROPE_TYPES, rope_type
from ..entries import MOE_KINDS
from ..options import refuse_unbuilt
from .deepseek import DEEPSEEK_KINDS, deepseek_from_hf, deepseek_to_hf
from .glm4 import glm4_from_hf, glm4_to_hf
from .olmo import OLMO_KINDS, olmo_from_hf, olmo_to_hf
from .phi3 import phi3_from_hf, phi3_to_hf
from .qwen3_next import HYBRID_KINDS, hybrid_from_hf, hybrid_to_hf
from .smollm3 import smollm3_from_hf, smollm3_to_hf

log = logging.getLogger(__name__)

__all__ = [
    "DECODER_KINDS",
    "DENSE_KINDS",
    "layer_type_rope",
    "decoder_config_from_hf",
    "decoder_config_to_hf",
    "moe_architecture",
    "moe_from_hf",
    "rope_from_hf",
    "wpack_from_hf",
    "wpack_to_hf",
    "gated_act",
    "plain_act",
    "PLAIN_ACT_TO_HF",
]

_FAMILY_FILES = {"phi3": (phi3_from_hf, lambda c, kind: phi3_to_hf(c)),
                 "glm4": (glm4_from_hf, lambda c, kind: glm4_to_hf(c)),
                 **{kind: (olmo_from_hf, olmo_to_hf) for kind in OLMO_KINDS},
                 "smollm3": (smollm3_from_hf, lambda c, kind: smollm3_to_hf(c))}
"""Dense families converted by a file of their own: ``(from_hf(hf, kind, layers, where=) -> fields overriding the
LLaMA-layout ones, to_hf(config, kind) -> config.json fields)``."""
DENSE_KINDS = tuple(_FAMILY_FILES)
DECODER_KINDS = ("llama", "qwen2", "qwen3", "mistral", "baichuan", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                 "gpt_oss", *DEEPSEEK_KINDS, *DENSE_KINDS, *HYBRID_KINDS, "gemma2", "gemma3_text")
"""HF model types with LLaMA's module layout (weight names of ``weights.entries``); those of :data:`MOE_KINDS` have
Mixture-of-Experts feed-forward layers (:mod:`..entries`), DeepSeek's and GLM's are converted by
:mod:`.deepseek`, Gemma's (``gemma2``, ``gemma3_text``: four norms per layer) by :mod:`.gemma`."""

# transformers' defaults for keys a config.json may omit (its config classes' field defaults).
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072, "mixtral": 131072,
                  "qwen2_moe": 32768, "qwen3_moe": 32768, "olmoe": 4096, "gpt_oss": 131072}
_NORM_EPS = {"olmoe": 1e-5, "gpt_oss": 1e-5}  # the others' default: 1e-6
_ROPE_THETA = {"olmo3": 500000.0, "smollm3": 2000000.0}  # the config classes' default_theta (the others': 10000)
_PARTIAL_ROTARY = ("glm4_moe", "glm4", "phi3")  # families that read partial_rotary_factor (phi3: in its own file)
_MOE_DEFAULTS = {  # (experts, top_k, expert width, norm_topk_prob) of transformers' config classes
    "mixtral": (8, 2, None, True), "qwen2_moe": (60, 4, 1408, False), "qwen3_moe": (128, 8, 768, False),
    "olmoe": (64, 8, None, False), "gpt_oss": (128, 4, None, False)}
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
"""GptOssConfig's rope parameters when a config.json has none (its ``default_theta`` 150000)."""
_BAICHUAN_AUTO_MAP = {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                      "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"}


# ---------------------------------------------------------------------------------------------------- W_pack rows


def wpack_from_hf(t: Tensor, num_heads: int) -> Tensor:
    """Baichuan's ``[q; k; v]`` rows (dim 0 of a weight [3*N*D, ...] or bias [3*N*D]) -> head-interleaved
    ``[q_h0, k_h0, v_h0, q_h1, ...]``."""
    rest = t.shape[1:]
    return t.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()  # [3, N, D] -> [N, 3, D]


def wpack_to_hf(t: Tensor, num_heads: int) -> Tensor:
    """Inverse of :func:`wpack_from_hf`: head-interleaved rows -> ``[q; k; v]``."""
    rest = t.shape[1:]
    return t.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()  # [N, 3, D] -> [3, N, D]


# ---------------------------------------------------------------------------------------------------- from HF


def gated_act(name: str) -> str:
    table = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
             "gelu_new": "geglu_tanh", "gelu_fast": "geglu_tanh"}
    if name not in table:
        raise ValueError(f"unsupported gated activation hidden_act={name!r} (supported: {', '.join(table)})")
    return table[name]


def plain_act(name: str) -> str:
    """Our activation for a non-gated MLP's ``hidden_act`` / ``activation_function`` (GPT-2, the encoders)."""
    table = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "relu": "relu"}
    if name not in table:
        raise ValueError(f"unsupported hidden activation {name!r} (supported: {', '.join(table)})")
    return table[name]


PLAIN_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
"""Inverse of :func:`plain_act`."""


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


def layer_type_rope(hf: dict[str, Any], kind: str, *, where: str) -> tuple[float, dict[str, Any] | None,
                                                                          dict[str, Any] | None]:
    """``(rope_theta, rope_scaling, sliding_rope)`` of a config whose ``rope_parameters`` are nested by layer type
    (``full_attention`` / ``sliding_attention``, OLMo 3's; a legacy top-level ``rope_scaling`` applies to the full
    layers, the sliding ones keeping plain RoPE, as ``Olmo3Config`` reads it): the full layers' are the model's, the
    sliding layers' are ``sliding_rope`` where they differ."""
    nested = hf.get("rope_parameters") or {}
    default = {"rope_theta": _ROPE_THETA.get(kind, 10000.0)}
    if nested and not {"full_attention", "sliding_attention"} & set(nested):
        raise ValueError(f"{where}: rope_parameters={nested} is not nested by layer type (full_attention, "
                         f"sliding_attention), as {kind} reads them")
    full_params = nested.get("full_attention") or {**dict(hf.get("rope_scaling") or {}),
                                                   "rope_theta": hf.get("rope_theta", default["rope_theta"])}
    sliding_params = nested.get("sliding_attention") or {"rope_theta": hf.get("rope_theta", default["rope_theta"])}
    ropes = []
    for params in (full_params, sliding_params):
        flat = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        theta, scaling = rope_from_hf({**flat, "rope_parameters": dict(params)}, default=default)
        if rope_type(scaling) in ("dynamic", "longrope"):  # Olmo3RotaryEmbedding never updates its frequencies
            raise ValueError(f"{where}: rope_type={rope_type(scaling)!r} is not supported for {kind} (its rotary "
                             "embedding keeps the frequencies it starts with)")
        ropes.append((theta, scaling))
    (theta, scaling), sliding = ropes
    return theta, scaling, None if sliding == ropes[0] else {"rope_theta": sliding[0], **(sliding[1] or {})}


def _sliding_from_hf(hf: dict[str, Any], kind: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    """``(sliding_window, layer_types)`` as transformers' Qwen2/Qwen3/Mistral/MoE configs resolve them."""
    if kind in ("mistral", "mixtral"):
        window = hf.get("sliding_window", 4096 if kind == "mistral" else None)  # an explicit null disables it
        return (None, None) if window is None else (int(window), None)
    if kind == "gpt_oss":  # GptOssConfig: every even layer slides unless layer_types says otherwise
        window = hf.get("sliding_window", 128)
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(num_layers)]
        return (None, None) if window is None else (int(window), list(types))
    if kind in ("qwen2_moe", "qwen3_moe"):
        window = hf.get("sliding_window", 4096)
        if not hf.get("use_sliding_window", False) or not window:
            return None, None
        types = hf.get("layer_types")
        if types is None and kind == "qwen2_moe":  # Qwen2MoeConfig: every other layer below max_window_layers
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
        return int(window), None if types is None else list(types)
    if kind in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False) or hf.get("sliding_window", 4096) is None:
            return None, None
        window = int(hf.get("sliding_window", 4096))
        types = hf.get("layer_types")
        if types is None:
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        return window, list(types)
    return None, None


def decoder_config_from_hf(hf: dict[str, Any], kind: str, *, extra: dict[str, Any], pad: int,
                           where: str = "config") -> ModelConfig:
    """:class:`ModelConfig` of a LLaMA-layout decoder (``kind`` in :data:`DECODER_KINDS`; ``where`` names the file in
    errors)."""
    heads = int(hf["num_attention_heads"])
    layers = int(hf["num_hidden_layers"])
    kw: dict[str, Any] = {}
    if kind == "baichuan":
        if "max_position_embeddings" not in hf:
            raise ValueError("Baichuan config without max_position_embeddings: the 13B layout (ALiBi positions) is not "
                             "supported, only the 7B layout (RoPE, W_pack, NormHead)")
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ValueError(f"Baichuan with num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads "
                             f"({heads}) is not supported (W_pack holds q, k, v of every head)")
        if hf.get("rope_parameters") or hf.get("rope_scaling") or hf.get("rope_theta"):
            log.warning("Baichuan config sets rope parameters; Baichuan's modeling code ignores them (base 10000, no "
                        "scaling), and so does this model")
        theta, scaling = 10000.0, None
        kw.update(qkv_packed=True, norm_head=True, attention_bias=False, mlp_bias=False)
    elif kind == "phi3":  # LongRoPE and its legacy names: its own file reads them
        theta, scaling = 10000.0, None
    elif kind == "olmo3":
        theta, scaling, sliding_rope = layer_type_rope(hf, kind, where=where)
        kw.update(sliding_rope=sliding_rope)
    else:
        default = _GPT_OSS_ROPE if kind == "gpt_oss" else {"rope_theta": _ROPE_THETA[kind]} if kind in _ROPE_THETA \
            else None
        theta, scaling = rope_from_hf(hf, default=default, partial=kind in (*_PARTIAL_ROTARY, *HYBRID_KINDS))
        window, types = _sliding_from_hf(hf, kind, layers)
        kw.update(sliding_window=window, layer_types=types)
        if kind == "llama":
            kw.update(attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)))
        elif kind == "qwen2":
            kw.update(attention_bias=True, o_bias=False)  # Qwen2Attention: bias=True on q/k/v, False on o
        elif kind in ("qwen3", "qwen3_moe"):
            kw.update(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
        elif kind == "qwen2_moe":
            kw.update(attention_bias=bool(hf.get("qkv_bias", True)), o_bias=False)
        elif kind == "olmoe":
            kw.update(_olmoe_attention(hf, heads))
        elif kind == "gpt_oss":
            kw.update(attention_bias=bool(hf.get("attention_bias", True)), attention_sinks=True)
            _check_gpt_oss_quantization(hf)
        if kind in MOE_KINDS and kind not in DEEPSEEK_KINDS:
            kw.update(moe=moe_from_hf(hf, kind, layers))
    head_dim = hf.get("head_dim")
    if head_dim is None and kind in ("qwen3", "gpt_oss"):
        head_dim = {"qwen3": 128, "gpt_oss": 64}[kind]  # their configs' defaults, independent of hidden / heads
    fields: dict[str, Any] = dict(
        family="decoder", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        num_layers=layers, num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=None if head_dim is None else int(head_dim), intermediate_size=int(
            hf["intermediate_size"] if kind not in HYBRID_KINDS else hf.get("intermediate_size", 0)),
        max_position_embeddings=int(hf.get("max_position_embeddings", _MAX_POSITIONS.get(kind, 2048))),
        norm="rmsnorm", norm_eps=float(hf.get("rms_norm_eps", _NORM_EPS.get(kind, 1e-6))),
        activation=gated_act(hf.get("hidden_act", "silu")),  # type: ignore[arg-type]
        position="rope", rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pre_norm=True, embedding_norm=False,
        final_norm=True, dropout=float(hf.get("attention_dropout", 0.0)),
        initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra, **kw,
    )
    if kind in DEEPSEEK_KINDS:
        fields.update(deepseek_from_hf(hf, kind, layers, where=where))
    elif kind in _FAMILY_FILES:
        refuse_unbuilt(hf, kind, where)
        fields.update(_FAMILY_FILES[kind][0](hf, kind, layers, where=where))
    if kind in HYBRID_KINDS:
        fields.update(hybrid_from_hf(hf, kind, layers))
    return ModelConfig(**fields)


def _olmoe_attention(hf: dict[str, Any], heads: int) -> dict[str, Any]:
    """OLMoE's attention switches: q/k norms over the whole projections (sized ``hidden_size``, as its code sizes
    them, so ``head_dim`` must be ``hidden_size / heads``); ``clip_qkv`` is refused."""
    if hf.get("clip_qkv") is not None:
        raise ValueError(f"OLMoE config: clip_qkv={hf['clip_qkv']} (q/k/v clamped in forward) is not supported; set "
                         "it to null")
    if hf.get("head_dim") not in (None, int(hf["hidden_size"]) // heads):
        raise ValueError(f"OLMoE config: head_dim={hf['head_dim']} != hidden_size / num_attention_heads is not "
                         "supported (OlmoeAttention sizes q_norm by hidden_size)")
    return dict(attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, qk_norm_over="projection")


def _check_gpt_oss_quantization(hf: dict[str, Any]) -> None:
    """gpt-oss checkpoints are published with MXFP4 experts (dequantized on load); other quantizations are
    refused."""
    q = hf.get("quantization_config")
    if q and q.get("quant_method") != "mxfp4":
        raise ValueError(f"gpt-oss config: quantization_config.quant_method={q.get('quant_method')!r} is not "
                         "supported (only mxfp4 experts, dequantized on load)")


def moe_from_hf(hf: dict[str, Any], kind: str, num_layers: int) -> MoEConfig:
    """The :class:`MoEConfig` of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json`` (transformers' defaults for absent
    keys; the load-balancing coefficient is ``router_aux_loss_coef`` whatever ``output_router_logits`` says: the
    loss is on in training unless turned off)."""
    experts, top_k, width, norm = _MOE_DEFAULTS[kind]
    n = int(hf.get("num_experts", hf.get("num_local_experts", experts)) or 0)
    if n < 1:
        raise ValueError(f"{kind} config with num_experts={n}: a model without experts is not supported as {kind}")
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} (random multiplicative noise on the router "
                         "input in training) is not supported; set it to 0.0")
    kw: dict[str, Any] = dict(num_experts=n, top_k=int(hf.get("num_experts_per_tok", top_k)),
                              aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)))
    if kind == "mixtral":
        kw.update(intermediate_size=int(hf.get("intermediate_size", 14336)), norm_topk_prob=True)
    elif kind == "olmoe":  # every layer MoE, its intermediate_size the experts' width
        kw.update(intermediate_size=int(hf.get("intermediate_size", 2048)), norm_topk_prob=bool(hf.get(
            "norm_topk_prob", norm)))
    elif kind == "gpt_oss":
        if hf.get("swiglu_limit", 7.0) is None:
            raise ValueError("gpt-oss config: swiglu_limit=null (an unclamped SwiGLU) is not supported")
        kw.update(intermediate_size=int(hf.get("intermediate_size", 2880)), scoring="softmax_topk",
                  norm_topk_prob=False, router_bias=True, expert_bias=True,
                  swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))
    else:
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        only = {int(i) for i in hf.get("mlp_only_layers") or []}
        kw.update(intermediate_size=int(hf.get("moe_intermediate_size", width)),
                  norm_topk_prob=bool(hf.get("norm_topk_prob", norm)),
                  dense_layers=[i for i in range(num_layers) if i in only or (i + 1) % step])
    if kind == "qwen2_moe":
        kw.update(shared_intermediate_size=int(hf.get("shared_expert_intermediate_size", 5632)), shared_gate=True)
    return MoEConfig(**kw)


def moe_architecture(c: ModelConfig) -> tuple[Any, ...] | None:
    """What of ``c.moe`` an HF config must carry (training settings such as the bias update rate excluded)."""
    m = c.moe
    if m is None:
        return None
    return (m.num_experts, m.top_k, m.intermediate_size, m.scoring, m.norm_topk_prob, m.num_groups, m.topk_groups,
            m.group_score if m.num_groups > 1 else None, m.routed_scaling_factor, m.score_bias,
            m.shared_intermediate_size, m.shared_gate, tuple(m.dense_layers), m.router_bias, m.expert_bias,
            m.swiglu_limit, m.swiglu_alpha if m.swiglu_limit is not None else None)


def _moe_to_hf(c: ModelConfig, kind: str) -> dict[str, Any]:
    m = c.moe
    if m is None:
        raise ValueError(f"{kind} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
    hf: dict[str, Any] = dict(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
                              output_router_logits=False)
    if kind == "mixtral":  # its intermediate_size is the experts' width (it has no dense layer)
        hf.update(num_local_experts=m.num_experts, router_jitter_noise=0.0, intermediate_size=m.intermediate_size)
        return hf
    if kind == "olmoe":  # likewise
        hf.update(num_experts=m.num_experts, intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob)
        return hf
    if kind == "gpt_oss":
        hf.update(num_local_experts=m.num_experts, intermediate_size=m.intermediate_size,
                  swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)
        return hf
    hf.update(num_experts=m.num_experts, moe_intermediate_size=m.intermediate_size, norm_topk_prob=m.norm_topk_prob,
              decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers))
    if kind == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=m.shared_intermediate_size)
    return hf


# ---------------------------------------------------------------------------------------------------- to HF


_INV_ACT = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}


def decoder_config_to_hf(c: ModelConfig, kind: str) -> dict[str, Any]:
    """The architecture fields of a LLaMA-layout decoder's ``config.json`` (the caller checks representability)."""
    hf: dict[str, Any] = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        hidden_act=_INV_ACT.get(c.activation, c.activation), max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
    )
    if kind == "baichuan":
        hf.update(model_max_length=c.max_position_embeddings, z_loss_weight=0, use_cache=True,
                  auto_map=dict(_BAICHUAN_AUTO_MAP))
        return hf
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope = {**dict(c.rope_scaling), "rope_theta": c.rope_theta}
    if kind in ("glm4_moe", *HYBRID_KINDS):  # always written: its absence means 0.5 / 0.25
        rope["partial_rotary_factor"] = c.partial_rotary_factor
    elif c.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = c.partial_rotary_factor
    hf.update(num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_parameters=rope,
              attention_dropout=c.dropout)
    sliding = c.sliding_layers
    if kind in DEEPSEEK_KINDS:
        hf.update(deepseek_to_hf(c, kind))
    elif kind in _FAMILY_FILES:
        hf.update(_FAMILY_FILES[kind][1](c, kind))
    elif kind in MOE_KINDS:
        hf.update(_moe_to_hf(c, kind))
    if kind in HYBRID_KINDS:
        hybrid_to_hf(c, kind, hf)
    if kind == "llama":
        hf.update(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)
    elif kind == "olmoe":
        hf.update(attention_bias=c.attention_bias, clip_qkv=None)
    elif kind == "gpt_oss":
        hf.update(attention_bias=c.attention_bias, sliding_window=c.sliding_window if sliding else None,
                  layer_types=["sliding_attention" if i in sliding else "full_attention" for i in range(c.num_layers)])
    elif kind in ("mistral", "mixtral"):
        hf.update(sliding_window=c.sliding_window if sliding else None)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        if kind == "qwen2_moe":
            hf.update(qkv_bias=c.attention_bias, max_window_layers=c.num_layers)
        else:
            hf.update(attention_bias=c.attention_bias)
        types = ["sliding_attention" if i in sliding else "full_attention" for i in range(c.num_layers)]
        hf.update(use_sliding_window=bool(sliding), sliding_window=c.sliding_window if sliding else None,
                  **({"layer_types": types} if kind == "qwen2_moe" else {}))
    elif kind in ("qwen2", "qwen3"):
        if kind == "qwen3":
            hf.update(attention_bias=c.attention_bias)
        types = ["sliding_attention" if i in sliding else "full_attention" for i in range(c.num_layers)]
        hf.update(use_sliding_window=bool(sliding), sliding_window=c.sliding_window if sliding else None,
                  max_window_layers=min(sliding) if sliding else c.num_layers, layer_types=types)
    return hf
