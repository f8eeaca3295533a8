"""A Hugging Face tokenizer directory's files: whether a directory holds a tokenizer (:func:`has_tokenizer`), and
putting the run's tokenizer into an exported model or adapter directory (:func:`write_tokenizer`), checked to encode
identically once written, with the run's chat template (``chat_template.jinja``) when the tokenizer did not carry it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from lightning_llm.data.base import load_tokenizer

log = logging.getLogger(__name__)

__all__ = ["TOKENIZER_FILES", "has_tokenizer", "write_tokenizer"]

# Files a Hugging Face tokenizer directory may consist of (copied verbatim when present).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
    "chat_template.json",
)
_PROBE = "The quick brown fox, 12345 -- 蚂蚁借呗怎么还款？花呗 Hello WORLD!"


def has_tokenizer(p: Path) -> bool:
    """Whether ``p`` holds tokenizer files."""
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model"))


def _encodings(tok: Any) -> tuple[Any, ...]:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    sample = " ".join(t for t, _ in vocab[:: max(1, len(vocab) // 50)][:50])  # tokens from the whole id range
    return (tok(_PROBE)["input_ids"], tok(_PROBE, sample)["input_ids"], len(tok.get_vocab()))


def write_tokenizer(source: Path, directory: Path, *, chat_template: str | None = None) -> None:
    """Put the tokenizer of ``source`` in ``directory``: its files copied verbatim, or, for a bare ``vocab.txt``
    (which ``AutoTokenizer`` cannot read without a ``tokenizer_config.json``), saved from the tokenizer loaded as the
    run loaded it; ``chat_template`` (the run's, when the tokenizer does not carry it) as ``chat_template.jinja``,
    the file transformers reads first. Raises ``ValueError`` if ``AutoTokenizer.from_pretrained(directory)`` then
    encodes differently or renders another template."""
    from transformers import AutoTokenizer

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
    if chat_template is not None:
        (directory / "chat_template.json").unlink(missing_ok=True)
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    try:
        theirs = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # any loader failure: re-raised naming the source
        raise ValueError(f"tokenizer from {source}: transformers cannot load the exported copy ({e}); pass "
                         "--tokenizer DIR or --no-tokenizer") from e
    if _encodings(theirs) != _encodings(ours):
        raise ValueError(f"tokenizer from {source}: AutoTokenizer loads the exported copy as {type(theirs).__name__}, "
                         f"which encodes differently from the run's {type(ours).__name__}; pass --tokenizer DIR or "
                         "--no-tokenizer")
    if chat_template is not None and theirs.get_chat_template() != chat_template:
        raise ValueError(f"tokenizer from {source}: the exported copy does not load the run's chat template")
    log.info("tokenizer from %s written to %s", source, directory)
