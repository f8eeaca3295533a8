"""What an exported model directory holds besides the weights, and where it comes from.

* :class:`ExportSources` / :func:`export_sources`: where the tokenizer, chat template and generation config of an
  export come from (the checkpoint's records, ``--tokenizer``, ``--base``).
* :func:`generation_config_dict` / :func:`write_generation_config`: decoders' ``generation_config.json``, stopping at
  the run's stop ids (``lightning_llm eval`` stops generation where it says too).
* :func:`write_model_directory`: ``save_hf`` + the tokenizer (``data.tokenizer_files.write_tokenizer``) + the
  generation config into a staging directory (``reliability.staged_directory``: the target appears only once
  complete), shared by ``lightning_llm export`` and ``merge``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_llm.data.base import BYTE_TOKENIZER
from lightning_llm.data.tokenizer_files import has_tokenizer, write_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.export.meta import CHECKPOINT_KEY, recorded_byte_tokenizer
from lightning_llm.files import read_json
from lightning_llm.models import save_hf
from lightning_llm.models.hf import SUPPORTED_ARCHITECTURES

log = logging.getLogger(__name__)

__all__ = ["ExportSources", "export_sources", "generation_config_dict", "write_generation_config",
           "write_model_directory"]


@dataclass
class ExportSources:
    """Where the non-weight files come from. ``tokenizer``: a directory, the byte tokenizer (a run on ``byte``), or
    ``None`` with ``no_tokenizer_reason``."""

    tokenizer: Path | ByteTokenizer | None = None
    no_tokenizer_reason: str = ""
    generation_config: dict[str, Any] | None = None
    backbone_dir: Path | None = None
    chat_template: str | None = None
    stop_token_ids: list[int] | None = None
    notes: list[str] = field(default_factory=list)


def _resolved(p: Any) -> Path | None:
    return Path(str(p)).expanduser().resolve() if p and Path(str(p)).expanduser().is_dir() else None


def export_sources(checkpoint: dict[str, Any], *, base: str | None = None, tokenizer: str | None = None,
                   no_tokenizer: bool = False) -> ExportSources:
    """Where the tokenizer and generation config of an export come from.

    The tokenizer is the one the run trained with: ``--tokenizer``, else the directory the checkpoint records
    (``checkpoint["export"]["tokenizer"]``; if that moved and was the backbone, ``--base``). Checkpoints that record
    none fall back to the datamodule's saved ``tokenizer_dir`` hyper-parameter, then to the backbone directory. A run
    on the built-in byte tokenizer (or ``--tokenizer byte``) exports it as files ``AutoTokenizer`` loads with the
    same ids."""
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    hp = dict(checkpoint.get("hyper_parameters") or {})
    backbone = _resolved(hp.get("backbone"))
    src = ExportSources(generation_config=meta.get("generation_config"), backbone_dir=_resolved(base) or backbone,
                        chat_template=meta.get("chat_template"), stop_token_ids=meta.get("stop_token_ids"))
    if no_tokenizer:
        src.no_tokenizer_reason = "--no-tokenizer"
        return src
    recorded = meta.get("tokenizer") if CHECKPOINT_KEY in checkpoint else None
    if tokenizer == BYTE_TOKENIZER or (not tokenizer and recorded == BYTE_TOKENIZER):
        src.tokenizer = recorded_byte_tokenizer(meta)
        return src
    if tokenizer:
        if _resolved(tokenizer) is None:
            raise FileNotFoundError(f"--tokenizer={tokenizer}: no such directory (or byte: the built-in byte "
                                    "tokenizer)")
        src.tokenizer = _resolved(tokenizer)
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


# ---------------------------------------------------------------------------------------------------- generation


def write_generation_config(model: nn.Module, directory: Path, sources: ExportSources) -> None:
    """Decoders: :func:`generation_config_dict` as ``generation_config.json``. Encoders and sequence classifiers (a
    reward model) get none (transformers writes none: they do not generate)."""
    config = model.config  # type: ignore[union-attr]
    if config.family != "decoder" or config.num_labels > 0:
        return
    gen = generation_config_dict(config, sources)
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def generation_config_dict(config: Any, sources: ExportSources) -> dict[str, Any]:
    """A decoder's generation config as the export writes it: the backbone's ``generation_config.json`` (as stored
    in the checkpoint, else from the backbone directory), or one made from the config's bos/eos/pad ids; its
    ``eos_token_id`` extended with the run's stop ids (where the run's own generation ended)."""
    gen = sources.generation_config
    if gen is None and sources.backbone_dir is not None and (sources.backbone_dir / "generation_config.json").is_file():
        gen = read_json(sources.backbone_dir / "generation_config.json")
    if gen is None:
        from transformers import GenerationConfig

        ids = {k: config.extra[k] for k in ("bos_token_id", "eos_token_id") if (config.extra or {}).get(k) is not None}
        gen = GenerationConfig(**ids, pad_token_id=config.pad_token_id).to_diff_dict()
    if sources.stop_token_ids:  # the run generated until its template's end-of-turn token or EOS: so will the export
        eos = gen.get("eos_token_id")
        have = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        stops = list(dict.fromkeys([*sources.stop_token_ids, *have]))
        gen = {**gen, "eos_token_id": stops if len(stops) > 1 else stops[0]}
    return gen


# ---------------------------------------------------------------------------------------------------- all of it


def check_architecture(model: nn.Module, architecture: str | None) -> None:
    """Refuse an ``--architecture`` that would drop trained weights (a classifier, an untied LM head)."""
    if architecture is None:
        return
    a = SUPPORTED_ARCHITECTURES.get(architecture)
    config = model.config  # type: ignore[union-attr]
    if a is None:
        return  # save_hf names the supported ones
    if config.family == "encoder" and config.num_labels > 0 and a.head != "cls":
        raise ValueError(f"--architecture={architecture} has no classification head: the trained classifier (and "
                         "pooler) would be dropped; leave --architecture out (a ...ForSequenceClassification is "
                         "written)")
    if config.family == "decoder" and config.num_labels > 0 and a.head != "cls":
        raise ValueError(f"--architecture={architecture} has no score head: the trained reward model's head would be "
                         "dropped; leave --architecture out (a ...ForSequenceClassification is written)")
    if config.family == "decoder" and not config.num_labels and not config.tie_embeddings and a.head == "base":
        raise ValueError(f"--architecture={architecture} has no LM head: the trained (untied) lm_head would be "
                         "dropped; leave --architecture out")


def write_model_directory(model: nn.Module, directory: Path, sources: ExportSources, *,
                          architecture: str | None = None) -> None:
    """``save_hf`` + tokenizer + generation config into ``directory`` (a staging directory)."""
    check_architecture(model, architecture)
    save_hf(model, directory, architecture=architecture)
    if sources.tokenizer is not None:
        write_tokenizer(sources.tokenizer, directory, chat_template=sources.chat_template,
                        token_type_ids=model.config.family == "encoder")  # type: ignore[union-attr]
    write_generation_config(model, directory, sources)
