"""``lightning_llm export CKPT --to DIR``: any training checkpoint -> a Hugging Face directory.

Reads every checkpoint layout our strategies write and consolidates it to full tensors (no process group needed):

* a plain Lightning ``.ckpt`` file (one device, DDP, ``strategy=tp`` with ``save_distributed_checkpoint=False``);
* a ``strategy=3d`` DCP directory (any dp/tp/pp/ZeRO layout) - :mod:`lightning_llm.strategies.hybrid_checkpoint`;
* a DCP directory of ``strategy=tp`` / native ZeRO-3 (Lightning's ``ModelParallelStrategy`` layout);
* a ``strategy=pp`` directory (one file per pipeline rank);
* a native ZeRO-1/2 directory (``model.pt`` + optimizer shards);
* a DeepSpeed checkpoint directory (via Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``).

The model is rebuilt from the checkpoint's hyper-parameters (``backbone``, ``model_overrides``; vocabulary and label
count from the weights' shapes). A PEFT/LoRA run is written either merged into full weights (``--merge-lora``, the
default) or as a peft adapter directory (``--adapter-only``) with the base model next to it in ``DIR/base``, so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base), DIR)`` loads it.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "main", "read_checkpoint", "rebuild_model"]


def _dcp_contents(path: Path) -> dict[str, Any]:
    """Every tensor/object of a DCP directory, loaded whole on this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    _load_state_dict(out, storage_reader=dcp.FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return out


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A consolidated Lightning-style checkpoint dict (``state_dict`` with full tensors, ``hyper_parameters``, ...)
    from any of the layouts listed in the module docstring."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"CKPT={p}: no such file or directory")
    if p.is_file():
        return torch.load(p, map_location="cpu", weights_only=False)
    from lightning_llm.strategies import hybrid_checkpoint
    from lightning_llm.strategies.pipeline_checkpoint import (
        CHECKPOINT_FILE,
        consolidate_checkpoint,
    )

    if hybrid_checkpoint.is_hybrid_checkpoint(p):
        return hybrid_checkpoint.consolidated_state_dict(p)
    if any(p.glob(CHECKPOINT_FILE.replace("{:02d}", "*"))):
        return consolidate_checkpoint(p)
    if (p / "model.pt").is_file():  # native ZeRO-1/2: replicated weights written once
        return torch.load(p / "model.pt", map_location="cpu", weights_only=False)
    if (p / ".metadata").is_file() and (p / "meta.pt").is_file():  # TP / ZeRO-3 (ModelParallelStrategy layout)
        meta = torch.load(p / "meta.pt", map_location="cpu", weights_only=False)
        return {**meta, "state_dict": dict(_dcp_contents(p).get("state_dict", {})), "optimizer_states": []}
    if (p / "latest").is_file() or any(p.glob("*/mp_rank_*_model_states.pt")):  # DeepSpeed
        from lightning.pytorch.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict,
        )

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "consolidated.ckpt"
            convert_zero_checkpoint_to_fp32_state_dict(str(p), str(out))
            return torch.load(out, map_location="cpu", weights_only=False)
    raise ValueError(f"CKPT={p}: not a checkpoint directory written by one of our strategies (3d, tp, pp, zero, "
                     "deepspeed)")


def _family(state: dict[str, Tensor]) -> str:
    if any(k.endswith("lm_head.weight") for k in state) or not any("classifier" in k for k in state):
        return "decoder"
    return "encoder"


def _find(state: dict[str, Tensor], suffix: str) -> Tensor | None:
    return next((v for k, v in state.items() if k.endswith(suffix)), None)


