"""Causal-LM pretraining data: corpora prepared once into memory-mapped token stores -> fixed-size blocks, one
corpus or a weighted mixture."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from lightning_llm.data.base import LLMDataModule, tokenizer_or_bytes, tokenizer_vocab_size
from lightning_llm.data.corpus.documents import generated_corpus
from lightning_llm.data.corpus.mixture import MixtureDataset, parse_data_path
from lightning_llm.data.corpus.prepare import CorpusSource, current_store, prepare_corpus
from lightning_llm.data.corpus.token_store import TokenizerSpec, TokenStore
from lightning_llm.files import DataError

log = logging.getLogger(__name__)

__all__ = ["BlockDataset", "TextDataModule", "generated_corpus"]


class BlockDataset(Dataset):
    """Blocks of ``block_size + 1`` tokens overlapping by one: inputs = block[:-1], labels = block[1:]."""

    def __init__(self, tokens: TokenStore | np.ndarray, block_size: int, start: int, stop: int) -> None:
        self.tokens, self.block_size, self.start, self.stop = tokens, block_size, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        j = (self.start + i) * self.block_size
        block = torch.from_numpy(np.asarray(self.tokens[j:j + self.block_size + 1], dtype=np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}


def split_blocks(store: TokenStore, *, block_size: int, val_fraction: float, name: str) -> tuple[BlockDataset,
                                                                                                  BlockDataset]:
    """``(train, validation)`` blocks of one store: the last ``val_fraction`` of its blocks validate."""
    n_blocks = (len(store) - 1) // block_size
    n_val = int(round(n_blocks * val_fraction))
    if n_blocks - n_val < 1:
        raise DataError(f"{name}: {len(store)} tokens, not enough for one training block of block_size={block_size}")
    if val_fraction > 0 and n_val == 0:
        n_val = 1 if n_blocks > 1 else 0
    return (BlockDataset(store, block_size, 0, n_blocks - n_val),
            BlockDataset(store, block_size, n_blocks - n_val, n_blocks))


class TextDataModule(LLMDataModule):
    """Pretraining text: documents tokenized once into a memory-mapped token store (EOS between documents), cut into
    ``block_size`` blocks (the remainder dropped; labels are the inputs shifted by one, prepared here so the loss
    needs no slicing of possibly-sharded logits).

    ``prepare_data`` (local rank 0 of each node; a file lock makes nodes sharing a filesystem prepare once) tokenizes
    with ``num_proc`` worker processes in bounded memory, or reuses the store while its inputs and tokenizer are
    unchanged (:mod:`lightning_llm.data.corpus.prepare`); ``setup`` on every rank only maps it. Several corpora with weights
    form a mixture (:mod:`lightning_llm.data.corpus.mixture`); the checkpoint records the data (each store's SHA-256,
    weights, block size), and a resume on other data is refused.
    """

    def __init__(
        self,
        data_path: str | list[str | float] | None = None,
        tokenizer_dir: str | None = None,
        *,
        block_size: int = 128,
        val_fraction: float = 0.05,
        text_field: str = "text",
        cache_dir: str = ".lightning_llm_cache/tokens",
        generated_docs: int = 400,
        num_proc: int | None = None,
        resume_on_other_data: bool = False,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            data_path: The corpus: a .jsonl/.json/.parquet/.txt file, a directory of them, a glob, or a list of
                those (one corpus); ``[w1, path1, w2, path2, ...]`` for a mixture drawn at weights w1, w2, ...;
                ``None`` uses a generated toy corpus.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            block_size: Tokens per training example.
            val_fraction: Share of each corpus's blocks (the last ones) held out for validation.
            text_field: Field (column) holding the text in JSON/JSONL/Parquet records.
            cache_dir: Where prepared token stores are kept (one per corpus and tokenizer).
            generated_docs: Documents in the generated corpus (when ``data_path`` is None).
            num_proc: Tokenizer worker processes when preparing a corpus (default: the CPU count).
            resume_on_other_data: Resume a checkpoint trained on other data (corpora, weights, tokenizer, block size)
                from the start of this data instead of refusing it: the model, optimizer and step count continue,
                the checkpoint's position in its data does not (e.g. a second training phase on a new mixture).
            batch_size: Per-device training batch size.
            eval_batch_size: Per-device evaluation batch size.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle (which also mixes the corpora of a mixture).
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        if block_size < 2:
            raise ValueError(f"--data.block_size must be >= 2, got {block_size}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be in [0, 1), got {val_fraction}")
        if num_proc is not None and num_proc < 1:
            raise ValueError(f"--data.num_proc must be >= 1 (or null for the CPU count), got {num_proc}")
        corpora = parse_data_path(data_path)
        self.sources = [CorpusSource(specs) for _, specs in corpora] or [CorpusSource(generated_docs=generated_docs)]
        self.weights = [w for w, _ in corpora] or [1.0]
        for source in self.sources:
            source.files()  # a missing path or an empty directory is refused now, naming --data.data_path
        self.data_path, self.text_field = data_path, text_field
        self.tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.tokenizer_dir = tokenizer_dir
        self.block_size, self.val_fraction = block_size, val_fraction
        self.cache_dir, self.generated_docs, self.num_proc = cache_dir, generated_docs, num_proc
        self.resume_on_other_data = resume_on_other_data
        self._spec: TokenizerSpec | None = None
        self.stores: list[TokenStore] = []
        self.prepared: bool | None = None  # whether this process tokenized a corpus (None: it prepared nothing)
        self.datasets: dict[str, Dataset] = {}
        self._resumed_data: dict[str, Any] | None = None

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def tokenizer_spec(self) -> TokenizerSpec:
        if self._spec is None:
            self._spec = TokenizerSpec.of(self.tokenizer, vocab_size=self.vocab_size)
        return self._spec

    def _store_args(self) -> dict[str, Any]:
        return {"spec": self.tokenizer_spec, "text_field": self.text_field, "cache_dir": self.cache_dir}

    def prepare_data(self) -> None:
        """Tokenize every corpus whose store is missing or stale (Lightning calls this on one process per node)."""
        built = [prepare_corpus(s, num_proc=self.num_proc, **self._store_args())[1] for s in self.sources]
        self.prepared = any(built)

    def setup(self, stage: str) -> None:
        if self.datasets:
            return
        if self.trainer is None:  # used outside a Trainer, which would have called prepare_data first
            self.prepare_data()
        self.stores = []
        for source in self.sources:
            store = current_store(source, **self._store_args())
            if store is None:
                raise DataError(f"{source.param}={source.label}: no up-to-date token store under "
                                f"--data.cache_dir={self.cache_dir} (prepare_data runs on local rank 0 of each node "
                                "before setup; on nodes without a shared filesystem run `lightning_llm prepare` on "
                                "each)")
            self.stores.append(store)
        parts = [split_blocks(st, block_size=self.block_size, val_fraction=self.val_fraction, name=src.label)
                 for st, src in zip(self.stores, self.sources, strict=True)]
        train = [p[0] for p in parts]
        self.datasets["fit"] = train[0] if len(train) == 1 else MixtureDataset(train, self.weights)
        self.datasets["validate"] = parts[0][1] if len(parts) == 1 else ConcatDataset([p[1] for p in parts])
        self._log_data(train)
        if self._resumed_data is not None:
            self._check_same_data(self._resumed_data)

    def _log_data(self, train: Sequence[BlockDataset]) -> None:
        if not getattr(self.trainer, "is_global_zero", True):
            return
        fit, n_val = self.datasets["fit"], len(self.datasets["validate"])
        if not isinstance(fit, MixtureDataset):
            log.info("data: %s training and %s validation blocks of %d tokens from %s (%s)", f"{len(fit):,}",
                     f"{n_val:,}", self.block_size, self.sources[0].label, self.stores[0].path)
            return
        log.info("data: a mixture of %d corpora, %s training samples of %d tokens per epoch, %s validation blocks",
                 len(train), f"{len(fit):,}", self.block_size, f"{n_val:,}")
        for source, store, blocks, w, n in zip(self.sources, self.stores, train, self.weights, fit.counts,
                                               strict=True):
            log.info("data: %.1f%% = %s samples (%.2f passes over its %s blocks) from %s (%s)", 100 * w, f"{n:,}",
                     n / len(blocks), f"{len(blocks):,}", source.label, store.path)

    # ------------------------------------------------------------------ what a checkpoint records of the data
    def data_identity(self) -> dict[str, Any]:
        """What decides the samples: every store's tokens (SHA-256), the weights, the block split."""
        return {"block_size": self.block_size, "val_fraction": self.val_fraction,
                "corpora": [{"corpus": src.label, "weight": w, "tokens_sha256": st.content, "tokens": len(st)}
                            for src, w, st in zip(self.sources, self.weights, self.stores, strict=True)]}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state and self.stores:
            state["data"] = self.data_identity()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "data" in state_dict:
            self._resumed_data = state_dict["data"]
            if self.stores:
                self._check_same_data(self._resumed_data)

    def _check_same_data(self, saved: dict[str, Any]) -> None:
        """Refuse a resume whose data differs from the checkpoint's: its sample positions would mean other samples."""
        now = self.data_identity()
        def key(d: dict[str, Any]) -> list[dict[str, Any]]:
            return [{k: v for k, v in c.items() if k != "corpus"} for c in d["corpora"]]

        diffs = [f"{k} {saved[k]} -> {now[k]}" for k in ("block_size", "val_fraction") if saved.get(k) != now[k]]
        if key(saved) != key(now):
            diffs.append(f"corpora {_corpora(saved)} -> {_corpora(now)}")
        self._resumed_data = None
        if not diffs:
            return
        what = "the checkpoint was trained on other data (" + "; ".join(diffs) + ")"
        if not self.resume_on_other_data:
            raise DataError(f"--ckpt_path: {what}: a resume would not continue its samples; resume with the "
                            "checkpoint's --data settings, pass --data.resume_on_other_data=true to train on this "
                            "data from its start, or start a new run")
        log.warning("%s: training continues on this data from its start (--data.resume_on_other_data)", what)
        self._resume = None  # no position to skip to in other data

    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["validate"], train=False, collate_fn=self._collate, shard_eval=True)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def _corpora(identity: dict[str, Any]) -> str:
    return "; ".join(f"{c['corpus']} (weight {c['weight']:.4g}, {c['tokens']:,} tokens, sha256 {c['tokens_sha256'][:12]})"
                     for c in identity["corpora"])
