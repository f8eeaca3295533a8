"""The base of the offline preference tasks (DPO and its variants, KTO): a decoder policy whose loss scores responses
by their summed log-probabilities, against a reference policy's where the loss has one.

What is written here once:

* the one model call of a step (:meth:`PreferenceTask.model_inputs`: the rows, and with the fused loss per-token
  cross-entropy instead of logits) and the rows' sequence log-probs from its output;
* the reference (:attr:`PreferenceTask.reference_mode`): ``None`` (a reference-free loss: nothing is built,
  precomputed or run for it), ``precomputed`` or ``on_the_fly`` (every step, from
  :class:`~lightning_llm.rl.rollouts.reference.ReferencePolicy`: a frozen copy placed like the policy, or the policy with
  its adapters off under PEFT).

**Precomputed.** At the start of training (``on_train_start``: after Lightning has restored a checkpoint, which it
does after ``on_fit_start`` under the native engine and DeepSpeed) the reference log-probs of every training and
validation item are computed with the initial policy, through ``run_model``, so under whatever layout trains it,
pipelines included, in eval mode: each data-parallel replica computes a contiguous 1/N of the items and the table is
summed over the replicas (each row comes from one replica: the one-device table). No reference copy is held for a
full fine-tune. The table is kept in the checkpoint with one digest per item
(:meth:`~lightning_llm.data.PreferenceDataModule.record_fingerprints`); where a resume (also at another layout) reads
it, it is checked against the data, and other items are refused in one line naming the checkpoint and the first item
that differs (file and line); a resume never recomputes it.

A reference batch (the datamodule's ``reference_dataloader(split)``) holds two rows per item, interleaved, and
``pair_index`` [rows] (the item's index in its split): the table of a split is ``[items, 2]`` summed reference
log-probs (DPO: chosen, rejected; KTO: the completion, its mismatched row).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm import preemption
from lightning_llm.rl.rollouts.reference import ReferencePolicy, sequence_logprobs
from lightning_llm.tasks.decoder import DecoderTask

log = logging.getLogger(__name__)

__all__ = ["PreferenceTask", "interleave_rows"]

ROW_KEYS = ("input_ids", "attention_mask", "labels")
"""The keys of a batch's model rows (right-padded [rows, S])."""


