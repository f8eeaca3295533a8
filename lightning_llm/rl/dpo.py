"""Direct preference optimisation: its settings and the pure loss functions (sigmoid DPO, conservative DPO, IPO).

Notation for a batch of b preference pairs, all [b] fp32: ``pc``/``pr`` the policy's log-probabilities of the chosen /
rejected response given the prompt (summed over response tokens; IPO averages them over the tokens), ``rc``/``rr`` the
reference policy's. With ``h = (pc - pr) - (rc - rr)``:

* ``sigmoid`` (Rafailov et al. 2023): ``-log sigmoid(beta h)``; with ``label_smoothing = eps`` it is conservative DPO
  (cDPO, Mitchell 2023): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2`` on length-averaged log-probabilities.

Implicit rewards: ``beta (pc - rc)`` and ``beta (pr - rr)``; accuracy is the share of pairs whose chosen reward is
strictly larger (ties, e.g. before the first step, count as wrong, as in trl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPOConfig", "PreferenceStats", "dpo_loss"]

DPOLossType = Literal["sigmoid", "ipo"]
ReferenceMode = Literal["precomputed", "on_the_fly"]


@dataclass
class DPOConfig:
    """The preference loss and where the reference log-probabilities come from."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (IPO: the regularisation is ``1 / (2 beta)``)."""
    loss_type: DPOLossType = "sigmoid"
    """``sigmoid`` (DPO; with ``label_smoothing`` > 0 conservative DPO) or ``ipo``."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed probability that a preference label is flipped (sigmoid loss only)."""
    reference: ReferenceMode = "precomputed"
    """``precomputed``: the reference log-probs of every training and validation pair are computed once before the
    first step (with the initial policy, through whatever layout trains it, pipelines included) and kept in the
    checkpoint, so no reference copy is held; ``on_the_fly``: computed every step (a frozen copy for a full
    fine-tune, the policy with adapters off under PEFT)."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--model.dpo.beta must be > 0, got {self.beta}")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"--model.dpo.loss_type must be sigmoid or ipo, got {self.loss_type!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--model.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError("--model.dpo.label_smoothing applies to loss_type=sigmoid only")
        if self.reference not in ("precomputed", "on_the_fly"):
            raise ValueError(f"--model.dpo.reference must be precomputed or on_the_fly, got {self.reference!r}")


torch.serialization.add_safe_globals([DPOConfig])  # saved in checkpoints' hyper-parameters


@dataclass
class PreferenceStats:
    """Per-pair quantities [b] of one batch (detached), for logging."""

    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor

    def means(self) -> dict[str, Tensor]:
        """The logged batch means, by trl's names."""
        return {
            "rewards/chosen": self.chosen_rewards.mean(),
            "rewards/rejected": self.rejected_rewards.mean(),
            "rewards/accuracies": (self.chosen_rewards > self.rejected_rewards).float().mean(),
            "rewards/margins": (self.chosen_rewards - self.rejected_rewards).mean(),
            "logps/chosen": self.chosen_logps.mean(),
            "logps/rejected": self.rejected_logps.mean(),
        }


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *,
             beta: float, loss_type: DPOLossType = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[Tensor, PreferenceStats]:
    """The mean preference loss over the b pairs and their statistics (see the module docstring; inputs [b], already
    length-averaged for IPO)."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    stats = PreferenceStats(chosen_rewards=(beta * (policy_chosen - ref_chosen)).detach(),
                            rejected_rewards=(beta * (policy_rejected - ref_rejected)).detach(),
                            chosen_logps=policy_chosen.detach(), rejected_logps=policy_rejected.detach())
    return losses.mean(), stats
