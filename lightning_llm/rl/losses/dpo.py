"""Preference optimisation on pairs: the settings and the pure loss functions, with trl's definitions, except
``sigmoid`` with ``label_smoothing`` > 0: conservative DPO, which trl 1.16's ``sigmoid`` ignores (see below).

Notation for a batch of b preference pairs, all [b] fp32: ``pc``/``pr`` the policy's log-probabilities of the chosen /
rejected response given the prompt, summed over the response tokens (EOS or end-of-turn included); ``ac``/``ar``
the same averaged per response token; ``rc``/``rr`` the reference policy's (summed). With ``h = (pc - pr) - (rc - rr)``
(the DPO logit), ``uc = pc - rc`` and ``ur = pr - rr`` (the log-ratios), ``s`` = sigmoid, ``eps`` =
``label_smoothing``:

Losses that need a reference policy (trl's ``DPOTrainer``):

* ``sigmoid`` (Rafailov et al. 2023): ``-(1 - eps) log s(beta h) - eps log s(-beta h)``; eps > 0 is conservative DPO
  (cDPO, Mitchell 2023: each label flipped with probability eps), as trl's ``sigmoid`` before 1.0. trl 1.16's
  ``sigmoid`` ignores ``label_smoothing`` (its ``DPOConfig`` reads it for ``robust`` and ``exo_pair`` only): with
  eps > 0 this loss is not trl 1.16's, with eps = 0 it is;
* ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 beta))^2`` on length-averaged log-probabilities;
* ``hinge`` (SLiC): ``relu(1 - beta h)``;
* ``robust`` (rDPO, Chowdhury et al. 2024): ``(-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps)``;
* ``bco_pair``: ``-log s(beta uc) - log s(-beta ur)`` (trl >= 1.0: without BCO's running reward mean);
* ``apo_zero`` / ``apo_down`` (D'Oosterlinck et al. 2024): ``1 - s(beta uc) + s(beta ur)`` /
  ``s(beta uc) + 1 - s(beta (uc - ur))``;
* ``sppo_hard``: ``(uc - 1 / (2 beta))^2 + (ur + 1 / (2 beta))^2``;
* ``nca_pair``: ``-log s(beta uc) - log s(-beta uc) / 2 - log s(-beta ur) / 2``.

Implicit rewards ``beta uc`` and ``beta ur``.

Losses without a reference (no reference model is built, held or run; rewards ``beta ac`` and ``beta ar``):

* ``simpo`` (Meng et al. 2024; trl's ``CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``):
  ``-(1 - eps) log s(beta (ac - ar) - gamma) - eps log s(-(beta (ac - ar) - gamma))``, ``gamma`` = ``simpo_gamma``;
* ``orpo`` (Hong et al. 2024; trl's ``ORPOTrainer``): ``NLL - beta mean(log s(L))`` with the log odds ratio
  ``L = (ac - ar) - (log(1 - exp(ac)) - log(1 - exp(ar)))`` (a mean log-prob above ``-eps`` of its dtype, e.g. exactly
  0 where the model gives the response probability 1 to its precision, counts as ``-eps``: ``L`` stays finite, where
  trl's is infinite or NaN) and ``NLL`` the mean negative log-likelihood over every
  chosen-response token of the batch (trl's cross-entropy over the chosen rows; here the response tokens only, as
  the DPO losses score them). :func:`orpo_loss` takes the NLL's per-pair share ``-pc * P / T`` (``P`` pairs and
  ``T`` chosen tokens in the global batch), so the pair mean of its terms is the global batch's loss under any split.

``rewards/accuracies`` is the share of pairs whose chosen reward is strictly larger (ties, e.g. DPO's before the first
step, count as wrong, as in trl).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DPOConfig", "LENGTH_AVERAGED", "PreferenceStats", "REFERENCE_FREE", "dpo_loss", "log1mexp", "orpo_loss",
           "simpo_loss"]

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust", "bco_pair", "apo_zero", "apo_down", "sppo_hard",
                      "nca_pair", "simpo", "orpo"]
ReferenceMode = Literal["precomputed", "on_the_fly"]
LOSS_TYPES: tuple[str, ...] = DPOLossType.__args__  # type: ignore[attr-defined]
REFERENCE_FREE = frozenset({"simpo", "orpo"})
"""Loss types that use no reference policy (nothing built, precomputed or run for it)."""
LENGTH_AVERAGED = frozenset({"ipo", "simpo", "orpo"})
"""Loss types on log-probabilities averaged per response token (the others sum them)."""
_SMOOTHED = ("sigmoid", "robust", "simpo")
SIMPO_GAMMA = 0.5
"""trl's default SimPO target margin."""


