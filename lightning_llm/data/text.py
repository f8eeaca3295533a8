"""Causal-LM pretraining data: documents -> one token stream (cached, memory-mapped) -> fixed-size blocks."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_llm.data.base import LLMDataModule, tokenizer_or_bytes, tokenizer_vocab_size
from lightning_llm.data.io import DataError, atomic_open, read_records, read_text

log = logging.getLogger(__name__)


def generated_corpus(n_docs: int = 400, *, seed: int = 0) -> list[str]:
    """Deterministic toy documents with learnable structure (a tiny grammar), for runs with no data files."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a robot"]
    verbs = ["sees", "likes", "follows", "draws", "finds", "helps"]
    objects = ["the ball", "a tree", "the river", "a small house", "the moon", "an old book"]
    docs = []
    for _ in range(n_docs):
        sents = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(rng.randint(3, 8))]
        docs.append(" ".join(s.capitalize() for s in sents))
    return docs


def read_documents(path: str | Path, *, text_field: str = "text") -> list[str]:
    """Documents from a ``.txt`` file (one document), a JSON/JSONL file (``text_field`` per record), or a
    directory of such files (sorted, recursive)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".json", ".jsonl"))
        if not files:
            raise DataError(f"--data.data_path={path}: no .txt, .json or .jsonl files in that directory")
    elif p.is_file():
        files = [p]
    else:
        raise FileNotFoundError(f"--data.data_path={path}: no such file or directory")
    docs: list[str] = []
    for f in files:
        if f.suffix == ".txt":
            text = read_text(f)
            if text.strip():
                docs.append(text)
        else:
            docs.extend(r[text_field] for r in read_records(f, required=[text_field], types={text_field: str}))
    if not docs:
        raise DataError(f"--data.data_path={path}: no text found")
    return docs


class BlockDataset(Dataset):
    """Blocks of ``block_size + 1`` tokens overlapping by one: inputs = block[:-1], labels = block[1:]."""

    def __init__(self, tokens: np.ndarray, block_size: int, start: int, stop: int) -> None:
        self.tokens, self.block_size, self.start, self.stop = tokens, block_size, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = (self.start + i) * self.block_size
        block = torch.from_numpy(np.asarray(self.tokens[j:j + self.block_size + 1], dtype=np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}


class TextDataModule(LLMDataModule):
    """Tokenize, concatenate (EOS between documents), cut into ``block_size`` blocks; the remainder is dropped.

    The token stream is cached on disk (``.npy``, memory-mapped) under a key of the input files, tokenizer and
    settings, so a second run skips tokenization (``self.cache_hit`` tells). Labels are the inputs shifted
    by one token (prepared here, so the loss needs no slicing of possibly-sharded logits).
    """

    def __init__(
        self,
        data_path: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        block_size: int = 128,
        val_fraction: float = 0.05,
        text_field: str = "text",
        cache_dir: str = ".lightning_llm_cache/tokens",
        generated_docs: int = 400,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            data_path: A .txt/.json/.jsonl file or a directory of them; ``None`` uses a generated toy corpus.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            block_size: Tokens per training example.
            val_fraction: Share of blocks (the last ones) held out for validation.
            text_field: Field holding the text in JSON/JSONL records.
            cache_dir: Where token streams are cached.
            generated_docs: Documents in the generated corpus (when ``data_path`` is None).
            batch_size: Per-device training batch size.
            eval_batch_size: Per-device evaluation batch size.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle.
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        if block_size < 2:
            raise ValueError(f"--data.block_size must be >= 2, got {block_size}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be in [0, 1), got {val_fraction}")
        if data_path is not None and not Path(data_path).exists():
            raise FileNotFoundError(f"--data.data_path={data_path}: no such file or directory")
        self.data_path, self.text_field = data_path, text_field
        self.tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.tokenizer_dir = tokenizer_dir
        self.block_size, self.val_fraction = block_size, val_fraction
        self.cache_dir, self.generated_docs = Path(cache_dir), generated_docs
        self.cache_hit: bool | None = None
        self.datasets: dict[str, BlockDataset] = {}

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    def _cache_key(self) -> str:
        h = hashlib.sha256()
        if self.data_path is None:
            h.update(f"generated:{self.generated_docs}".encode())
        else:
            p = Path(self.data_path)
            for f in sorted([p] if p.is_file() else p.rglob("*")):
                if f.is_file():
                    st = f.stat()
                    h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        tok = json.dumps(sorted(self.tokenizer.get_vocab().items())[:50] + [len(self.tokenizer.get_vocab())])
        h.update(f"{type(self.tokenizer).__name__}:{self.tokenizer_dir}:{tok}:{self.text_field}".encode())
        return h.hexdigest()[:16]

    def tokens(self) -> np.ndarray:
        """The whole corpus as one memory-mapped int32 array (tokenized once, then read from the cache)."""
        path = self.cache_dir / f"{self._cache_key()}.npy"
        if path.is_file():
            self.cache_hit = True
            return np.load(path, mmap_mode="r")
        self.cache_hit = False
        docs = generated_corpus(self.generated_docs) if self.data_path is None else read_documents(
            self.data_path, text_field=self.text_field)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.tokenizer, "sep_token_id", None)
        stream: list[int] = []
        for ids in self.tokenizer(docs, add_special_tokens=False)["input_ids"]:
            stream.extend(ids)
            if eos is not None:
                stream.append(eos)
        arr = np.asarray(stream, dtype=np.int32)
        with atomic_open(path, "wb") as f:
            np.save(f, arr)
        log.info("tokenized %d documents into %d tokens (cached at %s)", len(docs), len(arr), path)
        return np.load(path, mmap_mode="r")

    def setup(self, stage: str) -> None:
        if self.datasets:
            return
        tokens = self.tokens()
        n_blocks = (len(tokens) - 1) // self.block_size
        n_val = int(round(n_blocks * self.val_fraction))
        if n_blocks - n_val < 1:
            raise DataError(f"corpus has {len(tokens)} tokens: not enough for one block of "
                            f"block_size={self.block_size}")
        if self.val_fraction > 0 and n_val == 0:
            n_val = 1 if n_blocks > 1 else 0
        self.datasets["fit"] = BlockDataset(tokens, self.block_size, 0, n_blocks - n_val)
        self.datasets["validate"] = BlockDataset(tokens, self.block_size, n_blocks - n_val, n_blocks)
        log.info("%d training and %d validation blocks of %d tokens", n_blocks - n_val, n_val, self.block_size)

    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["validate"], train=False, collate_fn=self._collate)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
