"""RLHF with PPO: rollouts from the policy, scores from a reward model or a Python callable, per-token KL-penalized
rewards, GAE, and several clipped PPO epochs per rollout batch (manual optimization).

One training step = one rollout batch (the datamodule's prompts, :class:`~lightning_llm.data.PromptDataModule`):

1. generate responses with the policy (left-padded prompts, KV cache, temperature / top-k / top-p; truncated at
   the first EOS), decode them and score them (optional penalty for responses without EOS, optional clipping);
2. one no-grad forward of the policy (+ value head) and of the reference model gives old log-probs, values and
   reference log-probs; rewards = ``-beta * KL`` per token with the score added at the last response token;
3. GAE (gamma, lambda) -> advantages (whitened) and returns (multi-turn episodes: over the policy's tokens, chained
   across the environment's, :func:`~lightning_llm.rl.losses.core.gae`);
4. ``ppo_epochs`` passes over ``num_mini_batches`` shuffled mini-batches: clipped policy loss + ``vf_coef`` x
   clipped value loss, gradient clipping, one optimizer step each; a mini-batch whose mean importance ratio
   exceeds ``ratio_threshold`` is skipped (on every rank) and counted.

Rollouts, the reference policy (:class:`~lightning_llm.rl.rollouts.reference.ReferencePolicy`: a frozen copy, or the policy
with its PEFT adapters off), the update loop and the data-parallel rules are shared with GRPO
(:class:`~lightning_llm.tasks.online.base.OnlineRLTask`); this module holds what is PPO's own: the value head, GAE and
the clipped value loss.

Every layout (:class:`~lightning_llm.tasks.online.base.OnlineRLTask`'s rules; under a pipeline the value head sits on
the last stage, and a separate ``critic_backbone`` is refused): every data-parallel replica rolls out its own
prompts; batch statistics (whitening, logged means, the KL
fed to the adaptive controller, the ratio-skip decision) are all-reduced, and losses are normalized by the global
token count, so 2 ranks x B prompts compute what one device computes on 2B prompts. All forwards run with dropout
off (eval mode), as PPO's importance ratio must be 1 before the first update.

``trainer.max_steps`` counts optimizer steps (Lightning's rule for manual optimization):
``rollouts x ppo_epochs x num_mini_batches`` minus skipped mini-batches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.peft import count_parameters
from lightning_llm.rl.config import PPOConfig, UpdateSchedule
from lightning_llm.rl.losses.core import (
    gae,
    kl_penalty,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from lightning_llm.rl.losses.kl_control import make_kl_controller
from lightning_llm.rl.rollouts.policy import ActorCritic, Rollout, response_logits, response_logprobs
from lightning_llm.tasks.online.base import OnlineRLTask

log = logging.getLogger(__name__)


class PPOTask(OnlineRLTask):
    """PPO fine-tuning of a decoder policy against a reward (see the module docstring). The backbone, PEFT,
    generation and reward arguments are :class:`~lightning_llm.tasks.online.base.OnlineRLTask`'s."""

    rl_state_key = "ppo_state"

    def __init__(
        self,
        backbone: str = "debug",
        *,
        critic_backbone: str | None = None,
        ppo: PPOConfig | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            backbone: The policy: a named decoder size or a local HF directory (e.g. an SFT export).
            critic_backbone: A separate critic trunk (named decoder size or HF directory); default: the value
                head sits on the policy's last hidden state. A reward model's HF directory (a
                ``...ForSequenceClassification`` with one output, e.g. ``lightning_llm export`` of a ``RewardTask``
                run) starts the value model from the reward model, its score head the value head (as OpenRLHF and
                trl do).
            ppo: PPO hyper-parameters.
        """
        super().__init__(backbone, **kwargs)
        self.save_hyperparameters()
        critic = Path(critic_backbone).expanduser() if critic_backbone else None
        if critic is not None and critic.exists() and not (critic / "config.json").is_file():
            raise ValueError(f"--model.critic_backbone={critic_backbone} is a training checkpoint, not an HF directory: "
                             "export a reward model first (lightning_llm export CKPT --to DIR) and start the value "
                             "model from DIR")
        self.critic_backbone = critic_backbone
        self.ppo = ppo or PPOConfig()
        self.kl_ctl = make_kl_controller(self.ppo.kl_coef, adaptive=self.ppo.adaptive_kl, target=self.ppo.kl_target,
                                         horizon=self.ppo.kl_horizon)

    @property
    @override
    def update_schedule(self) -> UpdateSchedule:
        cfg = self.ppo
        return UpdateSchedule(epochs=cfg.ppo_epochs, num_mini_batches=cfg.num_mini_batches,
                              max_grad_norm=cfg.max_grad_norm, ratio_threshold=cfg.ratio_threshold)

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_policy()
        self.reference_for(policy)  # before checkpointing wrappers patch forward()
        critic = None
        if self.critic_backbone is not None:
            critic = self.build_decoder(self.critic_backbone)
            critic.lm_head = None  # the trunk returns hidden states [B, S, H] (or a reward model's scores [B, S, 1])
            labels = critic.config.num_labels
            if labels > 1:
                raise ValueError(f"--model.critic_backbone={self.critic_backbone}: a sequence classifier with "
                                 f"num_labels={labels}; a value model starts from a reward model with one output")
        hidden = (critic if critic is not None else policy).config.hidden_size
        model = ActorCritic(self.checkpointed(policy), hidden_size=hidden,
                            critic=self.checkpointed(critic) if critic is not None else None)
        trainable, total = count_parameters(model)
        ref = self.reference.parameter_count()
        rank_zero_info(f"PPO: trainable params: {trainable:,} || actor-critic params: {total:,} || reference: "
                       + (f"frozen copy, {ref:,} params" if ref else "policy with adapters disabled, 0 extra params"))
        return model

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.capabilities.pipelined and self.critic_backbone is not None:
            raise ValueError(f"--model.critic_backbone={self.critic_backbone}: a separate critic trunk is not split into "
                             "pipeline stages; under pipeline parallelism the value head sits on the policy's last "
                             "hidden state (leave critic_backbone unset)")

    @override
    def policy_decoder(self) -> Any:
        runner = self.pipeline()
        # Under a pipeline the actor-critic's stages decode: asked for the policy's logits alone.
        return runner.decoder(values=False) if runner is not None else self.policy

    @override
    def call_policy(self, *args: Any, **kwargs: Any) -> Any:
        # Through a pipeline's stages the actor-critic is what runs: it is asked for the policy's output alone.
        if self.capabilities.pipelined and self.whole_copy(self.policy) is None:
            return self.run_model(*args, values=False, **kwargs)
        return super().call_policy(*args, **kwargs)

    @property
    @override
    def policy(self) -> nn.Module:
        assert self.model is not None
        return self.model.policy

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts held by the task: ``policy``, ``value`` (head + critic), ``reference`` (0 with PEFT)."""
        assert self.model is not None and self.reference is not None
        policy = count_parameters(self.model.policy)[1]
        return {"policy": policy, "value": count_parameters(self.model)[1] - policy,
                "reference": self.reference.parameter_count(), "total": count_parameters(self)[1]}

    # ------------------------------------------------------------------------------------------ rollout
    @override
    @torch.no_grad()
    def make_rollout(self, batch: dict[str, Any], *, greedy: bool = False) -> Rollout:
        """Generate, score, and compute old log-probs / values / reference log-probs (no rewards yet)."""
        assert self.model is not None
        s = self.sample(batch, greedy=greedy)
        m = s.response_mask.float()
        r = Rollout(**s.packed(), logprobs=m, ref_logprobs=m, values=m, scores=s.scores, samples=s)
        logprobs, values, _ = self._forward(r, s.temperature)
        r.logprobs, r.values = logprobs * m, values * m
        r.ref_logprobs = self.reference_logprobs(r, s.temperature) * m
        return r

    def _forward(self, r: Rollout, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
        """(log-probs, values, entropies) [b, N] of the responses under the current actor-critic (no gradient)."""
        return self._scored(self.run_model(r.query_responses, **self.scoring_kwargs(r, temperature)), r, temperature)

    def _scored(self, output: tuple[Any, Tensor], r: Rollout, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
        """The actor-critic's output on ``r`` -> (log-probs, values, entropies) [b, N]."""
        scores, values = output
        logprobs, entropy = response_logprobs(scores, r, temperature)
        return logprobs, response_logits(values, r.context_length), entropy

    @override
    @torch.no_grad()
    def compute_advantages(self, r: Rollout) -> dict[str, float]:
        """Scores -> penalized/clipped scores, per-token rewards, GAE advantages and returns (in place on ``r``).
        Returns the rollout's global statistics (objective/* and val/num_eos_tokens)."""
        cfg = self.ppo
        mask = r.response_mask
        if cfg.missing_eos_penalty is not None:
            r.scores = r.scores - cfg.missing_eos_penalty * (~r.has_eos).float()
        if cfg.score_clip is not None:
            r.scores = r.scores.clamp(-cfg.score_clip, cfg.score_clip)
        kl = kl_penalty(r.logprobs, r.ref_logprobs, cfg.kl_estimator) * mask
        rewards, non_score = per_token_rewards(kl, r.scores, mask, kl_coef=self.kl_ctl.value)
        reduce = self._all_sum if self._world() > 1 else None
        if cfg.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=reduce) * mask
        advantages, returns = gae(rewards, r.values, mask, gamma=cfg.gamma, lam=cfg.lam)
        if cfg.whiten_advantages:
            advantages = masked_whiten(advantages, mask, all_reduce=reduce) * mask
        r.rewards, r.advantages, r.returns = rewards, advantages, returns
        eos_ids = self._gen_config().eos_ids
        n_eos = torch.isin(r.responses, torch.tensor(eos_ids, device=self.device)).logical_and(mask).sum() \
            if eos_ids else 0.0
        total = self._global_sums({"kl": kl.sum(), "scores": r.scores.sum(), "non_score": non_score.sum(),
                                   "entropy": -(r.logprobs * mask).sum(), "tokens": mask.sum(), "eos": n_eos,
                                   "rows": r.scores.shape[0]})
        rows = max(total["rows"], 1.0)
        seq_kl, scores, non_score_mean = total["kl"] / rows, total["scores"] / rows, total["non_score"] / rows
        stats = {
            "objective/kl": seq_kl,
            "objective/entropy": total["entropy"] / rows,
            "objective/non_score_reward": non_score_mean,
            "objective/rlhf_reward": scores + non_score_mean,
            "objective/scores": scores,
            "objective/kl_coef": self.kl_ctl.value,
            "val/num_eos_tokens": total["eos"],
            "response_length": total["tokens"] / rows,
        }
        global_b = int(total["rows"])
        self.kl_ctl.update(seq_kl, global_b)  # same KL on every rank: the coefficient stays in step
        self.episodes += global_b
        return stats

    # ------------------------------------------------------------------------------------------ PPO update
    @override
    def minibatch_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.model is not None and mb.advantages is not None and mb.returns is not None
        cfg, mask = self.ppo, mb.response_mask
        # Global tokens of this mini-batch / world size: DDP's gradient mean then equals the global token mean.
        token_count = self._all_sum(mask.sum().float()) / self._world()
        temperature = self.generation.temperature if self.generation.do_sample else 1.0

        def loss_of(output: Any, rows: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
            # Divided by the global token count: shares of global sums, which add up over rows (micro-batches).
            m = rows.response_mask
            new_logprobs, vpred, entropy = self._scored(output, rows, temperature)
            pg_loss, stats = policy_loss(new_logprobs * m, rows.logprobs, rows.advantages, m,
                                         clip_range=cfg.clip_range, token_count=token_count)
            vf_loss, vf_clipfrac = value_loss(vpred * m, rows.values, rows.returns, m,
                                              clip_range_value=cfg.clip_range_value, token_count=token_count)
            stats = {**stats, "policy": pg_loss.detach(), "value": vf_loss.detach(), "vf_clipfrac": vf_clipfrac,
                     "entropy": (entropy * m).sum() / token_count}
            return pg_loss + cfg.vf_coef * vf_loss, stats

        return self.update_loss(mb, loss_of, temperature=temperature)

    @override
    def update_stats(self, avg: dict[str, float]) -> dict[str, float]:
        return {**super().update_stats(avg), "loss/value_avg": avg.get("value", 0.0),
                "val/clipfrac_avg": avg.get("vf_clipfrac", 0.0)}

    @override
    def step_loss_value(self, stats: dict[str, float]) -> float:
        return stats["loss/policy_avg"] + self.ppo.vf_coef * stats["loss/value_avg"]

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def rl_state(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    @override
    def load_rl_state(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Checkpoints written before the shared ReferencePolicy held the frozen copy as `ref_model.*`.
        sd = checkpoint.get("state_dict", {})
        for k in [k for k in sd if k.startswith("ref_model.")]:
            sd["reference.frozen." + k[len("ref_model."):]] = sd.pop(k)
        super().on_load_checkpoint(checkpoint)
