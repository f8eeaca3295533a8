"""The reference policy of PPO, DPO and GRPO, and the sequence log-probabilities they all compute.

The reference is the initial policy, frozen. Two ways to hold it, chosen by the policy itself:

* the policy has PEFT adapters (LoRA, IA3, ...): the reference is the same weights with the adapters switched off
  (peft's ``enable_adapters(False)``), so no second copy exists; prompt tuning: the wrapped base decoder;
* otherwise (a full fine-tune): a frozen deep copy, taken when the policy is built.

A reference that shares the policy's weights is called the way the policy is called (the task's ``run_model``,
which also runs a pipeline-split model), inside :func:`~lightning_llm.rl.rollouts.policy.adapters_disabled`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.peft.prompt import PromptLearningLM
from lightning_llm.rl.losses.core import logprobs_from_logits
from lightning_llm.rl.rollouts.policy import adapters_disabled, has_adapters

log = logging.getLogger(__name__)

__all__ = ["ReferencePolicy", "sequence_logprobs", "token_logprobs"]


class ReferencePolicy(nn.Module):
    """The frozen reference of a policy (see the module docstring). ``frozen`` is the copy, or ``None`` when the
    reference shares the policy's weights."""

    def __init__(self, frozen: nn.Module | None = None) -> None:
        super().__init__()
        self.frozen = frozen.requires_grad_(False) if frozen is not None else None

    @classmethod
    def for_policy(cls, policy: nn.Module) -> ReferencePolicy:
        """The reference of a freshly built ``policy``: shared weights when it has adapters (or is prompt-tuned),
        else a frozen copy (take it before activation checkpointing patches the blocks' ``forward``)."""
        if isinstance(policy, PromptLearningLM) or has_adapters(policy):
            return cls(None)
        return cls(copy.deepcopy(policy))

    @property
    def shares_policy(self) -> bool:
        """No second copy: the reference is the policy with its adapters off."""
        return self.frozen is None

    def parameter_count(self) -> int:
        """Parameters held by the reference itself (0 when it shares the policy's)."""
        return sum(p.numel() for p in self.frozen.parameters()) if self.frozen is not None else 0

    @torch.no_grad()
    def run(self, policy: nn.Module, call: Callable[..., Any], *args: Any,
            call_frozen: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
        """The reference's output for the model call ``call(*args, **kwargs)`` of ``policy`` (``call`` runs the
        policy: ``policy`` itself, or the task's ``run_model`` under a pipeline); ``call_frozen`` runs the frozen
        copy (the task's ``run_frozen``: through its pipeline stages when split), default: the copy itself."""
        if self.frozen is not None:
            return (call_frozen or self.frozen)(*args, **kwargs)
        if isinstance(policy, PromptLearningLM):
            return policy.base(*args, **kwargs)
        if not has_adapters(policy):
            raise RuntimeError("no reference model: the policy has neither a frozen copy nor adapters to disable")
        with adapters_disabled(policy):
            return call(*args, **kwargs)


def token_logprobs(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Log-probabilities [B, S] fp32 of ``labels`` [B, S] (already shifted: the label of position t is the token
    predicted by the logits at t) under ``logits`` [B, S, V]; 0 where the label is ``ignore_index``."""
    mask = labels != ignore_index
    return logprobs_from_logits(logits, labels.masked_fill(~mask, 0)) * mask


def sequence_logprobs(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """``(sum of the label tokens' log-probs [B], number of label tokens [B])`` of each row (fp32)."""
    mask = labels != ignore_index
    return token_logprobs(logits, labels, ignore_index=ignore_index).sum(-1), mask.sum(-1).float()
