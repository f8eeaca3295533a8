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

       ratio_t = exp(new_t - old_t)                               (sequence level, GSPO: exp(mean_t(new_t - old_t)))
       KL_t    = exp(ref_t - new_t) - (ref_t - new_t) - 1         (k3, >= 0; --model.grpo.kl_estimator)
       l_t     = -min(min(ratio_t, delta) * A, clip(ratio_t, 1 - eps_lo, 1 + eps_hi) * A) + beta * KL_t
               | -sg(min(ratio_t, 1 + eps_hi)) * A * new_t + beta * KL_t              (loss_type=cispo)
       loss    = mean_i( sum_t l_it m_it / sum_t m_it )           (loss_type=grpo)
               | sum_it l_it m_it / sum_it m_it                   (dapo, cispo: token mean of the mini-batch)
               | sum_it l_it m_it / (B*G x max_new_tokens)        (dr_grpo)

   with ``m`` the loss mask [B*G, N] (tokens up to and including the first EOS; with
   ``mask_truncated_completions`` none of a response that never emitted EOS) and ``new`` the log-probs of the
   current policy (:func:`~lightning_llm.rl.losses.core.grpo_loss`). At ``beta=0`` no reference is built or run.

Dynamic sampling (``dynamic_sampling``, DAPO) refills the batch the same way on every layout: the first round samples
the loader's prompts; while fewer informative groups (rewards not all equal) than the global batch's prompts were found
and rounds remain, every replica samples its share of the next global batch of refill prompts (one permutation of
the prompt file per rollout, seeded by (data seed, rollout), without the first round's prompts; shares by global
position as the sampler deals them); then every rank gathers all groups sampled, keeps the first informative ones in
(round, global position) order up to the global batch (topped up with uninformative ones when the rounds run out) and
takes its share by position. Responses are seeded per (prompt, rollout, round), so the kept set, its order and every
token are one device's (:func:`~lightning_llm.rl.rollouts.samples.select_groups`).

