"""Reward sources of the RL tasks: :class:`RewardConfig` (``--model.reward`` / ``--model.rewards``) and what it
builds: a callable given by import path (the rule-based ones built in: :mod:`~lightning_llm.rl.rewards.verifiers`) or
a reward model (:mod:`~lightning_llm.rl.rewards.model`); several, named and weighted: :mod:`~lightning_llm.rl.rewards.sources`.

The built-in callables are named ``lightning_llm.rl.rewards:<name>`` in configs (``--model.reward.fn``)."""

from lightning_llm.rl.rewards.config import RewardConfig, RewardFn, import_path, load_callable
from lightning_llm.rl.rewards.model import RewardModel, build_reward
from lightning_llm.rl.rewards.sources import RewardSource, RewardSources
from lightning_llm.rl.rewards.verifiers import CHAR_SETS, CharShareReward, FormatReward, MathAccuracy, SoftOverlong

__all__ = ["CHAR_SETS", "CharShareReward", "FormatReward", "MathAccuracy", "RewardConfig", "RewardFn", "RewardModel",
           "RewardSource", "RewardSources", "SoftOverlong", "build_reward", "import_path", "load_callable"]
