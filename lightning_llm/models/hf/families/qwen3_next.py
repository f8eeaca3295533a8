"""The hybrid decoders: Qwen3-Next (``Qwen3NextForCausalLM``, MoE), Qwen3.5 (``Qwen3_5ForCausalLM``, dense) and
Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``), and Qwen3.5's and Qwen3.5-MoE's classes as published
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``: ``model.visual`` copied at export).

They keep LLaMA's block layout and mix two token mixers, as ``layer_types`` lists them (by default three
``linear_attention`` layers, then one ``full_attention``: ``full_attention_interval`` 4):

* ``linear_attn``: Gated DeltaNet (``models/layers/deltanet.py``; our block's ``self_attn``): Qwen3-Next's fused
  ``in_proj_qkvz`` / ``in_proj_ba`` (rows per key head, stored as we hold them), Qwen3.5's ``in_proj_qkv``
  (``[q; k; v]`` rows, permuted to per key head ``[q_g; k_g; v_g]``: :func:`qkv_from_hf`), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``; ``conv1d.weight`` [C, 1, K] (channels ``[q; k; v]``, permuted likewise); ``A_log``,
  ``dt_bias`` (bare tensors; our ``A_log.weight``, ``dt_bias.weight``); ``norm`` (the gated RMSNorm), ``out_proj``;
* ``self_attn``: gated attention: ``q_proj`` holds per head ``[q_h; gate_h]`` (``attention_output_gate``), per-head
  ``q_norm``/``k_norm``, partial rotary (``partial_rotary_factor``, 0.25 when absent; Qwen3.5's multimodal rotary
  sections are plain rotary on text);

every RMSNorm but the gated one scales by ``1 + weight`` (``norm_offset`` 1). Qwen3-Next's MoE layers (those outside
``mlp_only_layers`` and ``decoder_sparse_step``) and Qwen3.5-MoE's (every layer) route by softmax top-k (renormalised:
``norm_topk_prob``, always for Qwen3.5-MoE) with a sigmoid-gated shared expert, as Qwen2-MoE; their experts are
stored per expert. Multi-token-prediction weights (``mtp.*``) are ignored on load, as transformers ignores them.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import Tensor

from ...config import ModelConfig
from ...layers.configs import LinearAttentionConfig, MoEConfig
from ..record.entries import Entry, lin
from ..record.family import LLAMA_SIZE, Multimodal, NestedLM, decoder_classes
from ..record.readers import partial_rotary_factor
from .llama import Llama

log = logging.getLogger(__name__)

__all__ = ["Qwen3Next", "Qwen3_5Text", "Qwen3_5MoeText", "RECORDS", "qkv_from_hf", "qkv_to_hf"]

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.(self_attn|linear_attn)\.")
_SHAPE = dict(LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
              intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
              norm_offset=1.0, attention_output_gate=True, partial_rotary_factor=0.25,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
"""Qwen3.5- and Qwen3-Next-shaped hybrids at test size: three Gated DeltaNet layers, then one gated attention layer
(q/k norms, partial rotary 0.25, (1 + weight) norms)."""
_LINEAR = dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, conv_kernel_size=4)


def _linear(c: ModelConfig) -> LinearAttentionConfig:
    assert c.linear_attention is not None
    return c.linear_attention


def _qkv_sizes(c: ModelConfig) -> tuple[int, int, int]:
    """(key heads, key head width, value rows per key head)."""
    la = _linear(c)
    return la.num_key_heads, la.key_head_dim, la.num_value_heads // la.num_key_heads * la.value_head_dim


def qkv_from_hf(t: Tensor, c: ModelConfig) -> Tensor:
    """Rows (dim 0) ``[q; k; v]`` of a checkpoint's ``in_proj_qkv`` / ``conv1d`` -> ours per key head
    ``[q_g; k_g; v_g]``."""
    hk, dk, vg = _qkv_sizes(c)
    q, k, v = t.split([hk * dk, hk * dk, hk * vg])
    rest = t.shape[1:]
    return torch.cat([q.reshape(hk, dk, *rest), k.reshape(hk, dk, *rest), v.reshape(hk, vg, *rest)], dim=1) \
        .reshape(t.shape).contiguous()


def qkv_to_hf(t: Tensor, c: ModelConfig) -> Tensor:
    """Inverse of :func:`qkv_from_hf`."""
    hk, dk, vg = _qkv_sizes(c)
    rest = t.shape[1:]
    q, k, v = t.reshape(hk, 2 * dk + vg, *rest).split([dk, dk, vg], dim=1)
    return torch.cat([q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]).contiguous()


def _permuted(hf: str, ours: str, c: ModelConfig) -> Entry:
    return Entry(hf, (ours,), split=lambda w: (qkv_from_hf(w, c),), merge=lambda ws: qkv_to_hf(ws[0], c))


class Qwen3Next(Llama):
    model_type = "qwen3_next"
    label = "Qwen3-Next"
    group = "hybrid"
    classes = decoder_classes("Qwen3Next")
    guess_rank = 21  # DeltaNet layers, MoE with fused projections or dense layers
    peft_reroutes_mlp = True
    partial_rotary = True
    write_partial_rotary = True  # its absence means 0.25
    fused_projections = True
    """Its DeltaNet layers' ``in_proj_qkvz`` / ``in_proj_ba`` (Qwen3.5's: ``in_proj_qkv`` / ``z`` / ``b`` / ``a``)."""
    hybrid_moe: tuple[int, int, int, int] | None = (512, 10, 512, 512)
    """(experts, top-k, expert width, shared expert width) of its config class; None: dense."""
    moe_everywhere = False
    """Every layer is an MoE layer (its config class has no ``intermediate_size``)."""
    # Qwen3-Next's fused projections and MoE with a sigmoid-gated shared expert
    sizes = {"debug-qwen3-next": dict(
        _SHAPE, linear_attention=dict(_LINEAR, fused_projections=True),
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, shared_intermediate_size=32,
                 shared_gate=True, aux_loss_coef=0.001))}
    tiny = "debug-qwen3-next"

    def guess(self, c: ModelConfig) -> bool:
        return c.linear_attention is not None and c.moe is not None and bool(
            c.linear_attention.fused_projections or c.moe.dense_layers)

    # ------------------------------------------------------------------------------------------------ config

    def intermediate_size(self, hf: dict[str, Any]) -> int:
        return int(hf.get("intermediate_size", 0))

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        types = hf.get("layer_types")
        if types is None:  # Qwen3NextConfig: every full_attention_interval-th layer is full attention
            every = int(hf.get("full_attention_interval", 4))
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
        bad = sorted(set(types) - {"linear_attention", "full_attention"})
        if bad:
            raise ValueError(f"{self.model_type} config: layer_types {bad} are not built (linear_attention, "
                             "full_attention)")
        kw: dict[str, Any] = dict(
            head_dim=int(hf.get("head_dim") or 256),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, norm_offset=1.0,
            attention_output_gate=True, partial_rotary_factor=partial_rotary_factor(hf, 0.25),
            layer_types=list(types),
            linear_attention=None if "linear_attention" not in types else LinearAttentionConfig(
                num_key_heads=int(hf.get("linear_num_key_heads", 16)),
                num_value_heads=int(hf.get("linear_num_value_heads", 32)),
                key_head_dim=int(hf.get("linear_key_head_dim", 128)),
                value_head_dim=int(hf.get("linear_value_head_dim", 128)),
                conv_kernel_size=int(hf.get("linear_conv_kernel_dim", 4)),
                fused_projections=self.fused_projections))
        if self.hybrid_moe is not None:
            kw["moe"] = self._moe(hf, num_layers)
            if self.moe_everywhere:  # no dense layer: intermediate_size is absent (not an attribute of its config)
                kw["intermediate_size"] = kw["moe"].intermediate_size
        return kw

    def _moe(self, hf: dict[str, Any], num_layers: int) -> MoEConfig:
        assert self.hybrid_moe is not None
        experts, top_k, width, shared = self.hybrid_moe
        if self.moe_everywhere:
            dense: list[int] = []
        else:
            step = int(hf.get("decoder_sparse_step", 1) or 1)
            only = {int(i) for i in hf.get("mlp_only_layers") or []}
            dense = [i for i in range(num_layers) if i in only or (i + 1) % step]
        return MoEConfig(num_experts=int(hf.get("num_experts", experts)),
                         top_k=int(hf.get("num_experts_per_tok", top_k)),
                         intermediate_size=int(hf.get("moe_intermediate_size", width)),
                         norm_topk_prob=True if self.moe_everywhere else bool(hf.get("norm_topk_prob", True)),
                         shared_intermediate_size=int(hf.get("shared_expert_intermediate_size", shared)),
                         shared_gate=True, aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                         dense_layers=dense)

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        hf = super().config_to_hf(c, arch)
        hf.update(head_dim=c.head_dim, attention_bias=c.attention_bias,
                  layer_types=list(c.layer_types or ["full_attention"] * c.num_layers))
        la = c.linear_attention
        if la is not None:
            hf.update(linear_num_key_heads=la.num_key_heads, linear_num_value_heads=la.num_value_heads,
                      linear_key_head_dim=la.key_head_dim, linear_value_head_dim=la.value_head_dim,
                      linear_conv_kernel_dim=la.conv_kernel_size)
        if self.hybrid_moe is None:
            return hf
        m = c.moe
        if m is None:
            raise ValueError(f"{self.model_type} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
        hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.intermediate_size,
                  shared_expert_intermediate_size=m.shared_intermediate_size,
                  router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
        if not self.moe_everywhere:
            hf.update(norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers))
        else:  # no dense layer: its config class has no intermediate_size
            hf.pop("intermediate_size", None)
        return hf

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------------------------------------ weights

    def attention_entries(self, c: ModelConfig, p: str, layer: int) -> list[Entry]:
        """A Gated DeltaNet layer's weights (``p``: ``layers.N``): HF ``linear_attn`` <-> our ``self_attn``; the
        gated attention layers' are LLaMA's."""
        if layer not in c.linear_layers:
            return super().attention_entries(c, p, layer)
        hf, ours = f"{p}.linear_attn", f"{p}.self_attn"
        if _linear(c).fused_projections:
            e = [*lin(f"{hf}.in_proj_qkvz", f"{ours}.in_proj_qkvz", False),
                 *lin(f"{hf}.in_proj_ba", f"{ours}.in_proj_ba", False)]
        else:
            e = [_permuted(f"{hf}.in_proj_qkv.weight", f"{ours}.in_proj_qkv.weight", c)]
            e += [x for name in ("in_proj_z", "in_proj_b", "in_proj_a")
                  for x in lin(f"{hf}.{name}", f"{ours}.{name}", False)]
        e += [_permuted(f"{hf}.conv1d.weight", f"{ours}.conv1d.weight", c),
              Entry(f"{hf}.A_log", (f"{ours}.A_log.weight",)), Entry(f"{hf}.dt_bias", (f"{ours}.dt_bias.weight",)),
              *lin(f"{hf}.norm", f"{ours}.norm", False), *lin(f"{hf}.out_proj", f"{ours}.out_proj", False)]
        return e

    def ignored_key(self, c: ModelConfig, key: str) -> bool:
        return key.startswith("mtp.")  # multi-token prediction, which transformers does not build either

    # ------------------------------------------------------------------------------------------------ adapters

    def module_name_to_hf(self, c: ModelConfig, name: str) -> str:
        """A DeltaNet layer's ``self_attn`` is HF's ``linear_attn``."""
        return _renamed(c, name, to_hf=True)

    def module_name_from_hf(self, c: ModelConfig, name: str) -> str:
        return _renamed(c, name, to_hf=False)

    def adapter_tensor_to_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        """A LoRA ``lora_B`` on Qwen3.5's ``in_proj_qkv`` is permuted as the weight's rows are."""
        return qkv_to_hf(t, c) if _qkv_rows(c, name) else t

    def adapter_tensor_from_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        return qkv_from_hf(t, c) if _qkv_rows(c, name) else t


def _renamed(c: ModelConfig, name: str, *, to_hf: bool) -> str:
    if c.linear_attention is None:
        return name
    linear = set(c.linear_layers)

    def rename(m: re.Match[str]) -> str:
        kind = "linear_attn" if to_hf and int(m.group(2)) in linear else "self_attn"
        return f"{m.group(1)}layers.{m.group(2)}.{kind}."

    return _LAYER.sub(rename, name)


def _qkv_rows(c: ModelConfig, name: str) -> bool:
    atoms = name.split(".")
    return c.linear_attention is not None and "in_proj_qkv" in atoms and "lora_B" in atoms[atoms.index("in_proj_qkv"):]


class Qwen3_5Text(Qwen3Next):
    model_type = "qwen3_5_text"
    label = "Qwen3.5"
    classes = {"Qwen3_5ForCausalLM": "lm", "Qwen3_5TextModel": "base"}
    guess_rank = 20  # DeltaNet layers, no MoE
    peft_reroutes_mlp = False
    fused_projections = False
    hybrid_moe = None
    # Qwen3.5's split projections and dense MLPs
    sizes = {"debug-qwen3.5": dict(_SHAPE, linear_attention=dict(_LINEAR, fused_projections=False))}
    tiny = "debug-qwen3.5"

    def guess(self, c: ModelConfig) -> bool:
        return c.linear_attention is not None and c.moe is None


class Qwen3_5MoeText(Qwen3_5Text):
    model_type = "qwen3_5_moe_text"
    label = "Qwen3.5-MoE"
    classes = {"Qwen3_5MoeForCausalLM": "lm", "Qwen3_5MoeTextModel": "base"}
    guess_rank = 22  # DeltaNet layers with split projections, MoE on every layer
    peft_reroutes_mlp = True
    hybrid_moe = (256, 8, 512, 512)
    moe_everywhere = True

    def guess(self, c: ModelConfig) -> bool:
        return c.linear_attention is not None and c.moe is not None


class Qwen3_5(Multimodal):
    """Qwen3.5 as published: its language model's Gated DeltaNet + gated attention layers, ``model.visual``."""

    model_type = "qwen3_5"
    label = "Qwen3.5"
    classes = {"Qwen3_5ForConditionalGeneration": "lm"}
    text_kind = "qwen3_5_text"
    # transformers 5.24 ties their head by the outer tie_word_embeddings alone; the text config class is the family's
    nested = NestedLM(("qwen3_5_text",), tie_default=False)
    tiny = "debug-qwen3.5"

    def tiny_config(self, hf: dict[str, Any]) -> Any:
        """A ``Qwen3_5Config`` around the text config (its rotary given the interleaved M-RoPE sections the
        published configs carry): a one-layer vision tower of 2x2 patches, unmerged (ids inside the vocabulary)."""
        import transformers

        text = {k: v for k, v in hf.items() if k not in ("architectures", "dtype")}
        vocab = text["vocab_size"]
        rope = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}  # 2 frequencies
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
        return transformers.Qwen3_5Config(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                                          image_token_id=vocab - 1, video_token_id=vocab - 2,
                                          vision_start_token_id=vocab - 4, vision_end_token_id=vocab - 3,
                                          tie_word_embeddings=text["tie_word_embeddings"])


class Qwen3_5Moe(Multimodal):
    model_type = "qwen3_5_moe"
    label = "Qwen3.5-MoE"
    classes = {"Qwen3_5MoeForConditionalGeneration": "lm"}
    text_kind = "qwen3_5_moe_text"
    nested = NestedLM(("qwen3_5_moe_text",), tie_default=False)


RECORDS = (Qwen3Next(), Qwen3_5Text(), Qwen3_5MoeText(), Qwen3_5(), Qwen3_5Moe())
