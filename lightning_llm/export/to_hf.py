"""``lightning_llm export CKPT --to DIR``: any training checkpoint -> a Hugging Face directory.

Reads every checkpoint layout our strategies write, consolidated to full tensors (:mod:`.checkpoint`). The model is
rebuilt as trained (:mod:`.model`): from the model config the checkpoint stores (:mod:`.meta`), so a full fine-tune
needs nothing but the checkpoint; older checkpoints from their hyper-parameters (``backbone``, ``model_overrides``;
label count from the weights). A classification run is written as ``...ForSequenceClassification`` with its trained
pooler and classifier and the run's ``id2label``; a reward model (``RewardTask``: a decoder with a score head) as
``<Family>ForSequenceClassification`` with ``num_labels=1`` and the run's pad id. A PEFT/LoRA run is written either merged into full weights
(``--merge-lora``, the default; a tied embedding / LM head whose uses were trained apart is untied) or as a peft
adapter directory (``--adapter-only``, ``modules_to_save`` included) with the base model next to it in ``DIR/base``,
so ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR/base), DIR)`` loads it.

Beside the weights: the run's tokenizer (checked to encode identically when reloaded with ``AutoTokenizer``), with
the chat template the run rendered with when the tokenizer did not carry it, and, for decoders,
``generation_config.json`` (ending generation where the run's did: the template's end-of-turn token and EOS)
(:mod:`lightning_llm.export.files`). ``DIR`` appears only once complete (``reliability.staged_directory``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lightning_llm.data.tokenizer_files import write_tokenizer
from lightning_llm.export.checkpoint import read_checkpoint
from lightning_llm.export.files import export_sources, write_model_directory
from lightning_llm.export.model import base_model, rebuild_model
from lightning_llm.peft import export_adapter, merge_peft
from lightning_llm.reliability import staged_directory

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "main"]


def export_checkpoint(ckpt: str | Path, to: str | Path, *, adapter_only: bool = False, base: str | None = None,
                      architecture: str | None = None, tokenizer: str | None = None,
                      no_tokenizer: bool = False) -> Path:
    """Write ``to``: a HF model directory (``config.json``, ``model.safetensors``, tokenizer, generation config), or
    for ``adapter_only`` a peft adapter with that directory for the base model in ``to/base``. ``to`` appears only
    once complete; an existing ``to`` that holds a model is replaced."""
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
    tok.add_argument("--tokenizer", help="tokenizer directory to write, or byte for the built-in byte tokenizer "
                     "(default: the run's, from the checkpoint)")
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
