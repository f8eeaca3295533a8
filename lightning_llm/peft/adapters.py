"""Adapter weights and files in peft's own format, and merging adapters into the base weights.

Adapter export (:func:`export_adapter`) writes ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's own
layout with HF Llama module names (ours ``layers.N...`` / ``embed_tokens`` / ``norm`` -> ``model.layers.N...`` /
``model.embed_tokens`` / ``model.norm``; ``lm_head`` unchanged), so ``peft.PeftModel.from_pretrained`` loads it on the
``save_hf`` export of the base model; :func:`load_adapter` reads such a directory back into our decoder, and
:func:`merge_peft` folds injected adapters into the base weights (``lightning_llm merge``:
:mod:`lightning_llm.export.merge`).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.data.tokenizer_files import write_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.files import atomic_path, read_json
from lightning_llm.models.hf.convert.adapters import (
    adapter_tensor_from_hf,
    adapter_tensor_to_hf,
    fused_in_hf,
    module_name_from_hf,
    module_name_to_hf,
    peft_reroutes_mlp,
)
from lightning_llm.models.hf.save import decoder_module_prefix
from lightning_llm.peft.apply import LoraArgs, PeftConfig, apply_peft
from lightning_llm.peft.prompt import (
    PROMPT_METHODS,
    PrefixTuningLM,
    PromptLearningLM,
    PromptTuningLM,
    PTuningLM,
    prompt_table,
)
from lightning_llm.reliability import staged_directory
from lightning_llm.vocab import grow_base, trained_vocab_size

log = logging.getLogger(__name__)

QUANTIZATION_FILE = "quantization.json"
"""Beside an adapter trained on a quantized base: the quantization settings (``--model.quantize`` and its block)."""

__all__ = ["QUANTIZATION_FILE", "export_adapter", "hf_module_name", "load_adapter", "merge_peft", "peft_state_dict"]


def peft_state_dict(model: nn.Module, cfg: PeftConfig) -> dict[str, Tensor]:
    """The adapter weights in peft's saved layout with OUR module names (adapter name stripped)."""
    if cfg.method == "prompt_tuning":
        assert isinstance(model, PromptTuningLM)
        return {"prompt_embeddings": model.prompt.embedding.weight.detach().clone()}
    if cfg.method in PROMPT_METHODS:  # peft saves the encoder's output (what inference_mode loads), not its weights
        assert isinstance(model, (PTuningLM, PrefixTuningLM)), type(model).__name__
        return {"prompt_embeddings": prompt_table(model)}
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}


def hf_module_name(name: str, config: Any = None) -> str:
    """Our decoder parameter/module name -> the HF name (``layers.0.mlp.up_proj`` -> ``model.layers.0.mlp.up_proj``).

    One mapping for every LLaMA-layout family (llama, qwen2, qwen3, mistral, baichuan, the MoE families): projection
    names are the HF ones (``q_proj``, Qwen3's ``q_norm``, Baichuan's ``W_pack``, MLA's ``kv_b_proj``); the base-model
    prefix differs, and with ``config`` the family's own module names (DeepSeek's and GLM's ``shared_experts``:
    ``models.hf.convert.adapters.module_name_to_hf``)."""
    if config is not None:
        name = module_name_to_hf(config, name)
    if name.startswith(("layers.", "embed_tokens", "norm.")) or name == "norm":
        # a multimodal class's language model sits deeper (model.language_model.layers...)
        return (decoder_module_prefix(config) if config is not None else "model.") + name
    return name


def _our_module_name(hf_name: str, config: Any) -> str:
    """Inverse of :func:`hf_module_name`."""
    prefix = decoder_module_prefix(config) if config is not None else "model."
    name = hf_name[len(prefix):] if hf_name.startswith(prefix) else hf_name
    return module_name_from_hf(config, name)


def _wpack_rows(config: Any, state: dict[str, Tensor], *, to_hf: bool, where: str) -> dict[str, Tensor]:
    """Adapter tensors (our names) with Baichuan's ``W_pack`` rows converted between our head-interleaved order and
    the checkpoint's ``[q; k; v]`` (a LoRA's ``lora_B``: ``models.hf.convert.adapters.adapter_tensor_to_hf``); any other
    tensor on ``W_pack`` (another method's, a ``modules_to_save`` copy) is refused rather than written unpermuted."""
    odd = [k for k in state if "W_pack" in k.split(".") and not {"lora_A", "lora_B"} & set(k.split("."))]
    if odd and getattr(config, "qkv_packed", False):
        raise ValueError(f"{where}: {odd[0]} is on Baichuan's fused W_pack but not a LoRA lora_A/lora_B tensor: only "
                         "LoRA on W_pack is converted to Baichuan's row order; merge with `lightning_llm merge --ckpt`")
    convert = adapter_tensor_to_hf if to_hf else adapter_tensor_from_hf
    return {k: convert(config, k, v) for k, v in state.items()}


