"""Unpaired feedback for KTO: JSON/JSONL records ``{"prompt", "completion", "label": true|false}`` (trl's unpaired
preference format: ``true`` = desirable, thumbs up; ``false`` = undesirable), or generated records.

A record may also be a pair ``{"prompt", "chosen", "rejected"}``: it becomes two examples, the chosen completion
desirable and the rejected one undesirable (trl's ``unpair_preference_dataset``). The prompt and the completion are
read and encoded as :class:`~lightning_llm.data.PreferenceDataModule` reads a pair's prompt and reply (strings, or
messages under a chat template; prompt masked, the reply scored up to and including EOS or the template's end of
turn; the same truncation).

**The KL rows.** KTO's reference point is a KL estimate from mismatched pairs: each example also carries its prompt
with another example's completion. trl rotates the completions by one inside each device batch; here each example's
partner is fixed when the data are read (a rotation by one over a seeded shuffle of the split: every example lends
its completion to exactly one other), so the mismatched pairs - and their precomputed reference log-probs - do not
depend on the batch size, the data-parallel degree or the micro-batches, and every layout trains what one device
trains.

A batch of n examples holds (right-padded): ``input_ids``, ``attention_mask``, ``labels`` [n, S] (prompt +
completion, labels pre-shifted as in the preference pairs), the mismatched rows ``kl_input_ids``,
``kl_attention_mask``, ``kl_labels`` [n, S'], ``desirable`` [n] (bool) and ``example_index`` [n] (the example's index
in its split). :meth:`UnpairedPreferenceDataModule.reference_dataloader` yields the two rows of each example
interleaved (with ``pair_index``), as the preference pairs' reference batches are.

Every problem with a file raises :class:`~lightning_llm.files.DataError` naming the file and line: a missing field, a
``label`` that is not a JSON boolean, a training file with only one kind of label.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_llm.data.chat.messages import ChatColumns
from lightning_llm.data.preference import PreferenceDataModule, make_preference_pairs
from lightning_llm.files import DataError, read_records

log = logging.getLogger(__name__)

__all__ = ["UnpairedPreferenceDataModule", "make_unpaired_records"]

ROW_KEYS = ("input_ids", "attention_mask", "labels")
Records = list[tuple[dict[str, Any], str]]


def make_unpaired_records(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` deterministic records for runs without a file: generated prompts whose completion is digits
    (desirable, ``label: true``) for even records and letters (undesirable) for odd ones."""
    return [{"prompt": p["prompt"], "completion": p["chosen"] if i % 2 == 0 else p["rejected"], "label": i % 2 == 0}
            for i, p in enumerate(make_preference_pairs(n, seed=seed))]