class PreferenceTask(DecoderTask):
    """A decoder policy trained on offline preference data (see the module docstring). Subclasses set
    :attr:`reference_mode` and the loss (``loss_from_output``)."""

    def __init__(self, backbone: str = "debug", *, dropout: float | None = 0.0, **kwargs: Any) -> None:
        """
        Args:
            backbone: The policy (and initial reference): a named decoder size or a local HF directory.
            dropout: Dropout of the policy in training (0 by default, as trl: with dropout the policy's and the
                reference's log-probs differ before any update).
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.reference_table: dict[str, Tensor] = {}  # split -> [items, 2] summed reference log-probs (precomputed)
        self.reference_records: dict[str, Tensor | str] = {}  # split -> [items] int64 digests the table was computed on
        self._checked: set[str] = set()  # splits whose table was checked against the datamodule's items
        self._resumed = ""  # the checkpoint this task's state came from (its table is never recomputed)
        self._placed_tables: dict[str, tuple[Tensor, Tensor]] = {}  # split -> (table, its copy on the batches' device)

    item_name = "items"
    """What one item of the data is called in messages (DPO: pairs; KTO: examples)."""

    @property
    def reference_mode(self) -> str | None:
        """``precomputed``, ``on_the_fly``, or ``None`` when the loss uses no reference."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_policy()
        # PEFT: the reference is the policy with adapters off (no copy). A full fine-tune needs a frozen copy only
        # on the fly; precomputed log-probs come from the policy itself before its first update.
        mode = self.reference_mode
        if mode is not None and (self.peft_config is not None or mode == "on_the_fly"):
            self.reference = ReferencePolicy.for_policy(policy)
        return self.checkpointed(policy)

    @override
    def model_inputs(self, batch: dict[str, Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {"attention_mask": batch.get("attention_mask")}
        if self.uses_fused_loss():  # the model returns per-token cross-entropy [rows, S] instead of logits
            kwargs.update(labels=batch["labels"], reduction="none")
        return (batch["input_ids"],), kwargs

    def sequence_logps(self, output: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(summed log-probs [rows], label tokens [rows])`` from the model's output: logits, or with the fused loss
        the per-token cross-entropy (0 where the label is ignored), whose negation is the token log-prob."""
        if self.uses_fused_loss():
            return -output.float().sum(-1), (labels != -100).sum(-1).float()
        return sequence_logprobs(output, labels)

    def no_grad_logps(self, rows: dict[str, Tensor], *, reference: bool) -> Tensor:
        """Summed log-probs [rows] of ``rows`` (:data:`ROW_KEYS`) computed now, in eval mode without gradients, by
        the reference policy (``reference``; the policy itself where precomputing for a full fine-tune, which holds
        no reference) or by the policy."""
        args, kwargs = self.model_inputs(rows, "reference")
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                if reference and self.reference is not None:
                    output = self.run_reference(self.run_model, *args, **kwargs)
                else:
                    output = self.run_model(*args, **kwargs)
                output = output.full_tensor() if hasattr(output, "full_tensor") else output
                return self.sequence_logps(output, rows["labels"])[0]
        finally:
            self.train(was_training)

    # ------------------------------------------------------------------------------------------ reference
    @property
    def reference_columns(self) -> tuple[bool, bool]:
        """Which rows of an item the loss reads the reference log-probs of (DPO: both; KTO's ``apo_zero_unpaired``:
        not the KL row, which is then never run)."""
        return True, True

    def reference_rows(self, split: str, index: Tensor) -> Tensor:
        """The precomputed ``[len(index), 2]`` reference log-probs of the items ``index`` of ``split``."""
        table = self.reference_table.get(split)
        if table is None:
            raise RuntimeError(f"{type(self).__name__}: no precomputed reference log-probs for the {split} {self.item_name}")
        if table.device != index.device:  # the table's copy on the accelerator, made once (not every step)
            source, placed = self._placed_tables.get(split, (None, None))
            if source is not table or placed.device != index.device:
                placed = table.to(index.device)
                self._placed_tables[split] = (table, placed)
            table = placed
        return table[index]

    def _reference_datamodule(self) -> Any:
        dm = self.trainer.datamodule
        if not hasattr(dm, "reference_dataloader"):
            raise ValueError(f"reference=precomputed needs a datamodule with reference_dataloader() "
                             f"(PreferenceDataModule, UnpairedPreferenceDataModule); {type(dm).__name__} has none: "
                             "use reference=on_the_fly")
        return dm

    def _replica(self) -> tuple[int, int, Any]:
        """``(rank, replicas, group)`` of the data-parallel replicas (the ranks of one replica's tensor or pipeline
        group run the same batches)."""
        caps = self.capabilities
        if caps.data_parallel_size <= 1 or not dist.is_initialized():
            return 0, 1, None
        return dist.get_rank(caps.data_parallel_group), caps.data_parallel_size, caps.data_parallel_group

    @torch.no_grad()
    def precompute_reference(self, split: str) -> None:
        """Fill ``reference_table[split]`` from the datamodule's ``reference_dataloader``: each data-parallel replica
        computes a contiguous 1/N of the items, and the table is summed over the replicas (each row is non-zero on one
        replica only, so the sum is exact: the one-device table). Every rank runs the same number of model calls (a
        replica with fewer items repeats its last batch): ZeRO-3 and DDP run collectives inside them."""
        dm = self._reference_datamodule()
        n = len(dm.split_dataset(split))
        rank, replicas, group = self._replica()
        per = -(-n // replicas)
        loader = dm.reference_dataloader(split, range(min(n, rank * per), min(n, (rank + 1) * per)))
        calls = -(-per // loader.batch_size)
        second = self.reference_columns[1]
        table = torch.zeros(n, 2, dtype=torch.float32, device=self.device)
        if not second:
            table[:, 1] = float("nan")  # never computed, never read (a loss reading it would show NaN, not 0)
        done, last = 0, None
        with preemption.phase(f"the reference precompute ({split} {self.item_name})"):
            for last in loader:
                index, logps = self._reference_logps(last, second)
                table[index, 0:2 if second else 1] = logps
                done += 1
            if done < calls:  # the same number of model calls on every replica; these results are dropped
                last = last if last is not None else next(iter(dm.reference_dataloader(split, [0])))
                for _ in range(calls - done):
                    self._reference_logps(last, second)
        if replicas > 1:
            dist.all_reduce(table, group=group)
        self.reference_table[split] = table.cpu()
        self.reference_records[split] = dm.record_fingerprints(split)
        self._checked.add(split)
        log.info("%s: reference log-probs precomputed for %d %s %s (%d on each of %d data-parallel replicas)",
                 type(self).__name__, n, split, self.item_name, per, replicas)

    def _reference_logps(self, batch: dict[str, Tensor], both: bool) -> tuple[Tensor, Tensor]:
        """``(item index [b], reference log-probs [b, 2] or, without ``both``, [b, 1]: the first row of each item
        only)`` of one reference batch (two rows per item, interleaved)."""
        rows = {k: (batch[k] if both else batch[k][0::2]).to(self.device) for k in ROW_KEYS}
        logps = self.no_grad_logps(rows, reference=True).float()
        return batch["pair_index"][0::2].to(self.device), logps.view(-1, 2 if both else 1)

    def _check_reference_data(self, split: str) -> None:
        """Refuse a checkpoint's precomputed table for other items than the datamodule's (looked up by index, it
        would silently pair each item with another item's reference log-probs), naming the first that differs."""
        if self.reference_columns[1] and self.reference_table[split][:, 1].isnan().any():
            raise ValueError(f"{self._resumed}: its precomputed reference log-probs lack the second row of every "
                             f"{self.item_name[:-1]} (KTO's KL rows: written by loss_type=apo_zero_unpaired), which "
                             "this loss reads: resume with that loss type, or start a new run")
        dm = self._trainer.datamodule if self._trainer is not None else None
        saved = self.reference_records.get(split)
        if dm is None or saved is None:
            return
        where, what = self._resumed or "the loaded checkpoint", f"{split} {self.item_name}"
        if isinstance(saved, str):  # a checkpoint of one digest per split: no record to name
            if hasattr(dm, "fingerprint") and saved != dm.fingerprint(split):
                raise ValueError(f"{where}: its precomputed reference log-probs were computed on other {what} than "
                                 f"the datamodule holds ({dm.paths.get(split) or 'generated'}); resume with the same "
                                 "--data files and tokenizer, or start a new run")
        elif hasattr(dm, "record_fingerprints"):
            now = dm.record_fingerprints(split)
            common = min(len(now), len(saved))
            differs = (now[:common] != saved[:common]).nonzero()
            first = int(differs[0]) if len(differs) else common
            if first < max(len(now), len(saved)):
                item = self.item_name[:-1]
                record = dm.record_name(split, first) if first < len(now) else "beyond the data's end"
                raise ValueError(f"{where}: its precomputed reference log-probs were computed on other {what} than "
                                 f"the datamodule holds (the checkpoint: {len(saved)} {self.item_name}, the data: "
                                 f"{len(now)}); the first that differs is {item} {first} ({record}); resume with "
                                 "the same --data files and tokenizer, or start a new run")
        self._checked.add(split)

    def _reference_for(self, split: str) -> None:
        """``split``'s table ready: the checkpoint's (checked against the data), or precomputed now while the policy
        is still the initial one (a fit before its first step), never after a resume."""
        if split in self.reference_table:
            if split not in self._checked:  # once (a resume checks where it reads the table: on_load_checkpoint)
                self._check_reference_data(split)
            return
        if self._resumed:
            raise ValueError(f"{self._resumed}: it holds no precomputed reference log-probs for the {split} "
                             f"{self.item_name}, and its policy is not the initial one any more: resume with the "
                             "reference mode and data it was trained with, or use reference=on_the_fly")
        initial = self.trainer.state.fn == TrainerFn.FITTING and self.trainer.global_step == 0
        if not initial and self.reference is None:  # `validate` alone: only a reference copy could stand in
            raise ValueError(f"{type(self).__name__}: the checkpoint holds no precomputed reference log-probs for "
                             f"{split} {self.item_name} and a full fine-tune keeps no reference copy: validate with "
                             "reference=on_the_fly")
        self.precompute_reference(split)

    # ------------------------------------------------------------------------------------------ steps
    def _prepared(self, batch: dict[str, Tensor], split: str) -> dict[str, Tensor]:
        """The batch with what the task's loss needs besides its rows (the reference log-probs of ``split``): the
        subclass's; as it came here."""
        return batch

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        return super().training_step(self._prepared(batch, "fit"), batch_idx)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return super().validation_step(self._prepared(batch, "validate"), batch_idx)

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def on_train_start(self) -> None:
        # Here, not in on_fit_start: Lightning 2.6 restores a checkpoint after on_fit_start where the strategy
        # restores after set-up (native engine, DeepSpeed), and a resume must find the checkpoint's table.
        super().on_train_start()
        if self.reference_mode == "precomputed":
            for split in ("fit", "validate"):
                self._reference_for(split)

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.reference_mode == "precomputed":
            self._reference_for("validate")

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_table:
            checkpoint["dpo_reference"] = {k: v.clone() for k, v in self.reference_table.items()}
            checkpoint["dpo_reference_data"] = dict(self.reference_records)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Where the checkpoint's table is read, it is checked against the data (when a trainer holds them; else at
        the first use)."""
        super().on_load_checkpoint(checkpoint)
        self.reference_table = dict(checkpoint.get("dpo_reference") or {})
        self.reference_records = dict(checkpoint.get("dpo_reference_data") or {})
        self._checked = set()
        attached = self._trainer is not None
        self._resumed = (f"--ckpt_path={self.trainer.ckpt_path}" if attached and self.trainer.ckpt_path
                         else "the loaded checkpoint")
        if attached and self.reference_mode == "precomputed":
            for split in self.reference_table:
                self._check_reference_data(split)


def interleave_rows(first: dict[str, Tensor], second: dict[str, Tensor]) -> dict[str, Tensor]:
    """Two sets of n right-padded rows (:data:`ROW_KEYS`) -> 2n rows ``first[0], second[0], first[1], ...``, padded
    to the longer width (padding: id 0, mask 0, label -100); shapes only, no host read."""
    width = max(first["input_ids"].shape[1], second["input_ids"].shape[1])
    out = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        a, b = (torch.nn.functional.pad(t[key], (0, width - t[key].shape[1]), value=fill) for t in (first, second))
        out[key] = torch.stack([a, b], dim=1).flatten(0, 1)
    return out