_PEFT_REROUTED = ("gate_proj", "up_proj", "down_proj")
"""The targets peft moves to the fused experts of the families ``models.hf.convert.adapters.peft_reroutes_mlp``
names."""


def _check_peft_loads_as_trained(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    kind = (getattr(config, "extra", None) or {}).get("hf_model_type")
    adapted = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
                     & set(_PEFT_REROUTED))
    if adapted and kind is not None and peft_reroutes_mlp(config):
        raise ValueError(f"adapter export: LoRA on the MLP projections {adapted} of a {kind} model would not load as "
                         f"trained in peft's PeftModel, which moves those targets to the fused experts of transformers "
                         f"5's {kind}; the checkpoint holds the weights: merge them with `lightning_llm export CKPT` "
                         "or `lightning_llm merge --ckpt`")


def _check_not_fused_in_hf(model: nn.Module) -> None:
    """An adapter on a projection the HF model fuses with others (Phi-3's q/k/v in ``qkv_proj``, its and GLM-4's
    gate/up in ``gate_up_proj``) is not written: peft would hold it on the fused module, where it is another adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    config = getattr(model, "config", None)
    fused = fused_in_hf(config) if config is not None else {}
    held = {ours: hf for hf, parts in fused.items() for ours in parts}
    adapted = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))} & set(held))
    if adapted:
        kind = (config.extra or {}).get("hf_model_type")
        raise ValueError(f"adapter export: an adapter on {adapted} of a {kind} model is not written in peft's format: "
                         f"transformers' {kind} fuses them ({', '.join(sorted({held[a] for a in adapted}))}), where "
                         "peft's adapter would be another one; export the merged model (`lightning_llm export CKPT` "
                         "or `lightning_llm merge --ckpt`), or target the unfused projections")


def _check_llama_layout(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None or config.family != "decoder" or config.position != "rope" or config.norm != "rmsnorm":
        raise ValueError("adapter export supports LLaMA-layout decoders (rope + rmsnorm: llama, qwen2, qwen3, mistral, "
                         "baichuan); GPT-2 modules differ in HF (fused c_attn), so merge with `lightning_llm merge` "
                         "instead")
    if config.norm_head and any(n.rsplit(".", 1)[-1] == "lm_head" and hasattr(m, "lora_B")
                                for n, m in model.named_modules()):
        # Baichuan2's NormHead is no nn.Linear in its HF code: peft cannot attach this adapter there.
        raise ValueError("adapter export of a LoRA on Baichuan2's lm_head (a NormHead) is not supported: peft cannot "
                         "target NormHead on the HF model; drop lm_head from lora.target_modules")


def export_adapter(model: nn.Module, cfg: PeftConfig, directory: str | Path, *,
                   base_model_name_or_path: str | None = None, tokenizer: str | Path | ByteTokenizer | None = None,
                   chat_template: str | None = None, state: dict[str, Tensor] | None = None,
                   quantization: dict[str, Any] | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``modules_to_save`` weights included) loadable by
    ``PeftModel.from_pretrained`` on the HF export of the base model, plus the files of ``tokenizer`` (a directory
    or the byte tokenizer) if given, with ``chat_template`` (the run's, when the tokenizer does not carry it).
    ``state``: :func:`peft_state_dict` of ``model`` already gathered to full tensors (sharded layouts).
    ``directory`` appears only once complete (``reliability.staged_directory``); an existing adapter or model
    directory there is replaced. A LoRA on Baichuan's ``W_pack`` is written in the checkpoint's row order."""
    from safetensors.torch import save_file

    base = model.base if isinstance(model, PromptLearningLM) else model
    _check_llama_layout(base)
    _check_peft_loads_as_trained(base)
    _check_not_fused_in_hf(base)
    state = peft_state_dict(model, cfg) if state is None else state
    if cfg.method == "prompt_tuning":
        from peft import PromptTuningConfig

        c = base.config
        peft_cfg = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=cfg.num_virtual_tokens,
                                      token_dim=c.hidden_size, num_transformer_submodules=1,
                                      num_attention_heads=c.num_heads, num_layers=c.num_layers)
        tensors = state
    elif cfg.method in PROMPT_METHODS:
        assert isinstance(model, (PTuningLM, PrefixTuningLM))
        peft_cfg = copy.deepcopy(model.peft_config)
        tensors = state
    else:
        peft_cfg = cfg.peft_config()
        # Baichuan's W_pack: lora_B rows back to the checkpoint's [q; k; v] order (ours are head-interleaved)
        state = _wpack_rows(base.config, state, to_hf=True, where="adapter export")
        tensors = {"base_model.model." + hf_module_name(k, base.config): v for k, v in state.items()}
    peft_cfg.base_model_name_or_path = base_model_name_or_path
    with staged_directory(directory, flag="adapter directory") as tmp:
        peft_cfg.save_pretrained(str(tmp))
        with atomic_path(tmp / "adapter_model.safetensors") as f:  # the umask's mode (save_file's own is 0600)
            save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(f), metadata={"format": "pt"})
        if quantization is not None:
            (tmp / QUANTIZATION_FILE).write_text(json.dumps(quantization, indent=1))
        if tokenizer is not None:  # a run with its own (e.g. extended) tokenizer: merge and PeftModel users need it
            write_tokenizer(tokenizer if isinstance(tokenizer, ByteTokenizer) else Path(tokenizer), tmp,
                            chat_template=chat_template)
    log.info("adapter (%d tensors) written to %s", len(tensors), directory)
    return Path(directory)


