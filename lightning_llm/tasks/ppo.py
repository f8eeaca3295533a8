"""RLHF with PPO: rollouts from the policy, scores from a reward model or a Python callable, per-token KL-penalized
rewards, GAE, and several clipped PPO epochs per rollout batch (manual optimization).

One training step = one rollout batch (the datamodule's prompts, :class:`~lightning_llm.data.PromptDataModule`):

1. generate responses with the policy (left-padded prompts, KV cache, temperature / top-k / top-p; truncated at
   the first EOS), decode them and score them (optional penalty for responses without EOS, optional clipping);
2. one no-grad forward of the policy (+ value head) and of the reference model gives old log-probs, values and
   reference log-probs; rewards = ``-beta * KL`` per token with the score added at the last response token;
3. GAE (gamma, lambda) -> advantages (whitened) and returns;
4. ``ppo_epochs`` passes over ``num_mini_batches`` shuffled mini-batches: clipped policy loss + ``vf_coef`` x
   clipped value loss, gradient clipping, one optimizer step each; a mini-batch whose mean importance ratio
   exceeds ``ratio_threshold`` is skipped (on every rank) and counted.

Reference model: a frozen copy of the initial policy, or -- when the policy has PEFT adapters -- the same weights
with the adapters switched off (prompt tuning: the wrapped base decoder), so no second copy is held.

Data parallel (``ddp``): every rank rolls out its own prompts; batch statistics (whitening, logged means, the KL
fed to the adaptive controller, the ratio-skip decision) are all-reduced, and losses are normalized by the global
token count, so 2 ranks x B prompts compute what one device computes on 2B prompts. All forwards run with dropout
off (eval mode), as PPO's importance ratio must be 1 before the first update.

``trainer.max_steps`` counts optimizer steps (Lightning's rule for manual optimization):
``rollouts x ppo_epochs x num_mini_batches`` minus skipped mini-batches.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.generation import GenerationConfig, generate, strip_after_eos
from lightning_llm.peft import (
    LoraArgs,
    PeftConfig,
    PromptTuningLM,
    apply_peft,
    count_parameters,
    enable_gradient_checkpointing,
)
from lightning_llm.rl.config import PPOConfig
from lightning_llm.rl.core import (
    entropy_from_logits,
    gae,
    kl_penalty,
    logprobs_from_logits,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from lightning_llm.rl.kl_control import make_kl_controller
from lightning_llm.rl.policy import (
    ActorCritic,
    Rollout,
    adapters_disabled,
    has_adapters,
    pack_responses,
    response_logits,
)
from lightning_llm.rl.rewards import RewardConfig, RewardModel, build_reward
from lightning_llm.tasks.base import OptimConfig
from lightning_llm.tasks.causal_lm import CausalLMTask

log = logging.getLogger(__name__)


class PPOTask(CausalLMTask):
    """PPO fine-tuning of a decoder policy against a reward (see the module docstring)."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        dropout: float | None = 0.0,
        model_overrides: dict[str, Any] | None = None,
        lora: LoraArgs | None = None,
        peft: PeftConfig | None = None,
        critic_backbone: str | None = None,
        gradient_checkpointing: bool = False,
        checkpoint_reentrant: bool = False,
        adapter_dir: str | None = None,
        generation: GenerationConfig | None = None,
        ppo: PPOConfig | None = None,
        reward: RewardConfig | None = None,
        generation_seed: int | None = None,
        optim: OptimConfig | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
    ) -> None:
        """
        Args:
            backbone: The policy: a named decoder size or a local HF directory (e.g. an SFT export).
            dropout: Dropout of the policy (forwards run in eval mode anyway).
            model_overrides: Extra ModelConfig fields for a named size (also used for a named critic).
            lora: LoRA on the policy; the reference is then the policy with the adapter disabled.
            peft: Any supported PEFT method for the policy.
            critic_backbone: A separate critic trunk (named decoder size or HF directory); default: the value
                head sits on the policy's last hidden state.
            gradient_checkpointing: Recompute block activations in backward.
            checkpoint_reentrant: Use torch's reentrant checkpointing.
            adapter_dir: Where to export the policy's adapter after ``fit``.
            generation: Rollout sampling (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``;
                EOS/pad default to the datamodule's tokenizer). Validation decodes greedily.
            ppo: PPO hyper-parameters.
            reward: The reward source (``reward.fn`` import path or ``reward.model``).
            generation_seed: Seed of rollout sampling (default: the global seed); rank r at rollout i draws
                from ``seed + 1_000_003 * i + r``, so resumed runs sample the same responses.
            optim: Optimizer and LR schedule (stepped after every optimizer step).
            nonfinite_loss: On a NaN/inf mini-batch loss or gradients: ``stop`` the run or ``skip`` the mini-batch.
        """
        super().__init__(backbone, dropout=dropout, model_overrides=model_overrides, lora=lora, peft=peft,
                         gradient_checkpointing=gradient_checkpointing, checkpoint_reentrant=checkpoint_reentrant,
                         adapter_dir=adapter_dir, optim=optim, nonfinite_loss=nonfinite_loss)
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.critic_backbone = critic_backbone
        self.generation = generation or GenerationConfig(max_new_tokens=32, do_sample=True)
        self.ppo = ppo or PPOConfig()
        self.reward_config = reward or RewardConfig()
        if (self.reward_config.fn is None) == (self.reward_config.model is None):
            raise ValueError("--model.reward: set exactly one of reward.fn (an import path) and reward.model "
                             "(a reward-model checkpoint or HF directory)")
        self.generation_seed = generation_seed
        self.kl_ctl = make_kl_controller(self.ppo.kl_coef, adaptive=self.ppo.adaptive_kl, target=self.ppo.kl_target,
                                         horizon=self.ppo.kl_horizon)
        self.ref_model: nn.Module | None = None
        self._reward: Any = None  # callable or RewardModel: deliberately not a submodule (not saved, not in DDP)
        self.rollouts_done = 0
        self.episodes = 0
        self.skipped_minibatches = 0

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_backbone(self.backbone, family="decoder", dropout=self.dropout, **self.model_overrides)
        hidden = policy.config.hidden_size
        if self.peft_config is None:
            # The reference is the initial policy; copied before checkpointing wrappers patch forward().
            self.ref_model = copy.deepcopy(policy).requires_grad_(False)
        else:
            policy = apply_peft(policy, self.peft_config)
        critic = None
        if self.critic_backbone is not None:
            critic = self.build_backbone(self.critic_backbone, family="decoder", dropout=self.dropout,
                                         **self.model_overrides)
            critic.lm_head = None  # the trunk returns hidden states [B, S, H]
            hidden_c = critic.config.hidden_size
        for m in (policy, critic):
            if m is not None and self.gradient_checkpointing:
                enable_gradient_checkpointing(m, use_reentrant=self.checkpoint_reentrant)
        model = ActorCritic(policy, hidden_size=hidden_c if critic is not None else hidden, critic=critic)
        trainable, total = count_parameters(model)
        ref = sum(p.numel() for p in self.ref_model.parameters()) if self.ref_model is not None else 0
        rank_zero_info(f"PPO: trainable params: {trainable:,} || actor-critic params: {total:,} || reference: "
                       + (f"frozen copy, {ref:,} params" if ref else "policy with adapters disabled, 0 extra params"))
        return model

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        world, replicas = self.trainer.world_size, self.data_parallel_size
        if self.capabilities.batch_shared:
            # Rollouts are sampled with a per-rank generator and every statistic is all-reduced over the world:
            # ranks that share a batch (tensor/pipeline parallel) would feed one sharded forward different tokens.
            raise ValueError(
                f"--trainer.strategy={type(self.trainer.strategy).__name__}: PPOTask needs every rank to be a "
                f"data-parallel replica ({world} ranks here, {replicas} replica(s)); use ddp, zero1/2/3 or "
                "deepspeed_zero1/2/3 (tensor and pipeline parallelism are not supported for PPO)")

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self._reward is None:
            self._reward = build_reward(self.reward_config)

    @property
    def policy(self) -> nn.Module:
        assert self.model is not None
        return self.model.policy

    def parameter_report(self) -> dict[str, int]:
        """Parameter counts held by the task: ``policy``, ``value`` (head + critic), ``reference`` (0 with PEFT)."""
        assert self.model is not None
        policy = count_parameters(self.model.policy)[1]
        return {"policy": policy, "value": count_parameters(self.model)[1] - policy,
                "reference": count_parameters(self.ref_model)[1] if self.ref_model is not None else 0,
                "total": count_parameters(self)[1]}

    # ------------------------------------------------------------------------------------------ distributed helpers
    def _world(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _all_sum(self, x: Tensor) -> Tensor:
        """Sum over data-parallel ranks (identity on one process)."""
        if self._world() == 1:
            return x
        x = x.detach().clone().float()
        dist.all_reduce(x)
        return x

    def _global_mean(self, total: Tensor, count: Tensor | float) -> float:
        both = self._all_sum(torch.stack([total.detach().float(), torch.as_tensor(count, device=total.device).float()]))
        return float(both[0] / both[1].clamp(min=1))

    # ------------------------------------------------------------------------------------------ rollout
    def _gen_config(self, *, greedy: bool = False) -> GenerationConfig:
        dm = self.trainer.datamodule if self._trainer is not None else None
        changes: dict[str, Any] = {}
        if self.generation.eos_token_id is None and getattr(dm, "eos_token_id", None) is not None:
            changes["eos_token_id"] = dm.eos_token_id
        if getattr(dm, "pad_token_id", None) is not None:
            changes["pad_token_id"] = dm.pad_token_id
        if greedy:
            changes.update(do_sample=False, num_beams=1)
        cfg = GenerationConfig(**{**self.generation.__dict__, **changes})
        if cfg.num_beams != 1:
            raise ValueError("--model.generation.num_beams must be 1 for PPO rollouts (responses are sampled)")
        return cfg

    def _decode(self, ids: list[int]) -> str:
        dm = self.trainer.datamodule
        tok = getattr(dm, "tokenizer", None)
        if tok is None:
            raise ValueError("PPOTask needs a datamodule with a tokenizer (e.g. PromptDataModule)")
        return tok.decode(ids, skip_special_tokens=True)

    def _generator(self) -> torch.Generator:
        seed = self.generation_seed if self.generation_seed is not None else torch.initial_seed()
        g = torch.Generator(device=self.device)
        rank = self.trainer.global_rank if self._trainer is not None else 0
        g.manual_seed((int(seed) + 1_000_003 * self.rollouts_done + rank) % (2**63))
        return g

    def score(self, prompts: list[str], responses: list[str]) -> Tensor:
        """Scores [B] fp32 on this device from the reward source."""
        out = self._reward(prompts, responses)
        scores = out.detach().float() if isinstance(out, Tensor) else torch.tensor([float(s) for s in out])
        if scores.shape != (len(responses),):
            raise ValueError(f"the reward returned shape {tuple(scores.shape)} for {len(responses)} responses")
        return scores.to(self.device)

    def _reference_logprobs(self, r: Rollout, temperature: float) -> Tensor:
        if self.ref_model is not None:
            return r.forward_logprobs(self.ref_model, temperature=temperature)
        policy = self.policy
        if isinstance(policy, PromptTuningLM):
            return r.forward_logprobs(policy.base, temperature=temperature)
        if not has_adapters(policy):
            raise RuntimeError("no reference model: the policy has neither a frozen copy nor adapters to disable")
        with adapters_disabled(policy):
            return r.forward_logprobs(policy, temperature=temperature)

    @torch.no_grad()
    def make_rollout(self, batch: dict[str, Any], *, greedy: bool = False) -> tuple[Rollout, list[str]]:
        """Generate, score, and compute old log-probs / values / reference log-probs (no rewards yet)."""
        assert self.model is not None
        cfg = self._gen_config(greedy=greedy)
        self.eval()  # dropout off for generation and every PPO forward (policy, value head, reference)
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        responses = generate(self.policy, prompt_ids, prompt_mask, config=cfg,
                             generator=None if greedy else self._generator())  # [B, N]
        qr, am, pos, rmask, has_eos = pack_responses(prompt_ids, prompt_mask, responses, cfg.eos_ids)
        p = prompt_ids.shape[1]
        temperature = cfg.temperature if cfg.do_sample else 1.0
        logits, values = self.model(qr, attention_mask=am, position_ids=pos)
        logprobs = logprobs_from_logits(response_logits(logits, p) / temperature, responses)
        values = values[:, p - 1:-1]
        texts = [self._decode(ids) for ids in strip_after_eos(responses, cfg.eos_ids)]
        scores = self.score(list(batch["prompt"]), texts)
        m = rmask.float()
        r = Rollout(query_responses=qr, attention_mask=am, position_ids=pos, context_length=p, responses=responses,
                    response_mask=rmask, has_eos=has_eos, logprobs=logprobs * m, ref_logprobs=logprobs * 0,
                    values=values * m, scores=scores)
        r.ref_logprobs = self._reference_logprobs(r, temperature) * m
        return r, texts

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
        b = r.scores.shape[0]
        seq_kl = self._global_mean(kl.sum(), b)
        scores = self._global_mean(r.scores.sum(), b)
        non_score_mean = self._global_mean(non_score.sum(), b)
        eos_ids = self._gen_config().eos_ids
        n_eos = torch.isin(r.responses, torch.tensor(eos_ids, device=self.device)).logical_and(mask).sum().float() \
            if eos_ids else torch.zeros((), device=self.device)
        stats = {
            "objective/kl": seq_kl,
            "objective/entropy": self._global_mean(-(r.logprobs * mask).sum(), b),
            "objective/non_score_reward": non_score_mean,
            "objective/rlhf_reward": scores + non_score_mean,
            "objective/scores": scores,
            "objective/kl_coef": self.kl_ctl.value,
            "val/num_eos_tokens": float(self._all_sum(n_eos)),
            "response_length": self._global_mean(mask.sum().float(), b),
        }
        global_b = int(self._all_sum(torch.tensor(float(b), device=self.device)))
        self.kl_ctl.update(seq_kl, global_b)  # same KL on every rank: the coefficient stays in step
        self.episodes += global_b
        return stats

    # ------------------------------------------------------------------------------------------ PPO update
    def _minibatch_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.model is not None and mb.advantages is not None and mb.returns is not None
        cfg, p = self.ppo, mb.context_length
        mask = mb.response_mask
        # Global tokens of this mini-batch / world size: DDP's gradient mean then equals the global token mean.
        token_count = self._all_sum(mask.sum().float()) / self._world()
        temperature = self.generation.temperature if self.generation.do_sample else 1.0
        logits, vpred = self.model(mb.query_responses, attention_mask=mb.attention_mask, position_ids=mb.position_ids)
        rl = response_logits(logits, p).float() / temperature
        new_logprobs = logprobs_from_logits(rl, mb.responses) * mask
        vpred = vpred[:, p - 1:-1] * mask
        pg_loss, stats = policy_loss(new_logprobs, mb.logprobs, mb.advantages, mask, clip_range=cfg.clip_range,
                                     token_count=token_count)
        vf_loss, vf_clipfrac = value_loss(vpred, mb.values, mb.returns, mask, clip_range_value=cfg.clip_range_value,
                                          token_count=token_count)
        with torch.no_grad():
            entropy = (entropy_from_logits(rl) * mask).sum() / token_count
        stats = {**stats, "policy": pg_loss.detach(), "value": vf_loss.detach(), "vf_clipfrac": vf_clipfrac,
                 "entropy": entropy}
        return pg_loss + cfg.vf_coef * vf_loss, stats

    def ppo_update(self, r: Rollout) -> dict[str, float]:
        """``ppo_epochs`` x ``num_mini_batches`` optimizer steps on rollout ``r``; returns averaged global stats."""
        opt = self.optimizers()
        sch = self.lr_schedulers()
        cfg = self.ppo
        world = self._world()
        b = r.query_responses.shape[0]
        g = torch.Generator().manual_seed(self.rollouts_done)
        sums: dict[str, float] = {}
        done = 0
        for _ in range(cfg.ppo_epochs):
            for idx in torch.tensor_split(torch.randperm(b, generator=g), cfg.num_mini_batches):
                loss, stats = self._minibatch_loss(r.select(idx.to(self.device)))
                # Local stats are this rank's share of the global token mean: sum over ranks / world = global mean.
                glob = self._all_sum(torch.stack(list(stats.values())).detach()) / world
                values = dict(zip(stats, glob.tolist()))
                if cfg.ratio_threshold is not None and values["ratio"] > cfg.ratio_threshold:
                    self.skipped_minibatches += 1
                    log.warning("PPO: mini-batch skipped, mean importance ratio %.3g > ratio_threshold %.3g",
                                values["ratio"], cfg.ratio_threshold)
                    continue
                if not self._loss_is_finite(loss):  # "stop" raises naming the step; "skip" counts it
                    self._on_nonfinite_loss(loss, self.rollouts_done)
                    self.skipped_minibatches += 1
                    continue
                opt.zero_grad()
                self.manual_backward(loss)
                if cfg.max_grad_norm is not None:
                    self.clip_gradients(opt, gradient_clip_val=cfg.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()
                if sch is not None:
                    sch.step()
                for k, v in values.items():
                    sums[k] = sums.get(k, 0.0) + v
                done += 1
        avg = {k: v / max(done, 1) for k, v in sums.items()}
        return {
            "policy/approxkl_avg": avg.get("approxkl", 0.0), "policy/clipfrac_avg": avg.get("clipfrac", 0.0),
            "policy/entropy_avg": avg.get("entropy", 0.0), "loss/policy_avg": avg.get("policy", 0.0),
            "loss/value_avg": avg.get("value", 0.0), "val/clipfrac_avg": avg.get("vf_clipfrac", 0.0),
            "val/ratio": avg.get("ratio", 1.0), "policy/skipped_minibatches": float(self.skipped_minibatches),
        }

    # ------------------------------------------------------------------------------------------ steps
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        start = time.perf_counter()
        rollout, _ = self.make_rollout(batch)
        stats = self.compute_advantages(rollout)
        rollout_s = time.perf_counter() - start
        stats.update(self.ppo_update(rollout))
        self.rollouts_done += 1
        stats.update({"episode": float(self.episodes), "time/rollout_s": rollout_s,
                      "time/update_s": time.perf_counter() - start - rollout_s,
                      "lr": float(self.optimizers().param_groups[0]["lr"])})
        for name, value in stats.items():  # already global means: identical on every rank
            self.log(name, value, on_step=True, on_epoch=False, prog_bar=name in ("objective/scores", "objective/kl"),
                     batch_size=rollout.scores.shape[0])
        loss = stats["loss/policy_avg"] + self.ppo.vf_coef * stats["loss/value_avg"]
        return torch.tensor(loss)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        rollout, _ = self.make_rollout(batch, greedy=True)
        scores = rollout.scores
        self.log("eval/scores", scores.mean(), on_epoch=True, sync_dist=True, prog_bar=True,
                 batch_size=scores.shape[0])
        return scores.mean()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Rollout/update timing is logged by :meth:`training_step` (the parent's token rate counts prompts only)."""

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def on_fit_start(self) -> None:
        if isinstance(self._reward, RewardModel):
            self._reward.to(self.device)
        dm = self.trainer.datamodule
        batch_size = getattr(dm, "batch_size", None)
        if batch_size is not None and batch_size < self.ppo.num_mini_batches:
            raise ValueError(f"--data.batch_size={batch_size} is smaller than --model.ppo.num_mini_batches="
                             f"{self.ppo.num_mini_batches}: every mini-batch needs at least one rollout")
        if getattr(self.trainer, "gradient_clip_val", None):
            raise ValueError("--trainer.gradient_clip_val does not apply to PPO (manual optimization): use "
                             "--model.ppo.max_grad_norm")

    @override
    def on_validation_start(self) -> None:
        if isinstance(self._reward, RewardModel):
            self._reward.to(self.device)

    @override
    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        # The schedule steps after every optimizer step. Bounded by max_steps, Lightning's estimate already counts
        # optimizer steps; bounded by epochs it counts rollouts, so scale it by the updates per rollout.
        if self._trainer is not None and (self.trainer.max_steps is None or self.trainer.max_steps < 0):
            total = int(self.trainer.estimated_stepping_batches) * self.ppo.updates_per_rollout
            sch = config["lr_scheduler"]["scheduler"]
            sch.lr_lambdas = [self.optim.lr_lambda(total)]
        return config

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo_state"] = {"kl_ctl": self.kl_ctl.state_dict(), "rollouts": self.rollouts_done,
                                   "episodes": self.episodes, "skipped_minibatches": self.skipped_minibatches}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("ppo_state")
        if state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
            self.rollouts_done, self.episodes = int(state["rollouts"]), int(state["episodes"])
            self.skipped_minibatches = int(state["skipped_minibatches"])

    @override
    def on_fit_end(self) -> None:
        # The parent exports the adapter of `self.model`: present it the policy alone (HF module names).
        model = self.model
        if model is None or self.peft_config is None:
            return
        self.model = model.policy
        try:
            super().on_fit_end()
        finally:
            self.model = model
