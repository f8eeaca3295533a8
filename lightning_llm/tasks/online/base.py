"""What PPO and GRPO share: sampling rollouts from the policy, scoring them, the reference policy, and the clipped
policy update (manual optimization, several epochs of shuffled mini-batches per rollout batch).

One training step = one rollout batch of the datamodule's prompts (:class:`~lightning_llm.data.PromptDataModule`):
:meth:`OnlineRLTask.make_rollout` (generate, score, old and reference log-probs), :meth:`compute_advantages`
(the algorithm's), then :meth:`policy_update` calls the algorithm's :meth:`minibatch_loss` per mini-batch.

Every layout: data-parallel replicas roll out their own prompts and every statistic is summed over the
data-parallel group; the ranks of one replica (tensor- or pipeline-parallel) draw the same tokens from one generator
seeded by the replica. Under a pipeline, rollouts decode through the stages (``decoding_model``), the no-grad
forwards are forward-only pipeline passes (``run_model``) and each optimizer step's forward and backward runs
micro-batch by micro-batch (``PipelineRunner.train_additive``: the losses are shares of global sums, so they add
up). All forwards run with dropout off (eval mode): the importance ratio must be 1 before the first update. ``trainer.max_steps`` counts optimizer steps (Lightning's rule for manual optimization).

Rewards: one or several named, weighted sources (:mod:`lightning_llm.rl.rewards.sources`), each called with the prompts, the
responses and the prompt records' columns (which travel with their prompts in the batch on every layout); logged per
rollout: ``objective/scores`` (the weighted sum) and ``rewards/<name>/mean``, ``rewards/<name>/std`` per source (over
every replica's responses). ``--model.log_rollouts=true`` writes every trained response to ``rollouts.jsonl``
(:mod:`lightning_llm.rl.rollouts.rollout_log`).

Multi-turn rollouts (``--model.env``, ``--model.tools``: :mod:`lightning_llm.rl.multiturn`): a rollout's responses are
episodes, conversations of the policy with an environment or its tools decoded turn by turn with the KV cache kept;
the loss, KL and entropy count the policy's own tokens only (:mod:`lightning_llm.rl.multiturn.episodes`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.generation import GenerationConfig, for_datamodule, generate, strip_after_eos
from lightning_llm.rl.config import UpdateSchedule
from lightning_llm.rl.multiturn.env import EnvConfig
from lightning_llm.rl.multiturn.multi_turn import MultiTurn
from lightning_llm.rl.rewards import RewardConfig
from lightning_llm.rl.rewards.sources import RewardSource, RewardSources, columns_by_name, source_configs
from lightning_llm.rl.rollouts.policy import Packed, Rollout
from lightning_llm.rl.rollouts.reference import ReferencePolicy
from lightning_llm.rl.rollouts.rollout_log import TAKEN_FIELDS, RolloutLog, rollout_records
from lightning_llm.rl.rollouts.samples import Samples
from lightning_llm.rl.rollouts.seeding import prompt_uniforms, rank_generator, rollout_seed
from lightning_llm.tasks.decoder import DecoderTask
from lightning_llm.tasks.preference.reward import build_reward_source

log = logging.getLogger(__name__)

__all__ = ["OnlineRLTask", "Samples"]


def _unpadded(ids: Tensor, mask: Tensor) -> list[list[int]]:
    """Each row of ``ids`` [B, L] where ``mask`` [B, L] is set, as host lists (two host reads in all, not per row)."""
    return [[t for t, keep in zip(row, m) if keep] for row, m in zip(ids.tolist(), mask.bool().tolist())]


class OnlineRLTask(DecoderTask):
    """Base of the on-policy RL tasks (see the module docstring). Subclasses implement :meth:`make_rollout`,
    :meth:`compute_advantages`, :meth:`minibatch_loss` and :attr:`update_schedule`."""

    rl_state_key = "rl_state"
    """Checkpoint entry of the loop counters (and :meth:`rl_state` extras)."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        dropout: float | None = 0.0,
        generation: GenerationConfig | None = None,
        reward: RewardConfig | None = None,
        rewards: list[RewardConfig] | None = None,
        log_rollouts: bool = False,
        generation_seed: int | None = None,
        env: EnvConfig | None = None,
        tools: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            backbone: The policy: a named decoder size or a local HF directory (e.g. an SFT export). With PEFT
                the reference is the policy with the adapter disabled, otherwise a frozen copy.
            dropout: Dropout of the policy (forwards run in eval mode anyway).
            generation: Rollout sampling (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``;
                EOS/pad default to the datamodule's tokenizer). Validation decodes greedily.
            reward: The reward source (``reward.fn`` import path or ``reward.model``).
            rewards: Several reward sources (each a function or one reward model, with a ``name`` and a ``weight``):
                a response's score is the weighted sum of the sources that scored it (a function's ``None`` leaves a
                sample to the others). Used beside ``reward`` when both are given (``reward`` first).
            log_rollouts: Write every trained response to ``rollouts.jsonl`` in the run's log directory (beside
                ``metrics.csv``; rank 0, gathered from every replica, in the global prompt order).
            generation_seed: Seed of rollout sampling (default: the global seed); rank r at rollout i draws
                from ``seed + 1_000_003 * i + r``, so resumed runs sample the same responses. Tasks that sample
                per prompt (GRPO) seed each prompt from (seed, rollout, prompt index) instead: the same responses at
                any number of devices.
            env: A multi-turn environment (``env.cls``, a class with ``reset(record)`` and ``step(messages)``; its
                ``kwargs``) and the limits of an episode (``max_turns``, ``max_total_tokens``, ``step_timeout``,
                ``tool_format``); its step rewards add to the reward sources' score (which become optional).
            tools: Tools the policy may call (``pkg.module:function`` import paths: type-hinted functions with a
                docstring), their schemas in the chat template; each call's result appended as a ``tool`` message
                (the limits of ``env``).
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.automatic_optimization = False
        self.generation = generation or GenerationConfig(max_new_tokens=32, do_sample=True)
        self.multi_turn = MultiTurn(env, tools)  # the class and tools checked here, before training
        self.reward_configs = source_configs(reward, rewards, optional=self.multi_turn.cls is not None)
        taken = [cfg.source_name for _, cfg in self.reward_configs if cfg.source_name in TAKEN_FIELDS]
        if taken:
            raise ValueError(f"a reward source is named {taken[0]!r}, a field of every rollout record: give it "
                             "another --model.rewards[i].name")
        self.reward_config = self.reward_configs[0][1] if self.reward_configs else None
        self.log_rollouts = log_rollouts
        self._rollout_log: RolloutLog | None = None
        self.generation_seed = generation_seed
        self._reward: RewardSources | None = None  # deliberately not a submodule (not saved, not in DDP)
        self.rollouts_done = 0
        self.episodes = 0
        self.skipped_minibatches = 0

    @property
    @override
    def manual_clip_norm(self) -> float | None:
        return self.update_schedule.max_grad_norm

    # ------------------------------------------------------------------------------------------ to implement
    @property
    def update_schedule(self) -> UpdateSchedule:
        raise NotImplementedError

    def make_rollout(self, batch: dict[str, Any], *, greedy: bool = False) -> Rollout:
        raise NotImplementedError

    def compute_advantages(self, r: Rollout) -> dict[str, float]:
        """Fill ``r.advantages`` (and what the loss needs); return the rollout's global statistics."""
        raise NotImplementedError

    def minibatch_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of a mini-batch and this rank's share of its global statistics (must include ``ratio``)."""
        raise NotImplementedError

    def update_stats(self, avg: dict[str, float]) -> dict[str, float]:
        """Logged names of the averaged mini-batch statistics."""
        return {"policy/approxkl_avg": avg.get("approxkl", 0.0), "policy/clipfrac_avg": avg.get("clipfrac", 0.0),
                "policy/entropy_avg": avg.get("entropy", 0.0), "loss/policy_avg": avg.get("policy", 0.0),
                "val/ratio": avg.get("ratio", 1.0), "policy/skipped_minibatches": float(self.skipped_minibatches)}

    def rl_state(self) -> dict[str, Any]:
        """Extra state the algorithm checkpoints (e.g. PPO's KL controller)."""
        return {}

    def load_rl_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rl_state`."""

    # ------------------------------------------------------------------------------------------ model
    def reference_for(self, policy: Any) -> ReferencePolicy:
        """Build the reference of a freshly built policy (kept on the task as ``self.reference``)."""
        self.reference = ReferencePolicy.for_policy(policy)
        return self.reference

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self._reward is None:
            env = self.multi_turn.reward_source()
            self._reward = RewardSources([RewardSource(cfg.source_name, build_reward_source(cfg), weight=cfg.weight)
                                          for _, cfg in self.reward_configs] + ([env] if env is not None else []))

    @property
    def reward_sources(self) -> RewardSources:
        """The run's reward sources (built with the model)."""
        assert self._reward is not None, "configure_model() builds the reward sources"
        return self._reward

    def _ready_reward(self) -> None:
        """A reward model on this device, its data-parallel ranks told to run the same number of forwards."""
        model = self.reward_sources.model
        if model is not None:
            model.to(self.device)
            model.lockstep = self.capabilities.data_parallel_group if self._world() > 1 else None

    @override
    def scoring_models(self) -> dict[str, nn.Module]:
        """The reward model, where a source is one (placed by tensor parallelism and ZeRO-3 like the policy)."""
        model = self._reward.model if self._reward is not None else None
        return {"reward": model.model} if model is not None else {}

    def run_summary_lines(self) -> list[str]:
        """Lines the run summary adds for this task: the reward sources and the reference policy."""
        sources = ", ".join(f"{s.name} (weight {s.weight:g})" for s in self.reward_sources.sources)
        ref = self.reference
        what = ("none" if ref is None else "policy with adapters disabled (no copy)" if ref.shares_policy
                else f"frozen copy, {ref.parameter_count():,} params")
        return [f"rewards: {sources}", f"reference: {what}", *self.multi_turn.summary_lines()]

    # ------------------------------------------------------------------------------------------ distributed helpers
    def _world(self) -> int:
        """Data-parallel replicas: the ranks of a tensor-parallel group hold one replica's batch, so statistics are
        summed over replicas, not over the world."""
        return self.data_parallel_size if self._trainer is not None else 1

    def _all_sum(self, x: Tensor) -> Tensor:
        """Sum over data-parallel replicas (identity on one replica), in fp32 (float64 kept)."""
        if self._world() == 1:
            return x
        x = x.detach().clone()
        x = x if x.dtype == torch.float64 else x.float()
        dist.all_reduce(x, group=self.capabilities.data_parallel_group)
        return x

    def _global_sums(self, values: dict[str, Tensor | float]) -> dict[str, float]:
        """``values`` (0-d tensors or numbers) each summed over the data-parallel replicas, in fp32: one collective
        and one host read for a rollout's statistics, not one of each per statistic."""
        local = torch.stack([torch.as_tensor(v, device=self.device).detach().float() for v in values.values()])
        return dict(zip(values, self._all_sum(local).tolist()))

    # ------------------------------------------------------------------------------------------ rollout
    def _gen_config(self, *, greedy: bool = False) -> GenerationConfig:
        dm = self.trainer.datamodule if self._trainer is not None else None
        cfg = for_datamodule(self.generation, dm)
        if greedy:
            cfg = GenerationConfig(**{**cfg.__dict__, "do_sample": False, "num_beams": 1})
        if cfg.num_beams != 1:
            raise ValueError(f"--model.generation.num_beams must be 1 for {type(self).__name__} rollouts "
                             "(responses are sampled)")
        return cfg

    def _decode(self, ids: list[int], *, keep_special: bool = False) -> str:
        tok = getattr(self.trainer.datamodule, "tokenizer", None)
        if tok is None:
            raise ValueError(f"{type(self).__name__} needs a datamodule with a tokenizer (e.g. PromptDataModule)")
        return tok.decode(ids, skip_special_tokens=not keep_special)

    def _dp_rank(self) -> int:
        """This rank's data-parallel rank: the ranks of a tensor- or pipeline-parallel group share it (and their one
        batch)."""
        if self._trainer is None or not (dist.is_available() and dist.is_initialized()):
            return 0
        return dist.get_rank(self.capabilities.data_parallel_group)

    @torch.no_grad()
    def sample(self, batch: dict[str, Any], *, greedy: bool = False, repeats: int = 1,
               seed_per_prompt: bool = False, draw: int = 0, positions: list[int] | None = None) -> Samples:
        """Generate ``repeats`` responses per prompt (rows of one prompt are adjacent), decode and score them.
        ``seed_per_prompt``: draw from :func:`~lightning_llm.rl.rollouts.seeding.prompt_uniforms` (needs the batch's
        ``index``, as :class:`~lightning_llm.data.PromptDataModule` gives; ``draw``: the sampling round) instead of the
        per-rank generator (:func:`~lightning_llm.rl.rollouts.seeding.rank_generator`). ``positions``: the prompts'
        places in the rollout's global order (default: the data-parallel sampler's,
        :mod:`lightning_llm.rl.rollouts.samples`)."""
        cfg = self._gen_config(greedy=greedy)
        self.eval()  # dropout off for generation and every forward of the rollout and the update
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"]
        n = prompt_ids.shape[0]
        turns = self.multi_turn.cfg.max_turns if self.multi_turn.enabled else 1
        uniforms = generator = None
        seed = rollout_seed(self.generation_seed)
        if not greedy and seed_per_prompt:
            if "index" not in batch:
                raise ValueError(f"{type(self).__name__} seeds rollouts per prompt: its batches need the prompts' "
                                 "record 'index' (as PromptDataModule's batches have)")
            uniforms = prompt_uniforms(batch["index"], repeats, cfg.max_new_tokens * turns, seed=seed,
                                       rollout=self.rollouts_done, draw=draw, device=self.device)
        elif not greedy:
            generator = rank_generator(seed, rollout=self.rollouts_done, dp_rank=self._dp_rank(), device=self.device)
        unpadded = _unpadded(prompt_ids, prompt_mask)
        episodes = None
        with self.decoding(self.policy_decoder()) as decoder:
            if self.multi_turn.enabled:  # episodes with an environment or tools (rl.multiturn)
                packed, episodes = self.multi_turn.rollout(decoder, batch, repeats=repeats, cfg=cfg, uniforms=uniforms,
                                                           generator=generator, device=self.device,
                                                           decode=lambda ids, keep: self._decode(ids, keep_special=keep))
            else:
                prompt_ids = prompt_ids.repeat_interleave(repeats, 0) if repeats > 1 else prompt_ids
                prompt_mask = prompt_mask.repeat_interleave(repeats, 0) if repeats > 1 else prompt_mask
                responses = generate(decoder, prompt_ids, prompt_mask, config=cfg, generator=generator,
                                     uniforms=uniforms)  # [B, N]
        if episodes is None:
            packed = Packed.of_responses(prompt_ids, prompt_mask, responses, cfg.eos_ids)
            texts = [self._decode(ids) for ids in strip_after_eos(responses, cfg.eos_ids)]
        else:
            texts = [e.text for e in episodes]
        rows = list(batch.get("columns") or [{} for _ in range(n)])
        dp, rank = self._world(), self._dp_rank()
        s = Samples(**packed.packed(), texts=texts, episodes=episodes,
                    scores=torch.zeros(len(texts), device=self.device),
                    temperature=cfg.temperature if cfg.do_sample else 1.0,
                    prompts=[p for p in batch["prompt"] for _ in range(repeats)],
                    columns=[c for c in rows for _ in range(repeats)],
                    positions=positions if positions is not None else [j * dp + rank for j in range(n)],
                    prompt_ids=unpadded, conversations=batch.get("conversation"),
                    index=batch["index"].tolist() if "index" in batch else list(range(n)))
        self.score(s)
        return s

    def score(self, s: Samples) -> None:
        """Score ``s`` with every reward source (in place: ``scores``, ``source_scores``): each gets the prompts, the
        responses and the records' columns (``completion_ids``: each response's tokens in the mask, EOS
        included); a reward model gets the prompt conversations where the data has a chat template."""
        repeats = len(s.texts) // max(len(s.prompt_ids), 1)
        columns = columns_by_name(s.columns)
        columns["completion_ids"] = _unpadded(s.responses, s.response_mask)
        if s.episodes is not None:  # multi-turn: the whole conversations and the environments' rewards
            columns["messages"] = [[dict(m) for m in e.conversation] for e in s.episodes]
            columns["env_reward"] = [e.env_reward for e in s.episodes]
        conversations = None if s.conversations is None else [c for c in s.conversations for _ in range(repeats)]
        scored = self.reward_sources.score(s.prompts, s.texts, columns=columns, conversations=conversations,
                                           device=self.device)
        s.scores, s.source_scores = scored.total, scored.per_source

    def scoring_kwargs(self, r: Rollout, temperature: float) -> dict[str, Any]:
        """Keyword inputs of a policy call on rollout ``r``: with the fused loss also ``labels``, the temperature and
        ``token_scores=True``, so the model returns :class:`~lightning_llm.kernels.loss.head_loss.TokenScores`."""
        kwargs: dict[str, Any] = {"attention_mask": r.attention_mask, "position_ids": r.position_ids}
        if self.uses_fused_loss():
            kwargs.update(labels=r.labels(), temperature=temperature, token_scores=True)
        return kwargs

    def reference_logprobs(self, r: Rollout, temperature: float) -> Tensor:
        """Log-probs [B, N] of the rollout's responses under the reference policy."""
        return r.forward_logprobs(functools.partial(self.run_reference, self.call_policy), temperature=temperature,
                                  fused=self.uses_fused_loss())

    # ------------------------------------------------------------------------------------------ model calls
    def policy_decoder(self) -> Any:
        """What rollouts decode with: the policy, or under a pipeline its stages run token by token."""
        runner = self.pipeline()
        return runner.decoder() if runner is not None else self.policy

    def call_policy(self, *args: Any, **kwargs: Any) -> Any:
        """The policy's output (no gradient needed): the policy itself, or a forward-only pass through the pipeline
        (whose model is the task's model: the policy, with its value head for PPO); inside a rollout's decoding
        session that holds whole copies (tp, pp), the policy's copy."""
        whole = self.whole_copy(self.policy)
        if whole is not None:
            return whole(*args, **kwargs)
        runner = self.pipeline()
        return runner.forward(*args, **kwargs) if runner is not None else self.policy(*args, **kwargs)

    def update_loss(self, mb: Rollout, loss_of: Callable[[Any, Rollout], tuple[Tensor, dict[str, Tensor]]], *,
                    temperature: float) -> tuple[Tensor, dict[str, Tensor]]:
        """``loss_of(output, rows)`` on the task model's output for mini-batch ``mb``: one call, or under a pipeline
        micro-batch by micro-batch (forward and backward run here; ``manual_backward`` then applies the gradients).
        ``loss_of`` must return shares of global sums (losses and statistics divided by global counts), which add up
        over the micro-batches of ``mb``."""
        assert self.model is not None
        kwargs = self.scoring_kwargs(mb, temperature)
        runner = self.pipeline()
        if runner is None:
            return loss_of(self.model(mb.query_responses, **kwargs), mb)
        return runner.train_additive(lambda output, rows: loss_of(output, mb.select(rows)), mb.query_responses,
                                     **kwargs)

    # ------------------------------------------------------------------------------------------ update
    def policy_update(self, r: Rollout) -> dict[str, float]:
        """``epochs`` x ``num_mini_batches`` optimizer steps on rollout ``r``; returns averaged global stats."""
        opt, sch, cfg = self.optimizers(), self.lr_schedulers(), self.update_schedule
        world, b = self._world(), r.query_responses.shape[0]
        g = torch.Generator().manual_seed(self.rollouts_done)
        sums: dict[str, float] = {}
        done = 0
        for _ in range(cfg.epochs):
            for idx in torch.tensor_split(torch.randperm(b, generator=g), cfg.num_mini_batches):
                loss, stats = self.minibatch_loss(r.select(idx.to(self.device)))
                # Local stats are this rank's share of the global mean: sum over ranks / world = global mean.
                glob = self._all_sum(torch.stack(list(stats.values())).detach()) / world
                values = dict(zip(stats, glob.tolist()))
                if cfg.ratio_threshold is not None and values["ratio"] > cfg.ratio_threshold:
                    self.skipped_minibatches += 1
                    log.warning("%s: mini-batch skipped, mean importance ratio %.3g > ratio_threshold %.3g",
                                type(self).__name__, values["ratio"], cfg.ratio_threshold)
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
        return self.update_stats({k: v / max(done, 1) for k, v in sums.items()})

    # ------------------------------------------------------------------------------------------ steps
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        start = time.perf_counter()
        with self.decoding():  # ZeRO-3: the policy gathered once for the rollout's generation and no-grad forwards
            rollout = self.make_rollout(batch)
        stats = self.compute_advantages(rollout)
        stats.update(self.source_stats(rollout))
        if self._rollout_log is not None:
            self._rollout_log.write(rollout_records(rollout, step=self.rollouts_done,
                                                    names=self.reward_sources.names))
        rollout_s = time.perf_counter() - start
        stats.update(self.policy_update(rollout))
        self.rollouts_done += 1
        stats.update({"episode": float(self.episodes), "time/rollout_s": rollout_s,
                      "time/update_s": time.perf_counter() - start - rollout_s,
                      "lr": float(self.optimizers().param_groups[0]["lr"])})
        for name, value in stats.items():  # already global means: identical on every rank
            self.log(name, value, on_step=True, on_epoch=False, prog_bar=name in ("objective/scores", "objective/kl"),
                     batch_size=rollout.scores.shape[0])
        return torch.tensor(self.step_loss_value(stats))

    def source_stats(self, r: Rollout) -> dict[str, float]:
        """``rewards/<name>/mean`` and ``rewards/<name>/std`` of each source over every replica's responses."""
        return self.reward_sources.statistics(r.samples.source_scores, all_sum=self._all_sum)

    def step_loss_value(self, stats: dict[str, float]) -> float:
        """The number ``training_step`` returns (progress bar): the mean policy loss."""
        return stats["loss/policy_avg"]

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        scores = self.sample(batch, greedy=True).scores
        self.log("eval/scores", scores.mean(), on_epoch=True, sync_dist=True, prog_bar=True,
                 batch_size=scores.shape[0])
        return scores.mean()

    # ------------------------------------------------------------------------------------------ lifecycle
    def _ready_episodes(self) -> None:
        """Multi-turn rollouts set up against the datamodule's chat template (every rank: a collective under tp/pp)."""
        if self.multi_turn.enabled:
            self.multi_turn.ready(self.trainer.datamodule, dp_rank=self._dp_rank(),
                                  batch_shared=self.capabilities.batch_shared)

    @override
    def on_fit_start(self) -> None:
        self._ready_reward()
        self._ready_episodes()
        dm = self.trainer.datamodule
        path = (getattr(dm, "paths", None) or {}).get("fit")  # before the first rollout: the sources' inputs exist
        self.reward_sources.check_inputs(getattr(dm, "column_names", None), max_new_tokens=self.generation.max_new_tokens,
                                         where=f"--data.train_path={path}" if path else "the generated prompts")
        if self.log_rollouts:
            # trainer.log_dir is a collective (broadcast): evaluate it on every rank; rank 0 writes.
            directory = Path(self.trainer.log_dir or self.trainer.default_root_dir)
            self._rollout_log = RolloutLog(directory / "rollouts.jsonl", writer=self.trainer.global_rank == 0,
                                           replicas=self._world(), group=self.capabilities.data_parallel_group)
        batch_size = getattr(self.trainer.datamodule, "batch_size", None)
        per_rank = (batch_size or 0) * self.rollouts_per_prompt
        if batch_size is not None and per_rank < self.update_schedule.num_mini_batches:
            raise ValueError(f"--data.batch_size={batch_size} gives {per_rank} rollouts per rank, fewer than the "
                             f"{self.update_schedule.num_mini_batches} mini-batches of an update "
                             "(--model.*.num_mini_batches): every mini-batch needs at least one rollout")
        if getattr(self.trainer, "gradient_clip_val", None):
            raise ValueError(f"--trainer.gradient_clip_val does not apply to {type(self).__name__} (manual "
                             "optimization): use the algorithm's max_grad_norm (e.g. --model.ppo.max_grad_norm)")

    @property
    def rollouts_per_prompt(self) -> int:
        """Responses sampled per prompt in training."""
        return 1

    @override
    def on_validation_start(self) -> None:
        self._ready_reward()
        self._ready_episodes()

    @override
    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        # The schedule steps after every optimizer step. Bounded by max_steps, Lightning's estimate already counts
        # optimizer steps; bounded by epochs it counts rollouts, so scale it by the updates per rollout.
        if self._trainer is not None and (self.trainer.max_steps is None or self.trainer.max_steps < 0):
            total = int(self.trainer.estimated_stepping_batches) * self.update_schedule.updates_per_rollout
            sch = config["lr_scheduler"]["scheduler"]
            sch.lr_lambdas = [self.optim.lr_lambda(total)]
        return config

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[self.rl_state_key] = {"rollouts": self.rollouts_done, "episodes": self.episodes,
                                         "skipped_minibatches": self.skipped_minibatches, **self.rl_state()}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get(self.rl_state_key)
        if state:
            self.rollouts_done, self.episodes = int(state["rollouts"]), int(state["episodes"])
            self.skipped_minibatches = int(state["skipped_minibatches"])
            self.load_rl_state(state)
