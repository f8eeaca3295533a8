"""The training tasks (causal LM, classification, SFT, DPO, PPO, GRPO), user subclasses and the non-finite guard."""
