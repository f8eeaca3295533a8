"""PEFT on our decoders, with peft's own layers and file format:

* :mod:`.apply`: the methods' configuration (:class:`PeftConfig`, :class:`LoraArgs`) and applying them
  (:func:`apply_peft`: LoRA, IA3, LoHa, LoKr injected in place; prompt-learning methods wrap the decoder), the
  adapters' initial values, parameter counts, activation checkpointing of the blocks;
* :mod:`.prompt`: prompt tuning, P-tuning and prefix tuning around a frozen decoder (:class:`PromptLearningLM`);
* :mod:`.adapters`: adapter weights and directories in peft's format (:func:`export_adapter`, :func:`load_adapter`)
  and merging adapters into the base weights (:func:`merge_peft`).

Inside this package ``import peft`` is Hugging Face's peft (absolute imports).
"""

from lightning_llm.peft.adapters import QUANTIZATION_FILE, export_adapter, hf_module_name, load_adapter, merge_peft, peft_state_dict
from lightning_llm.peft.apply import (
    INJECTED_METHODS,
    LoraArgs,
    PeftConfig,
    PeftMethod,
    apply_peft,
    check_expert_lora,
    count_parameters,
    enable_gradient_checkpointing,
    initialises_without_base,
)
from lightning_llm.peft.prompt import (
    PROMPT_METHODS,
    PrefixTuningLM,
    PromptLearningLM,
    PromptTuningLM,
    PTuningLM,
    build_prompt_model,
    check_prompt_layout,
)

__all__ = ["INJECTED_METHODS", "PROMPT_METHODS", "QUANTIZATION_FILE", "LoraArgs", "PTuningLM", "PeftConfig", "PeftMethod", "PrefixTuningLM",
           "PromptLearningLM", "PromptTuningLM", "apply_peft", "build_prompt_model", "check_expert_lora", "check_prompt_layout",
           "count_parameters", "enable_gradient_checkpointing", "export_adapter", "hf_module_name",
           "initialises_without_base", "load_adapter", "merge_peft", "peft_state_dict"]
