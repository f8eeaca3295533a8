"""The on-policy RL tasks: :class:`~.base.OnlineRLTask` (rollouts, scoring, the update loop) -> PPO (:mod:`.ppo`) and
GRPO (:mod:`.grpo`). Users import them from :mod:`lightning_llm.tasks`."""
