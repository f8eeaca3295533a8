"""GRPO (group relative policy optimisation, Shao et al. 2024, "DeepSeekMath"): on-policy RL without a critic.
Each prompt gets G sampled responses; a response's advantage is its reward relative to its group.

One training step = one rollout batch of B prompts per rank (:class:`~lightning_llm.data.PromptDataModule`):

1. sample G responses per prompt (``self.sample(batch, repeats=G)``; rows ``i*G .. i*G+G-1`` are prompt i's),
   decode and score them (``--model.reward.fn`` or ``--model.reward.model``; optional missing-EOS penalty);
2. one no-grad forward of the policy (eval mode) gives the old log-probs ``old`` [B*G, N], and the reference
   (frozen copy, or the policy with its PEFT adapters off) the reference log-probs ``ref`` [B*G, N];
3. group-relative advantages per response, broadcast to each of its tokens ([B*G] -> [B*G, N])::

       A_i = (r_i - mean(r_group)) / (std(r_group) + eps)        (unbiased std; scale_rewards=false: centre only)

4. ``epochs`` passes over ``num_mini_batches`` shuffled mini-batches of responses, one optimizer step each::

       ratio_t = exp(new_t - old_t)
       KL_t    = exp(ref_t - new_t) - (ref_t - new_t) - 1         (k3, >= 0; --model.grpo.kl_estimator)
       l_t     = -min(ratio_t * A, clip(ratio_t, 1 - eps_clip, 1 + eps_clip) * A) + beta * KL_t
       loss    = mean_i( sum_t l_it m_it / sum_t m_it )           (loss_type=grpo)
               | sum_it l_it m_it / sum_it m_it                   (loss_type=dapo: token mean of the mini-batch)

   with ``m`` the response mask [B*G, N] (tokens up to and including the first EOS) and ``new`` the log-probs
   of the current policy.

Every layout (:class:`~lightning_llm.tasks.online_rl.OnlineRLTask`'s rules): a prompt's G responses are sampled on
the data-parallel replica holding the prompt, so groups never straddle ranks and advantages need no communication. Sampling is seeded per prompt (seed,
rollout, prompt index), not per rank; logged statistics are all-reduced, and the loss is divided by the global
number of responses (grpo) or tokens (dapo) of the mini-batch over the replicas, so 2 replicas x B prompts compute
what one device computes on 2B prompts.

Logged per rollout: ``objective/scores`` (mean reward after the EOS penalty), ``reward_std`` (mean within-group
std), ``frac_reward_zero_std`` (groups whose rewards are all equal: no signal), ``objective/kl`` (mean per-token
KL_t of the rollout policy to the reference over response tokens), ``response_length``, ``episode`` (responses so
far); per update (averaged): ``loss/policy_avg`` (the loss), ``policy/kl_avg``, ``policy/clipfrac_avg``,
``policy/approxkl_avg``, ``policy/entropy_avg``, ``val/ratio``. ``trainer.max_steps`` counts optimizer steps:
rollouts x epochs x num_mini_batches.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.peft import count_parameters
from lightning_llm.rl.config import GRPOConfig
from lightning_llm.rl.core import (
    group_advantages,
    grpo_loss,
    kl_penalty,
)
from lightning_llm.rl.policy import Rollout
from lightning_llm.tasks.online_rl import OnlineRLTask, UpdateSchedule

log = logging.getLogger(__name__)

__all__ = ["GRPOTask"]


class GRPOTask(OnlineRLTask):
    """GRPO fine-tuning of a decoder policy against a reward (see the module docstring). The backbone, PEFT,
    generation and reward arguments are :class:`~lightning_llm.tasks.online_rl.OnlineRLTask`'s."""

    rl_state_key = "grpo_state"

    def __init__(self, backbone: str = "debug", *, grpo: GRPOConfig | None = None, **kwargs: Any) -> None:
        """
        Args:
            backbone: The policy: a named decoder size or a local HF directory (e.g. an SFT export).
            grpo: GRPO hyper-parameters (group size, clipping, KL coefficient, loss reduction).
        """
        super().__init__(backbone, **kwargs)
        self.save_hyperparameters()
        self.grpo = grpo or GRPOConfig()
        if not self.generation.do_sample:
            raise ValueError("--model.generation.do_sample=false: the G responses of a prompt would be identical "
                             "(zero advantages); GRPO samples its rollouts (validation decodes greedily anyway)")

    @property
    @override
    def update_schedule(self) -> UpdateSchedule:
        cfg = self.grpo
        return UpdateSchedule(epochs=cfg.epochs, num_mini_batches=cfg.num_mini_batches,
                              max_grad_norm=cfg.max_grad_norm, ratio_threshold=cfg.ratio_threshold)

    @property
    @override
    def rollouts_per_prompt(self) -> int:
        return self.grpo.num_generations

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_policy()
        self.reference_for(policy)  # before checkpointing wrappers patch forward()
        model = self.checkpointed(policy)
        trainable, total = count_parameters(model)
        ref = self.reference.parameter_count()
        rank_zero_info(f"GRPO: trainable params: {trainable:,} || policy params: {total:,} || reference: "
                       + (f"frozen copy, {ref:,} params" if ref else "policy with adapters disabled, 0 extra params"))
        return model

    def _logprobs(self, r: Rollout, temperature: float) -> tuple[Tensor, Tensor]:
        """(log-probs, entropies) [b, N] of the responses under the current policy (no gradient)."""
        output = self.call_policy(r.query_responses, **self.scoring_kwargs(r, temperature))
        return self.response_logprobs(output, r, temperature)

    # ------------------------------------------------------------------------------------------ rollout
    @override
    @torch.no_grad()
    def make_rollout(self, batch: dict[str, Any], *, greedy: bool = False) -> Rollout:
        """Sample G responses per prompt (1 when greedy), score them, and compute old and reference log-probs."""
        s = self.sample(batch, greedy=greedy, repeats=1 if greedy else self.grpo.num_generations,
                        seed_per_prompt=True)
        m = s.response_mask.float()  # [B*G, N]
        r = Rollout(query_responses=s.query_responses, attention_mask=s.attention_mask, position_ids=s.position_ids,
                    context_length=s.context_length, responses=s.responses, response_mask=s.response_mask,
                    has_eos=s.has_eos, logprobs=m, ref_logprobs=m, values=torch.zeros_like(m),  # no critic
                    scores=s.scores)
        r.logprobs = self._logprobs(r, s.temperature)[0] * m
        r.ref_logprobs = self.reference_logprobs(r, s.temperature) * m
        return r

    @override
    @torch.no_grad()
    def compute_advantages(self, r: Rollout) -> dict[str, float]:
        """Missing-EOS penalty, group-relative advantages (in place on ``r``, [B*G, N]); the rollout's global
        statistics."""
        cfg, g = self.grpo, self.grpo.num_generations
        mask = r.response_mask
        if r.scores.shape[0] % g:
            raise ValueError(f"{r.scores.shape[0]} responses do not form groups of --model.grpo.num_generations={g}")
        if cfg.missing_eos_penalty is not None:
            r.scores = r.scores - cfg.missing_eos_penalty * (~r.has_eos).to(r.scores.dtype)
        adv, std = group_advantages(r.scores, g, scale=cfg.scale_rewards, eps=cfg.eps)  # [B*G], [B]
        r.advantages = adv[:, None] * mask  # every token of a response carries its advantage
        tokens = mask.sum().float()
        kl = kl_penalty(r.logprobs, r.ref_logprobs, cfg.kl_estimator) * mask  # old policy vs reference
        b, groups = r.scores.shape[0], std.shape[0]
        stats = {
            "objective/scores": self._global_mean(r.scores.sum(), b),
            "reward_std": self._global_mean(std.sum(), groups),
            "frac_reward_zero_std": self._global_mean((std.abs() < 1e-8).sum(), groups),
            "objective/kl": self._global_mean(kl.sum(), tokens),
            "response_length": self._global_mean(tokens, b),
        }
        self.episodes += int(self._all_sum(torch.tensor(float(b), device=self.device)))
        return stats

    # ------------------------------------------------------------------------------------------ update
    @override
    def minibatch_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        assert mb.advantages is not None
        cfg, mask = self.grpo, mb.response_mask
        world = self._world()
        # Global responses / tokens of this mini-batch over the world size: DDP's gradient mean of the per-rank
        # losses is then the gradient of the global mini-batch's loss (ranks may hold different token counts).
        counts = self._all_sum(torch.stack([torch.tensor(float(mask.shape[0]), device=self.device),
                                            mask.sum().float()])) / world
        temperature = self.generation.temperature if self.generation.do_sample else 1.0

        def loss_of(output: Any, rows: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
            # Divided by the global counts: shares of global sums, which add up over rows (micro-batches).
            new_logprobs, entropy = self.response_logprobs(output, rows, temperature)
            m = rows.response_mask
            loss, stats = grpo_loss(new_logprobs * m, rows.logprobs, rows.ref_logprobs, rows.advantages, m,
                                    clip_range=cfg.clip_range, beta=cfg.beta, kl_estimator=cfg.kl_estimator,
                                    loss_type=cfg.loss_type, seq_count=counts[0], token_count=counts[1])
            stats["entropy"] = (entropy * m).sum() / counts[1]
            return loss, stats

        return self.update_loss(mb, loss_of, temperature=temperature)

    @override
    def update_stats(self, avg: dict[str, float]) -> dict[str, float]:
        return {**super().update_stats(avg), "policy/kl_avg": avg.get("kl", 0.0)}

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts held by the task: ``policy``, ``reference`` (0 with PEFT), ``total``."""
        assert self.model is not None and self.reference is not None
        return {"policy": count_parameters(self.model)[1], "reference": self.reference.parameter_count(),
                "total": count_parameters(self)[1]}
