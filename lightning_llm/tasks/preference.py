"""The base of the offline preference tasks (DPO and its variants, KTO): a decoder policy whose loss scores responses
by their summed log-probabilities, against a reference policy's where the loss has one.

What is written here once:

* the one model call of a step (:meth:`PreferenceTask.model_inputs`: the rows, and with the fused loss per-token
  cross-entropy instead of logits) and the rows' sequence log-probs from its output;
* the reference (:attr:`PreferenceTask.reference_mode`): ``None`` (a reference-free loss: nothing is built,
  precomputed or run for it), ``precomputed`` (before the first step every rank computes the reference log-probs
  of every training and validation item with the initial policy, through ``run_model``, so under whatever layout
  trains it, pipelines included, in eval mode; kept in the checkpoint, where a resume, also at another layout,
  finds them; no reference copy is held for a full fine-tune) or ``on_the_fly`` (every step, from
  :class:`~lightning_llm.rl.reference.ReferencePolicy`: a frozen copy placed like the policy, or the policy with
  its adapters off under PEFT).

A reference batch (the datamodule's ``reference_dataloader(split)``) holds two rows per item, interleaved, and
``pair_index`` [rows] (the item's index in its split): the table of a split is ``[items, 2]`` summed reference
log-probs (DPO: chosen, rejected; KTO: the completion, its mismatched row).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.rl.reference import ReferencePolicy, sequence_logprobs
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
        self.reference_data: dict[str, str] = {}  # split -> fingerprint of the items the table was computed on

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
    def reference_rows(self, split: str, index: Tensor) -> Tensor:
        """The precomputed ``[len(index), 2]`` reference log-probs of the items ``index`` of ``split``."""
        table = self.reference_table.get(split)
        if table is None:
            raise RuntimeError(f"{type(self).__name__}: no precomputed reference log-probs for the {split} {self.item_name}")
        return table.to(index.device)[index]

    def precompute_reference(self, split: str) -> None:
        """Fill ``reference_table[split]`` from the datamodule's ``reference_dataloader(split)`` (every item)."""
        dm = self.trainer.datamodule
        if not hasattr(dm, "reference_dataloader"):
            raise ValueError(f"reference=precomputed needs a datamodule with reference_dataloader() "
                             f"(PreferenceDataModule, UnpairedPreferenceDataModule); {type(dm).__name__} has none: "
                             "use reference=on_the_fly")
        n = len(dm.split_dataset(split))
        table = torch.zeros(n, 2, dtype=torch.float32)
        for batch in dm.reference_dataloader(split):
            batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            logps = self.no_grad_logps(batch, reference=True).float().cpu().view(-1, 2)
            table[batch["pair_index"][0::2].cpu()] = logps
        self.reference_table[split] = table
        if hasattr(dm, "fingerprint"):
            self.reference_data[split] = dm.fingerprint(split)
        log.info("%s: reference log-probs precomputed for %d %s %s", type(self).__name__, n, split, self.item_name)

    def _check_reference_data(self, split: str) -> None:
        """Refuse a checkpoint's precomputed table for other items than the datamodule's (looked up by index, it
        would silently pair each example with another example's reference log-probs)."""
        dm = self.trainer.datamodule
        saved, now = self.reference_data.get(split), getattr(dm, "fingerprint", None)
        if saved is not None and now is not None and saved != now(split):
            raise ValueError(f"the checkpoint's precomputed reference log-probs were computed on other {split} {self.item_name} "
                             "than the datamodule holds: resume with the same --data files and tokenizer, or start a "
                             "new run")

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self) -> None:
        if self.reference_mode != "precomputed":
            return
        for split in ("fit", "validate"):
            if split in self.reference_table:  # a resume brings them from the checkpoint
                self._check_reference_data(split)
            else:
                self.precompute_reference(split)

    @override
    def on_validation_start(self) -> None:
        if self.reference_mode != "precomputed":
            return
        if "validate" in self.reference_table:
            self._check_reference_data("validate")
            return
        if self.reference is None:  # `validate` alone: the initial policy is gone, only a copy could stand in
            raise ValueError(f"{type(self).__name__}: the checkpoint holds no precomputed reference log-probs for "
                             f"validation {self.item_name} and a full fine-tune keeps no reference copy: validate with "
                             "reference=on_the_fly")
        self.precompute_reference("validate")

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_table:
            checkpoint["dpo_reference"] = {k: v.clone() for k, v in self.reference_table.items()}
            checkpoint["dpo_reference_data"] = dict(self.reference_data)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference_table = dict(checkpoint.get("dpo_reference") or {})
        self.reference_data = dict(checkpoint.get("dpo_reference_data") or {})


def interleave_rows(first: dict[str, Tensor], second: dict[str, Tensor]) -> dict[str, Tensor]:
    """Two sets of n right-padded rows (:data:`ROW_KEYS`) -> 2n rows ``first[0], second[0], first[1], ...``, padded
    to the longer width (padding: id 0, mask 0, label -100); shapes only, no host read."""
    width = max(first["input_ids"].shape[1], second["input_ids"].shape[1])
    out = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        a, b = (torch.nn.functional.pad(t[key], (0, width - t[key].shape[1]), value=fill) for t in (first, second))
        out[key] = torch.stack([a, b], dim=1).flatten(0, 1)
    return out
