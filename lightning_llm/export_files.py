"""The files of an exported model directory besides the weights, and how the directory is written.

* :func:`staged_directory`: everything goes into a hidden ``.<name>.partial-*`` directory beside the target, which
  replaces the target in one rename only once complete (``reliability.publish``); an error at any point leaves no
  target and no temporary directory.
* :func:`write_tokenizer`: the run's tokenizer (the one it trained with), checked to encode identically once written.
* :func:`write_generation_config`: decoders' ``generation_config.json``.
* :func:`write_model_directory`: ``save_hf`` + the two above, shared by ``lightning_llm export`` and ``merge``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from lightning_llm.data.io import read_json

log = logging.getLogger(__name__)

__all__ = ["ExportSources", "has_tokenizer", "staged_directory", "write_generation_config", "write_model_directory",
           "write_tokenizer"]

# Files a Hugging Face tokenizer directory may consist of (copied verbatim when present).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json",
)
_PROBE = "The quick brown fox, 12345 -- 蚂蚁借呗怎么还款？花呗 Hello WORLD!"


@dataclass
class ExportSources:
    """Where the non-weight files come from. ``tokenizer``: a directory, or ``None`` with ``no_tokenizer_reason``."""

    tokenizer: Path | None = None
    no_tokenizer_reason: str = ""
    generation_config: dict[str, Any] | None = None
    backbone_dir: Path | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- the directory


def _is_model_directory(p: Path) -> bool:
    return (p / "config.json").is_file() or (p / "adapter_config.json").is_file()


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike[str], *, flag: str) -> Iterator[Path]:
    """Yield an empty staging directory; on a clean exit it replaces ``target`` atomically, on an error it is removed
    (with any parent directories this call created). An existing ``target`` is replaced only if it is empty or a
    model directory (a previous export), never another directory: ``flag`` names the option in that error."""
    from lightning_llm.reliability import publish, remove_path

    target = Path(target).absolute()
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise ValueError(f"{flag}={target}: exists and is not a directory")
        if any(target.iterdir()) and not _is_model_directory(target):
            raise ValueError(f"{flag}={target}: an existing directory that holds no model (no config.json or "
                             "adapter_config.json): it would be replaced as a whole; choose a new path")
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as e:
        _remove_created(created)
        raise ValueError(f"{flag}={target}: cannot create the output directory ({e.strerror or e})") from e
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the export should be as readable as a mkdir's
        yield tmp
        publish(tmp, target)
    except BaseException:
        remove_path(tmp)
        _remove_created(created)
        raise


def _remove_created(created: list[Path]) -> None:
    for p in created:  # deepest first; only directories that stayed empty
        with contextlib.suppress(OSError):
            p.rmdir()


# ---------------------------------------------------------------------------------------------------- tokenizer


def has_tokenizer(p: Path) -> bool:
    """Whether ``p`` holds tokenizer files."""
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model"))


def _encodings(tok: Any) -> tuple[Any, ...]:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    sample = " ".join(t for t, _ in vocab[:: max(1, len(vocab) // 50)][:50])  # tokens from the whole id range
    return (tok(_PROBE)["input_ids"], tok(_PROBE, sample)["input_ids"], len(tok.get_vocab()))


def write_tokenizer(source: Path, directory: Path) -> None:
    """Put the tokenizer of ``source`` in ``directory``: its files copied verbatim, or, for a bare ``vocab.txt``
    (which ``AutoTokenizer`` cannot read without a ``tokenizer_config.json``), saved from the tokenizer loaded as the
    run loaded it. Raises ``ValueError`` if ``AutoTokenizer.from_pretrained(directory)`` then encodes differently."""
    from transformers import AutoTokenizer

    from lightning_llm.data.base import load_tokenizer

    if not has_tokenizer(source):
        raise ValueError(f"tokenizer directory {source}: no tokenizer.json, tokenizer_config.json or vocab.txt there")
    ours = load_tokenizer(str(source), param="tokenizer directory")
    if (source / "tokenizer_config.json").is_file() or (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, directory / name)
    else:
        ours.save_pretrained(str(directory))
        if (source / "vocab.txt").is_file():  # readers that want the plain WordPiece file still find it
            shutil.copy2(source / "vocab.txt", directory / "vocab.txt")
    try:
        theirs = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # any loader failure: re-raised naming the source
        raise ValueError(f"tokenizer from {source}: transformers cannot load the exported copy ({e}); pass "
                         "--tokenizer DIR or --no-tokenizer") from e
    if _encodings(theirs) != _encodings(ours):
        raise ValueError(f"tokenizer from {source}: AutoTokenizer loads the exported copy as {type(theirs).__name__}, "
                         f"which encodes differently from the run's {type(ours).__name__}; pass --tokenizer DIR or "
                         "--no-tokenizer")
    log.info("tokenizer from %s written to %s", source, directory)


# ---------------------------------------------------------------------------------------------------- generation


def write_generation_config(model: nn.Module, directory: Path, sources: ExportSources) -> None:
    """Decoders: the backbone's ``generation_config.json`` (as stored in the checkpoint, else from the backbone
    directory), or one made from the config's bos/eos/pad ids. Encoders get none (transformers writes none)."""
    config = model.config  # type: ignore[union-attr]
    if config.family != "decoder":
        return
    gen = sources.generation_config
    if gen is None and sources.backbone_dir is not None and (sources.backbone_dir / "generation_config.json").is_file():
        gen = read_json(sources.backbone_dir / "generation_config.json")
    if gen is None:
        from transformers import GenerationConfig

        ids = {k: config.extra[k] for k in ("bos_token_id", "eos_token_id") if (config.extra or {}).get(k) is not None}
        gen = GenerationConfig(**ids, pad_token_id=config.pad_token_id).to_diff_dict()
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------- all of it


def check_architecture(model: nn.Module, architecture: str | None) -> None:
    """Refuse an ``--architecture`` that would drop trained weights (a classifier, an untied LM head)."""
    if architecture is None:
        return
    from lightning_llm.models.hf_config import SUPPORTED_ARCHITECTURES

    a = SUPPORTED_ARCHITECTURES.get(architecture)
    config = model.config  # type: ignore[union-attr]
    if a is None:
        return  # save_hf names the supported ones
    if config.family == "encoder" and config.num_labels > 0 and a.head != "cls":
        raise ValueError(f"--architecture={architecture} has no classification head: the trained classifier (and "
                         "pooler) would be dropped; leave --architecture out (a ...ForSequenceClassification is "
                         "written)")
    if config.family == "decoder" and not config.tie_embeddings and a.head == "base":
        raise ValueError(f"--architecture={architecture} has no LM head: the trained (untied) lm_head would be "
                         "dropped; leave --architecture out")


def write_model_directory(model: nn.Module, directory: Path, sources: ExportSources, *,
                          architecture: str | None = None) -> None:
    """``save_hf`` + tokenizer + generation config into ``directory`` (a staging directory)."""
    from lightning_llm.models import save_hf

    check_architecture(model, architecture)
    save_hf(model, directory, architecture=architecture)
    if sources.tokenizer is not None:
        write_tokenizer(sources.tokenizer, directory)
    write_generation_config(model, directory, sources)
