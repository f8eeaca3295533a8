"""KTO (and APO-zero unpaired) on thumbs-up/down feedback, under every layout, through the declared task contract.

The data (:class:`~lightning_llm.data.UnpairedPreferenceDataModule`): n examples per batch, each a prompt + completion
row labelled desirable or not, and its KL row (its prompt with another example's completion, the partner fixed when
the data are read). A training step:

1. the reference log-probs of both rows of every example (``apo_zero_unpaired``: of its own row only; the KL row's
   are never computed): precomputed before the first step (a table ``[examples, 2]`` kept in the checkpoint, NaN
   where never computed) or computed on the fly (the two rows interleaved in one reference call);
2. ``kto`` only: the KL reference point ``z``, from the policy's log-probs of the KL rows (a forward without
   gradients, in eval mode as the reference's: ``run_model``, so through the pipeline stages, tensor-parallel or
   ZeRO-3 shards of any layout) minus the reference's, averaged over the GLOBAL batch (one collective over the
   data-parallel replicas, nothing read back to the host), clamped at 0 and detached; handed to every row as
   ``kl`` [n], so each micro-batch of a pipeline sees the global value;
3. the one model call on the examples' rows and the loss (:func:`~lightning_llm.rl.losses.kto.kto_loss`, a mean over the
   examples, weighed by their count across replicas and micro-batches).

So 2 ranks x 4 examples train what one device trains on the same 8 (trl averages the per-device KL estimates, its
mismatched rows rotated inside each device batch). Validation computes ``z`` per batch (no collective).

Logged per step (global): ``train_loss``, ``rewards/chosen``, ``rewards/rejected`` (the mean implicit reward
``beta (log policy - log reference)`` of the desirable / undesirable examples; NaN for a batch without one of
them), ``rewards/margins`` (their difference), ``logps/chosen``, ``logps/rejected`` and ``kl``; per validation epoch
the same with a ``val_`` prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_llm.contract import replica_mean
from lightning_llm.rl.losses.kto import KTOConfig, kto_loss
from lightning_llm.tasks.preference.base import ROW_KEYS, PreferenceTask, interleave_rows

log = logging.getLogger(__name__)

__all__ = ["KTOConfig", "KTOTask"]

_CLASS_STATS = ("rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected")


class KTOTask(PreferenceTask):
    """KTO of a decoder policy on unpaired desirable / undesirable completions (see the module docstring). The
    backbone and PEFT arguments are :class:`~lightning_llm.tasks.decoder.DecoderTask`'s."""

    item_name = "examples"

    def __init__(self, backbone: str = "debug", *, dropout: float | None = 0.0, kto: KTOConfig | None = None,
                 **kwargs: Any) -> None:
        """
        Args:
            backbone: The policy (and initial reference): a named decoder size or a local HF directory.
            dropout: Dropout of the policy in training (0 by default, as trl).
            kto: The loss (``beta``, ``desirable_weight``, ``undesirable_weight``, ``loss_type``) and the reference
                mode.
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.save_hyperparameters()
        self.kto = kto or KTOConfig()
        self.val_stats = nn.ModuleDict({n.replace("/", "_"): MeanMetric() for n in (*_CLASS_STATS, "kl")})

    @property
    @override
    def reference_mode(self) -> str | None:
        return self.kto.reference

    @property
    @override
    def reference_columns(self) -> tuple[bool, bool]:
        return True, self.kto.uses_kl  # apo_zero_unpaired reads no KL row: its reference is never run

    # ------------------------------------------------------------------------------------------ loss
    @override
    def loss_from_output(self, output: Any, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, dict[str, Any]]:
        logps, _ = self.sequence_logps(output, batch["labels"])  # [n]
        cfg = self.kto
        loss, rewards = kto_loss(logps, batch["ref_logps"].to(logps), batch["desirable"], batch["kl"].to(logps),
                                 beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                                 undesirable_weight=cfg.undesirable_weight, loss_type=cfg.loss_type)
        return loss, {"rewards": rewards, "logps": logps.detach(), "desirable": batch["desirable"].float(),
                      "kl": batch["kl"].float()}

    @override
    def _prepared(self, batch: dict[str, Tensor], split: str) -> dict[str, Tensor]:
        """The examples' rows with ``desirable``, ``ref_logps`` [n] and ``kl`` [n] (see the module docstring)."""
        rows = {key: batch[key] for key in ROW_KEYS}
        kl_rows = {key: batch["kl_" + key] for key in ROW_KEYS}
        n = rows["input_ids"].shape[0]
        if self.kto.reference == "precomputed":
            ref = self.reference_rows(split, batch["example_index"])  # [n, 2]: (example, KL row; NaN unused)
        elif self.kto.uses_kl:
            ref = self.no_grad_logps(interleave_rows(rows, kl_rows), reference=True).view(n, 2)
        else:  # apo_zero_unpaired: the examples' rows alone
            ref = self.no_grad_logps(rows, reference=True).view(n, 1)
        kl = torch.zeros((), device=ref.device)
        if self.kto.uses_kl:
            local = (self.no_grad_logps(kl_rows, reference=False).to(ref) - ref[:, 1]).mean()
            if split == "fit":  # the global batch's mean over the data-parallel replicas
                caps = self.capabilities
                local = replica_mean(caps.data_parallel_group, local.reshape(1), n, dp=caps.data_parallel_size)[0][0]
            kl = local.clamp(min=0)
        return {**rows, "desirable": batch["desirable"], "example_index": batch["example_index"],
                "ref_logps": ref[:, 0].float(), "kl": kl.float().expand(n)}

    @override
    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float(batch["input_ids"].shape[0])  # the loss is a mean over the examples

    # ------------------------------------------------------------------------------------------ steps
    @override
    def log_train_outputs(self, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        good = outputs["desirable"].double()
        bad = 1 - good
        rewards, logps = outputs["rewards"].double(), outputs["logps"].double()
        # this replica's sums, summed over the replicas: (a mean over replicas of weight 1) x their number
        local = torch.stack([(rewards * good).sum(), (logps * good).sum(), good.sum(),
                             (rewards * bad).sum(), (logps * bad).sum(), bad.sum()])
        caps = self.capabilities
        means, replicas = replica_mean(caps.data_parallel_group, local, 1.0, dp=caps.data_parallel_size)
        sums = means.double() * replicas
        n_good, n_bad = sums[2], sums[5]
        values = {"rewards/chosen": sums[0] / n_good, "logps/chosen": sums[1] / n_good,
                  "rewards/rejected": sums[3] / n_bad, "logps/rejected": sums[4] / n_bad}
        values["rewards/margins"] = values["rewards/chosen"] - values["rewards/rejected"]
        values["kl"] = outputs["kl"][0].double()  # the global estimate, on every row
        n = int(self.loss_weight(batch))
        for name, value in values.items():
            self.log(name, value.float(), on_step=True, on_epoch=False, batch_size=n)

    @override
    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        if stage != "val":
            return
        good = outputs["desirable"]
        for name in _CLASS_STATS:
            weight = good if name.endswith("chosen") else 1 - good
            self.val_stats[name.replace("/", "_")].update(outputs[name.split("/")[0]], weight)
        self.val_stats["kl"].update(outputs["kl"][0], self.loss_weight(batch))

    @override
    def metric_collection(self, stage: str) -> dict[str, Any]:
        if stage != "val":
            return {}
        return {f"val_{name}": self.val_stats[name.replace("/", "_")] for name in (*_CLASS_STATS, "kl")}

    @override
    def on_validation_epoch_end(self) -> None:
        margin = self.val_stats["rewards_chosen"].compute() - self.val_stats["rewards_rejected"].compute()
        self.log("val_rewards/margins", margin, sync_dist=True)
        super().on_validation_epoch_end()

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self) -> None:
        counts = getattr(self.trainer.datamodule, "label_counts", None)
        if counts is not None:
            good, bad = counts("fit")
            cfg = self.kto
            ratio = cfg.desirable_weight * good / max(cfg.undesirable_weight * bad, 1e-12)
            if not 1 <= ratio <= 4 / 3:
                log.warning("KTO: desirable_weight x desirable examples / (undesirable_weight x undesirable examples)"
                            " = %.2f x %d / (%.2f x %d) = %.2f; the KTO paper recommends [1, 4/3]", cfg.desirable_weight,
                            good, cfg.undesirable_weight, bad, ratio)
        super().on_fit_start()
