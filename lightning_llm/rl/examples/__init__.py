"""The RL recipes' toy problems (``configs/grpo_math.yaml``, ``grpo_tools.yaml``, ``ppo_reward_model.yaml``): data
generators run as ``python -m lightning_llm.rl.examples.<name>``, and the tool and environment of the multi-turn
recipe."""