def rebuild_model(checkpoint: dict[str, Any], *, base: str | None = None) -> tuple[nn.Module, Any]:
    """Our model with the checkpoint's weights, and its ``PeftConfig`` (or ``None``).

    ``base``: a HF directory holding the frozen base weights, for PEFT checkpoints that store only the adapter
    (plain ``.ckpt`` files of PEFT runs; ``strategy=3d`` checkpoints hold the base too).
    """
    from lightning_llm.models import build_model
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft

    hp = dict(checkpoint.get("hyper_parameters") or {})
    state = {k[len("model."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    if not state:
        raise ValueError("the checkpoint holds no model weights (`model.*` entries of the task)")
    family = _family(state)
    backbone = base or hp.get("backbone", "debug")
    overrides = {k: v for k, v in dict(hp.get("model_overrides") or {}).items() if v is not None}
    if hp.get("dropout") is not None:
        overrides["dropout"] = hp["dropout"]
    embed = _find(state, "embed_tokens.weight")
    if embed is not None and not Path(str(backbone)).is_dir():
        overrides.setdefault("vocab_size", int(embed.shape[0]))
    classifier = _find(state, "classifier.weight")
    if family == "encoder" and classifier is not None and not Path(str(backbone)).is_dir():
        overrides.setdefault("num_labels", int(classifier.shape[0]))
    model = build_model(str(backbone), family=family, **overrides)  # type: ignore[arg-type]
    peft_cfg = None
    if checkpoint.get("peft") is not None:
        peft_cfg = PeftConfig(**checkpoint["peft"])
    elif hp.get("peft") is not None or hp.get("lora") is not None:
        peft_cfg = hp.get("peft") or PeftConfig(method="lora", lora=hp["lora"])
        if isinstance(peft_cfg, dict):
            peft_cfg = PeftConfig(**peft_cfg)
        if isinstance(peft_cfg.lora, dict):
            peft_cfg.lora = LoraArgs(**peft_cfg.lora)
    if peft_cfg is not None:
        model = apply_peft(model, peft_cfg)
    have = set(state)
    missing = [n for n in model.state_dict() if n not in have]
    frozen_missing = [n for n in missing if "lora_" not in n]
    if missing and (peft_cfg is None or any("lora_" in n for n in missing)):
        raise ValueError(f"the checkpoint lacks {len(missing)} weights of the rebuilt model, e.g. {missing[:3]}")
    if frozen_missing and not Path(str(backbone)).is_dir():
        raise ValueError(f"the checkpoint holds only the adapter of a PEFT run and backbone={backbone!r} is not a "
                         "directory: pass --base HF_DIR with the base weights the run started from")
    model.load_state_dict(state, strict=False)
    model.eval()
    return model, peft_cfg


def _base_model(model: nn.Module) -> nn.Module:
    """A plain copy of a PEFT-injected model without its adapters (base-layer weights, not merged)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    plain = copy.deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent = plain.get_submodule(name.rsplit(".", 1)[0]) if "." in name else plain
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
    return plain


def export_checkpoint(ckpt: str | Path, to: str | Path, *, adapter_only: bool = False, base: str | None = None,
                      architecture: str | None = None) -> Path:
    """Write ``to`` (HF ``config.json`` + ``model.safetensors``; or a peft adapter + ``to/base``)."""
    from lightning_llm.models import save_hf
    from lightning_llm.peft import export_adapter, merge_peft

    model, peft_cfg = rebuild_model(read_checkpoint(ckpt), base=base)
    out = Path(to)
    if peft_cfg is None:
        if adapter_only:
            raise ValueError("--adapter-only: the checkpoint is not from a PEFT/LoRA run")
        return save_hf(model, out, architecture=architecture)
    if adapter_only:
        export_adapter(model, peft_cfg, out, base_model_name_or_path=str(out / "base"))
        save_hf(_base_model(model), out / "base", architecture=architecture)
        return out
    return save_hf(merge_peft(model), out, architecture=architecture)


def main(argv: list[str]) -> int:
    """``lightning_llm export CKPT --to DIR [--merge-lora | --adapter-only] [--base HF_DIR]``."""
    parser = argparse.ArgumentParser(prog="lightning_llm export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="checkpoint file or directory (any of our strategies' layouts)")
    parser.add_argument("--to", required=True, help="output directory (Hugging Face format)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--merge-lora", action="store_true", help="PEFT runs: fold the adapter into full weights "
                                                                "(default)")
    mode.add_argument("--adapter-only", action="store_true", help="PEFT runs: write the peft adapter (+ DIR/base)")
    parser.add_argument("--base", help="HF directory of the base model, for adapter-only PEFT checkpoints")
    parser.add_argument("--architecture", help="HF architecture (default: from the model family)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.to, adapter_only=args.adapter_only, base=args.base,
                                architecture=args.architecture)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning_llm export: error: {e}")
        return 2
    print(f"exported {args.ckpt} -> {out}")
    return 0
