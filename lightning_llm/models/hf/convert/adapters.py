"""A peft adapter of a decoder in the Hugging Face checkpoint's terms (what ``peft/adapters.py`` translates an adapter
file by), as the model's family record says (:mod:`..record.family`): module paths where the HF names differ from ours
below the block (DeepSeek's and GLM's shared experts, the hybrids' layers), the HF projections that fuse several of ours
(Phi-3's ``qkv_proj``, its and GLM-4's ``gate_up_proj``), the rows of a LoRA's ``lora_B`` where ours are permuted
(Baichuan's ``W_pack``, Qwen3.5's ``in_proj_qkv``), and the families whose MLP targets peft moves to fused experts."""

from __future__ import annotations

from torch import Tensor

from ...config import ModelConfig
from .registry import family_of

__all__ = ["adapter_tensor_from_hf", "adapter_tensor_to_hf", "fused_in_hf", "module_name_from_hf", "module_name_to_hf",
           "peft_reroutes_mlp"]


def adapter_tensor_to_hf(config: ModelConfig, name: str, t: Tensor) -> Tensor:
    """An adapter tensor of ours (peft state-dict name) in the checkpoint's row order (every tensor not permuted in
    ours is returned unchanged)."""
    return family_of(config).adapter_tensor_to_hf(config, name, t)


def adapter_tensor_from_hf(config: ModelConfig, name: str, t: Tensor) -> Tensor:
    """Inverse of :func:`adapter_tensor_to_hf` (a peft adapter of the HF checkpoint -> our row order)."""
    return family_of(config).adapter_tensor_from_hf(config, name, t)


def module_name_to_hf(config: ModelConfig, name: str) -> str:
    """Our module path inside the decoder -> the HF model's (``model.`` prefix not added): DeepSeek's and GLM's
    shared experts are ``shared_experts`` there, a hybrid's DeltaNet layer ``linear_attn`` (a peft adapter's keys
    name them so)."""
    return family_of(config).module_name_to_hf(config, name)


def module_name_from_hf(config: ModelConfig, name: str) -> str:
    """Inverse of :func:`module_name_to_hf`."""
    return family_of(config).module_name_from_hf(config, name)


def fused_in_hf(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The HF projections of the config's family that fuse several of ours (Phi-3's ``qkv_proj`` = our q/k/v, its and
    GLM-4's ``gate_up_proj`` = gate/up): a peft adapter on them is not the one on ours."""
    return dict(family_of(config).fused_in_hf)


def peft_reroutes_mlp(config: ModelConfig) -> bool:
    """peft (0.21, ``convert_peft_config_for_transformers``) loads the family's LoRA adapters with the targets
    ``gate_proj``/``up_proj``/``down_proj`` moved to the fused experts of transformers 5 (transformers'
    ``_MODEL_TO_CONVERSION_PATTERN``): a LoRA on a dense or shared MLP of these names would not load as trained."""
    return family_of(config).peft_reroutes_mlp
