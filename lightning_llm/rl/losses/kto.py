"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) on unpaired feedback: the settings and the pure loss,
with trl's ``KTOTrainer`` definitions.

A batch holds n completions, each labelled desirable (thumbs up) or undesirable (thumbs down). With ``p``/``r`` the
policy's / reference's log-probability of a completion given its prompt (summed over its tokens, EOS or end-of-turn
included), ``u = p - r``, ``s`` = sigmoid and ``z`` the KL estimate below:

* ``kto``: a desirable completion costs ``desirable_weight (1 - s(beta (u - z)))``, an undesirable one
  ``undesirable_weight (1 - s(beta (z - u)))``;
* ``apo_zero_unpaired`` (APO-zero's unpaired form): ``desirable_weight (1 - s(beta u))`` and
  ``undesirable_weight s(beta u)`` (no KL term);

and the loss is the mean over the n completions. The reference point ``z`` estimates ``KL(policy || reference)``
from mismatched pairs: every example also carries its prompt with another example's completion, ``z`` is the mean
of ``p - r`` over those mismatched rows of the whole global batch, clamped at 0 and detached (no gradient flows
through it). Rewards: ``beta u``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["KTOConfig", "kto_loss"]

KTOLossType = Literal["kto", "apo_zero_unpaired"]


@dataclass
class KTOConfig:
    """The KTO loss and where the reference log-probabilities come from."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward ``beta (log policy - log reference)``."""
    desirable_weight: float = 1.0
    """Weight of the desirable (``label: true``) completions' losses (KTO's lambda_D)."""
    undesirable_weight: float = 1.0
    """Weight of the undesirable (``label: false``) completions' losses (KTO's lambda_U). The KTO paper recommends
    ``desirable_weight * n_desirable / (undesirable_weight * n_undesirable)`` in [1, 4/3]."""
    loss_type: KTOLossType = "kto"
    """``kto`` or ``apo_zero_unpaired`` (no KL term, so no mismatched rows are scored)."""
    reference: Literal["precomputed", "on_the_fly"] = "precomputed"
    """``precomputed``: the reference log-probs of every example (and of its mismatched row) are computed once before
    the first step with the initial policy, through the training layout, and kept in the checkpoint; ``on_the_fly``:
    computed every step (a frozen copy for a full fine-tune, the policy with adapters off under PEFT)."""

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"--model.kto.beta must be > 0, got {self.beta}")
        if self.desirable_weight <= 0 or self.undesirable_weight <= 0:
            raise ValueError(f"--model.kto.desirable_weight ({self.desirable_weight}) and undesirable_weight "
                             f"({self.undesirable_weight}) must be > 0")
        if self.loss_type not in ("kto", "apo_zero_unpaired"):
            raise ValueError(f"--model.kto.loss_type must be kto or apo_zero_unpaired, got {self.loss_type!r}")
        if self.reference not in ("precomputed", "on_the_fly"):
            raise ValueError(f"--model.kto.reference must be precomputed or on_the_fly, got {self.reference!r}")

    @property
    def uses_kl(self) -> bool:
        """Whether the loss has the KL reference point (``kto``)."""
        return self.loss_type == "kto"


# Saved in checkpoints' hyper-parameters; those written while the class lived in ``lightning_llm/rl/kto.py`` name it
# there and still load weights_only.
torch.serialization.add_safe_globals([KTOConfig, (KTOConfig, "lightning_llm.rl.kto.KTOConfig")])


def kto_loss(policy: Tensor, reference: Tensor, desirable: Tensor, kl: Tensor | float, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: KTOLossType = "kto"
             ) -> tuple[Tensor, Tensor]:
    """``(mean loss over the n completions, rewards [n] (detached))`` from the summed log-probs ``policy`` and
    ``reference`` [n], ``desirable`` [n] (bool or 0/1) and the KL estimate ``kl`` (a detached scalar, or [n] holding
    it per row; ignored by ``apo_zero_unpaired``). See the module docstring."""
    u = policy - reference
    good = desirable.bool()
    if loss_type == "kto":
        z = torch.as_tensor(kl, dtype=u.dtype, device=u.device).detach()
        desirable_loss, undesirable_loss = 1 - torch.sigmoid(beta * (u - z)), 1 - torch.sigmoid(beta * (z - u))
    elif loss_type == "apo_zero_unpaired":
        desirable_loss, undesirable_loss = 1 - torch.sigmoid(beta * u), torch.sigmoid(beta * u)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    losses = torch.where(good, desirable_weight * desirable_loss, undesirable_weight * undesirable_loss)
    return losses.mean(), (beta * u).detach()