def load_adapter(model: nn.Module, directory: str | Path) -> tuple[nn.Module, PeftConfig]:
    """Inject an exported LoRA adapter (:func:`export_adapter` or any peft LoRA adapter of a Llama model) into our
    decoder and load its weights (the base grown first to an extended vocabulary its ``modules_to_save`` hold).
    Returns the model and the equivalent :class:`PeftConfig`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = Path(directory)
    raw = read_json(directory / "adapter_config.json")
    if raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type")
        why = (" (a prompt-learning adapter holds no weights to merge: load it with peft.PeftModel.from_pretrained "
               "on the HF base)") if kind in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING") else ""
        raise ValueError(f"--adapter={directory}: only LoRA adapters can be loaded/merged, got {kind}{why}")
    targets = raw["target_modules"]
    fused = sorted(set(targets if isinstance(targets, list) else [targets]) & set(fused_in_hf(model.config)))
    if fused:
        held = {name: fused_in_hf(model.config)[name] for name in fused}
        raise ValueError(f"--adapter={directory}: targets {fused}, which this model holds apart as {held}: an adapter "
                         "on a fused projection is not converted; merge it into the HF checkpoint with peft first")
    cfg = PeftConfig(method="lora", lora=LoraArgs(
        r=raw["r"], alpha=raw["lora_alpha"], dropout=raw.get("lora_dropout", 0.0),
        target_modules=sorted(targets) if isinstance(targets, list) else [targets],
        modules_to_save=raw.get("modules_to_save"), bias=raw.get("bias", "none"),
        use_rslora=raw.get("use_rslora", False)))
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    grow_base(model, trained_vocab_size(tensors), cfg, where=f"--adapter={directory}")
    model = apply_peft(model, cfg)
    prefix = "base_model.model."
    ours = _wpack_rows(model.config, {_our_module_name(k.removeprefix(prefix), model.config): v
                                      for k, v in tensors.items()},
                       to_hf=False, where=f"--adapter={directory}")
    result = set_peft_model_state_dict(model, ours, adapter_name="default")
    unexpected = getattr(result, "unexpected_keys", [])
    # Adapter weights the file lacks would stay at their initialisation (a LoRA at zero, a module_to_save at the
    # base's values): a different model than the one trained.
    missing = [k for k in getattr(result, "missing_keys", []) if ".default." in k or k.endswith(".default")]
    if unexpected or missing:
        raise ValueError(f"--adapter={directory}: does not match the model: unexpected weights {unexpected[:5]}, "
                         f"missing {missing[:5]}")
    return model, cfg


def merge_peft(model: nn.Module) -> nn.Module:
    """Fold injected adapters into the base weights and remove the PEFT wrappers (in place); returns the plain model.
    Modules trained in full (``modules_to_save``) replace the originals.

    A tied embedding / LM head (``tie_embeddings``) stays tied only if both uses still hold the same values: with
    ``modules_to_save`` each use trained its own copy, and a LoRA on ``lm_head`` changes the head only, so the merged
    model is untied (``config.tie_embeddings=False``) and keeps both tensors rather than re-tying to one of them.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(model, PromptLearningLM):
        raise ValueError(f"{model.method} has no weights to merge: export the adapter with --adapter-only and keep it "
                         "beside the base model")
    # A base weight shared by several modules (the tied embedding under a LoRA'd lm_head) is copied before the merge
    # writes into it: merging in place would change the embedding too.
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper)):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if isinstance(module, ModulesToSaveWrapper):
                new = module.modules_to_save["default"]
            else:
                base = module.get_base_layer()
                for pname, p in list(base.named_parameters(recurse=False)):
                    if uses.get(id(p), 0) > 1:
                        setattr(base, pname, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                module.merge(safe_merge=True)
                new = base
            replacements.append((parent, name.rsplit(".", 1)[-1], new))
    for parent, attr, new in replacements:
        setattr(parent, attr, new)
    for p in model.parameters():
        p.requires_grad_(True)
    config = getattr(model, "config", None)
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if getattr(config, "tie_embeddings", False) and embed is not None and head is not None:
        if embed.weight is head.weight or torch.equal(embed.weight, head.weight):
            model.tie_weights()  # type: ignore[operator]
        else:
            log.warning("embed_tokens and lm_head of the tied model were trained apart (modules_to_save / a LoRA on "
                        "lm_head): the merged model is untied (tie_word_embeddings=false) and keeps both")
            model.config = config.replace(tie_embeddings=False)
    return model
