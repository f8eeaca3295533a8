"""Instruction (alpaca-style) data for supervised fine-tuning: ``{"instruction", "input", "output"}`` records.

Each record becomes ``prompt = template(instruction, input)`` and ``response = output + EOS``. Training rows are
``prompt + response`` with labels pre-shifted by one token and -100 wherever the next token belongs to the prompt
(so only the response is learned). Evaluation rows additionally carry the prompt alone (left-padded in the batch,
for generation), the reference text and the record index.

``cutoff_len`` bounds prompt + response like LLaMA-Factory's ``infer_seqlen`` (long sources shrink first); a
truncated prompt loses tokens from the end of its instruction/input part while the template's tail (e.g.
``### Response:``) is kept. ``packing`` packs whole training rows into ``cutoff_len`` sequences
(:func:`~lightning_llm.data.packing.pack_examples`: per-example ``segment_ids`` and ``position_ids``, so attention
and positions stay within each example).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_llm.data.base import (
    EncodedDataset,
    LLMDataModule,
    eos_and_pad_ids,
    tokenizer_or_bytes,
    tokenizer_vocab_size,
)
from lightning_llm.data.io import DataError, read_records
from lightning_llm.data.packing import pack_examples
from lightning_llm.generation import left_pad

log = logging.getLogger(__name__)

TEMPLATES: dict[str, tuple[str, str]] = {
    # name: (with input, without input); placeholders {instruction} and {input}
    "alpaca": (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
    ),
    "plain": ("{instruction}{input}\n", "{instruction}\n"),
}


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of ``cutoff_len`` between source (prompt) and target (response) tokens."""
    if target_len * 2 < cutoff_len:  # short target: truncate the source only
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:  # short source: truncate the target only
        max_target_len = cutoff_len - source_len
    else:  # both long: proportional
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


class PromptTemplate:
    """Renders prompts from a named template (``alpaca``, ``plain``) or a format string with ``{instruction}``
    and ``{input}`` (used for both record kinds)."""

    def __init__(self, template: str) -> None:
        if template in TEMPLATES:
            self.with_input, self.without_input = TEMPLATES[template]
        elif "{instruction}" in template:
            self.with_input = self.without_input = template
        else:
            raise ValueError(f"--data.template={template!r}: a template name ({', '.join(TEMPLATES)}) or a format "
                             f"string containing {{instruction}} (and optionally {{input}})")
        try:
            self.render("x", "y")
        except (KeyError, IndexError) as e:
            raise ValueError(f"--data.template: unknown placeholder {e} (use {{instruction}} and {{input}})") from None

    def render(self, instruction: str, inp: str) -> str:
        template = self.with_input if inp else self.without_input
        return template.format(instruction=instruction, input=inp)

    def tail(self, inp: str) -> str:
        """Fixed text after the last placeholder (kept when a long prompt is truncated)."""
        template = self.with_input if inp else self.without_input
        return template.rsplit("}", 1)[-1]


