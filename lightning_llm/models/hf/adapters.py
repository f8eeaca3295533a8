"""A peft adapter of a decoder in the Hugging Face checkpoint's terms (what ``peft/adapters.py`` translates an adapter
file by): module paths where the HF names differ from ours below the block (DeepSeek's and GLM's shared experts, the
hybrids' layers), the HF projections that fuse several of ours (Phi-3's ``qkv_proj``, its and GLM-4's
``gate_up_proj``), and the rows of a LoRA's ``lora_B`` on Baichuan's ``W_pack`` (head-interleaved in ours)."""

from __future__ import annotations

from torch import Tensor

from ..config import ModelConfig
from .families.decoders import wpack_from_hf, wpack_to_hf
from .families.deepseek import DEEPSEEK_KINDS
from .families.glm4 import GLM4_FUSED
from .families.phi3 import PHI3_FUSED
from .families.qwen3_next import hybrid_adapter_tensor, hybrid_module_name

__all__ = ["adapter_tensor_from_hf", "adapter_tensor_to_hf", "fused_in_hf", "module_name_from_hf", "module_name_to_hf"]

_FUSED_IN_HF = {"phi3": PHI3_FUSED, "glm4": GLM4_FUSED}


def _is_wpack_rows(name: str) -> bool:
    """Adapter tensors whose dim 0 are W_pack's output rows: ``...W_pack.lora_B[.adapter].weight`` (and bias)."""
    atoms = name.split(".")
    return "W_pack" in atoms and "lora_B" in atoms[atoms.index("W_pack"):]


def adapter_tensor_to_hf(config: ModelConfig, name: str, t: Tensor) -> Tensor:
    """An adapter tensor of ours (peft state-dict name) in the checkpoint's row order: ``lora_B`` of a packed
    ``W_pack`` is un-permuted (its rows are W_pack's rows); every other tensor is returned unchanged."""
    if config.qkv_packed and _is_wpack_rows(name):
        return wpack_to_hf(t, config.num_heads)
    return hybrid_adapter_tensor(config, name, t, to_hf=True)


def adapter_tensor_from_hf(config: ModelConfig, name: str, t: Tensor) -> Tensor:
    """Inverse of :func:`adapter_tensor_to_hf` (a peft adapter of the HF checkpoint -> our row order)."""
    if config.qkv_packed and _is_wpack_rows(name):
        return wpack_from_hf(t, config.num_heads)
    return hybrid_adapter_tensor(config, name, t, to_hf=False)


_HF_MODULE_NAMES = {kind: ((".mlp.shared_expert.", ".mlp.shared_experts."),) for kind in DEEPSEEK_KINDS}
"""Family -> (our module path piece, the HF one): where a family's HF names differ from ours below the block."""


def _kind(config: ModelConfig) -> str | None:
    return (config.extra or {}).get("hf_model_type")


def module_name_to_hf(config: ModelConfig, name: str) -> str:
    """Our module path inside the decoder -> the HF model's (``model.`` prefix not added): DeepSeek's and GLM's
    shared experts are ``shared_experts`` there (a peft adapter's keys name them so)."""
    for ours, hf in _HF_MODULE_NAMES.get(_kind(config) or "", ()):
        name = name.replace(ours, hf)
    return hybrid_module_name(config, name, to_hf=True) if config.linear_attention is not None else name


def fused_in_hf(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The HF projections of the config's family that fuse several of ours (Phi-3's ``qkv_proj`` = our q/k/v, its and
    GLM-4's ``gate_up_proj`` = gate/up): a peft adapter on them is not the one on ours."""
    return dict(_FUSED_IN_HF.get(_kind(config) or "", {}))


def module_name_from_hf(config: ModelConfig, name: str) -> str:
    """Inverse of :func:`module_name_to_hf`."""
    for ours, hf in _HF_MODULE_NAMES.get(_kind(config) or "", ()):
        name = name.replace(hf, ours)
    return hybrid_module_name(config, name, to_hf=False) if config.linear_attention is not None else name
