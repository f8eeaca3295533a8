"""PPO and GRPO hyper-parameters (names and defaults follow trl's ``PPOConfig`` / ``GRPOConfig`` where they have
the same knob), and the :class:`UpdateSchedule` the online RL tasks read from either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_llm.rl.losses.core import GRPO_LOSS_TYPES, IMPORTANCE_SAMPLING_LEVELS, KLEstimator

__all__ = ["GRPOConfig", "GRPOLossType", "ImportanceSamplingLevel", "PPOConfig", "UpdateSchedule"]


@dataclass
class PPOConfig:
    """Rollout post-processing and the PPO update."""

    ppo_epochs: int = 4
    """Passes over each rollout batch."""
    num_mini_batches: int = 1
    """Mini-batches (optimizer steps) per pass; the per-device rollout batch must be divisible by it."""
    clip_range: float = 0.2
    """Policy ratio clip epsilon."""
    clip_range_value: float = 0.2
    """Value clip: new values stay within this distance of the rollout's values."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """KL penalty coefficient (the initial one with ``adaptive_kl``)."""
    kl_estimator: KLEstimator = "k1"
    """Per-token KL estimator in the reward: ``k1`` (log-ratio), ``k2`` or ``k3``."""
    adaptive_kl: bool = False
    """Adapt ``kl_coef`` towards ``kl_target`` (Ziegler et al.)."""
    kl_target: float | None = None
    """Target sequence KL (nats) of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (samples) of the adaptive controller."""
    whiten_advantages: bool = True
    """Normalize advantages to zero mean, unit variance over the (global) rollout batch."""
    whiten_rewards: bool = False
    """Scale per-token rewards to unit variance (mean kept) before GAE."""
    score_clip: float | None = None
    """Clip sequence scores to ``[-score_clip, score_clip]``."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of responses that never emit EOS."""
    ratio_threshold: float | None = 10.0
    """Skip a mini-batch whose mean importance ratio exceeds this (counted in ``policy/skipped_minibatches``)."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm of every update."""

    def __post_init__(self) -> None:
        checks = {
            "ppo_epochs": self.ppo_epochs >= 1, "num_mini_batches": self.num_mini_batches >= 1,
            "clip_range": self.clip_range > 0, "clip_range_value": self.clip_range_value > 0,
            "vf_coef": self.vf_coef >= 0, "gamma": 0 <= self.gamma <= 1, "lam": 0 <= self.lam <= 1,
            "kl_coef": self.kl_coef >= 0, "kl_estimator": self.kl_estimator in ("k1", "k2", "k3"),
            "kl_horizon": self.kl_horizon >= 1,
            "score_clip": self.score_clip is None or self.score_clip > 0,
            "ratio_threshold": self.ratio_threshold is None or self.ratio_threshold > 1,
            "max_grad_norm": self.max_grad_norm is None or self.max_grad_norm > 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"--model.ppo.{bad[0]}={getattr(self, bad[0])!r} is out of range")
        if self.adaptive_kl and (self.kl_target is None or self.kl_target <= 0):
            raise ValueError("--model.ppo.kl_target must be > 0 when --model.ppo.adaptive_kl=true")

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.num_mini_batches


torch.serialization.add_safe_globals([PPOConfig])  # saved in checkpoints' hyper-parameters