Every layout (:class:`~lightning_llm.tasks.online.base.OnlineRLTask`'s rules): a prompt's G responses are sampled on
the data-parallel replica holding the prompt, so groups never straddle ranks and advantages need no communication. Sampling is seeded per prompt (seed,
rollout, prompt index), not per rank; logged statistics are all-reduced, and the loss is divided by the global
number of responses (grpo) or tokens (dapo) of the mini-batch over the replicas, so 2 replicas x B prompts compute
what one device computes on 2B prompts.

Logged per rollout: ``objective/scores`` (mean reward after the EOS penalty), ``reward_std`` (mean within-group
std), ``frac_reward_zero_std`` (groups whose rewards are all equal: no signal; under dynamic sampling of every group
sampled, with ``sampling_rounds``), ``objective/kl`` (mean per-token KL_t of the rollout policy to the reference over
response tokens; not at beta 0), ``response_length``, ``episode`` (responses so far), ``rewards/<name>/mean|std``
per reward source; per update (averaged): ``loss/policy_avg`` (the loss), ``policy/kl_avg`` (beta > 0),
``policy/clipfrac_avg``,
``policy/approxkl_avg``, ``policy/entropy_avg``, ``val/ratio``. ``trainer.max_steps`` counts optimizer steps:
rollouts x epochs x num_mini_batches.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.peft import count_parameters
from lightning_llm.rl.config import GRPOConfig, UpdateSchedule
from lightning_llm.rl.losses.core import (
    group_advantages,
    grpo_loss,
    kl_penalty,
)
from lightning_llm.rl.rollouts.policy import Rollout, response_logprobs
from lightning_llm.rl.rollouts.samples import Samples, select_groups
from lightning_llm.tasks.online.base import OnlineRLTask

log = logging.getLogger(__name__)

__all__ = ["GRPOTask"]


class GRPOTask(OnlineRLTask):
    """GRPO fine-tuning of a decoder policy against a reward (see the module docstring). The backbone, PEFT,
    generation and reward arguments are :class:`~lightning_llm.tasks.online.base.OnlineRLTask`'s."""

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
        self._sampling_stats: dict[str, float] = {}  # dynamic sampling's statistics of the current rollout
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
        if self.grpo.beta != 0:  # beta 0: no KL term, so no reference model at all (trl's rule)
            self.reference_for(policy)  # before checkpointing wrappers patch forward()
        model = self.checkpointed(policy)
        trainable, total = count_parameters(model)
        ref = self.reference.parameter_count() if self.reference is not None else 0
        what = ("none (beta=0)" if self.reference is None else f"frozen copy, {ref:,} params" if ref
                else "policy with adapters disabled, 0 extra params")
        rank_zero_info(f"GRPO: trainable params: {trainable:,} || policy params: {total:,} || reference: {what}")
        return model

    def _logprobs(self, r: Rollout, temperature: float) -> tuple[Tensor, Tensor]:
        """(log-probs, entropies) [b, N] of the responses under the current policy (no gradient)."""
        output = self.call_policy(r.query_responses, **self.scoring_kwargs(r, temperature))
        return response_logprobs(output, r, temperature)

    # ------------------------------------------------------------------------------------------ rollout
    @override
    @torch.no_grad()
    def make_rollout(self, batch: dict[str, Any], *, greedy: bool = False) -> Rollout:
        """Sample G responses per prompt (1 when greedy; with dynamic sampling, more rounds), score them, and compute
        old and (beta > 0) reference log-probs."""
        cfg, g = self.grpo, self.grpo.num_generations
        self._sampling_stats = {}
        if cfg.dynamic_sampling and not greedy:
            s = self._dynamic_samples(batch)
        else:
            s = self.sample(batch, greedy=greedy, repeats=1 if greedy else g, seed_per_prompt=True)
        m = s.response_mask.float()  # [B*G, N]
        r = Rollout(**s.packed(), logprobs=m, ref_logprobs=None, values=torch.zeros_like(m),  # no critic
                    scores=s.scores, samples=s)
        if cfg.mask_truncated_completions:
            r.loss_mask = s.response_mask & s.has_eos[:, None]
        r.logprobs = self._logprobs(r, s.temperature)[0] * m
        if cfg.beta != 0:
            r.ref_logprobs = self.reference_logprobs(r, s.temperature) * m
        return r

    def _penalised(self, scores: Tensor, has_eos: Tensor) -> Tensor:
        """The scores the advantages are computed from: minus ``missing_eos_penalty`` where a response has no EOS."""
        penalty = self.grpo.missing_eos_penalty
        return scores if penalty is None else scores - penalty * (~has_eos).to(scores.dtype)

    def _informative(self, s: Samples) -> list[bool]:
        """Per prompt of ``s``: its group's (penalised) rewards are not all equal."""
        std = self._penalised(s.scores, s.has_eos).view(-1, self.grpo.num_generations).std(dim=1)
        return (std.abs() >= 1e-8).tolist()

    def _dynamic_samples(self, batch: dict[str, Any]) -> Samples:
        """DAPO's dynamic sampling, the same on every layout (see the module docstring)."""
        cfg, g = self.grpo, self.grpo.num_generations
        dm = self.trainer.datamodule
        if not (hasattr(dm, "datasets") and hasattr(dm, "collate")):
            raise ValueError("--model.grpo.dynamic_sampling=true samples more prompts from the datamodule's training "
                             "prompts: it needs a PromptDataModule")
        dp, rank = self._world(), self._dp_rank()
        first = self.sample(batch, repeats=g, seed_per_prompt=True)
        candidates = first.groups(g, draw=0, informative=self._informative(first))
        target = int(self._all_sum(torch.tensor(float(len(first.positions)), device=self.device)))
        rounds, refill = 1, None
        while rounds < cfg.max_sampling_rounds:
            found = self._all_sum(torch.tensor(float(sum(c.informative for c in candidates)), device=self.device))
            if int(found) >= target:
                break
            if refill is None:  # one permutation per rollout, without the first round's prompts (of every replica)
                used = set(self._gathered([c.index for c in candidates]))
                order = torch.randperm(len(dm.datasets["fit"]), generator=torch.Generator().manual_seed(
                    (int(dm.seed) * 1_000_003 + self.rollouts_done) % (2**63))).tolist()
                refill = [i for i in order if i not in used]
            chunk = refill[(rounds - 1) * target:rounds * target]
            if len(chunk) < target:  # the prompt file is used up for this rollout (on every rank alike)
                break
            mine = list(range(rank, target, dp))
            more = dm.collate([dm.datasets["fit"][chunk[p]] for p in mine])
            more.update(input_ids=more["input_ids"].to(self.device), attention_mask=more["attention_mask"].to(
                self.device))
            s = self.sample(more, repeats=g, seed_per_prompt=True, draw=rounds, positions=mine)
            candidates += s.groups(g, draw=rounds, informative=self._informative(s))
            rounds += 1
        every = [c for part in self._gathered_groups(candidates) for c in part]
        chosen = select_groups([(c.key, c.informative) for c in every], target)
        by_key = {c.key: c for c in every}
        gen = self._gen_config()
        out = Samples.of_groups([by_key[k] for k in chosen[rank::dp]], pad_id=gen.pad_token_id, eos_ids=gen.eos_ids,
                                temperature=first.temperature, device=self.device)
        out.positions = list(range(rank, target, dp))
        self._sampling_stats = {"frac_reward_zero_std": sum(not c.informative for c in every) / len(every),
                                "sampling_rounds": float(rounds)}
        return out

    def _gathered(self, values: list[int]) -> list[int]:
        """``values`` of every data-parallel replica, concatenated."""
        return [v for part in self._gathered_groups(values) for v in part]

    def _gathered_groups(self, obj: Any) -> list[Any]:
        """``obj`` of every data-parallel replica, in replica order (itself alone on one replica)."""
        if self._world() == 1:
            return [obj]
        every: list[Any] = [None] * self._world()
        dist.all_gather_object(every, obj, group=self.capabilities.data_parallel_group)
        return every

    @override
    @torch.no_grad()
    def compute_advantages(self, r: Rollout) -> dict[str, float]:
        """Missing-EOS penalty, group-relative advantages (in place on ``r``, [B*G, N]); the rollout's global
        statistics."""
        cfg, g = self.grpo, self.grpo.num_generations
        mask = r.response_mask
        if r.scores.shape[0] % g:
            raise ValueError(f"{r.scores.shape[0]} responses do not form groups of --model.grpo.num_generations={g}")
        r.scores = self._penalised(r.scores, r.has_eos)
        adv, std = group_advantages(r.scores, g, scale=cfg.scale_rewards, eps=cfg.eps)  # [B*G], [B]
        r.advantages = adv[:, None] * mask  # every token of a response carries its advantage
        kl = None if r.ref_logprobs is None else kl_penalty(r.logprobs, r.ref_logprobs, cfg.kl_estimator) * mask
        total = self._global_sums({"scores": r.scores.sum(), "std": std.sum(), "zero_std": (std.abs() < 1e-8).sum(),
                                   "tokens": mask.sum(), "rows": r.scores.shape[0], "groups": std.shape[0],
                                   **({"kl": kl.sum()} if kl is not None else {})})  # kl: old policy vs reference
        rows, groups = max(total["rows"], 1.0), max(total["groups"], 1.0)
        stats = {
            "objective/scores": total["scores"] / rows,
            "reward_std": total["std"] / groups,
            "frac_reward_zero_std": total["zero_std"] / groups,
            "response_length": total["tokens"] / rows,
            **self._sampling_stats,  # dynamic sampling: of every group sampled (already global)
        }
        if kl is not None:
            stats["objective/kl"] = total["kl"] / max(total["tokens"], 1.0)
        self.episodes += int(total["rows"])
        return stats

    # ------------------------------------------------------------------------------------------ update
    @override
    def minibatch_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        assert mb.advantages is not None
        cfg, mask = self.grpo, mb.trained_mask
        world = self._world()
        # Global responses / tokens of this mini-batch over the world size: DDP's gradient mean of the per-rank
        # losses is then the gradient of the global mini-batch's loss (ranks may hold different token counts).
        counts = self._all_sum(torch.stack([torch.tensor(float(mask.shape[0]), device=self.device),
                                            mask.sum().float()])).clamp(min=1) / world  # 0 trained tokens: 0
        temperature = self.generation.temperature if self.generation.do_sample else 1.0

        def loss_of(output: Any, rows: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
            # Divided by the global counts: shares of global sums, which add up over rows (micro-batches).
            new_logprobs, entropy = response_logprobs(output, rows, temperature)
            m = rows.trained_mask
            loss, stats = grpo_loss(new_logprobs * m, rows.logprobs * m, rows.ref_logprobs, rows.advantages, m,
                                    clip_range=cfg.clip_range, clip_range_high=cfg.clip_range_high, delta=cfg.delta,
                                    importance_sampling_level=cfg.importance_sampling_level, beta=cfg.beta,
                                    kl_estimator=cfg.kl_estimator, loss_type=cfg.loss_type,
                                    max_new_tokens=self.generation.max_new_tokens, seq_count=counts[0],
                                    token_count=counts[1])
            stats["entropy"] = (entropy * m).sum() / counts[1]
            return loss, stats

        return self.update_loss(mb, loss_of, temperature=temperature)

    @override
    def update_stats(self, avg: dict[str, float]) -> dict[str, float]:
        kl = {"policy/kl_avg": avg.get("kl", 0.0)} if self.grpo.beta != 0 else {}
        return {**super().update_stats(avg), **kl}

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts held by the task: ``policy``, ``reference`` (0 with PEFT or at beta 0), ``total``."""
        assert self.model is not None
        ref = self.reference.parameter_count() if self.reference is not None else 0
        return {"policy": count_parameters(self.model)[1], "reference": ref, "total": count_parameters(self)[1]}
