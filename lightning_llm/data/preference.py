"""Preference pairs for DPO: JSON/JSONL records ``{"prompt", "chosen", "rejected"}``, or generated pairs.

A batch of b pairs holds 2b rows, INTERLEAVED: row ``2i`` is prompt + chosen response of pair i, row ``2i + 1`` prompt +
rejected response. Any contiguous even split of the rows (a data-parallel shard, a pipeline micro-batch) therefore
holds whole pairs. Per row (right-padded, [2b, S]): ``input_ids``, ``attention_mask`` and pre-shifted ``labels``
(the label at t is token t + 1 where that token belongs to the response, EOS included; -100 on the prompt and the
padding, so only the response is scored), ``score_mask`` (True at each row's last token that is not padding:
transformers' rule, the token a reward model scores), plus ``pair_index`` [2b] (the pair's record index in its split, used to
look up precomputed reference log-probabilities).

Prompts longer than ``max_prompt_len`` keep their last tokens; responses are cut to ``cutoff_len`` minus the prompt.
Every problem with a file raises :class:`~lightning_llm.files.DataError` naming the file and line.

A record may carry a numeric ``margin`` (how much the chosen response should win by, for a reward model's loss; 0
when absent): batches hold it per row as ``margin`` [2b] (both rows of a pair carry it). ``predict_path`` serves
records ``{"prompt", "response"}`` one row each (right-padded ``input_ids``, ``attention_mask``, ``index``): what a
reward model scores (:class:`~lightning_llm.tasks.RewardTask`'s ``predict``). :class:`ReplyEncoder` turns a prompt
and a reply into a row's ids the same way for every one of them (and for a reward model scoring RL samples).

With a chat template (``--data.template``: the tokenizer's own by default, or a named one; see
:mod:`lightning_llm.data.chat.template`) a pair is a conversation: the prompt (a string: one user message; messages;
or the record's OpenAI ``messages`` / ShareGPT ``conversations``; a system message kept) rendered with the template's
generation prompt, and each reply rendered as the assistant turn after it, scored up to and including the template's
end-of-turn token (:mod:`lightning_llm.data.chat.encode`; ``chosen``/``rejected`` may be strings, messages, or whole
conversations sharing their beginning). Too-long prompts lose their oldest turns first, then the end of the last user
message's text (the template's markers and generation prompt stay). Without a template (``auto`` on a tokenizer
that has none, or ``none``) the strings are joined as they are (prompt + response + EOS).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from lightning_llm.data.base import (
    EncodedDataset,
    LLMDataModule,
    eos_and_pad_ids,
    tokenizer_or_bytes,
    tokenizer_vocab_size,
)
from lightning_llm.data.chat.encode import ChatEncoder, labels_for
from lightning_llm.data.chat.messages import ChatColumns, Conversation, preference_conversation, response_conversation
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.data.prompts import make_prompts
from lightning_llm.files import DataError, read_records, write_jsonl_atomic
from lightning_llm.models.scores import score_mask

log = logging.getLogger(__name__)

__all__ = ["PreferenceDataModule", "ReplyEncoder", "corrupt_title", "csl_preference_pairs", "make_preference_pairs",
           "record_margin"]

FIELDS = ("prompt", "chosen", "rejected")


def make_preference_pairs(n: int, *, seed: int = 0) -> list[dict[str, str]]:
    """``n`` deterministic pairs for runs without a file: the chosen response is digits, the rejected one letters
    (the preference PPO's digits reward expresses)."""
    rng = random.Random(seed)
    prompts = make_prompts(n, seed=seed)
    out = []
    for p in prompts:
        k = rng.randint(3, 8)
        out.append({"prompt": p, "chosen": "".join(rng.choice("0123456789") for _ in range(k)),
                    "rejected": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(k))})
    return out


