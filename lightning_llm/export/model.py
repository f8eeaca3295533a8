"""Rebuild the trained model from a consolidated checkpoint dict (:func:`.checkpoint.read_checkpoint`), exactly as
trained.

New checkpoints store the model config (``checkpoint["export"]["model_config"]``, :mod:`lightning_llm.export.meta`):
the model is built from it on the meta device and takes its weights from the checkpoint; only a PEFT checkpoint that
holds just the adapter needs the frozen base weights from a directory (``--base``, else the run's ``backbone``).
Older checkpoints are rebuilt from the backbone, as the run built it (with the classifier sized from the weights).

What must never happen silently, and is refused or handled here:

* checkpoint weights the rebuilt model has no place for (e.g. a trained classifier on a base-encoder backbone) or
  model weights the checkpoint and the base do not provide;
* a base directory whose architecture differs from the run's;
* a tied embedding / LM head whose two uses were trained apart (a pipeline run keeps one copy per stage): the model
  is untied (``tie_embeddings=False``) so both trained tensors are kept.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.export.meta import CHECKPOINT_KEY
from lightning_llm.models import ModelConfig, build_model, load_hf, model_from_config
from lightning_llm.models.quantize import requantize_as_trained
from lightning_llm.peft import PROMPT_METHODS, LoraArgs, PeftConfig, PromptLearningLM, apply_peft
from lightning_llm.vocab import resize_embeddings

log = logging.getLogger(__name__)

__all__ = ["base_model", "peft_config_of", "rebuild_model"]

# Config fields that change what a weight means without changing its shape: a --base directory must agree on them.
_SHAPELESS_FIELDS = ("family", "norm", "norm_eps", "activation", "position", "rope_theta", "rope_scaling",
                     "pre_norm", "embedding_norm", "final_norm", "position_offset", "num_heads", "num_kv_heads",
                     "norm_offset", "scale_embeddings", "query_pre_attn_scalar", "attn_logit_softcap",
                     "final_logit_softcap", "sliding_rope", "rope_interleave", "nope_layers", "norm_weight_fp32")


def _is_adapter_key(key: str, prompt_tuning: bool) -> bool:
    """PEFT's own weights: ``...lora_A.default.weight``, ``...modules_to_save.default.weight``, ``prompt.*``."""
    if prompt_tuning:
        return key.startswith("prompt.")
    return ".default." in key or key.endswith(".default")


def _plain_name(key: str, prompt_tuning: bool) -> str:
    """The base model's name of a (frozen) weight of a PEFT-wrapped model."""
    if prompt_tuning:
        return key.removeprefix("base.")
    return key.replace(".base_layer.", ".").replace(".original_module.", ".")


def _peft_config(checkpoint: dict[str, Any], hp: dict[str, Any]) -> Any:
    if checkpoint.get("peft") is not None:
        return PeftConfig(**checkpoint["peft"])
    if hp.get("peft") is None and hp.get("lora") is None:
        return None
    cfg = hp.get("peft") or PeftConfig(method="lora", lora=hp["lora"])
    if isinstance(cfg, dict):
        cfg = PeftConfig(**cfg)
    if isinstance(cfg.lora, dict):
        cfg.lora = LoraArgs(**cfg.lora)
    return cfg


def peft_config_of(checkpoint: dict[str, Any]) -> PeftConfig | None:
    """The PEFT settings a checkpoint's run trained with (``None``: a full fine-tune)."""
    return _peft_config(checkpoint, dict(checkpoint.get("hyper_parameters") or {}))


def _family(state: dict[str, Tensor]) -> str:
    if any(k.endswith("lm_head.weight") for k in state) or not any("classifier" in k for k in state):
        return "decoder"
    return "encoder"


def _trained_apart(plain: dict[str, Tensor]) -> bool:
    """Whether the checkpoint holds a different embedding and LM head (a tied model's two uses trained apart)."""
    e, h = plain.get("embed_tokens.weight"), plain.get("lm_head.weight")
    return e is not None and h is not None and e.shape == h.shape and not torch.equal(e, h)


def _untie_note(what: str) -> None:
    log.warning("%s: embed_tokens and lm_head were trained apart; the export unties them (tie_word_embeddings=false, "
                "both written) so it keeps both trained tensors", what)


