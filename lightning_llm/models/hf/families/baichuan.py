"""Baichuan2-7B (``BaichuanForCausalLM``, trust_remote_code; not in transformers): the LLaMA layout with a fused
``W_pack`` [3H, H] = q, k, v rows, a ``NormHead`` (lm_head rows L2-normalised in forward), RoPE with base 10000
(hard-coded by its code), no biases, multi-head attention. The 13B layout (ALiBi, no ``max_position_embeddings``) is
refused.

``W_pack`` is stored head-interleaved in our model (see :class:`~lightning_llm.models.layers.block.Attention`):
:func:`wpack_from_hf` / :func:`wpack_to_hf` permute its rows (weight, bias, and a LoRA ``lora_B``) at the boundary.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor

from ...config import ModelConfig
from ..record.entries import Entry, lin
from ..record.family import LLAMA_SIZE
from .llama import Llama

log = logging.getLogger(__name__)

__all__ = ["Baichuan", "RECORDS", "wpack_from_hf", "wpack_to_hf"]

_AUTO_MAP = {"AutoConfig": "configuration_baichuan.BaichuanConfig",
             "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"}


def wpack_from_hf(t: Tensor, num_heads: int) -> Tensor:
    """Baichuan's ``[q; k; v]`` rows (dim 0 of a weight [3*N*D, ...] or bias [3*N*D]) -> head-interleaved
    ``[q_h0, k_h0, v_h0, q_h1, ...]``."""
    rest = t.shape[1:]
    return t.reshape(3, num_heads, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()  # [3, N, D] -> [N, 3, D]


def wpack_to_hf(t: Tensor, num_heads: int) -> Tensor:
    """Inverse of :func:`wpack_from_hf`: head-interleaved rows -> ``[q; k; v]``."""
    rest = t.shape[1:]
    return t.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()  # [N, 3, D] -> [3, N, D]


def _is_wpack_rows(name: str) -> bool:
    """Adapter tensors whose dim 0 are W_pack's output rows: ``...W_pack.lora_B[.adapter].weight`` (and bias)."""
    atoms = name.split(".")
    return "W_pack" in atoms and "lora_B" in atoms[atoms.index("W_pack"):]


class Baichuan(Llama):
    model_type = "baichuan"
    label = "Baichuan2-7B"
    chat_template = "baichuan2"
    classes = {"BaichuanForCausalLM": "lm"}
    guess_rank = 30  # a packed W_pack or a NormHead
    sizes = {"debug-baichuan2": dict(
        LLAMA_SIZE, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, qkv_packed=True, norm_head=True)}

    def guess(self, c: ModelConfig) -> bool:
        return c.qkv_packed or c.norm_head

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("rope_parameters") or hf.get("rope_scaling") or hf.get("rope_theta"):
            log.warning("Baichuan config sets rope parameters; Baichuan's modeling code ignores them (base 10000, no "
                        "scaling), and so does this model")
        return dict(rope_theta=10000.0, rope_scaling=None)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        heads = int(hf["num_attention_heads"])
        if "max_position_embeddings" not in hf:
            raise ValueError("Baichuan config without max_position_embeddings: the 13B layout (ALiBi positions) is not "
                             "supported, only the 7B layout (RoPE, W_pack, NormHead)")
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ValueError(f"Baichuan with num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads "
                             f"({heads}) is not supported (W_pack holds q, k, v of every head)")
        return dict(qkv_packed=True, norm_head=True, attention_bias=False, mlp_bias=False)

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        return dict(self.base_to_hf(c), model_max_length=c.max_position_embeddings, z_loss_weight=0, use_cache=True,
                    auto_map=dict(_AUTO_MAP))

    def attention_entries(self, c: ModelConfig, p: str, layer: int) -> list[Entry]:
        """``W_pack``: [q; k; v] rows in the checkpoint, head-interleaved in ours; ``o_proj``."""
        n = c.num_heads
        return [Entry(f"{p}.self_attn.W_pack.{t}", (f"{p}.self_attn.W_pack.{t}",),
                      split=lambda w, n=n: (wpack_from_hf(w, n),), merge=lambda ws, n=n: wpack_to_hf(ws[0], n))
                for t in (("weight", "bias") if c.attention_bias else ("weight",))] + \
            lin(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", bool(c.o_bias))

    def adapter_tensor_to_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        """``lora_B`` of ``W_pack`` is un-permuted (its rows are W_pack's rows)."""
        return wpack_to_hf(t, c.num_heads) if _is_wpack_rows(name) else t

    def adapter_tensor_from_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        return wpack_from_hf(t, c.num_heads) if _is_wpack_rows(name) else t


RECORDS = (Baichuan(),)
