"""A deterministic sentence-pair dataset with a learnable signal, so the quickstart needs no outside files.

Each of ``num_topics`` topics owns a disjoint set of Chinese characters. A sentence draws most of its characters
from one topic plus some noise characters shared by all topics. A pair is labelled "1" when both sentences come
from the same topic (a paraphrase-like match, as in AFQMC) and "0" otherwise, half and half. A model has to
compare the two segments, so the task is not solvable from one sentence alone: chance is 50%.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from lightning_llm.data.base import check_batch_sizes
from lightning_llm.data.pairs import SentencePairDataModule
from lightning_llm.files import atomic_open, write_jsonl_atomic

log = logging.getLogger(__name__)

_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_FIRST_CJK = 0x4E00


def generate_pair_dataset(out_dir: str | Path, *, n_train: int = 2000, n_val: int = 400, n_test: int = 400,
                          num_topics: int = 4, chars_per_topic: int = 12, noise_chars: int = 24,
                          noise_rate: float = 0.1, min_len: int = 6, max_len: int = 14, seed: int = 0) -> Path:
    """Write ``train.json``/``dev.json``/``test.json`` (CLUE format; test unlabelled) and ``tokenizer/vocab.txt``.

    Deterministic for a given argument set; files are written atomically. Returns ``out_dir``.
    """
    out = Path(out_dir)
    rng = random.Random(seed)
    alphabet = [chr(_FIRST_CJK + i) for i in range(num_topics * chars_per_topic + noise_chars)]
    topics = [alphabet[t * chars_per_topic:(t + 1) * chars_per_topic] for t in range(num_topics)]
    noise = alphabet[num_topics * chars_per_topic:]

    def sentence(topic: int) -> str:
        n = rng.randint(min_len, max_len)
        return "".join(rng.choice(noise) if rng.random() < noise_rate else rng.choice(topics[topic]) for _ in range(n))

    def split(n: int, prefix: str, labelled: bool) -> list[dict]:
        rows = []
        for i in range(n):
            t1 = rng.randrange(num_topics)
            same = rng.random() < 0.5
            t2 = t1 if same else rng.choice([t for t in range(num_topics) if t != t1])
            row = {"sentence1": sentence(t1), "sentence2": sentence(t2), "id": f"{prefix}-{i}"}
            if labelled:
                row["label"] = "1" if same else "0"
            rows.append(row)
        return rows

    write_jsonl_atomic(out / "train.json", split(n_train, "train", True))
    write_jsonl_atomic(out / "dev.json", split(n_val, "dev", True))
    write_jsonl_atomic(out / "test.json", split(n_test, "test", False))
    with atomic_open(out / "tokenizer" / "vocab.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(_SPECIAL + alphabet) + "\n")
    log.info("synthetic pair dataset written to %s (%d/%d/%d rows)", out, n_train, n_val, n_test)
    return out


class SyntheticPairDataModule(SentencePairDataModule):
    """:class:`SentencePairDataModule` over :func:`generate_pair_dataset` output (made on first use)."""

    def __init__(self, out_dir: str = ".lightning_llm_cache/synthetic_pairs", *, n_train: int = 2000,
                 n_val: int = 400, n_test: int = 400, data_seed: int = 0, max_length: int = 40,
                 batch_size: int = 32, eval_batch_size: int | None = None, num_workers: int = 0,
                 seed: int = 42) -> None:
        """
        Args:
            out_dir: Where the generated dataset and its vocabulary are written.
            n_train: Training pairs.
            n_val: Validation pairs.
            n_test: Unlabelled pairs for ``predict``.
            data_seed: Seed of the generator (the data), separate from the shuffle ``seed``.
            max_length: Longest tokenized pair.
            batch_size: Per-device training batch size.
            eval_batch_size: Per-device evaluation batch size.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle.
        """
        check_batch_sizes(batch_size, eval_batch_size)  # before generating a dataset
        out = Path(out_dir) / f"seed{data_seed}-n{n_train}-{n_val}-{n_test}"
        if not (out / "tokenizer" / "vocab.txt").is_file():
            generate_pair_dataset(out, n_train=n_train, n_val=n_val, n_test=n_test, seed=data_seed)
        super().__init__(str(out), str(out / "tokenizer"), max_length=max_length, batch_size=batch_size,
                         eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