def _base_weights(directory: str | None, config: Any, shapes: dict[str, torch.Size], need: list[str], *,
                  peft: bool) -> dict[str, Tensor]:
    """The weights ``need`` (names of the base model, ``shapes`` as the run's config has them) from the HF directory
    the run started from."""
    why = "a PEFT run's checkpoint holds only the adapter" if peft else "the checkpoint lacks base-model weights"
    if not directory or not Path(str(directory)).is_dir():
        raise ValueError(f"{why} (e.g. {need[:3]}) and backbone={directory!r} is not a directory: pass --base HF_DIR "
                         "with the base weights the run started from")
    overrides = {"num_labels": config.num_labels, "pooler": config.pooler} if config.family == "encoder" else {}
    if config.family == "decoder" and config.num_labels:  # a reward model on a ...ForCausalLM base: its head starts
        overrides = {"num_labels": config.num_labels}   # fresh there (PEFT trains it whole: modules_to_save)
    base, base_config = load_hf(directory, family=config.family, **overrides)
    if peft and config.family == "decoder" and config.vocab_size > base_config.vocab_size:
        # The run grew the vocabulary (--model.resize_embeddings): grow the frozen base the same way; its new rows
        # are replaced by the adapter's modules_to_save, which the run had to train (vocab.check_new_rows_trained).
        resize_embeddings(base, config.vocab_size)
    have = base.state_dict()
    diffs = [f"{f}: run={getattr(config, f)!r}, there={getattr(base_config, f)!r}" for f in _SHAPELESS_FIELDS
             if getattr(config, f) != getattr(base_config, f)]
    diffs += [f"{k}: run {tuple(shapes[k])}, there {tuple(have[k].shape)}" for k in need
              if k in have and have[k].shape != shapes[k]]
    diffs += [f"{k}: not there" for k in need if k not in have]
    if diffs:
        raise ValueError(f"--base/backbone {directory} is not the model the run trained on: {'; '.join(diffs[:5])}")
    return {k: have[k] for k in need}


