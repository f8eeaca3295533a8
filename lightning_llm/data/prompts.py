"""Prompt data for RL fine-tuning (PPO): JSON/JSONL records with a ``prompt`` field, or generated prompts.

Batches hold the prompts LEFT-padded for batched generation (``input_ids``/``attention_mask`` [B, P]), the prompt
texts (``prompt``, for text-based rewards), the record ``index`` and the record's other fields (``columns``: one dict
per prompt, every field but the prompt itself (``prompt``, ``messages``, ``conversations``), values as read from the
JSON; a field some record lacks is ``None`` there). The columns travel with their prompt through every layout: a
reward function receives them as keyword lists (:mod:`lightning_llm.rl.rewards.sources`). Prompts longer than ``max_prompt_len`` keep
their last tokens (the end of a prompt is what the response continues).

With a chat template (``--data.template``: the tokenizer's own by default, or a named one; see
:mod:`lightning_llm.data.chat.template`) a prompt is a conversation: the ``prompt`` field as one user message (or a
list of messages), or the record's OpenAI ``messages`` / ShareGPT ``conversations`` without a trailing reply,
rendered with the template's generation prompt; too-long prompts lose their oldest turns, then the end of the last
user message's text (the template's markers stay). The ``prompt`` text handed to rewards is then the last user
message's text, and batches also hold the fitted prompt ``conversation`` (a decoder reward model renders it). Rollouts stop at the template's end-of-turn token and EOS (:attr:`PromptDataModule.stop_token_ids`).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_llm.data.base import (
    EncodedDataset,
    LLMDataModule,
    eos_and_pad_ids,
    left_pad,
    tokenizer_or_bytes,
    tokenizer_vocab_size,
)
from lightning_llm.data.chat.encode import ChatEncoder
from lightning_llm.data.chat.messages import ChatColumns, message_text, prompt_conversation
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.files import DataError, read_records

log = logging.getLogger(__name__)

__all__ = ["RESERVED_COLUMNS", "PromptDataModule", "make_prompts", "record_columns"]

RESERVED_COLUMNS = ("prompts", "responses", "completion_ids", "messages", "env_reward")
"""Keyword names a reward function is called with besides the columns (``messages`` and ``env_reward``: of a
multi-turn rollout's episodes): a column may not take one of them."""


def record_columns(records: list[dict[str, Any]], *, exclude: set[str], where: str) -> list[dict[str, Any]]:
    """Each record's fields but ``exclude`` (and the reader's ``_line``), over the union of the records' field names
    (in order of first appearance; ``None`` where a record lacks one): every prompt of a file has the same columns."""
    names: dict[str, None] = {}
    for rec in records:
        names.update(dict.fromkeys(k for k in rec if k not in exclude and k != "_line"))
    clash = [n for n in names if n in RESERVED_COLUMNS]
    if clash:
        raise DataError(f"{where}: a column is named {clash[0]!r}, a name reward functions are already called with "
                        f"({', '.join(RESERVED_COLUMNS)}): rename it")
    return [{n: rec.get(n) for n in names} for rec in records]


def make_prompts(n: int, *, seed: int = 0) -> list[str]:
    """``n`` deterministic short prompts (``"Continue: <letters>\\n"``) for runs without a prompt file."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [f"Continue: {''.join(rng.choice(letters) for _ in range(rng.randint(3, 8)))}\n" for _ in range(n)]


class PromptDataModule(LLMDataModule):
    """Prompts for rollouts. ``batch_size`` is the per-device rollout batch (prompts generated per PPO step)."""

    def __init__(
        self,
        train_path: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        val_path: str | None = None,
        prompt_field: str = "prompt",
        max_prompt_len: int = 128,
        bos: bool = False,
        template: str = "auto",
        columns: ChatColumns | None = None,
        default_system: str | None = None,
        generated_prompts: int = 256,
        generated_val_prompts: int = 0,
        limit_examples: int | None = None,
        batch_size: int = 16,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            train_path: JSON array or JSONL file of records with a ``prompt`` field; ``None`` uses generated prompts.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            val_path: Prompts for validation (responses generated and scored).
            prompt_field: Name of the prompt field.
            max_prompt_len: Most prompt tokens (longer prompts keep their last tokens).
            bos: Prepend the tokenizer's BOS token (raw prompts; a chat template writes its own).
            template: The chat template: ``auto`` (the tokenizer's ``chat_template``, else none), ``none`` (raw
                prompt strings), ``tokenizer``, a named one (``chatml``, ``llama3``, ``llama2``, ``mistral``,
                ``baichuan2``, ``alpaca``, ``plain``) or a Jinja string / ``.jinja`` file.
            columns: Format and column/role names of conversation records (chat templates only).
            default_system: System message of prompts that have none (chat templates only).
            generated_prompts: Number of generated training prompts when ``train_path`` is None.
            generated_val_prompts: Number of generated validation prompts when ``val_path`` is None (0 = none).
            limit_examples: Use only the first N records of every file.
            batch_size: Per-device rollout batch size.
            eval_batch_size: Per-device validation batch size.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle and of generated prompts.
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        for name, path in (("train_path", train_path), ("val_path", val_path)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"--data.{name}={path}: no such file")
        if max_prompt_len < 1:
            raise ValueError(f"--data.max_prompt_len must be >= 1, got {max_prompt_len}")
        if train_path is None and generated_prompts < 1:
            raise ValueError("--data.generated_prompts must be >= 1 when --data.train_path is not given")
        self.paths = {"fit": train_path, "validate": val_path}
        self.prompt_field, self.max_prompt_len, self.bos = prompt_field, max_prompt_len, bos
        self.generated = {"fit": generated_prompts, "validate": generated_val_prompts}
        self.limit_examples = limit_examples
        self.tokenizer_dir = tokenizer_dir  # an explicit byte on an HF backbone is the user's choice (vocab.py)
        self.tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(self.tokenizer, tokenizer_dir)
        chat = None if template == "none" else resolve_template(template, self.tokenizer, fallback=None)
        if chat is not None and bos:
            raise ValueError(f"--data.bos=true applies to raw prompts; the chat template ({chat.name}) writes its own "
                             "beginning (use --data.template=none for raw prompts)")
        self.chat = None if chat is None else ChatEncoder(self.tokenizer, chat, eos_token_id=self.eos_token_id)
        self.tokenizer = self.chat.tokenizer if self.chat is not None else self.tokenizer
        self.columns, self.default_system = columns or ChatColumns(), default_system
        self.datasets: dict[str, EncodedDataset] = {}

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def stop_token_ids(self) -> list[int]:
        """Where a response ends: the chat template's end-of-turn token and EOS (EOS alone without a template)."""
        return self.chat.stop_token_ids if self.chat is not None else [self.eos_token_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _records(self, split: str, *, required: bool) -> list[dict[str, Any]]:
        """The split's records (``_line`` numbered; generated prompts when it has no file), limited."""
        path = self.paths[split]
        if path is None:
            n = self.generated[split]
            texts = make_prompts(n, seed=self.seed + (0 if split == "fit" else 1)) if n else []
            return [{self.prompt_field: t, "_line": i + 1} for i, t in enumerate(texts)]
        recs = read_records(path, required=[self.prompt_field] if required else [],
                            types={self.prompt_field: str} if required else None)
        return recs[: self.limit_examples] if self.limit_examples else recs

    def _columns(self, split: str, recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        exclude = {self.prompt_field, "messages", "conversations", *([self.columns.messages] if self.columns.messages
                                                                     else [])}
        return record_columns(recs, exclude=exclude, where=str(self.paths[split] or "generated prompts"))

    @property
    def column_names(self) -> list[str]:
        """The training prompts' columns (what reward functions receive as keyword lists; after ``setup``)."""
        rows = self.datasets.get("fit")
        return list(rows[0]["columns"]) if rows is not None and len(rows) else []

    def _chat_rows(self, split: str) -> list[dict[str, Any]]:
        """Rows of a split under the chat template: fitted prompt ids, the last user text, the index."""
        assert self.chat is not None
        path = self.paths[split]
        recs = self._records(split, required=False)
        rows = []
        for i, (rec, columns) in enumerate(zip(recs, self._columns(split, recs))):
            where = f"{path}:{rec['_line']}" if path else f"generated prompt {i + 1}"
            conv = prompt_conversation(rec, self.columns, where, field=self.prompt_field,
                                       default_system=self.default_system)
            fitted = self.chat.fit_prompt(conv, self.max_prompt_len)
            ids = self.chat.ids(fitted.messages, conv.tools, generation_prompt=True, where=where)
            text = next(message_text(m) for m in reversed(conv.messages) if m["role"] == "user")
            rows.append({"input_ids": ids, "prompt": text, "index": i, "conversation": fitted, "columns": columns})
        return rows

    def encode(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.bos and self.tokenizer.bos_token_id is not None:
            ids = [int(self.tokenizer.bos_token_id)] + ids
        return ids[-self.max_prompt_len:]

    def setup(self, stage: str) -> None:
        for split in ("fit", "validate"):
            if split in self.datasets or stage not in ("fit", "validate"):
                continue
            rows = self._chat_rows(split) if self.chat is not None else self._raw_rows(split)
            if split == "fit" and stage == "fit" and not rows:
                raise DataError(f"{self.paths['fit']}: no prompts")
            self.datasets[split] = EncodedDataset(rows)
        log.info("%d training and %d validation prompts", len(self.datasets.get("fit", [])),
                 len(self.datasets.get("validate", [])))

    def _raw_rows(self, split: str) -> list[dict[str, Any]]:
        """Rows of a split without a chat template: the prompt's ids, its text, the index and the columns."""
        recs = self._records(split, required=True)
        rows = []
        for i, (rec, columns) in enumerate(zip(recs, self._columns(split, recs))):
            text = rec[self.prompt_field]
            ids = self.encode(text)
            if not ids:
                raise DataError(f"{self.paths[split]}: record {i + 1} has an empty prompt (use --data.bos=true "
                                f"to start responses from BOS)")
            rows.append({"input_ids": ids, "prompt": text, "index": i, "columns": columns})
        return rows

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        ids, mask = left_pad([r["input_ids"] for r in rows], self.pad_token_id)
        batch = {"input_ids": ids, "attention_mask": mask, "prompt": [r["prompt"] for r in rows],
                 "index": torch.tensor([r["index"] for r in rows]), "columns": [r["columns"] for r in rows]}
        if self.chat is not None:  # the prompt conversations (a decoder reward model renders them with its template)
            batch["conversation"] = [r["conversation"] for r in rows]
        return batch

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets.get("validate", EncodedDataset([])), train=False, collate_fn=self.collate)