class InstructionDataModule(LLMDataModule):
    """Alpaca-format JSON/JSONL for SFT, with optional packing; validation/test/predict batches also carry
    left-padded prompts for generation (``gen_input_ids``, ``gen_attention_mask``), ``prompt``/``label`` texts and
    the record ``index``."""

    def __init__(
        self,
        train_path: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        val_fraction: float = 0.0,
        template: str = "alpaca",
        cutoff_len: int = 1024,
        max_prompt_len: int | None = None,
        packing: bool = False,
        limit_examples: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            train_path: JSON array or JSONL file of ``{"instruction", "input", "output"}`` records.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            val_path: Validation records (default: ``val_fraction`` of the training records).
            test_path: Test records.
            predict_path: Records to generate for in ``predict`` (default ``test_path``); ``output`` may be empty.
            val_fraction: Share of training records held out for validation when ``val_path`` is not given.
            template: ``alpaca`` (default), ``plain``, or a format string with ``{instruction}`` and ``{input}``.
            cutoff_len: Most tokens of prompt + response in a training row (and of a packed sequence).
            max_prompt_len: Most prompt tokens given to generation (default ``cutoff_len``).
            packing: Pack whole training rows into ``cutoff_len``-token sequences (best-fit decreasing); each
                example keeps its own positions and attends only to itself (``segment_ids``), so losses and
                gradients are those of the examples unpacked.
            limit_examples: Use only the first N records of every file (quick runs).
            batch_size: Per-device training batch size.
            eval_batch_size: Per-device evaluation/generation batch size.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle and of the validation split.
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        for name, path in (("train_path", train_path), ("val_path", val_path), ("test_path", test_path),
                           ("predict_path", predict_path)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"--data.{name}={path}: no such file")
        if cutoff_len < 2:
            raise ValueError(f"--data.cutoff_len must be >= 2, got {cutoff_len}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be in [0, 1), got {val_fraction}")
        self.paths = {"fit": train_path, "validate": val_path, "test": test_path, "predict": predict_path or test_path}
        self.tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.template = PromptTemplate(template)
        self.cutoff_len, self.max_prompt_len = cutoff_len, max_prompt_len or cutoff_len
        self.packing, self.val_fraction, self.limit_examples = packing, val_fraction, limit_examples
        self.datasets: dict[str, EncodedDataset] = {}
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(self.tokenizer, tokenizer_dir)

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    # ------------------------------------------------------------------------------------------ records -> rows
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _prompt_ids(self, rec: dict[str, Any], limit: int) -> list[int]:
        inp = rec.get("input") or ""
        ids = self._encode(self.template.render(rec["instruction"], inp))
        if len(ids) <= limit:
            return ids
        tail = self._encode(self.template.tail(inp))[:limit]
        return ids[:limit - len(tail)] + tail if tail else ids[:limit]

    def encode_record(self, rec: dict[str, Any], index: int, *, with_eval: bool) -> dict[str, Any]:
        prompt = self._prompt_ids(rec, 10**9)
        response = self._encode(rec.get("output") or "") + [self.eos_token_id]
        src_len, tgt_len = infer_seqlen(len(prompt), len(response), self.cutoff_len)
        if src_len < len(prompt):
            prompt_t = self._prompt_ids(rec, src_len)
        else:
            prompt_t = prompt
        full = prompt_t + response[:tgt_len]
        # labels[t] = full[t + 1] where that token is part of the response; -100 elsewhere (pre-shifted).
        labels = [-100] * max(len(prompt_t) - 1, 0) + response[:tgt_len] + [-100]
        labels = labels[len(labels) - len(full):] if len(prompt_t) == 0 else labels
        row: dict[str, Any] = {"input_ids": full, "labels": labels}
        if with_eval:
            row["prompt_ids"] = self._prompt_ids(rec, self.max_prompt_len)
            row["prompt"] = self.template.render(rec["instruction"], rec.get("input") or "")
            row["label"] = rec.get("output") or ""
            row["index"] = index
        return row

    def _read(self, path: str, *, need_output: bool) -> list[dict[str, Any]]:
        required = ["instruction", "output"] if need_output else ["instruction"]
        recs = read_records(path, required=required, types={"instruction": str, "input": str, "output": str})
        return recs[: self.limit_examples] if self.limit_examples else recs

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate") and "fit" not in self.datasets and "validate" not in self.datasets:
            train = self._read(self.paths["fit"], need_output=True) if self.paths["fit"] else []
            if self.paths["validate"]:
                val = self._read(self.paths["validate"], need_output=True)
            elif self.val_fraction > 0 and train:
                g = torch.Generator().manual_seed(self.seed)
                order = torch.randperm(len(train), generator=g).tolist()
                n_val = max(1, int(round(len(train) * self.val_fraction)))
                held = set(order[:n_val])
                val = [r for i, r in enumerate(train) if i in held]
                train = [r for i, r in enumerate(train) if i not in held]
            else:
                val = []
            if stage == "fit" and not train:
                raise DataError("--data.train_path is required for fit")
            rows = [self.encode_record(r, i, with_eval=False) for i, r in enumerate(train)]
            self.datasets["fit"] = EncodedDataset(pack_examples(rows, self.cutoff_len) if self.packing else rows)
            self.datasets["validate"] = EncodedDataset(
                [self.encode_record(r, i, with_eval=True) for i, r in enumerate(val)])
            log.info("%d training rows (%d records, packing=%s), %d validation records",
                     len(self.datasets["fit"]), len(train), self.packing, len(val))
        for name in ("test", "predict"):
            if stage == name and name not in self.datasets:
                if not self.paths[name]:
                    raise DataError(f"--data.{name}_path (or test_path) is required for {name}")
                recs = self._read(self.paths[name], need_output=name == "test")
                self.datasets[name] = EncodedDataset(
                    [self.encode_record(r, i, with_eval=True) for i, r in enumerate(recs)])

    # ------------------------------------------------------------------------------------------ batches
    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Right-padded ``input_ids``/``labels``/``attention_mask`` [B, S] (packed rows: also ``position_ids`` and
        ``segment_ids``, padded with 0); plus generation fields for eval rows."""
        longest = max(len(r["input_ids"]) for r in rows)
        pads = {"input_ids": self.pad_token_id, "labels": -100, "position_ids": 0, "segment_ids": 0}
        batch: dict[str, Any] = {}
        for key, pad in pads.items():
            if key in rows[0]:
                batch[key] = torch.full((len(rows), longest), pad, dtype=torch.long)
        batch["attention_mask"] = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            for key in pads:
                if key in batch:
                    batch[key][i, :n] = torch.tensor(r[key])
            batch["attention_mask"][i, :n] = 1
        if "prompt_ids" in rows[0]:
            batch["gen_input_ids"], batch["gen_attention_mask"] = left_pad([r["prompt_ids"] for r in rows],
                                                                           self.pad_token_id)
            batch["prompt"] = [r["prompt"] for r in rows]
            batch["label"] = [r["label"] for r in rows]
            batch["index"] = torch.tensor([r["index"] for r in rows])
        return batch

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["validate"], train=False, collate_fn=self.collate)

    def test_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["test"], train=False, collate_fn=self.collate)

    def predict_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["predict"], train=False, collate_fn=self.collate)