def _from_config(config: Any, plain: dict[str, Tensor], *, base_dir: str | None, peft: bool) -> nn.Module:
    """The base model built from the stored config, weights from the checkpoint, the rest from ``base_dir``."""
    with torch.device("meta"):
        model = model_from_config(config)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    unexpected = sorted(set(plain) - set(shapes))
    bad = [f"{k}: {tuple(v.shape)} vs {tuple(shapes[k])}" for k, v in plain.items() if k in shapes
           and v.shape != shapes[k]]
    if unexpected or bad:
        raise ValueError(f"the checkpoint's weights do not fit the model of its stored config: unexpected "
                         f"{unexpected[:3]}, shapes {bad[:3]}")
    missing = [k for k in shapes if k not in plain]
    if missing:
        plain = {**_base_weights(base_dir, config, shapes, missing, peft=peft), **plain}
    for module in model.modules():  # non-persistent buffers (rope tables) are not in the state dict: compute them
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    model.init_buffers()  # type: ignore[operator]
    # then the checkpoint's state, persistent buffers included (init_buffers would zero the routers' correction biases
    # that a DeepSeek-V3 run moved)
    model.load_state_dict({k: plain[k] for k in shapes}, strict=True, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # assign=True gave lm_head its own tensor; equal values, so re-tie the Parameter
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise ValueError(f"rebuilt model has uninitialised tensors {still_meta[:3]}")
    return model


def _from_backbone(hp: dict[str, Any], plain: dict[str, Tensor], *, base: str | None, peft: bool) -> nn.Module:
    """Older checkpoints (no stored config): the base model as the run built it from its backbone, then the
    checkpoint's weights over it."""
    family = _family(plain)
    backbone = str(base or hp.get("backbone", "debug"))
    is_dir = Path(backbone).is_dir()
    overrides = {k: v for k, v in dict(hp.get("model_overrides") or {}).items() if v is not None}
    if hp.get("dropout") is not None:
        overrides["dropout"] = hp["dropout"]
    embed = plain.get("embed_tokens.weight")
    if embed is not None and not is_dir:
        overrides.setdefault("vocab_size", int(embed.shape[0]))
    classifier = plain.get("classifier.weight")
    if family == "encoder" and classifier is not None:
        # The run built its head with num_labels (and so a pooler); a base/MLM directory has neither.
        overrides["num_labels"] = int(classifier.shape[0])
    if family == "decoder" and _trained_apart(plain):
        _untie_note("checkpoint")
        overrides["tie_embeddings"] = False
    model = build_model(backbone, family=family, **overrides)  # type: ignore[arg-type]
    have = set(model.state_dict())
    unexpected = sorted(set(plain) - have)
    if unexpected:
        raise ValueError(f"the checkpoint holds {len(unexpected)} weights that backbone={backbone} rebuilt without, "
                         f"e.g. {unexpected[:3]}: pass --base HF_DIR with the run's backbone")
    missing = sorted(have - set(plain))
    if missing and not peft:  # a full fine-tune's checkpoint holds every weight: the backbone's would be untrained
        raise ValueError(f"the checkpoint lacks {len(missing)} weights of the rebuilt model, e.g. {missing[:3]}")
    if missing and not is_dir:
        raise ValueError(f"the checkpoint holds only the adapter of a PEFT run and backbone={backbone!r} is not a "
                         "directory: pass --base HF_DIR with the base weights the run started from")
    model.load_state_dict(plain, strict=False)
    return model


def rebuild_model(checkpoint: dict[str, Any], *, base: str | None = None) -> tuple[nn.Module, Any]:
    """Our model with the checkpoint's weights (eval mode), and its ``PeftConfig`` (or ``None``).

    ``base``: a HF directory with the frozen base weights, for PEFT checkpoints that hold only the adapter (it
    replaces the run's ``backbone`` path, e.g. after the base moved).
    """
    hp = dict(checkpoint.get("hyper_parameters") or {})
    state = {k[len("model."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    if not state:
        raise ValueError("the checkpoint holds no model weights (`model.*` entries of the task)")
    peft_cfg = _peft_config(checkpoint, hp)
    prompt = peft_cfg is not None and peft_cfg.method in PROMPT_METHODS
    plain = {_plain_name(k, prompt): v for k, v in state.items() if not _is_adapter_key(k, prompt)}
    stored = (checkpoint.get(CHECKPOINT_KEY) or {}).get("model_config")
    if stored:
        config = ModelConfig.from_dict(dict(stored))
        if config.family == "decoder" and config.tie_embeddings and _trained_apart(plain):
            _untie_note("checkpoint")
            config = config.replace(tie_embeddings=False)
        model = _from_config(config, plain, base_dir=base or hp.get("backbone"), peft=peft_cfg is not None)
    else:
        model = _from_backbone(hp, plain, base=base, peft=peft_cfg is not None)
    _name_labels(model, checkpoint.get("label_names"))
    # A quantized (QLoRA) run trained its adapters against the dequantized base: fold them into those values.
    requantize_as_trained(model, checkpoint.get("quantization"), where="export")
    if peft_cfg is not None:
        model = apply_peft(model, peft_cfg)
        names = set(model.state_dict())
        adapter = {k: v for k, v in state.items() if _is_adapter_key(k, prompt)}
        unexpected = sorted(set(adapter) - names)
        missing = sorted(k for k in names if _is_adapter_key(k, prompt) and k not in adapter)
        if unexpected or missing:
            raise ValueError(f"the checkpoint's {peft_cfg.method} weights do not match its PEFT settings: missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}")
        model.load_state_dict(adapter, strict=False)
    model.eval()
    return model, peft_cfg


def _name_labels(model: nn.Module, label_names: list[str] | None) -> None:
    """The run's label names (stored beside the weights by the classification task) name the classes, over any map
    the backbone directory brought (older checkpoints have no stored config holding them)."""
    config = getattr(model, "config", None)
    if not label_names or config is None or config.family != "encoder" or len(label_names) != config.num_labels:
        return
    config.extra = {**(config.extra or {}), "id2label": {str(i): n for i, n in enumerate(label_names)}}


def base_model(model: nn.Module) -> nn.Module:
    """A plain copy of a PEFT model without its adapters: base-layer weights (not merged), the original modules of
    ``modules_to_save`` and the frozen decoder of prompt tuning / P-tuning / prefix tuning."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    plain = copy.deepcopy(model.base if isinstance(model, PromptLearningLM) else model)  # deepcopy keeps ties
    wrapped = [(n, m) for n, m in plain.named_modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]
    for name, module in wrapped:
        parent = plain.get_submodule(name.rsplit(".", 1)[0]) if "." in name else plain
        inner = module.original_module if isinstance(module, ModulesToSaveWrapper) else module.get_base_layer()
        setattr(parent, name.rsplit(".", 1)[-1], inner)
    return plain
