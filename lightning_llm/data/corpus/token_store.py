"""The prepared token store of a corpus: one flat token file, memory-mapped for training, plus document boundaries and
a manifest; and the tokenization of one task, as a worker process runs it.

A store is a directory (written elsewhere, then renamed into place with its manifest last, see
:mod:`lightning_llm.data.corpus.prepare`)::

    tokens.bin      every document's tokens followed by EOS, concatenated (uint16, or uint32 past 65,536 ids)
    documents.bin   int64 end offset of each document in tokens.bin (the document boundaries)
    manifest.json   inputs (path, bytes, mtime, SHA-256 of sampled content), tokenizer fingerprint, counts, dtype,
                    SHA-256 of tokens.bin
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lightning_llm.data.corpus.documents import BATCH_CHARS, BATCH_DOCS, Task, read_task
from lightning_llm.files import DataError

log = logging.getLogger(__name__)

FORMAT = "lightning_llm.token_store/1"
MANIFEST, TOKENS, DOCUMENTS = "manifest.json", "tokens.bin", "documents.bin"


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker process needs to tokenize exactly as the run's tokenizer does (``tokenizer(texts,
    add_special_tokens=False)``), and what identifies it. A fast (``tokenizers``-backed) tokenizer travels as its
    backend's full serialized state (truncation and padding off); any other as a pickle."""

    name: str
    backend_json: str | None
    split_special_tokens: bool
    pickled: bytes | None
    eos: int | None
    vocab_size: int

    @classmethod
    def of(cls, tokenizer: Any, *, vocab_size: int) -> TokenizerSpec:
        eos = tokenizer.eos_token_id
        if eos is None:  # BERT-style vocabularies: [SEP] ends a document
            eos = getattr(tokenizer, "sep_token_id", None)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            backend = Tokenizer.from_str(backend.to_str())  # a copy: the state the tokenizer's calls may have left
            backend.no_truncation()
            backend.no_padding()
            return cls(type(tokenizer).__name__, backend.to_str(), bool(getattr(tokenizer, "split_special_tokens",
                                                                                 False)), None, eos, vocab_size)
        return cls(type(tokenizer).__name__, None, False, pickle.dumps(tokenizer), eos, vocab_size)

    @property
    def fingerprint(self) -> str:
        """SHA-256 of everything that decides the token ids: the full serialized tokenizer, EOS, vocabulary size."""
        h = hashlib.sha256(f"{self.name}|{self.split_special_tokens}|{self.eos}|{self.vocab_size}|".encode())
        h.update(self.backend_json.encode() if self.backend_json is not None else self.pickled or b"")
        return h.hexdigest()

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encoder(self) -> Any:
        """``texts -> list of id lists`` (in a worker: built once per process)."""
        if self.backend_json is not None:
            tok = Tokenizer.from_str(self.backend_json)
            tok.encode_special_tokens = self.split_special_tokens
            return lambda texts: [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
        tok = pickle.loads(self.pickled)
        return lambda texts: tok(texts, add_special_tokens=False)["input_ids"]


@dataclass
class Shard:
    """A task's output: ``tokens`` files written beside the store, the document ends relative to the shard."""

    index: int
    tokens_path: str
    ends: np.ndarray
    n_tokens: int
    n_docs: int
    n_empty: int
    input_bytes: int


def tokenize_task(index: int, task: Task, *, spec: TokenizerSpec, encode: Any, text_field: str, out_dir: str
                  ) -> Shard:
    """Tokenize one task in batches of about :data:`BATCH_CHARS` characters; write its tokens (EOS after each
    document; a blank document or one without tokens adds nothing) to ``out_dir/shard-<index>.bin``. Memory: one
    batch of texts and ids."""
    path = os.path.join(out_dir, f"shard-{index:07d}.bin")
    ends: list[int] = []
    n_tokens = n_empty = chars = 0
    # Where the current document's tokens begin in this shard (None: it began in an earlier task, a large .txt).
    doc_start: int | None = None if task.kind == "txt" and task.start > 0 else 0
    batch: list[tuple[str, bool]] = []
    with open(path, "wb") as out:

        def flush() -> None:
            nonlocal n_tokens, n_empty, doc_start
            flat: list[int] = []
            for ids, (_, ends_doc) in zip(encode([t for t, _ in batch]), batch, strict=True):
                flat.extend(ids)
                if not ends_doc:
                    continue
                if doc_start == n_tokens + len(flat):  # a document without tokens adds nothing (no lone EOS)
                    n_empty += 1
                    continue
                if spec.eos is not None:
                    flat.append(spec.eos)
                ends.append(n_tokens + len(flat))
                doc_start = ends[-1]
            try:
                arr = np.array(flat, dtype=spec.dtype)
            except OverflowError:
                raise DataError(f"{task.path}: the tokenizer returned an id >= {np.iinfo(spec.dtype).max + 1}, "
                                f"beyond its vocabulary size {spec.vocab_size}") from None
            out.write(arr.tobytes())
            n_tokens += len(arr)
            batch.clear()

        doc_open = doc_start is None  # text of the current document was read (a large .txt continued)
        for text, ends_doc in read_task(task, text_field=text_field):
            if ends_doc and not doc_open and not text.strip():  # an empty or blank document adds nothing
                n_empty += 1
                continue
            doc_open = not ends_doc
            batch.append((text, ends_doc))
            chars += len(text)
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                flush()
                chars = 0
        if batch:
            flush()
    return Shard(index, path, np.asarray(ends, dtype=np.int64), n_tokens, len(ends), n_empty, task.size)


class TokenStore:
    """A prepared store, read-only: ``store[i:j]`` slices the memory-mapped tokens (only the pages read become
    resident). Pickles as its path, so DataLoader workers map the file themselves instead of copying it."""

    def __init__(self, path: str | Path, manifest: dict[str, Any]) -> None:
        self.path, self.manifest = Path(path), manifest
        self._tokens: np.memmap | None = None

    @classmethod
    def open(cls, path: str | Path) -> TokenStore | None:
        """The finished store at ``path``, or ``None`` (absent, or a manifest of another format: never a half-written
        one, whose manifest is written last)."""
        try:
            manifest = json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if manifest.get("format") != FORMAT:
            return None
        return cls(path, manifest)

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            n = int(self.manifest["tokens"])
            self._tokens = np.memmap(self.path / TOKENS, dtype=np.dtype(self.manifest["dtype"]), mode="r",
                                     shape=(n,)) if n else np.zeros(0, dtype=self.manifest["dtype"])
        return self._tokens

    def documents(self) -> np.memmap:
        """End offset of every document in the token stream (memory-mapped int64)."""
        return np.memmap(self.path / DOCUMENTS, dtype=np.int64, mode="r")

    def __len__(self) -> int:
        return int(self.manifest["tokens"])

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.tokens[index]

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "manifest": self.manifest, "_tokens": None}

    @property
    def content(self) -> str:
        """SHA-256 of the token stream: what a checkpoint records of the data it was trained on."""
        return str(self.manifest["tokens_sha256"])

    def __repr__(self) -> str:
        m = self.manifest
        return f"TokenStore({self.path}, {m['tokens']:,} tokens, {m['documents']:,} documents)"