GRPOLossType = Literal["grpo", "dapo", "dr_grpo", "cispo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
# GRPOConfig types them as str and checks them itself: an unknown value is then refused in one line naming the
# choices (jsonargparse's own Literal check prints a many-line union error).


@dataclass
class GRPOConfig:
    """Group sampling, group-relative advantages and the clipped GRPO update (no critic)."""

    num_generations: int = 8
    """G: responses sampled per prompt; advantages are relative to the prompt's group (G >= 2)."""
    epochs: int = 1
    """Passes over each rollout batch (trl's ``num_iterations``); with 1 pass and 1 mini-batch the ratio stays 1."""
    num_mini_batches: int = 1
    """Mini-batches (optimizer steps) per pass over the B x G responses of a rank."""
    clip_range: float = 0.2
    """Policy ratio clip epsilon (the lower one: the ratio is clipped to ``[1 - clip_range, 1 + clip_range_high]``;
    trl's ``epsilon``)."""
    clip_range_high: float | None = None
    """Upper clip epsilon (DAPO's clip-higher, 0.28 in the paper; trl's ``epsilon_high``); default ``clip_range``.
    ``cispo``: the importance weight is bounded by ``1 + clip_range_high`` (trl's ``epsilon_high`` is that bound)."""
    delta: float | None = None
    """Upper bound on the unclipped ratio, which binds where the advantage is negative (INTELLECT-2's two-sided
    clipping; trl's ``delta``); must exceed ``1 + clip_range_high``. Default: none."""
    importance_sampling_level: str = "token"
    """``token``: each token's ratio ``exp(new - old)``; ``sequence`` (GSPO, Zheng et al. 2025): a response's ratio is
    ``exp`` of the mean of its tokens' log-ratios, clipped per response (GSPO's ranges are ~3e-4 / 4e-4)."""
    beta: float = 0.04
    """Coefficient of the per-token KL to the reference in the loss. 0: no KL term, and no reference model is built
    or run (the run summary says ``reference: none``; ``objective/kl`` is not logged)."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator in the loss: ``k3`` = exp(ref - new) - (ref - new) - 1 (trl's), ``k1`` or ``k2``."""
    scale_rewards: bool = True
    """Divide the group-centred rewards by the group's (unbiased) std + ``eps``; false: centre only (Dr. GRPO)."""
    eps: float = 1e-4
    """Added to the group std before dividing (trl's 1e-4): a group of equal rewards gets zero advantages."""
    loss_type: str = "grpo"
    """``grpo``: each response's token mean, then the mean over responses; ``dapo``: the mean over every token of
    the global mini-batch (long responses weigh more; trl's default); ``dr_grpo``: the token sum over responses x
    ``max_new_tokens`` (a constant, Liu et al. 2025; usually with ``scale_rewards=false``); ``cispo`` (MiniMax-M1):
    the clipped, detached importance weight times the log-prob, token mean as ``dapo``."""
    mask_truncated_completions: bool = False
    """Responses that never emitted EOS (cut at ``max_new_tokens``) leave the loss (DAPO's overlong filtering; their
    scores still count in their group's advantages)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero std: no signal) are dropped and more prompts
    are sampled until the rollout batch is full or ``max_sampling_rounds`` is reached (then topped up with dropped
    groups). Logged: ``frac_reward_zero_std`` of every sampled group and ``sampling_rounds``."""
    max_sampling_rounds: int = 4
    """Most sampling rounds of a rollout under ``dynamic_sampling`` (the first one included)."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of responses that never emit EOS (before group normalisation)."""
    ratio_threshold: float | None = 10.0
    """Skip a mini-batch whose mean importance ratio exceeds this (counted in ``policy/skipped_minibatches``)."""
    max_grad_norm: float | None = 1.0
    """Clip the gradient norm of every update."""

    def __post_init__(self) -> None:
        checks = {
            "num_generations": self.num_generations >= 2, "epochs": self.epochs >= 1,
            "num_mini_batches": self.num_mini_batches >= 1, "clip_range": self.clip_range > 0,
            "clip_range_high": self.clip_range_high is None or self.clip_range_high > 0,
            "delta": self.delta is None or self.delta > 1 + (self.clip_range_high or self.clip_range),
            "beta": self.beta >= 0, "kl_estimator": self.kl_estimator in ("k1", "k2", "k3"), "eps": self.eps > 0,
            "loss_type": self.loss_type in GRPO_LOSS_TYPES,
            "importance_sampling_level": self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS,
            "max_sampling_rounds": self.max_sampling_rounds >= 1,
            "missing_eos_penalty": self.missing_eos_penalty is None or self.missing_eos_penalty >= 0,
            "ratio_threshold": self.ratio_threshold is None or self.ratio_threshold > 1,
            "max_grad_norm": self.max_grad_norm is None or self.max_grad_norm > 0,
        }
        why = {"num_generations": " (>= 2: a group of one has no relative advantage)",
               "loss_type": f" (one of {', '.join(GRPO_LOSS_TYPES)})",
               "importance_sampling_level": f" (one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)})",
               "delta": " (> 1 + clip_range_high: it bounds the ratio above the clip range)"}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"--model.grpo.{bad[0]}={getattr(self, bad[0])!r} is out of range{why.get(bad[0], '')}")

    @property
    def updates_per_rollout(self) -> int:
        return self.epochs * self.num_mini_batches


torch.serialization.add_safe_globals([GRPOConfig])  # saved in checkpoints' hyper-parameters


@dataclass(frozen=True)
class UpdateSchedule:
    """How a rollout batch is consumed: ``epochs`` passes of ``num_mini_batches`` optimizer steps."""

    epochs: int
    num_mini_batches: int
    max_grad_norm: float | None
    ratio_threshold: float | None

    @property
    def updates_per_rollout(self) -> int:
        return self.epochs * self.num_mini_batches