@dataclass
class DPOConfig:
    """The preference loss and where the reference log-probabilities come from."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (IPO: the regularisation is ``1 / (2 beta)``; ORPO: the weight of
    the odds-ratio term)."""
    loss_type: DPOLossType = "sigmoid"
    """With a reference: ``sigmoid`` (DPO; with ``label_smoothing`` > 0 conservative DPO), ``ipo``, ``hinge``,
    ``robust``, ``bco_pair``, ``apo_zero``, ``apo_down``, ``sppo_hard``, ``nca_pair``. Without one (no reference model
    at all): ``simpo``, ``orpo``. Definitions: :mod:`lightning_llm.rl.losses.dpo`."""
    label_smoothing: float = 0.0
    """The assumed probability that a preference label is flipped (``sigmoid``: conservative DPO, cDPO, which trl
    1.16's ``sigmoid`` ignores; ``robust``; ``simpo``)."""
    simpo_gamma: float | None = None
    """SimPO's target reward margin ``gamma`` (``loss_type=simpo`` only; default 0.5, trl's)."""
    reference: ReferenceMode = "precomputed"
    """``precomputed``: the reference log-probs of every training and validation pair are computed once before the
    first step (with the initial policy, through whatever layout trains it, pipelines included) and kept in the
    checkpoint, so no reference copy is held; ``on_the_fly``: computed every step (a frozen copy for a full
    fine-tune, the policy with adapters off under PEFT). ``simpo`` and ``orpo`` use no reference."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--model.dpo.beta must be > 0, got {self.beta}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--model.dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"--model.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in _SMOOTHED:
            raise ValueError(f"--model.dpo.label_smoothing applies to loss_type {', '.join(_SMOOTHED)} only, not "
                             f"{self.loss_type}")
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ValueError(f"--model.dpo.simpo_gamma applies to loss_type=simpo only, not {self.loss_type}")
        if self.reference not in ("precomputed", "on_the_fly"):
            raise ValueError(f"--model.dpo.reference must be precomputed or on_the_fly, got {self.reference!r}")
        if self.reference == "on_the_fly" and not self.needs_reference:
            raise ValueError(f"--model.dpo.reference=on_the_fly: loss_type={self.loss_type} uses no reference model")

    @property
    def gamma(self) -> float:
        """SimPO's target margin in use (``simpo_gamma``, or trl's default)."""
        return SIMPO_GAMMA if self.simpo_gamma is None else self.simpo_gamma

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference policy (every loss type but ``simpo`` and ``orpo``)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def length_averaged(self) -> bool:
        """Whether the loss takes per-token averages of the log-probs (``ipo``, ``simpo``, ``orpo``)."""
        return self.loss_type in LENGTH_AVERAGED


# Saved in checkpoints' hyper-parameters; those written while the class lived in ``lightning_llm/rl/dpo.py`` name it
# there and still load weights_only.
torch.serialization.add_safe_globals([DPOConfig, (DPOConfig, "lightning_llm.rl.dpo.DPOConfig")])


@dataclass
class PreferenceStats:
    """Per-pair quantities [b] of one batch (detached), for logging; ``extra``: further per-pair values whose means
    are logged under their names (ORPO's ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``)."""

    chosen_rewards: Tensor
    rejected_rewards: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)

    def means(self) -> dict[str, Tensor]:
        """The logged batch means, by trl's names."""
        return {
            "rewards/chosen": self.chosen_rewards.mean(),
            "rewards/rejected": self.rejected_rewards.mean(),
            "rewards/accuracies": (self.chosen_rewards > self.rejected_rewards).float().mean(),
            "rewards/margins": (self.chosen_rewards - self.rejected_rewards).mean(),
            "logps/chosen": self.chosen_logps.mean(),
            "logps/rejected": self.rejected_logps.mean(),
            **{name: value.mean() for name, value in self.extra.items()},
        }


