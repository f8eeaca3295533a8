"""The RL and preference losses, pure functions of tensors: PPO and the GRPO loss family (:mod:`.core`), DPO and its
variants (:mod:`.dpo`), KTO (:mod:`.kto`), PPO's KL controllers (:mod:`.kl_control`)."""
