"""Supervised fine-tuning data: conversations (OpenAI ``messages``, ShareGPT ``conversations``, alpaca records with
``system``/``history``), rendered with a chat template, learning exactly the assistant replies.

Records are read by :mod:`lightning_llm.data.chat.messages`, rendered and tokenized by :mod:`lightning_llm.data.chat.encode`
with the template ``--data.template`` names (:mod:`lightning_llm.data.chat.template`: the tokenizer's own
``chat_template`` by default, else ``alpaca``; a named template; a Jinja string; a ``{instruction}``/``{input}``
format string). A training row is the whole conversation's tokens (``apply_chat_template``'s) with labels pre-shifted
by one token and -100 everywhere but the replies: every assistant message (``assistant_turns=all``) or the last, each
up to and including the template's end-of-turn token. Evaluation rows additionally carry the prompt for generation:
the conversation before its last reply with the template's generation prompt (left-padded in the batch), the
rendered prompt text, the reference reply and the record index. Generation stops at the template's end-of-turn
token and EOS (:attr:`InstructionDataModule.stop_token_ids`).

``cutoff_len`` bounds a training row (whole replies kept; a too-long first reply shares it with its prompt as
LLaMA-Factory's ``infer_seqlen``: the user text is shortened, the template's markers kept). ``packing`` packs whole
training rows into ``cutoff_len`` sequences (:func:`~lightning_llm.data.packing.pack_examples`: per-example
``segment_ids`` and ``position_ids``, so attention and positions stay within each example).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

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
from lightning_llm.data.chat.encode import ChatEncoder, infer_seqlen, labels_for
from lightning_llm.data.chat.messages import (
    ChatColumns,
    Conversation,
    load_conversation,
    make_conversations,
    message_text,
)
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.data.packing import pack_examples
from lightning_llm.files import DataError, read_records

log = logging.getLogger(__name__)

__all__ = ["InstructionDataModule", "infer_seqlen"]


class InstructionDataModule(LLMDataModule):
    """Conversation/instruction JSON or JSONL for SFT, with optional packing; validation/test/predict batches also
    carry left-padded prompts for generation (``gen_input_ids``, ``gen_attention_mask``), ``prompt``/``label`` texts
    and the record ``index``."""

    def __init__(
        self,
        train_path: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        val_fraction: float = 0.0,
        template: str = "auto",
        columns: ChatColumns | None = None,
        assistant_turns: Literal["all", "last"] = "all",
        default_system: str | None = None,
        cutoff_len: int = 1024,
        max_prompt_len: int | None = None,
        packing: bool = False,
        generated_conversations: int = 0,
        limit_examples: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            train_path: JSON array or JSONL file of conversations: OpenAI ``{"messages": [...]}``, ShareGPT
                ``{"conversations": [...], "system", "tools"}`` or alpaca ``{"instruction", "input", "output",
                "system", "history"}`` records (see ``columns``).
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            val_path: Validation records (default: ``val_fraction`` of the training records).
            test_path: Test records.
            predict_path: Records to generate for in ``predict`` (default ``test_path``); they need no answer.
            val_fraction: Share of training records held out for validation when ``val_path`` is not given.
            template: The chat template: ``auto`` (the tokenizer's ``chat_template``, else ``alpaca``),
                ``tokenizer``, ``chatml``, ``llama3``, ``llama2``, ``mistral``, ``baichuan2``, ``alpaca``, ``plain``,
                a Jinja string or ``.jinja`` file, or a format string with ``{instruction}`` and ``{input}``.
            columns: Format and column/role names of the records (default: told apart per record).
            assistant_turns: Learn every assistant reply (``all``) or only the last one (``last``).
            default_system: System message of conversations that have none.
            cutoff_len: Most tokens of a training row (and of a packed sequence).
            max_prompt_len: Most prompt tokens given to generation (default ``cutoff_len``).
            packing: Pack whole training rows into ``cutoff_len``-token sequences (best-fit decreasing); each
                example keeps its own positions and attends only to itself (``segment_ids``), so losses and
                gradients are those of the examples unpacked.
            generated_conversations: Without ``train_path``: this many generated two-turn conversations
                (:func:`~lightning_llm.data.chat.messages.make_conversations`), 1 in 16 held out for validation.
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
        if generated_conversations < 0:
            raise ValueError(f"--data.generated_conversations must be >= 0, got {generated_conversations}")
        self.paths = {"fit": train_path, "validate": val_path, "test": test_path, "predict": predict_path or test_path}
        self.tokenizer_dir = tokenizer_dir  # an explicit byte on an HF backbone is the user's choice (vocab.py)
        tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(tokenizer, tokenizer_dir)
        self.chat = ChatEncoder(tokenizer, resolve_template(template, tokenizer, fallback="alpaca"),
                                eos_token_id=self.eos_token_id)
        self.tokenizer = self.chat.tokenizer
        self.columns, self.assistant_turns, self.default_system = columns or ChatColumns(), assistant_turns, \
            default_system
        self.cutoff_len, self.max_prompt_len = cutoff_len, max_prompt_len or cutoff_len
        self.packing, self.val_fraction, self.limit_examples = packing, val_fraction, limit_examples
        self.generated_conversations = generated_conversations
        self.datasets: dict[str, EncodedDataset] = {}
        log.info("chat template %s; generation stops at %s", self.chat.template.name, self.stop_token_ids)

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids generation stops at: the template's end-of-turn token and EOS."""
        return self.chat.stop_token_ids

    # ------------------------------------------------------------------------------------------ records -> rows
    def encode_record(self, conv: Conversation, index: int, *, with_eval: bool) -> dict[str, Any]:
        """One conversation -> a row: ``input_ids``/``labels`` (a prompt-only predict record: the prompt, nothing
        labelled), plus with ``with_eval`` the generation prompt ``prompt_ids``, its text, the reference ``label``
        (the last reply) and ``index``."""
        answered = conv.messages[-1]["role"] == "assistant"
        row: dict[str, Any] = {}
        if answered:
            enc, cut = self.chat.training_row(conv, cutoff_len=self.cutoff_len, turns=self.assistant_turns)
            row.update(input_ids=enc.ids, labels=labels_for(enc.ids, enc.spans), truncated=cut)
        if with_eval:
            prompt = Conversation(conv.messages[:-1] if answered else conv.messages, conv.tools, conv.where)
            ids = self.chat.ids(self.chat.fit_prompt(prompt, self.max_prompt_len).messages, conv.tools,
                                generation_prompt=True, where=conv.where)
            row.update(prompt_ids=ids, index=index, label=message_text(conv.messages[-1]) if answered else "",
                       prompt=self.chat.render(prompt.messages, conv.tools, generation_prompt=True, where=conv.where))
            if not answered:
                row.update(input_ids=ids, labels=[-100] * len(ids), truncated=False)
        return row

    def _read(self, path: str, *, need_output: bool) -> list[Conversation]:
        recs = read_records(path)
        recs = recs[: self.limit_examples] if self.limit_examples else recs
        return [load_conversation(r, self.columns, f"{path}:{r['_line']}", with_answer=need_output,
                                  ends_with="assistant" if need_output else "any",
                                  default_system=self.default_system) for r in recs]

    def _generated(self) -> tuple[list[Conversation], list[Conversation]]:
        recs = make_conversations(self.generated_conversations, seed=self.seed)
        convs = [load_conversation(r, self.columns, f"generated conversation {i + 1}", ends_with="assistant",
                                   default_system=self.default_system) for i, r in enumerate(recs)]
        n_val = len(convs) // 16
        return convs[n_val:], convs[:n_val]

    def _rows(self, convs: list[Conversation], *, with_eval: bool, what: str) -> EncodedDataset:
        rows = [self.encode_record(c, i, with_eval=with_eval) for i, c in enumerate(convs)]
        cut = sum(r.pop("truncated") for r in rows)
        if cut:
            log.warning("%s: %d of %d conversations are longer than cutoff_len=%d tokens and were shortened", what, cut,
                        len(rows), self.cutoff_len)
        return EncodedDataset(rows)

    def setup(self, stage: str) -> None:
        if stage in ("fit", "validate") and "fit" not in self.datasets and "validate" not in self.datasets:
            if self.paths["fit"] is None and self.generated_conversations:
                train, val = self._generated()
            else:
                train = self._read(self.paths["fit"], need_output=True) if self.paths["fit"] else []
                val = []
            if self.paths["validate"]:
                val = self._read(self.paths["validate"], need_output=True)
            elif self.val_fraction > 0 and train:
                g = torch.Generator().manual_seed(self.seed)
                order = torch.randperm(len(train), generator=g).tolist()
                n_val = max(1, int(round(len(train) * self.val_fraction)))
                held = set(order[:n_val])
                val = [r for i, r in enumerate(train) if i in held]
                train = [r for i, r in enumerate(train) if i not in held]
            if stage == "fit" and not train:
                raise DataError("--data.train_path (or --data.generated_conversations) is required for fit")
            rows = self._rows(train, with_eval=False, what="training").examples
            self.datasets["fit"] = EncodedDataset(pack_examples(rows, self.cutoff_len) if self.packing else rows)
            self.datasets["validate"] = self._rows(val, with_eval=True, what="validation")
            log.info("%d training rows (%d records, packing=%s), %d validation records",
                     len(self.datasets["fit"]), len(train), self.packing, len(val))
        for name in ("test", "predict"):
            if stage == name and name not in self.datasets:
                if not self.paths[name]:
                    raise DataError(f"--data.{name}_path (or test_path) is required for {name}")
                convs = self._read(self.paths[name], need_output=name == "test")
                self.datasets[name] = self._rows(convs, with_eval=True, what=name)

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
