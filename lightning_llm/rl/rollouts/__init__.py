"""What a rollout is made of: the policy's side (:mod:`.policy`: the packed rollout, response logits, PPO's value
head), the reference policy (:mod:`.reference`), the sampled responses and their global order (:mod:`.samples`),
their seeding (:mod:`.seeding`), and the ``rollouts.jsonl`` log (:mod:`.rollout_log`)."""
