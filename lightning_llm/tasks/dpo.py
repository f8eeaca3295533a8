"""DPO (and IPO, conservative DPO) on preference pairs, under every layout, through the declared task contract.

Both responses of a pair go through the model in ONE call: the batch of b pairs holds 2b interleaved rows
(:class:`~lightning_llm.data.PreferenceDataModule`: chosen, rejected, chosen, ...), :meth:`DPOTask.model_inputs`
passes them as one batch and :meth:`DPOTask.loss_from_output` pairs the rows' log-probabilities up again. So a
pipeline runs DPO micro-batch by micro-batch like any task (micro-batches of an even number of rows hold whole pairs),
tensor parallelism hands it full logits, and data parallelism shards pairs.

The reference log-probabilities arrive in the batch (``ref_logps`` [2b], summed over response tokens), from either

* ``--model.dpo.reference=precomputed`` (default): before the first step every rank computes them for every training
  and validation pair with the initial policy through ``run_model`` (so under whatever layout trains it, pipelines
  included), in eval mode; they are kept in the checkpoint (a resume, also at another layout, reuses them). No
  reference copy is held;
* ``on_the_fly``: every step, from :class:`~lightning_llm.rl.reference.ReferencePolicy` (a frozen copy for a full
  fine-tune; the policy with its adapters off under PEFT, also through a pipeline).

Logged per step (global over data-parallel replicas): ``train_loss``, ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; per validation epoch the same with a
``val_`` prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_llm.contract import replica_mean
from lightning_llm.rl.dpo import DPOConfig, PreferenceStats, dpo_loss
from lightning_llm.rl.reference import ReferencePolicy, sequence_logprobs
from lightning_llm.tasks.decoder import DecoderTask

log = logging.getLogger(__name__)

__all__ = ["DPOTask"]

_STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")


class DPOTask(DecoderTask):
    """Direct preference optimisation of a decoder policy (see the module docstring). The backbone and PEFT
    arguments are :class:`~lightning_llm.tasks.decoder.DecoderTask`'s."""

    def __init__(self, backbone: str = "debug", *, dropout: float | None = 0.0, dpo: DPOConfig | None = None,
                 **kwargs: Any) -> None:
        """
        Args:
            backbone: The policy (and initial reference): a named decoder size or a local HF directory.
            dropout: Dropout of the policy in training (0 by default, as trl: with dropout the policy's and the
                reference's log-probs differ before any update).
            dpo: The loss (``beta``, ``loss_type``, ``label_smoothing``) and the reference mode.
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.save_hyperparameters()
        self.dpo = dpo or DPOConfig()
        self.reference_table: dict[str, Tensor] = {}  # split -> [pairs, 2] summed reference log-probs (precomputed)
        self.reference_data: dict[str, str] = {}  # split -> fingerprint of the pairs the table was computed on
        self.val_stats = nn.ModuleDict({n.replace("/", "_"): MeanMetric() for n in _STAT_NAMES})

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_policy()
        # PEFT: the reference is the policy with adapters off (no copy). A full fine-tune needs a frozen copy only
        # on the fly; precomputed log-probs come from the policy itself before its first update.
        if self.peft_config is not None or self.dpo.reference == "on_the_fly":
            self.reference = ReferencePolicy.for_policy(policy)
        return self.checkpointed(policy)

    @override
    def model_inputs(self, batch: dict[str, Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {"attention_mask": batch.get("attention_mask")}
        if self.uses_fused_loss():  # the model returns per-token cross-entropy [2b, S] instead of logits
            kwargs.update(labels=batch["labels"], reduction="none")
        return (batch["input_ids"],), kwargs

    def _sequence_logprobs(self, output: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """``(summed log-probs [2b], label tokens [2b])`` from the model's output: logits, or with the fused loss
        the per-token cross-entropy (0 where the label is ignored), whose negation is the token log-prob."""
        if self.uses_fused_loss():
            return -output.float().sum(-1), (labels != -100).sum(-1).float()
        return sequence_logprobs(output, labels)

    @override
    def loss_from_output(self, output: Any, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, dict[str, Any]]:
        logps, counts = self._sequence_logprobs(output, batch["labels"])  # [2b] each: rows interleave chosen/rejected
        ref = batch["ref_logps"].to(logps)
        if self.dpo.loss_type == "ipo":  # IPO compares length-averaged log-probs
            logps, ref = logps / counts.clamp(min=1), ref / counts.clamp(min=1)
        loss, stats = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=self.dpo.beta,
                               loss_type=self.dpo.loss_type, label_smoothing=self.dpo.label_smoothing)
        return loss, {"chosen_rewards": stats.chosen_rewards, "rejected_rewards": stats.rejected_rewards,
                      "chosen_logps": stats.chosen_logps, "rejected_logps": stats.rejected_logps}

    @override
    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float(batch["input_ids"].shape[0] // 2)  # the loss is a mean over pairs

    # ------------------------------------------------------------------------------------------ reference
    def _reference_logps(self, batch: dict[str, Tensor]) -> Tensor:
        """Summed reference log-probs [2b] of the batch's rows, computed now (eval mode, no grad)."""
        args, kwargs = self.model_inputs(batch, "reference")
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                if self.reference is not None:
                    output = self.run_reference(self.run_model, *args, **kwargs)
                else:  # precomputed for a full fine-tune: the policy itself, before any update
                    output = self.run_model(*args, **kwargs)
                output = output.full_tensor() if hasattr(output, "full_tensor") else output
                return self._sequence_logprobs(output, batch["labels"])[0]
        finally:
            self.train(was_training)

    def _with_reference(self, batch: dict[str, Tensor], split: str) -> dict[str, Tensor]:
        if self.dpo.reference == "on_the_fly":
            return {**batch, "ref_logps": self._reference_logps(batch)}
        table = self.reference_table.get(split)
        if table is None:
            raise RuntimeError(f"DPOTask: no precomputed reference log-probs for the {split} pairs")
        rows = table.to(batch["pair_index"].device)[batch["pair_index"]]  # [2b, 2]: (chosen, rejected) per pair
        return {**batch, "ref_logps": rows.gather(1, _row_parity(batch).unsqueeze(1)).squeeze(1)}

    def precompute_reference(self, split: str) -> None:
        """Fill ``reference_table[split]`` from the datamodule's ``reference_dataloader(split)`` (every pair)."""
        dm = self.trainer.datamodule
        if not hasattr(dm, "reference_dataloader"):
            raise ValueError(f"--model.dpo.reference=precomputed needs a datamodule with reference_dataloader() "
                             f"(PreferenceDataModule); {type(dm).__name__} has none: use --model.dpo.reference="
                             "on_the_fly")
        n = len(dm.split_dataset(split))
        table = torch.zeros(n, 2, dtype=torch.float32)
        for batch in dm.reference_dataloader(split):
            batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            logps = self._reference_logps(batch).float().cpu().view(-1, 2)
            table[batch["pair_index"][0::2].cpu()] = logps
        self.reference_table[split] = table
        if hasattr(dm, "fingerprint"):
            self.reference_data[split] = dm.fingerprint(split)
        log.info("DPO: reference log-probs precomputed for %d %s pairs", n, split)

    # ------------------------------------------------------------------------------------------ steps
    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        return super().training_step(self._with_reference(batch, "fit"), batch_idx)

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return super().validation_step(self._with_reference(batch, "validate"), batch_idx)

    @override
    def log_train_outputs(self, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        means = _stats(outputs).means()
        caps = self.capabilities
        pairs = self.loss_weight(batch)
        values, _ = replica_mean(caps.data_parallel_group, torch.stack(list(means.values())), pairs,
                                 dp=caps.data_parallel_size)
        for name, value in zip(means, values):
            self.log(name, value, on_step=True, on_epoch=False, batch_size=int(pairs))
            if name == "rewards/accuracies":
                self.progress_bar.show(self, "accuracy", value)

    @override
    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        if stage != "val":
            return
        pairs = self.loss_weight(batch)
        for name, value in _stats(outputs).means().items():
            self.val_stats[name.replace("/", "_")].update(value, pairs)

    @override
    def metric_collection(self, stage: str) -> dict[str, Any]:
        if stage != "val":
            return {}
        return {f"val_{name}": self.val_stats[name.replace("/", "_")] for name in _STAT_NAMES}

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self) -> None:
        if self.dpo.reference != "precomputed":
            return
        for split in ("fit", "validate"):
            if split in self.reference_table:  # a resume brings them from the checkpoint
                self._check_reference_data(split)
            else:
                self.precompute_reference(split)

    def _check_reference_data(self, split: str) -> None:
        """Refuse a checkpoint's precomputed table for other pairs than the datamodule's (looked up by index, it
        would silently pair each example with another example's reference log-probs)."""
        dm = self.trainer.datamodule
        saved, now = self.reference_data.get(split), getattr(dm, "fingerprint", None)
        if saved is not None and now is not None and saved != now(split):
            raise ValueError(f"the checkpoint's precomputed reference log-probs were computed on other {split} pairs "
                             "than the datamodule holds: resume with the same --data files and tokenizer, or start a "
                             "new run")

    @override
    def on_validation_start(self) -> None:
        if self.dpo.reference == "precomputed" and "validate" in self.reference_table:
            self._check_reference_data("validate")
        elif self.dpo.reference == "precomputed":
            if self.reference is None:  # `validate` alone: the initial policy is gone, only a copy could stand in
                raise ValueError("DPOTask: the checkpoint holds no precomputed reference log-probs for validation "
                                 "pairs and a full fine-tune keeps no reference copy: validate with "
                                 "--model.dpo.reference=on_the_fly")
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


def _row_parity(batch: dict[str, Tensor]) -> Tensor:
    """0 for chosen rows, 1 for rejected rows [2b] (the rows interleave)."""
    return torch.arange(batch["input_ids"].shape[0], device=batch["pair_index"].device) % 2


def _stats(outputs: dict[str, Any]) -> PreferenceStats:
    return PreferenceStats(chosen_rewards=outputs["chosen_rewards"], rejected_rewards=outputs["rejected_rewards"],
                           chosen_logps=outputs["chosen_logps"], rejected_logps=outputs["rejected_logps"])
