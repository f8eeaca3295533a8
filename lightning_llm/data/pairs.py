"""Sentence-pair classification data in CLUE JSONL (AFQMC, LCQMC, ...)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_llm.data.base import EncodedDataset, LLMDataModule, tokenizer_or_bytes, tokenizer_vocab_size
from lightning_llm.files import DataError, read_records

log = logging.getLogger(__name__)


def pad_collate(examples: list[dict[str, Any]], *, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Dynamic padding: right-pad ``input_ids``/``token_type_ids`` to the longest example of the batch.

    Returns input_ids/token_type_ids/attention_mask [B, S_max], plus ``labels`` [B] and ``index`` [B]
    (the example's position in its split, used to write predictions in order).
    """
    longest = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), longest), pad_id, dtype=torch.long),
        "token_type_ids": torch.zeros((len(examples), longest), dtype=torch.long),
        "attention_mask": torch.zeros((len(examples), longest), dtype=torch.long),
    }
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(e["input_ids"])
        batch["token_type_ids"][i, :n] = torch.tensor(e["token_type_ids"])
        batch["attention_mask"][i, :n] = 1
    batch["labels"] = torch.tensor([e["label"] for e in examples], dtype=torch.long)
    batch["index"] = torch.tensor([e["index"] for e in examples], dtype=torch.long)
    return batch


class SentencePairDataModule(LLMDataModule):
    """Sentence pairs with a label, one JSON object per line (CLUE format).

    The label map is built from the training split (sorted label strings) unless ``label_names`` is given,
    and is stored in checkpoints by the task. The CLUE test split has no labels: ``predict_file`` may lack
    the label field; ``test_file`` defaults to the dev split so ``lightning_llm test`` reports metrics.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        train_file: str = "train.json",
        val_file: str = "dev.json",
        test_file: str = "dev.json",
        predict_file: str = "test.json",
        text_fields: tuple[str, str] = ("sentence1", "sentence2"),
        label_field: str = "label",
        id_field: str = "id",
        label_names: list[str] | None = None,
        max_length: int = 128,
        max_train_samples: int | None = None,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            data_dir: Directory holding the split files.
            tokenizer_dir: Local tokenizer directory (vocab.txt or tokenizer.json), or ``byte`` for the built-in byte
                tokenizer (pairs laid out as BERT's, ``<bos>``/``<eos>`` for ``[CLS]``/``[SEP]``). ``None``: the
                backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            train_file: Training split file name inside ``data_dir``.
            val_file: Validation split file name.
            test_file: Split used by ``test`` (needs labels).
            predict_file: Split used by ``predict`` (labels not needed).
            text_fields: The two text fields of a record.
            label_field: The label field (any JSON scalar; compared as a string).
            id_field: The id field written to prediction files (the line number when absent).
            label_names: Fixed label order; default: sorted labels of the training split.
            max_length: Longest tokenized pair; longer pairs are truncated (longest first) and counted.
            max_train_samples: Use only the first N training records (quick runs).
            batch_size: Per-device training batch size.
            eval_batch_size: Per-device evaluation batch size (default ``batch_size``).
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle.
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        if data_dir is None:
            raise ValueError("--data.data_dir is required (directory with train/dev/test JSONL files)")
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"--data.data_dir={data_dir}: directory not found")
        if max_length < 8:
            raise ValueError(f"--data.max_length must be >= 8, got {max_length}")
        self.data_dir = Path(data_dir)
        self.tokenizer_dir, self.tokenizer = tokenizer_dir, tokenizer_or_bytes(tokenizer_dir)
        self.files = {"fit": train_file, "validate": val_file, "test": test_file, "predict": predict_file}
        self.text_fields = tuple(text_fields)
        self.label_field, self.id_field = label_field, id_field
        self.label_names: list[str] | None = list(label_names) if label_names else None
        self.max_length = max_length
        self.max_train_samples = max_train_samples
        self.datasets: dict[str, EncodedDataset] = {}
        self.ids: dict[str, list[Any]] = {}
        self.truncated: dict[str, int] = {}
        """Per split: how many pairs were cut to ``max_length``."""

    # ----------------------------------------------------------------------------------------------- sizes
    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def num_labels(self) -> int:
        self._ensure_label_names()
        assert self.label_names is not None
        return len(self.label_names)

    def _ensure_label_names(self) -> None:
        if self.label_names is None:
            records = self._read("fit", need_label=True)
            self.label_names = sorted({str(r[self.label_field]) for r in records})
            if len(self.label_names) < 2:
                raise DataError(f"{self.data_dir / self.files['fit']}: only one label {self.label_names} in training data")
            log.info("label map from %s: %s", self.files["fit"], self.label_names)

    # ---------------------------------------------------------------------------------------------- reading
    def _read(self, split: str, *, need_label: bool) -> list[dict[str, Any]]:
        path = self.data_dir / self.files[split]
        required = list(self.text_fields) + ([self.label_field] if need_label else [])
        records = read_records(path, required=required, types={f: str for f in self.text_fields})
        if split == "fit" and self.max_train_samples:
            records = records[: self.max_train_samples]
        return records

    def _encode(self, split: str) -> EncodedDataset:
        need_label = split != "predict"
        records = self._read(split, need_label=need_label)
        path = self.data_dir / self.files[split]
        self._ensure_label_names()
        label_to_id = {name: i for i, name in enumerate(self.label_names or [])}
        first, second = self.text_fields
        a = [r[first] for r in records]
        b = [r[second] for r in records]
        full = self.tokenizer(a, b, truncation=False)["input_ids"]
        enc = self.tokenizer(a, b, truncation="longest_first", max_length=self.max_length)
        cut = sum(len(ids) > self.max_length for ids in full)
        if cut:
            log.warning("%s: %d of %d pairs are longer than max_length=%d tokens and were truncated",
                        path, cut, len(records), self.max_length)
        self.truncated[split] = cut
        examples = []
        for i, r in enumerate(records):
            label = -100
            if self.label_field in r:
                name = str(r[self.label_field])
                if name not in label_to_id:
                    if need_label:
                        raise DataError(f"{path}:{r['_line']}: label {name!r} never appears in the training split "
                                        f"(known labels: {self.label_names})")
                else:
                    label = label_to_id[name]
            ids = enc["input_ids"][i]
            # a tokenizer without token types (XLM-R's, ModernBERT's: model_input_names) gives none: zeros
            types = enc["token_type_ids"][i] if "token_type_ids" in enc else [0] * len(ids)
            examples.append({"input_ids": ids, "token_type_ids": types, "label": label, "index": i})
        self.ids[split] = [r.get(self.id_field, r["_line"]) for r in records]
        return EncodedDataset(examples)

    def setup(self, stage: str) -> None:
        splits = {"fit": ["fit", "validate"], "validate": ["validate"], "test": ["test"], "predict": ["predict"]}[stage]
        for split in splits:
            if split not in self.datasets:
                self.datasets[split] = self._encode(split)

    # ---------------------------------------------------------------------------------------------- loaders
    def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return pad_collate(examples, pad_id=self.tokenizer.pad_token_id or 0)

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self._collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["validate"], train=False, collate_fn=self._collate)

    def test_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["test"], train=False, collate_fn=self._collate)

    def predict_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["predict"], train=False, collate_fn=self._collate)
