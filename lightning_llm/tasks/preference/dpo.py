"""DPO and its variants (IPO, conservative DPO, hinge, robust, BCO, APO, SPPO, NCA; SimPO and ORPO without a reference)
on preference pairs, under every layout, through the declared task contract.

Both responses of a pair go through the model in ONE call: the batch of b pairs holds 2b interleaved rows
(:class:`~lightning_llm.data.PreferenceDataModule`: chosen, rejected, chosen, ...), :meth:`DPOTask.model_inputs`
passes them as one batch and :meth:`DPOTask.loss_from_output` pairs the rows' log-probabilities up again. So a
pipeline runs DPO micro-batch by micro-batch like any task (micro-batches of an even number of rows hold whole pairs),
tensor parallelism hands it full logits, and data parallelism shards pairs.

The reference log-probabilities (losses that have one) arrive in the batch (``ref_logps`` [2b], summed over response
tokens), precomputed before the first step or computed on the fly (:mod:`lightning_llm.tasks.preference.base`). ``simpo``
and ``orpo`` have none: no reference model is built, precomputed or run. ORPO's NLL term is a mean over the chosen
tokens of the global batch: each step first sums the global batch's chosen tokens and pairs (one collective over the
data-parallel replicas, nothing read back to the host) and hands every row ``nll_scale = pairs / tokens``, so each
pair's share of it is known in any micro-batch (validation: each batch's own tokens).

Logged per step (global over data-parallel replicas): ``train_loss``, ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (ORPO also ``nll_loss``,
``log_odds_ratio``, ``log_odds_chosen``); per validation epoch the same with a ``val_`` prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_llm.contract import replica_mean
from lightning_llm.rl.losses.dpo import DPOConfig, PreferenceStats, dpo_loss, orpo_loss, simpo_loss
from lightning_llm.tasks.preference.base import PreferenceTask

log = logging.getLogger(__name__)

__all__ = ["DPOConfig", "DPOTask"]

_STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected")
_ORPO_NAMES = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


class DPOTask(PreferenceTask):
    """Direct preference optimisation of a decoder policy and its variants (see the module docstring). The backbone
    and PEFT arguments are :class:`~lightning_llm.tasks.decoder.DecoderTask`'s."""

    item_name = "pairs"

    def __init__(self, backbone: str = "debug", *, dropout: float | None = 0.0, dpo: DPOConfig | None = None,
                 **kwargs: Any) -> None:
        """
        Args:
            backbone: The policy (and initial reference): a named decoder size or a local HF directory.
            dropout: Dropout of the policy in training (0 by default, as trl: with dropout the policy's and the
                reference's log-probs differ before any update).
            dpo: The loss (``beta``, ``loss_type``, ``label_smoothing``, ``simpo_gamma``) and the reference mode.
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.save_hyperparameters()
        self.dpo = dpo or DPOConfig()
        self._val_names = _STAT_NAMES + (_ORPO_NAMES if self.dpo.loss_type == "orpo" else ())
        self.val_stats = nn.ModuleDict({n.replace("/", "_"): MeanMetric() for n in self._val_names})

    @property
    @override
    def reference_mode(self) -> str | None:
        return self.dpo.reference if self.dpo.needs_reference else None

    # ------------------------------------------------------------------------------------------ loss
    @override
    def loss_from_output(self, output: Any, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, dict[str, Any]]:
        logps, counts = self.sequence_logps(output, batch["labels"])  # [2b] each: rows interleave chosen/rejected
        cfg = self.dpo
        if cfg.loss_type == "simpo":
            avg = logps / counts.clamp(min=1)
            loss, stats = simpo_loss(avg[0::2], avg[1::2], beta=cfg.beta, gamma=cfg.gamma,
                                     label_smoothing=cfg.label_smoothing)
        elif cfg.loss_type == "orpo":
            avg = logps / counts.clamp(min=1)
            nll_share = -logps[0::2] * batch["nll_scale"][0::2].to(logps)
            loss, stats = orpo_loss(avg[0::2], avg[1::2], nll_share, beta=cfg.beta)
        else:
            ref = batch["ref_logps"].to(logps)
            if cfg.length_averaged:  # IPO compares length-averaged log-probs
                logps, ref = logps / counts.clamp(min=1), ref / counts.clamp(min=1)
            loss, stats = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=cfg.beta,
                                   loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)
        return loss, {"chosen_rewards": stats.chosen_rewards, "rejected_rewards": stats.rejected_rewards,
                      "chosen_logps": stats.chosen_logps, "rejected_logps": stats.rejected_logps, **stats.extra}

    @override
    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float(batch["input_ids"].shape[0] // 2)  # the loss is a mean over pairs

    @override
    def _prepared(self, batch: dict[str, Tensor], split: str) -> dict[str, Tensor]:
        """The batch with what the loss needs besides the rows: the reference log-probs, ORPO's NLL scale."""
        if self.dpo.loss_type == "orpo":
            return {**batch, "nll_scale": self._nll_scale(batch, split)}
        if not self.dpo.needs_reference:
            return batch
        rows = batch["input_ids"].shape[0]
        if self.dpo.reference == "on_the_fly":
            return {**batch, "ref_logps": self.no_grad_logps(batch, reference=True)}
        pairs = self.reference_rows(split, batch["pair_index"])  # [2b, 2]: (chosen, rejected) per pair
        parity = torch.arange(rows, device=pairs.device) % 2  # 0 on chosen rows, 1 on rejected rows
        return {**batch, "ref_logps": pairs.gather(1, parity.unsqueeze(1)).squeeze(1)}

    def _nll_scale(self, batch: dict[str, Tensor], split: str) -> Tensor:
        """``pairs / chosen tokens`` [2b] of the global batch (training) or of this batch (validation)."""
        rows = batch["input_ids"].shape[0]
        tokens = (batch["labels"][0::2] != -100).sum().double()
        pairs = rows // 2
        if split == "fit":
            caps = self.capabilities
            per_pair, _ = replica_mean(caps.data_parallel_group, (tokens / pairs).reshape(1), pairs,
                                       dp=caps.data_parallel_size)
            tokens = per_pair[0].double() * pairs
        return (pairs / tokens.clamp(min=1)).float().expand(rows)

    # ------------------------------------------------------------------------------------------ steps
    @override
    def log_train_outputs(self, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        self.log_pair_means(_stats(outputs).means(), self.loss_weight(batch))

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
        return {f"val_{name}": self.val_stats[name.replace("/", "_")] for name in self._val_names}


def _stats(outputs: dict[str, Any]) -> PreferenceStats:
    return PreferenceStats(chosen_rewards=outputs["chosen_rewards"], rejected_rewards=outputs["rejected_rewards"],
                           chosen_logps=outputs["chosen_logps"], rejected_logps=outputs["rejected_logps"],
                           extra={k: outputs[k] for k in _ORPO_NAMES if k in outputs})