class UnpairedPreferenceDataModule(PreferenceDataModule):
    """Unpaired feedback for KTO (see the module docstring). ``batch_size`` counts examples per device."""

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
        generated_examples: int = 256,
        generated_val_examples: int = 32,
        limit_examples: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 42,
    ) -> None:
        """
        Args:
            train_path: JSON array or JSONL file of ``{"prompt", "completion", "label": true|false}`` records (or
                ``{"prompt", "chosen", "rejected"}`` pairs, unpaired); ``None`` uses ``generated_examples`` generated
                records.
            tokenizer_dir: Local tokenizer directory, or ``byte`` for the built-in byte tokenizer (259 ids). ``None``: the
                backbone's own tokenizer when ``--model.backbone`` is a Hugging Face directory (the command line fills
                it in), else the byte tokenizer.
            val_path: Validation records (default: ``val_fraction`` of the training records, or generated records).
            val_fraction: Share of the training records held out for validation when ``val_path`` is not given.
            cutoff_len: Most tokens of prompt + completion in a row.
            max_prompt_len: Most prompt tokens (the prompt's end is kept).
            template: The chat template: ``auto`` (the tokenizer's ``chat_template``, else none), ``none`` (raw
                strings: prompt + completion + EOS), ``tokenizer``, a named one (``chatml``, ``llama3``, ...) or a
                Jinja string / ``.jinja`` file.
            columns: Format and column/role names of conversation records (chat templates only).
            default_system: System message of prompts that have none (chat templates only).
            generated_examples: Generated training records when ``train_path`` is not given.
            generated_val_examples: Generated validation records when neither ``train_path`` nor ``val_path`` is given.
            limit_examples: Use only the first N records of every file (quick runs).
            batch_size: Per-device training batch size, in examples.
            eval_batch_size: Per-device evaluation batch size, in examples.
            num_workers: DataLoader worker processes.
            seed: Seed of the training shuffle, of the validation split and of the KL rows' partners.
        """
        super().__init__(train_path, tokenizer_dir, val_path=val_path, val_fraction=val_fraction,
                         cutoff_len=cutoff_len, max_prompt_len=max_prompt_len, template=template, columns=columns,
                         default_system=default_system, generated_pairs=generated_examples,
                         generated_val_pairs=generated_val_examples, limit_examples=limit_examples,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed)

    # ------------------------------------------------------------------------------------------ records
    def _records(self, split: str) -> Records:
        """``(record, "file:line")`` of a split's file (pairs unpaired, every record checked), or generated records."""
        path = self.paths[split]
        if path is None:
            n = self.generated[split] if split == "fit" or self.paths["fit"] is None else 0
            recs = make_unpaired_records(n, seed=self.seed + (0 if split == "fit" else 1)) if n else []
            return [(r, f"generated example {i + 1}") for i, r in enumerate(recs)]
        recs = read_records(path)
        recs = recs[: self.limit_examples] if self.limit_examples else recs
        return [(r, where) for rec in recs for r, where in self._unpaired(rec, f"{path}:{rec['_line']}")]

    def _unpaired(self, rec: dict[str, Any], where: str) -> Records:
        if "completion" not in rec and "chosen" in rec and "rejected" in rec:  # a pair: two examples
            base = {k: v for k, v in rec.items() if k not in ("chosen", "rejected")}
            return [({**base, "completion": rec["chosen"], "label": True}, where),
                    ({**base, "completion": rec["rejected"], "label": False}, where)]
        required = ("prompt", "completion", "label") if self.chat is None else ("completion", "label")
        for key in required:
            if key not in rec:
                raise DataError(f"{where}: missing field {key!r} (fields present: "
                                f"{sorted(k for k in rec if k != '_line')}); KTO records are {{\"prompt\", "
                                "\"completion\", \"label\": true|false}")
        if not isinstance(rec["label"], bool):
            raise DataError(f"{where}: field 'label' must be a JSON boolean (true: desirable, false: undesirable), "
                            f"got {rec['label']!r}")
        text_only = (str,) if self.chat is None else (str, dict, list)
        for key in ("prompt", "completion"):
            if key in rec and not isinstance(rec[key], text_only):
                raise DataError(f"{where}: field {key!r} must be a string" + (
                    " without a chat template (--data.template=none, or a tokenizer without one); set --data.template "
                    "to train on conversations" if self.chat is None else " or messages") + f", got {type(rec[key]).__name__}")
        return [(rec, where)]

    def split_records(self) -> tuple[Records, Records]:
        """The training and validation examples, each with its KL partner's completion (see the module docstring)."""
        train, val = super().split_records()
        if self.paths["fit"] is not None and train and len({r["label"] for r, _ in train}) < 2:
            kind = "desirable (label true)" if train[0][0]["label"] else "undesirable (label false)"
            raise DataError(f"{self.paths['fit']}: every training example is {kind}: KTO needs both desirable (true) "
                            "and undesirable (false) completions")
        return self._with_partners(train, self.seed), self._with_partners(val, self.seed + 1)

    @staticmethod
    def _with_partners(recs: Records, seed: int) -> Records:
        """Each record as a pseudo-pair ``chosen`` = its completion, ``rejected`` = its partner's completion (the
        preference pairs' encoding then gives the example's row and its KL row)."""
        if len(recs) == 1:
            raise DataError(f"{recs[0][1]}: a split of one example: KTO's KL rows borrow another example's "
                            "completion, so a split needs at least 2")
        order = torch.randperm(len(recs), generator=torch.Generator().manual_seed(seed)).tolist()
        partner = {order[k]: order[k - 1] for k in range(len(order))}  # a rotation: nobody is their own partner
        return [({**rec, "chosen": rec["completion"], "rejected": recs[partner[i]][0]["completion"]}, where)
                for i, (rec, where) in enumerate(recs)]

    def encode_pair(self, rec: dict[str, Any], index: int, where: str) -> dict[str, Any]:
        """One example -> ``{"chosen": its row, "rejected": its KL row, "index", "label"}``."""
        try:
            row = super().encode_pair(rec, index, where)
        except DataError as e:  # the pair encoding names the fields it was handed
            raise DataError(str(e).replace("'chosen'", "'completion'").replace(
                "'rejected'", "'completion' (of the example lending its completion to this KL row)")) from None
        row["label"] = rec["label"]
        return row

    # ------------------------------------------------------------------------------------------ batches
    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """n examples -> their rows and their KL rows, each right-padded to its own longest (see the module
        docstring)."""
        both = super().collate(rows)  # 2n interleaved rows: example, KL row, example, ...
        out: dict[str, Any] = {}
        for prefix, part in (("", 0), ("kl_", 1)):
            width = int(both["attention_mask"][part::2].sum(1).max())
            out.update({prefix + key: both[key][part::2, :width].contiguous() for key in ROW_KEYS})
        out["desirable"] = torch.tensor([r["label"] for r in rows], dtype=torch.bool)
        out["example_index"] = both["pair_index"][0::2].clone()
        return out

    def label_counts(self, split: str = "fit") -> tuple[int, int]:
        """``(desirable, undesirable)`` examples of a split (after ``setup``)."""
        labels = [row["label"] for row in self.split_dataset(split)]
        return sum(labels), len(labels) - sum(labels)