def corrupt_title(title: str, rng: random.Random) -> str:
    """A worse title: the characters shuffled and half of them replaced by random CJK characters (same length)."""
    chars = list(title)
    rng.shuffle(chars)
    for i in rng.sample(range(len(chars)), len(chars) // 2):
        chars[i] = chr(rng.randint(0x4E00, 0x9FA5))
    out = "".join(chars)
    return out if out != title else out[::-1] + "\u4e00"


def csl_preference_pairs(path: str | Path, *, seed: int = 0, max_abstract_chars: int | None = None
                         ) -> list[dict[str, str]]:
    """Preference pairs from alpaca-format CSL records (``instruction``, ``input`` = abstract, ``output`` = title):
    prompt = instruction + abstract, chosen = the real title, rejected = :func:`corrupt_title` of it."""
    rng = random.Random(seed)
    pairs = []
    for rec in read_records(path, required=["instruction", "input", "output"]):
        abstract = rec["input"][:max_abstract_chars] if max_abstract_chars else rec["input"]
        pairs.append({"prompt": rec["instruction"] + abstract, "chosen": rec["output"],
                      "rejected": corrupt_title(rec["output"], rng)})
    return pairs


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_llm.data.preference --csl DIR --out DIR``: write ``train.jsonl`` / ``val.jsonl``
    preference pairs from the CSL title set's ``dev.json`` / ``test.json``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lightning_llm.data.preference", description=main.__doc__)
    parser.add_argument("--csl", required=True, help="directory with the CSL dev.json and test.json (alpaca format)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for src, name in (("dev.json", "train.jsonl"), ("test.json", "val.jsonl")):
        n = write_jsonl_atomic(out / name, csl_preference_pairs(Path(args.csl) / src, seed=args.seed))
        print(f"{n} pairs -> {out / name}")
    return 0


def record_margin(rec: dict[str, Any], where: str) -> float:
    """A record's optional ``margin`` (0 when absent); :class:`DataError` naming ``where`` when it is not a finite
    number."""
    value = rec.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {value!r}")
    return float(value)


class ReplyEncoder:
    """A prompt and a reply -> the token ids (and pre-shifted labels: the reply's tokens) of one row. Without a chat
    template: the prompt's last ``max_prompt_len`` tokens + the reply + EOS, the row cut to ``cutoff_len``; with one
    (``chat``): the reply's assistant turn after the prompt conversation fitted to ``max_prompt_len`` tokens, up to and
    including the template's end-of-turn token, cut to ``cutoff_len``."""

    def __init__(self, tokenizer: Any, chat: ChatEncoder | None, *, eos_token_id: int, max_prompt_len: int,
                 cutoff_len: int) -> None:
        self.tokenizer, self.chat, self.eos_token_id = tokenizer, chat, eos_token_id
        self.max_prompt_len, self.cutoff_len = max_prompt_len, cutoff_len

    def prompt_ids(self, text: str, where: str | None) -> list[int]:
        """A raw prompt's ids (its last ``max_prompt_len``); refused empty where a record is named (``where``)."""
        ids = self._encode(text)[-self.max_prompt_len:]
        if not ids and where is not None:
            raise DataError(f"{where}: empty prompt (a response is scored given its prompt)")
        return ids

    def raw(self, prompt: list[int], reply: str) -> tuple[list[int], list[int]]:
        """``(ids, labels)`` of prompt ids + a reply string + EOS."""
        response = (self._encode(reply) + [self.eos_token_id])[: self.cutoff_len - len(prompt)]
        # labels[t] = ids[t + 1] on response tokens: the prompt's last position predicts the first response token.
        return prompt + response, [-100] * (len(prompt) - 1) + response + [-100]

    def fit(self, conv: Conversation) -> Conversation:
        """The prompt conversation fitted to ``max_prompt_len`` tokens (chat template)."""
        assert self.chat is not None
        return self.chat.fit_prompt(conv, self.max_prompt_len)

    def turn(self, prompt: Conversation, reply: dict[str, Any]) -> tuple[list[int], list[int]]:
        """``(ids, labels)`` of a reply's assistant turn after a fitted prompt (chat template)."""
        assert self.chat is not None
        enc = self.chat.encode(Conversation([*prompt.messages, reply], prompt.tools, prompt.where), turns="last")
        start, end = enc.spans[0]
        end = min(end, self.cutoff_len)
        return enc.ids[:end], labels_for(enc.ids[:end], [(start, end)])

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


class PreferenceDataModule(LLMDataModule):
    """Preference pairs (see the module docstring). ``batch_size`` counts pairs per device."""

    def __init__(
        self,
        train_path: str | None = None,
        tokenizer_dir: str | None = None,
        *,
        val_path: str | None = None,
        val_fraction: float = 0.0,
        cutoff_len: int = 512,
        max_prompt_len: int = 256,
        template: str = "auto",
        columns: ChatColumns | None = None,
        default_system: str | None = None,
        generated_pairs: int = 256,
        generated_val_pairs: int = 32,
        limit_examples: int | None = None,
        predict_path: str | None = None,
        pad_to_multiple_of: int = 1,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            train_path: JSON array or JSONL file of ``{"prompt", "chosen", "rejected"}`` records; ``None`` uses
                ``generated_pairs`` generated pairs.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``:
                the backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line
                fills it in), else the byte tokenizer.
            val_path: Validation pairs (default: ``val_fraction`` of the training pairs, or generated pairs).
            val_fraction: Share of the training pairs held out for validation when ``val_path`` is not given.
            cutoff_len: Most tokens of prompt + response in a row.
            max_prompt_len: Most prompt tokens (the prompt's end is kept).
            template: The chat template: ``auto`` (the tokenizer's ``chat_template``, else none), ``none`` (raw
                strings: prompt + response + EOS), ``tokenizer``, a named one (``chatml``, ``llama3``, ``llama2``,
                ``mistral``, ``baichuan2``, ``alpaca``, ``plain``) or a Jinja string / ``.jinja`` file.
            columns: Format and column/role names of conversation records (chat templates only).
            default_system: System message of prompts that have none (chat templates only).
            generated_pairs: Generated training pairs when ``train_path`` is not given.
            generated_val_pairs: Generated validation pairs when neither ``train_path`` nor ``val_path`` is given.
            limit_examples: Use only the first N records of every file (quick runs).
            predict_path: JSON/JSONL records ``{"prompt", "response"}`` to score (``lightning_llm predict`` with a
                reward model): one row each, encoded as a pair's response is.
            pad_to_multiple_of: Pad every batch's rows to a multiple of this many tokens (context parallelism cuts
                rows into ``2 x context_parallel_size`` equal chunks).
            batch_size: Per-device training batch size, in pairs.
            eval_batch_size: Per-device evaluation batch size, in pairs.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle and of the validation split.
        """
        super().__init__(batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)
        if max_prompt_len < 1 or cutoff_len <= max_prompt_len:
            raise ValueError(f"--data.cutoff_len ({cutoff_len}) must exceed --data.max_prompt_len ({max_prompt_len}) "
                             "which must be >= 1: a response needs room after the prompt")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"--data.val_fraction must be in [0, 1), got {val_fraction}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"--data.pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.paths = {"fit": train_path, "validate": val_path, "predict": predict_path}
        self.pad_to_multiple_of = pad_to_multiple_of
        self.tokenizer_dir = tokenizer_dir  # an explicit byte on an HF backbone is the user's choice (vocab.py)
        self.tokenizer = tokenizer_or_bytes(tokenizer_dir)
        self.eos_token_id, self.pad_token_id = eos_and_pad_ids(self.tokenizer, tokenizer_dir)
        chat = None if template == "none" else resolve_template(template, self.tokenizer, fallback=None)
        self.chat = None if chat is None else ChatEncoder(self.tokenizer, chat, eos_token_id=self.eos_token_id)
        self.tokenizer = self.chat.tokenizer if self.chat is not None else self.tokenizer
        self.columns, self.default_system = columns or ChatColumns(), default_system
        self.cutoff_len, self.max_prompt_len = cutoff_len, max_prompt_len
        self.val_fraction, self.limit_examples = val_fraction, limit_examples
        self.generated = {"fit": generated_pairs, "validate": generated_val_pairs}
        self.datasets: dict[str, EncodedDataset] = {}
        self.predict_records: list[dict[str, Any]] = []
        """The ``predict_path`` records in file order (without ``_line``), after ``setup("predict")``."""
        self.replies = ReplyEncoder(self.tokenizer, self.chat, eos_token_id=self.eos_token_id,
                                    max_prompt_len=max_prompt_len, cutoff_len=cutoff_len)

    @property
    def vocab_size(self) -> int:
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def stop_token_ids(self) -> list[int]:
        """Where a reply ends: the chat template's end-of-turn token and EOS (EOS alone without a template)."""
        return self.chat.stop_token_ids if self.chat is not None else [self.eos_token_id]

    # ------------------------------------------------------------------------------------------ records -> rows
    def encode_pair(self, rec: dict[str, Any], index: int, where: str) -> dict[str, Any]:
        """One pair -> ``{"chosen": (ids, labels), "rejected": (ids, labels), "margin", "index"}``."""
        row: dict[str, Any] = {"index": index, "margin": record_margin(rec, where)}
        if self.chat is not None:  # a conversation: one fitted prompt, each reply its assistant turn
            conv, *replies = preference_conversation(rec, self.columns, where, default_system=self.default_system)
            prompt = self.replies.fit(conv)
            for key, reply in zip(("chosen", "rejected"), replies):
                row[key] = self.replies.turn(prompt, reply)
            return row
        for key in FIELDS:
            if not isinstance(rec.get(key), str):
                raise DataError(f"{where}: field {key!r} must be a string without a chat template (--data.template="
                                "none, or a tokenizer without one); set --data.template to train on conversations")
        prompt_ids = self.replies.prompt_ids(rec["prompt"], where)
        for key in ("chosen", "rejected"):
            row[key] = self.replies.raw(prompt_ids, rec[key])
        return row

    def encode_response(self, rec: dict[str, Any], index: int, where: str) -> dict[str, Any]:
        """One ``{"prompt", "response"}`` record to score -> ``{"input_ids", "index"}``, the row a pair's response
        would be."""
        if self.chat is not None:
            conv, reply = response_conversation(rec, self.columns, where, default_system=self.default_system)
            return {"input_ids": self.replies.turn(self.replies.fit(conv), reply)[0], "index": index}
        for key in ("prompt", "response"):
            if not isinstance(rec.get(key), str):
                raise DataError(f"{where}: field {key!r} must be a string without a chat template (--data.template="
                                "none, or a tokenizer without one)")
        return {"input_ids": self.replies.raw(self.replies.prompt_ids(rec["prompt"], where), rec["response"])[0],
                "index": index}

    def _records(self, split: str) -> list[tuple[dict[str, Any], str]]:
        """``(record, "file:line")`` of a split's file, or generated pairs."""
        path = self.paths[split]
        if path is None:
            n = self.generated[split] if split == "fit" or self.paths["fit"] is None else 0
            pairs = make_preference_pairs(n, seed=self.seed + (0 if split == "fit" else 1)) if n else []
            return [(r, f"generated pair {i + 1}") for i, r in enumerate(pairs)]
        recs = read_records(path, required=FIELDS if self.chat is None else ())
        recs = recs[: self.limit_examples] if self.limit_examples else recs
        return [(r, f"{path}:{r['_line']}") for r in recs]

    def split_records(self) -> tuple[list[tuple[dict[str, Any], str]], list[tuple[dict[str, Any], str]]]:
        """The training and validation ``(record, "file:line")`` (``val_fraction`` held out of the training file)."""
        train, val = self._records("fit"), self._records("validate")
        if self.paths["validate"] is None and self.paths["fit"] is not None and self.val_fraction > 0:
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(len(train), generator=g).tolist()
            held = set(order[: max(1, round(len(train) * self.val_fraction))])
            val = [r for i, r in enumerate(train) if i in held]
            train = [r for i, r in enumerate(train) if i not in held]
        return train, val

    def setup(self, stage: str) -> None:
        if stage == "predict":
            self._setup_predict()
        if stage not in ("fit", "validate") or "fit" in self.datasets:
            return
        train, val = self.split_records()
        if stage == "fit" and not train:
            raise DataError(f"{self.paths['fit']}: no preference pairs")
        for split, recs in (("fit", train), ("validate", val)):
            self.datasets[split] = EncodedDataset([{**self.encode_pair(r, i, where), "where": where}
                                                   for i, (r, where) in enumerate(recs)])
        log.info("%d training and %d validation preference pairs", len(train), len(val))

    def _setup_predict(self) -> None:
        path = self.paths["predict"]
        if path is None:
            raise ValueError("predict needs --data.predict_path: JSON/JSONL records {\"prompt\", \"response\"} to "
                             "score")
        if "predict" in self.datasets:
            return
        recs = read_records(path)
        recs = recs[: self.limit_examples] if self.limit_examples else recs
        rows = [self.encode_response(r, i, f"{path}:{r['_line']}") for i, r in enumerate(recs)]
        self.predict_records = [{k: v for k, v in r.items() if k != "_line"} for r in recs]
        self.datasets["predict"] = EncodedDataset(rows)
        log.info("%d records to score from %s", len(rows), path)

    # ------------------------------------------------------------------------------------------ batches
    def _width(self, longest: int) -> int:
        return -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """b pairs -> 2b interleaved rows (chosen, rejected, chosen, ...), right-padded."""
        seqs = [r[key] for r in rows for key in ("chosen", "rejected")]
        longest = self._width(max(len(ids) for ids, _ in seqs))
        ids = torch.full((len(seqs), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, (seq, lab) in enumerate(seqs):
            ids[i, : len(seq)], labels[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), torch.tensor(lab), 1
        index = torch.tensor([r["index"] for r in rows]).repeat_interleave(2)
        margin = torch.tensor([r.get("margin", 0.0) for r in rows], dtype=torch.float32).repeat_interleave(2)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "pair_index": index, "margin": margin,
                "score_mask": score_mask(ids, self.pad_token_id)}

    def collate_responses(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Records to score -> right-padded ``input_ids``, ``attention_mask`` [B, S] and their ``index`` [B]."""
        longest = self._width(max(len(r["input_ids"]) for r in rows))
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])], mask[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"]), 1
        return {"input_ids": ids, "attention_mask": mask, "index": torch.tensor([r["index"] for r in rows]),
                "score_mask": score_mask(ids, self.pad_token_id)}

    def split_dataset(self, split: str) -> EncodedDataset:
        """The encoded pairs of ``fit`` or ``validate`` (after ``setup``)."""
        return self.datasets.get(split, EncodedDataset([]))

    def fingerprint(self, split: str) -> str:
        """A digest of the split's encoded pairs (token ids, in order): a precomputed reference table is valid only
        for the data it was computed on."""
        digest = hashlib.sha256()
        for row in self.split_dataset(split):
            for key in ("chosen", "rejected"):
                digest.update(repr(row[key]).encode())
        return digest.hexdigest()

    def record_fingerprints(self, split: str) -> torch.Tensor:
        """One int64 digest [items] per encoded pair of the split (both rows' token ids and labels): a precomputed
        reference table is valid only for the items it was computed on, and the first digest that differs names the
        record (:meth:`record_name`)."""
        out = []
        for row in self.split_dataset(split):
            digest = hashlib.blake2b(digest_size=8)
            for key in ("chosen", "rejected"):
                digest.update(repr(row[key]).encode())
            out.append(int.from_bytes(digest.digest(), "little", signed=True))
        return torch.tensor(out, dtype=torch.int64)

    def record_name(self, split: str, index: int) -> str:
        """Where item ``index`` of ``split`` was read: ``file:line``, or ``generated pair N``."""
        return self.split_dataset(split)[index]["where"]

    def reference_dataloader(self, split: str, indices: Sequence[int] | None = None) -> DataLoader:
        """The items ``indices`` of ``split`` (default: every one) in order, unsharded, as the pairs' interleaved rows
        (KTO's examples: each one's row and its KL row) with ``pair_index``: what a rank precomputes the reference
        log-probs of."""
        data = self.split_dataset(split)
        return DataLoader(data if indices is None else Subset(data, list(indices)), batch_size=self.eval_batch_size,
                          shuffle=False, collate_fn=functools.partial(PreferenceDataModule.collate, self))

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self.datasets["fit"], train=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.split_dataset("validate"), train=False, collate_fn=self.collate)

    def predict_dataloader(self) -> DataLoader:
        return self.make_loader(self.split_dataset("predict"), train=False, collate_fn=self.collate_responses)


if __name__ == "__main__":
    raise SystemExit(main())
