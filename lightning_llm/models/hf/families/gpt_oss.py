"""gpt-oss (``GptOssForCausalLM``, ``GptOssModel``, ``GptOssForSequenceClassification``): the LLaMA layout with
attention sinks (a bare ``self_attn.sinks`` [N]), q/k/v/o biases, sliding and full layers alternating
(``layer_types``, ``sliding_window``), YaRN (its defaults when absent); a router with a bias (``mlp.router``), softmax
over the chosen top-k logits; experts with biases and the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), stored
fused: ``mlp.experts.gate_up_proj`` [E, H, 2I] (the input dim first, gate and up columns alternating),
``down_proj`` [E, I, H] and their biases; or, as openai/gpt-oss-20b is published, as MXFP4 ``*_blocks`` /
``*_scales`` with a ``quantization_config`` (dequantized on load: ``source.Mxfp4Mapped``; another quantization is
refused).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ..record.entries import Entry, Fused, Stacked, lin
from ..record.family import LLAMA_SIZE, decoder_classes
from ..record.readers import layer_types
from .llama import Llama

__all__ = ["GptOss", "RECORDS", "quantize_mxfp4", "to_mxfp4"]

_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
"""GptOssConfig's rope parameters when a config.json has none (its ``default_theta`` 150000)."""
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class GptOss(Llama):
    model_type = "gpt_oss"
    label = "gpt-oss"
    group = "moe"
    classes = decoder_classes("GptOss")
    guess_rank = 40  # attention sinks
    max_positions = 131072
    norm_eps = 1e-5
    head_dim = 64
    rope_default = _ROPE
    moe_defaults = (128, 4, None, False)
    # sinks, alternating sliding (window 8) and full layers, YaRN, biased router with a softmax over the chosen
    # top-k, biased experts with the clamped SwiGLU
    sizes = {"debug-gpt-oss": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 64},
        attention_bias=True, attention_sinks=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="softmax_topk", norm_topk_prob=False,
                 router_bias=True, expert_bias=True, swiglu_limit=7.0, aux_loss_coef=0.001))}
    tiny = "debug-gpt-oss"

    def guess(self, c: ModelConfig) -> bool:
        return c.attention_sinks

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        q = hf.get("quantization_config")
        if q and q.get("quant_method") != "mxfp4":
            raise ValueError(f"gpt-oss config: quantization_config.quant_method={q.get('quant_method')!r} is not "
                             "supported (only mxfp4 experts, dequantized on load)")
        window = hf.get("sliding_window", 128)  # GptOssConfig: every even layer slides unless layer_types says
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(num_layers)]
        return dict(sliding_window=None if window is None else int(window),
                    layer_types=None if window is None else list(types),
                    attention_bias=bool(hf.get("attention_bias", True)), attention_sinks=True)

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return dict(attention_bias=c.attention_bias, sliding_window=c.sliding_window if c.sliding_layers else None,
                    layer_types=layer_types(c))

    def experts_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        if hf.get("swiglu_limit", 7.0) is None:
            raise ValueError("gpt-oss config: swiglu_limit=null (an unclamped SwiGLU) is not supported")
        return dict(intermediate_size=int(hf.get("intermediate_size", 2880)), scoring="softmax_topk",
                    norm_topk_prob=False, router_bias=True, expert_bias=True,
                    swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))

    def experts_to_hf(self, m: MoEConfig) -> dict[str, Any]:
        return dict(num_local_experts=m.num_experts, intermediate_size=m.intermediate_size,
                    swiglu_limit=m.swiglu_limit, swiglu_alpha=m.swiglu_alpha)

    def moe_entries(self, c: ModelConfig, layer: int) -> list[Entry | Stacked | Fused]:
        """``mlp.router`` (weight, bias) and the fused ``mlp.experts`` ([E, H, 2I] alternating gate/up columns,
        [E, I, H], their biases [E, 2I] alternating and [E, H])."""
        p = f"layers.{layer}.mlp"
        moe = c.moe
        assert moe is not None
        out: list[Entry | Stacked | Fused] = [
            *lin(f"{p}.router", f"{p}.gate", moe.router_bias),
            Fused(f"{p}.experts.gate_up_proj", f"{p}.experts.gate_up_proj", (0, 2, 1), interleaved=True),
            Fused(f"{p}.experts.down_proj", f"{p}.experts.down_proj", (0, 2, 1))]
        if moe.expert_bias:
            out += [Fused(f"{p}.experts.gate_up_proj_bias", f"{p}.experts.gate_up_proj_bias", (0, 1), interleaved=True),
                    Fused(f"{p}.experts.down_proj_bias", f"{p}.experts.down_proj_bias", (0, 1))]
        return out

    def tiny_written(self, directory: Path, *, plain: bool) -> None:
        if not plain:  # its experts as MXFP4, as published
            to_mxfp4(directory)


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """[E, R, C] -> MXFP4 blocks [E, R, C/32, 16] uint8 (two FP4 codes per byte, the low nibble first) and scales
    [E, R, C/32] uint8 (one power of two per 32 values, its exponent + 127): each block divided by the smallest power
    of two that brings it within +-6, rounded to the nearest FP4 value (the inverse of ``source.dequantize_mxfp4``)."""
    e, r, c = w.shape
    x = w.float().reshape(e, r, c // 32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = ((x / torch.pow(2.0, exp)[..., None])[..., None] - _FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def to_mxfp4(out: Path) -> None:
    """Rewrite a saved gpt-oss checkpoint's expert matrices as MXFP4 (the matrix transposed: [E, 2I, H] with the gate
    and up rows alternating, [E, H, I]) and add the ``quantization_config`` the published checkpoints carry."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[f"{key}_blocks"], sd[f"{key}_scales"] = quantize_mxfp4(sd.pop(key).transpose(1, 2))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


RECORDS = (GptOss(),)
