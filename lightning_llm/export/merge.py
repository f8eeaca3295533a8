"""``lightning_llm merge --base HF_DIR (--adapter DIR | --ckpt CKPT) --output DIR``: fold a PEFT adapter (an
exported adapter directory, or a checkpoint of a PEFT run in any layout ``export`` reads) into the base weights and
write a full Hugging Face checkpoint with the tokenizer and generation config. A run that grew the vocabulary
(``--model.resize_embeddings``) is merged onto the base grown the same way (:func:`lightning_llm.vocab.grow_base`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lightning_llm.data.tokenizer_files import has_tokenizer
from lightning_llm.export.checkpoint import read_checkpoint
from lightning_llm.export.files import ExportSources, export_sources, write_model_directory
from lightning_llm.files import read_json
from lightning_llm.models import load_hf
from lightning_llm.models.quantize import requantize_as_trained
from lightning_llm.peft import QUANTIZATION_FILE, PeftConfig, apply_peft, load_adapter, merge_peft
from lightning_llm.reliability import staged_directory
from lightning_llm.vocab import grow_base, trained_vocab_size

log = logging.getLogger(__name__)

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """``lightning_llm merge --base HF_DIR (--adapter DIR | --ckpt CKPT) --output DIR``: write merged full weights
    (with the tokenizer and generation config; the output appears only once complete)."""
    parser = argparse.ArgumentParser(prog="lightning_llm merge", description=main.__doc__)
    parser.add_argument("--base", required=True, help="HF checkpoint directory of the base model")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    src.add_argument("--ckpt", help="checkpoint of a PEFT run (file or directory, any layout `export` reads)")
    parser.add_argument("--output", required=True, help="directory for the merged HF checkpoint")
    args = parser.parse_args(argv)
    try:
        _merge(args.base, adapter=args.adapter, ckpt=args.ckpt, output=args.output)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning_llm merge: error: {e}")
        return 2
    print(f"merged weights written to {args.output}")
    return 0


def _merge(base: str, *, adapter: str | None, ckpt: str | None, output: str) -> None:
    if not Path(base).is_dir():
        raise FileNotFoundError(f"--base={base}: no such directory")
    model, _ = load_hf(base, family="decoder")
    if adapter:
        base_vocab = int(model.config.vocab_size)
        quant = Path(adapter) / QUANTIZATION_FILE  # trained on a quantized base: fold into the values it computed with
        requantize_as_trained(model, read_json(quant) if quant.is_file() else None, where=f"--adapter={adapter}")
        model, _ = load_adapter(model, adapter)
        if model.config.vocab_size > base_vocab and not has_tokenizer(Path(adapter)):
            raise ValueError(f"--adapter={adapter}: trained with an extended vocabulary ({model.config.vocab_size} > "
                             f"{base_vocab} ids of --base) but holds no tokenizer files: copy the run's tokenizer "
                             "into it (the base's tokenizer does not cover the new ids)")
        # The tokenizer: the adapter's own copy if it has one (an export of a run with its own tokenizer), else the
        # base's.
        tok = next((Path(d).resolve() for d in (adapter, base) if has_tokenizer(Path(d))), None)
        sources = ExportSources(tokenizer=tok, backbone_dir=Path(base).resolve(),
                                no_tokenizer_reason=f"neither --adapter nor --base={base} holds tokenizer files")
    else:
        assert ckpt is not None
        checkpoint = read_checkpoint(ckpt)
        if not checkpoint.get("peft"):
            raise ValueError(f"--ckpt={ckpt}: not a checkpoint of a PEFT run (no 'peft' entry)")
        state = {k[len("model."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
        peft_cfg = PeftConfig(**checkpoint["peft"])
        grow_base(model, trained_vocab_size(state), peft_cfg, where=f"--ckpt={ckpt}")
        requantize_as_trained(model, checkpoint.get("quantization"), where=f"--ckpt={ckpt}")
        model = apply_peft(model, peft_cfg)
        names = set(model.state_dict())
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in state]
        unexpected = sorted(set(state) - names)
        if missing or unexpected:
            raise ValueError(f"--ckpt={ckpt}: does not match --base with its PEFT settings: adapter weights missing "
                             f"{missing[:3]}, unexpected {unexpected[:3]}")
        model.load_state_dict(state, strict=False)
        sources = export_sources(checkpoint, base=base)
    merged = merge_peft(model)
    with staged_directory(output, flag="--output") as tmp:
        write_model_directory(merged, tmp, sources)
    if sources.tokenizer is None:
        log.warning("%s: no tokenizer written: %s", output, sources.no_tokenizer_reason)