def _smoothed_sigmoid(logits: Tensor, eps: float) -> Tensor:
    return -F.logsigmoid(logits) * (1 - eps) - F.logsigmoid(-logits) * eps


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *,
             beta: float, loss_type: DPOLossType = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[Tensor, PreferenceStats]:
    """The mean loss over the b pairs of a loss with a reference, and their statistics (see the module docstring;
    inputs [b], already length-averaged for IPO)."""
    uc, ur = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    h = uc - ur
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid(beta * h, eps)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "robust":
        losses = (-F.logsigmoid(beta * h) * (1 - eps) + F.logsigmoid(-beta * h) * eps) / (1 - 2 * eps)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(beta * uc) - F.logsigmoid(-beta * ur)
    elif loss_type == "apo_zero":
        losses = 1 - torch.sigmoid(beta * uc) + torch.sigmoid(beta * ur)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(beta * uc) + 1 - torch.sigmoid(beta * h)
    elif loss_type == "sppo_hard":
        losses = (uc - 0.5 / beta) ** 2 + (ur + 0.5 / beta) ** 2
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(beta * uc) - 0.5 * F.logsigmoid(-beta * uc) - 0.5 * F.logsigmoid(-beta * ur)
    else:
        raise ValueError(f"dpo_loss: loss_type {loss_type!r} is not a loss with a reference")
    stats = PreferenceStats(chosen_rewards=(beta * uc).detach(), rejected_rewards=(beta * ur).detach(),
                            chosen_logps=policy_chosen.detach(), rejected_logps=policy_rejected.detach())
    return losses.mean(), stats


def simpo_loss(avg_chosen: Tensor, avg_rejected: Tensor, *, beta: float, gamma: float = SIMPO_GAMMA,
               label_smoothing: float = 0.0) -> tuple[Tensor, PreferenceStats]:
    """SimPO's mean loss over the b pairs from the length-averaged policy log-probs [b] (no reference)."""
    losses = _smoothed_sigmoid(beta * (avg_chosen - avg_rejected) - gamma, label_smoothing)
    return losses.mean(), _free_stats(avg_chosen, avg_rejected, beta)


_LN2 = math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, without cancellation: ``log(-expm1(x))`` near 0, ``log1p(-exp(x))`` below
    ``-log 2`` (Maechler 2012)."""
    near = x > -_LN2
    return torch.where(near, torch.log(-torch.expm1(x.clamp(min=-_LN2))),
                       torch.log1p(-torch.exp(x.clamp(max=-_LN2))))


def orpo_loss(avg_chosen: Tensor, avg_rejected: Tensor, nll_share: Tensor, *, beta: float
              ) -> tuple[Tensor, PreferenceStats]:
    """ORPO's loss from the length-averaged policy log-probs [b] and each pair's share of the chosen responses' NLL
    [b] (``-pc * P / T``: see the module docstring), as a mean over the b pairs (no reference)."""
    # log(1 - e^0) = -inf: a mean log-prob of 0 (probability 1 to the dtype's precision) counts as -eps
    ac, ar = (x.clamp(max=-torch.finfo(x.dtype).eps) for x in (avg_chosen, avg_rejected))
    log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
    ratio = F.logsigmoid(log_odds)
    stats = _free_stats(avg_chosen, avg_rejected, beta)
    stats.extra = {"nll_loss": nll_share.detach(), "log_odds_ratio": ratio.detach(),
                   "log_odds_chosen": log_odds.detach()}
    return (nll_share - beta * ratio).mean(), stats


def _free_stats(avg_chosen: Tensor, avg_rejected: Tensor, beta: float) -> PreferenceStats:
    return PreferenceStats(chosen_rewards=(beta * avg_chosen).detach(), rejected_rewards=(beta * avg_rejected).detach(),
                           chosen_logps=avg_chosen.detach(), rejected_logps=avg_rejected.detach())
