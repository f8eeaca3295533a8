"""Phi-3 and Phi-4 (``Phi3ForCausalLM``, ``Phi3Model``): ``config.json`` <-> :class:`ModelConfig` and the fused
projections.

A Phi-3 block is LLaMA's (pre-norms ``input_layernorm`` / ``post_attention_layernorm``, no biases) with two fused
projections: ``self_attn.qkv_proj`` [N*D + 2*K*D, H] (the q rows, then k, then v) and ``mlp.gate_up_proj`` [2*I, H]
(the gate rows, then up). Our model keeps q/k/v and gate/up apart (so tensor-parallel plans and LoRA targets are
LLaMA's): the mapping splits them on load (a lazy read takes each block's rows only) and concatenates them on save.
Rotary embedding on the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75), LLaMA's halves. LongRoPE
(``rope_type: longrope``, the 128k variants; the legacy ``su`` / ``yarn`` names mean it too, as transformers reads
them): ``short_factor`` / ``long_factor`` chosen per forward by its longest position against the top-level
``original_max_position_embeddings`` (which transformers puts in the rope parameters), cos and sin times the
attention factor (``models/layers/rope.py``). ``sliding_window`` (Phi-3-mini-4k's 2047) on every layer.

Dropout: ``attention_dropout``, ``resid_pdrop`` and ``embd_pdrop`` are our one ``dropout`` when equal; different
values are refused by name.

LoRA adapters on ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` are not written in peft's format (peft
would hold them on the fused ``qkv_proj``/``gate_up_proj``): ``fused_in_hf`` names them for the adapter export,
which refuses them in one line; the merged model exports exactly.
"""

from __future__ import annotations

from typing import Any

from ...config import ModelConfig
from ..record.entries import Entry, row_split
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.options import PLAIN_WEIGHTS
from .llama import Llama

__all__ = ["Phi3", "RECORDS", "fused_mlp_entries"]

PHI3_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""Phi-3's fused HF projection -> our projections it holds (in row order)."""
_LEGACY_LONGROPE = ("su", "yarn")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """``(theta, scaling, partial_rotary_factor)`` as ``Phi3Config.convert_rope_params_to_dict`` resolves them."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = float(params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) or 1.0)
    kind = params.pop("rope_type", params.pop("type", None)) or "default"
    params.pop("type", None)
    if kind in _LEGACY_LONGROPE:
        kind = "longrope"
    if kind not in ("default", "longrope"):
        raise ValueError(f"rope_type={kind!r}: Phi-3 takes default or longrope rope parameters")
    if kind == "default":
        return theta, None, partial
    # the top-level original_max_position_embeddings wins (standardize_rope_params), 4096 by default
    params["original_max_position_embeddings"] = int(hf.get("original_max_position_embeddings", 4096))
    return theta, {"rope_type": "longrope", **params}, partial


def _dropout(hf: dict[str, Any], where: str) -> float:
    values = {k: float(hf.get(k, 0.0) or 0.0) for k in ("attention_dropout", "resid_pdrop", "embd_pdrop")}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where}: {', '.join(f'{k}={v}' for k, v in values.items())} is not supported for phi3 "
                         "(built: one dropout on the embeddings, attention probabilities and residual branches; set "
                         "them equal)")
    return values["attention_dropout"]


def fused_mlp_entries(c: ModelConfig, p: str) -> list[Entry]:
    """``{p}.mlp.gate_up_proj`` [2*I, H] <-> our gate and up projections (Phi-3's and GLM-4's), and ``down_proj``."""
    i, m = c.intermediate_size, f"{p}.mlp"
    return [row_split(f"{m}.gate_up_proj.weight", (f"{m}.gate_proj.weight", f"{m}.up_proj.weight"), (i, i)),
            Entry(f"{m}.down_proj.weight", (f"{m}.down_proj.weight",))]


class Phi3(Llama):
    model_type = "phi3"
    label = "Phi-3, Phi-4"
    classes = decoder_classes("Phi3")
    unbuilt = (PLAIN_WEIGHTS,)
    fused_in_hf = PHI3_FUSED
    # Phi-4-mini's partial rotary with LongRoPE whose short range (16) the 32-token blocks pass
    sizes = {"debug-phi3": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]})}
    tiny = "debug-phi3"

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        theta, scaling, partial = _rope(hf)
        if scaling is not None:  # the factors divide each rotary frequency
            heads = int(hf["num_attention_heads"])
            half = int(int(hf.get("head_dim") or int(hf["hidden_size"]) // heads) * partial) // 2
            bad = [k for k in ("short_factor", "long_factor") if len(scaling.get(k) or ()) != half]
            if bad:
                raise ValueError(f"{where}: rope {bad[0]} must list {half} numbers (half the rotary dims), got "
                                 f"{len(scaling.get(bad[0]) or ())}")
        return dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        window = hf.get("sliding_window")
        return dict(max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                    norm_eps=float(hf.get("rms_norm_eps", 1e-5)), dropout=_dropout(hf, where),
                    sliding_window=None if window is None else int(window), layer_types=None,
                    attention_bias=False, mlp_bias=False)

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor}
        return {**rope, **dict(c.rope_scaling or {})}

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        hf: dict[str, Any] = dict(resid_pdrop=c.dropout, embd_pdrop=c.dropout, attention_dropout=c.dropout,
                                  sliding_window=c.sliding_window if c.sliding_layers else None)
        if c.rope_scaling and "original_max_position_embeddings" in c.rope_scaling:
            hf["original_max_position_embeddings"] = c.rope_scaling["original_max_position_embeddings"]
        return hf

    def attention_entries(self, c: ModelConfig, p: str, layer: int) -> list[Entry]:
        """``{p}.self_attn.qkv_proj`` [N*D + 2*K*D, H] <-> our q/k/v projections, and ``o_proj``."""
        assert c.head_dim is not None and c.num_kv_heads is not None
        rows = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        a = f"{p}.self_attn"
        return [row_split(f"{a}.qkv_proj.weight", tuple(f"{a}.{n}.weight" for n in PHI3_FUSED["qkv_proj"]), rows),
                Entry(f"{a}.o_proj.weight", (f"{a}.o_proj.weight",))]

    def mlp_entries(self, c: ModelConfig, p: str) -> list[Entry]:
        return fused_mlp_entries(c, p)


RECORDS = (Phi3(),)
