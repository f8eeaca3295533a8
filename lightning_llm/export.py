"""``lightning_llm export CKPT --to DIR``: any training checkpoint -> a Hugging Face directory.

Reads every checkpoint layout our strategies write and consolidates it to full tensors (no process group needed):

* a plain Lightning ``.ckpt`` file (one device, DDP, ``strategy=tp`` with ``save_distributed_checkpoint=False``);
* a ``strategy=3d`` DCP directory (any dp/tp/pp/ZeRO layout) - :mod:`lightning_llm.strategies.hybrid_checkpoint`;
* a DCP directory of ``strategy=tp`` / native ZeRO-3 (Lightning's ``ModelParallelStrategy`` layout);
* a ``strategy=pp`` directory (one file per pipeline rank);
* a native ZeRO-1/2 directory (``model.pt`` + optimizer shards);
* a DeepSpeed checkpoint directory (via Lightning's ``convert_zero_checkpoint_to_fp32_state_dict``).

The model is rebuilt as trained (:mod:`lightning_llm.export_model`): from the model config the checkpoint stores
(:mod:`lightning_llm.export_meta`), so a full fine-tune needs nothing but the checkpoint; older checkpoints from
their hyper-parameters (``backbone``, ``model_overrides``; label count from the weights). A classification run is
written as ``...ForSequenceClassification`` with its trained pooler and classifier and the run's ``id2label``. A
PEFT/LoRA run is written either merged into full weights (``--merge-lora``, the default; a tied embedding / LM head
whose uses were trained apart is untied) or as a peft adapter directory (``--adapter-only``, ``modules_to_save``
included) with the base model next to it in ``DIR/base``, so
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base), DIR)`` loads it.

Beside the weights: the run's tokenizer (checked to encode identically when reloaded with ``AutoTokenizer``), with
the chat template the run rendered with when the tokenizer did not carry it, and, for decoders,
``generation_config.json`` (ending generation where the run's did: the template's end-of-turn token and EOS). ``DIR`` appears only once complete (:mod:`lightning_llm.export_files`).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_llm.export_files import (
    ExportSources,
    has_tokenizer,
    staged_directory,
    write_model_directory,
    write_tokenizer,
)
from lightning_llm.export_meta import CHECKPOINT_KEY
from lightning_llm.export_model import base_model, rebuild_model

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "export_sources", "main", "read_checkpoint", "rebuild_model"]


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


def _resolved(p: Any) -> Path | None:
    return Path(str(p)).expanduser().resolve() if p and Path(str(p)).expanduser().is_dir() else None


def export_sources(checkpoint: dict[str, Any], *, base: str | None = None, tokenizer: str | None = None,
                   no_tokenizer: bool = False) -> ExportSources:
    """Where the tokenizer and generation config of an export come from.

    The tokenizer is the one the run trained with: ``--tokenizer``, else the directory the checkpoint records
    (``checkpoint["export"]["tokenizer"]``; if that moved and was the backbone, ``--base``). Checkpoints that record
    none fall back to the datamodule's saved ``tokenizer_dir`` hyper-parameter, then to the backbone directory. A run
    on the built-in byte tokenizer has no Hugging Face tokenizer to write."""
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    hp = dict(checkpoint.get("hyper_parameters") or {})
    backbone = _resolved(hp.get("backbone"))
    src = ExportSources(generation_config=meta.get("generation_config"), backbone_dir=_resolved(base) or backbone,
                        chat_template=meta.get("chat_template"), stop_token_ids=meta.get("stop_token_ids"))
    if no_tokenizer:
        src.no_tokenizer_reason = "--no-tokenizer"
        return src
    if tokenizer:
        if _resolved(tokenizer) is None:
            raise FileNotFoundError(f"--tokenizer={tokenizer}: no such directory")
        src.tokenizer = _resolved(tokenizer)
        return src
    recorded = meta.get("tokenizer") if CHECKPOINT_KEY in checkpoint else None
    if recorded == "byte":
        src.no_tokenizer_reason = ("the run used the built-in byte tokenizer (ids 0-258), which has no Hugging Face "
                                   "files")
        return src
    if recorded:
        candidates = [recorded]
        if base and str(recorded) == str(Path(str(hp.get("backbone"))).expanduser().resolve()):
            candidates.append(base)  # the backbone (holding the tokenizer) moved: --base names its new place
    else:
        dm_hp = dict(checkpoint.get("datamodule_hyper_parameters") or {})
        candidates = [dm_hp.get("tokenizer_dir"), base, hp.get("backbone")]
    found = next((d for d in map(_resolved, candidates) if d is not None and has_tokenizer(d)), None)
    if found is None:
        named = [str(c) for c in candidates if c]
        src.no_tokenizer_reason = (f"no tokenizer found (looked in {named})" if named else
                                   "the checkpoint names no tokenizer directory") + "; pass --tokenizer DIR"
    src.tokenizer = found
    return src


def export_checkpoint(ckpt: str | Path, to: str | Path, *, adapter_only: bool = False, base: str | None = None,
                      architecture: str | None = None, tokenizer: str | None = None,
                      no_tokenizer: bool = False) -> Path:
    """Write ``to``: a HF model directory (``config.json``, ``model.safetensors``, tokenizer, generation config), or
    for ``adapter_only`` a peft adapter with that directory for the base model in ``to/base``. ``to`` appears only
    once complete; an existing ``to`` that holds a model is replaced."""
    from lightning_llm.peft import export_adapter, merge_peft

    checkpoint = read_checkpoint(ckpt)
    model, peft_cfg = rebuild_model(checkpoint, base=base)
    if adapter_only and peft_cfg is None:
        raise ValueError("--adapter-only: the checkpoint is not from a PEFT/LoRA run")
    sources = export_sources(checkpoint, base=base, tokenizer=tokenizer, no_tokenizer=no_tokenizer)
    out = Path(to).absolute()
    with staged_directory(out, flag="--to") as tmp:
        if adapter_only:
            export_adapter(model, peft_cfg, tmp, base_model_name_or_path=str(out / "base"))
            (tmp / "base").mkdir()
            write_model_directory(base_model(model), tmp / "base", sources, architecture=architecture)
            if sources.tokenizer is not None:  # PeftModel users load the tokenizer from the adapter directory
                write_tokenizer(sources.tokenizer, tmp, chat_template=sources.chat_template)
        else:
            write_model_directory(model if peft_cfg is None else merge_peft(model), tmp, sources,
                                  architecture=architecture)
    if sources.tokenizer is None:
        log.warning("%s: no tokenizer written: %s", out, sources.no_tokenizer_reason)
    return out


def main(argv: list[str]) -> int:
    """``lightning_llm export CKPT --to DIR [--merge-lora | --adapter-only] [--base HF_DIR] [--tokenizer DIR]``."""
    parser = argparse.ArgumentParser(prog="lightning_llm export", description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="checkpoint file or directory (any of our strategies' layouts)")
    parser.add_argument("--to", required=True, help="output directory (Hugging Face format), written atomically")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--merge-lora", action="store_true", help="PEFT runs: fold the adapter into full weights "
                                                                "(default)")
    mode.add_argument("--adapter-only", action="store_true", help="PEFT runs: write the peft adapter (+ DIR/base)")
    parser.add_argument("--base", help="HF directory of the base model, for adapter-only PEFT checkpoints (default: "
                                       "the run's backbone)")
    parser.add_argument("--architecture", help="HF architecture (default: from the model family and head)")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", help="tokenizer directory to write (default: the run's, from the checkpoint)")
    tok.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.to, adapter_only=args.adapter_only, base=args.base,
                                architecture=args.architecture, tokenizer=args.tokenizer,
                                no_tokenizer=args.no_tokenizer)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning_llm export: error: {e}")
        return 2
    print(f"exported {args.ckpt} -> {out}")
    return 0
