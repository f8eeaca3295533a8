"""A Hugging Face tokenizer directory's files: whether a directory holds a tokenizer (:func:`has_tokenizer`), and
putting the run's tokenizer (a directory, or the byte tokenizer) into an exported model or adapter directory
(:func:`write_tokenizer`), checked to encode identically once written, with the run's chat template
(``chat_template.jinja``) when the tokenizer did not carry it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from lightning_llm.data.base import load_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer

log = logging.getLogger(__name__)

__all__ = ["TOKENIZER_FILES", "has_tokenizer", "write_tokenizer"]

# Files a Hugging Face tokenizer directory may consist of (copied verbatim when present).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.txt",
    "vocab.json", "merges.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "spm.model",
    "chat_template.jinja",
    "chat_template.json",
)
_PROBE = "The quick brown fox, 12345 -- 蚂蚁借呗怎么还款？花呗 Hello WORLD!"


def has_tokenizer(p: Path) -> bool:
    """Whether ``p`` holds tokenizer files."""
    return any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model"))


def _encodings(tok: Any, specials: list[str]) -> tuple[Any, ...]:
    """Ids of a probe text with ``specials`` written in it (read as their ids or as text, as the tokenizer does),
    of a pair, and the vocabulary's size."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    sample = " ".join(t for t, _ in vocab[:: max(1, len(vocab) // 50)][:50])  # tokens from the whole id range
    return (tok(" x".join([_PROBE, *specials]))["input_ids"], tok(_PROBE, sample)["input_ids"], len(tok.get_vocab()))


def write_tokenizer(source: Path | ByteTokenizer, directory: Path, *, chat_template: str | None = None,
                    token_type_ids: bool = False) -> str | None:
    """Put the tokenizer of ``source`` in ``directory``: its files copied verbatim, or, for a bare ``vocab.txt``
    (which ``AutoTokenizer`` cannot read without a ``tokenizer_config.json``), saved from the tokenizer loaded as the
    run loaded it; the byte tokenizer (a run on ``byte``) as ``tokenizer.json`` + ``tokenizer_config.json``
    (:meth:`ByteTokenizer.save_pretrained`, returning ``token_type_ids`` if asked: an encoder's export);
    ``chat_template`` (the run's, when the tokenizer does not carry it) as ``chat_template.jinja``, the file
    transformers reads first.

    The copy is kept only if ``AutoTokenizer.from_pretrained(directory)`` then loads the run's tokenizer: the same
    ids and the same template. It may not, beside a model's ``config.json``: transformers 5.24 loads any tokenizer
    files next to a ``qwen2`` (``phi3``, ``qwen3_5``, ...) config as that family's own class, whatever
    ``tokenizer_config.json`` names (the byte tokenizer's ids then come out otherwise). Then the files written here
    are removed and one warning says so: the export of good weights never fails over its tokenizer. Returns
    ``None`` when written, else that reason."""
    before = set(directory.iterdir())
    if isinstance(source, ByteTokenizer):
        ours = source
        ours.save_pretrained(directory, token_type_ids=token_type_ids)
    else:
        ours = _copy_files(source, directory)
    label = "the byte tokenizer" if isinstance(source, ByteTokenizer) else f"tokenizer from {source}"
    if chat_template is not None:
        (directory / "chat_template.json").unlink(missing_ok=True)
        (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    why = _reload_problem(ours, directory, chat_template)
    if why is not None:
        for f in set(directory.iterdir()) - before:
            f.unlink()
        reason = f"{label} not written to {directory}: {why}; load the run's tokenizer from its own directory"
        log.warning("%s", reason)
        return reason
    log.info("%s written to %s", label, directory)
    return None


def _reload_problem(ours: Any, directory: Path, chat_template: str | None) -> str | None:
    """Why ``AutoTokenizer`` does not load ``directory``'s copy as the run's tokenizer ``ours`` (None: it does)."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure means the copy is unusable
        return f"transformers cannot load the copy ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    specials = sorted(ours.added_tokens_encoder)
    if _encodings(theirs, specials) != _encodings(ours, specials):
        return (f"AutoTokenizer loads the copy as {type(theirs).__name__}, which encodes otherwise than the run's "
                f"{type(ours).__name__}")
    if chat_template is not None and theirs.get_chat_template() != chat_template:
        return "the copy does not load the run's chat template"
    return None


def _copy_files(source: Path, directory: Path) -> Any:
    """The tokenizer directory ``source``'s files in ``directory``; returns the tokenizer as the run loaded it."""
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
    return ours
