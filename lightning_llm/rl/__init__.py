"""Reinforcement learning from feedback: PPO and the GRPO loss family (pure functions), KL controllers, reward sources
and verifiers, rollouts."""

from lightning_llm.rl.config import GRPOConfig, PPOConfig
from lightning_llm.rl.losses.core import (
    entropy_from_logits,
    gae,
    group_advantages,
    grpo_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from lightning_llm.rl.losses.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    make_kl_controller,
)
from lightning_llm.rl.rewards import (
    CharShareReward,
    FormatReward,
    MathAccuracy,
    RewardConfig,
    RewardModel,
    RewardSource,
    RewardSources,
    SoftOverlong,
    build_reward,
    load_callable,
)

__all__ = [
    "AdaptiveKLController", "CharShareReward", "FixedKLController", "FormatReward", "GRPOConfig", "MathAccuracy",
    "PPOConfig", "RewardConfig", "RewardModel", "RewardSource", "RewardSources", "SoftOverlong", "build_reward", "entropy_from_logits", "gae", "group_advantages", "grpo_loss", "kl_penalty",
    "load_callable", "logprobs_from_logits", "make_kl_controller", "masked_mean", "masked_var", "masked_whiten",
    "per_token_rewards", "policy_loss", "value_loss",
]
