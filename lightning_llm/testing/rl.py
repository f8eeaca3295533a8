"""The on-policy RL layout tests' helpers: a prompt file with columns, a reward that checks each prompt arrives with its
own columns, the layouts by name, one fit of a PPO or GRPO task from a JSON-able spec (the one-device reference before
a launch and every layout inside it call the same function), and the comparisons of two fits' outputs.

A fit writes under its ``out`` directory: ``rows.json`` (the metrics logged at each rollout, rank 0), ``steps.json.pt``
(the final full parameters: :class:`~lightning_llm.testing.StepRecorder`), ``rollouts.json`` (every rollout's tokens
per prompt, the reference's and reward model's bytes per rank: :class:`~lightning_llm.testing.RolloutRecorder`) and,
with ``log_rollouts``, ``rollouts.jsonl``.

Multi-turn rollouts: :class:`DigitsEnv` (a deterministic environment of the layout tests) and :class:`ScriptedPolicy`
(a decoder whose next tokens a test fixes: each prompt's turns, token by token, through the KV cache).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_llm.data import PromptDataModule
from lightning_llm.files import atomic_open, write_jsonl_atomic
from lightning_llm.generation import GenerationConfig
from lightning_llm.peft import LoraArgs
from lightning_llm.reliability import FAULT_ENV
from lightning_llm.rl import GRPOConfig, PPOConfig, RewardConfig
from lightning_llm.rl.multiturn.env import EnvConfig
from lightning_llm.rl.multiturn.episodes import Episode, open_episodes, run_episodes
from lightning_llm.strategies import HybridParallelStrategy
from lightning_llm.strategies.presets import PipelineParallelStrategy, ZeroStrategy
from lightning_llm.tasks import GRPOTask, PPOTask
from lightning_llm.tasks.base import OptimConfig
from lightning_llm.testing import MetricRows, RolloutRecorder, StepRecorder, launch, wait

__all__ = ["GLOBAL_PROMPTS", "GRPO_SPECS", "PPO_SPEC", "DigitsEnv", "PairedDigits", "ScriptedPolicy",
           "check_against_template", "check_prefills", "compare_fits", "fit_rollouts", "held_bytes", "layout_runs", "rl_fit", "rl_layout",
           "scripted_run", "write_rl_prompts"]

GLOBAL_PROMPTS = 8
"""Prompts per rollout over all replicas (one device holds them all)."""


def write_rl_prompts(path: Path, n: int = 64) -> Path:
    """``n`` records ``{"prompt": "Say 07 digits:", "number": 7, "meta": {"even": false, "tags": [...]}}``: the number
    also sits in the prompt, so a reward can check that each prompt arrived with its own record's columns; ``meta``
    is missing from every fifth record (a column some records lack is ``None`` there)."""
    rows = []
    for i in range(n):
        row: dict[str, Any] = {"prompt": f"Say {i:02d} digits:", "number": i}
        if i % 5:
            row["meta"] = {"even": i % 2 == 0, "tags": ["x"] * (i % 3)}
        rows.append(row)
    write_jsonl_atomic(path, rows)
    return path


class PairedDigits:
    """The share of a response's characters that are digits, plus ``0.05 * (number % 4)`` from the record's
    ``number`` column: a pairing of a prompt with another record's columns changes the score, and is refused
    outright (the number is also in the prompt). A record's ``meta`` column is checked too (``None`` exactly where
    the record lacks it)."""

    def __call__(self, prompts: list[str], responses: list[str], *, number: list[int], meta: list[Any],
                 **columns: Any) -> list[float]:
        out = []
        for prompt, response, n, m in zip(prompts, responses, number, meta, strict=True):
            if f"Say {n:02d} " not in prompt or (m is None) != (n % 5 == 0):
                raise AssertionError(f"prompt {prompt!r} arrived with another record's columns (number {n}, meta {m})")
            share = sum(c.isdigit() for c in response) / len(response) if response else 0.0
            out.append(share + 0.05 * (n % 4))
        return out


class DigitsEnv:
    """A deterministic environment (its messages a function of the record and the conversation): records whose
    ``number`` is odd open with a system message of their own (``reset``); after each turn the user asks for the
    record's number again, naming the turn and how many digits the last answer held; the reward is the share of
    digits of the answer that are the number's last digit; done once an answer holds that digit."""

    def __init__(self, *, greeting: str = "Count with me.") -> None:
        self.greeting, self.number = greeting, 0

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        self.number = int(record["number"])
        if self.number % 2 == 0:
            return None
        return [{"role": "system", "content": self.greeting}, *record["messages"]]

    def step(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        answer, digit = messages[-1]["content"], str(self.number % 10)
        turn = sum(m["role"] == "assistant" for m in messages)
        reward = sum(c == digit for c in answer) / max(len(answer), 1)
        text = f"Turn {turn}: {sum(c.isdigit() for c in answer)} digits. Say {self.number:02d} again:"
        return {"messages": [{"role": "user", "content": text}], "reward": reward, "done": digit in answer}


class ScriptedPolicy(nn.Module):
    """A decoder (``generate``'s protocol, with a KV cache) whose tokens a test fixes: ``scripts`` maps a prompt's ids
    to its turns (token lists); the next token of a row is the next one of its current turn (the turn: how many
    generation prompts ``header`` its tokens hold), ``end`` after the script. The tokens so far are kept in the
    cache (they ride along as the layer's keys), so the cache's row selection applies to them as to a model's."""

    def __init__(self, scripts: dict[tuple[int, ...], list[list[int]]], *, header: list[int], vocab: int,
                 end: int) -> None:
        super().__init__()
        self.scripts, self.header, self.vocab, self.end = scripts, header, vocab, end
        self.fed: list[int] = []  # columns fed per forward

    def _next(self, real: list[int]) -> int:
        prompt = next(k for k in self.scripts if tuple(real[:len(k)]) == k)
        h = len(self.header)
        starts = [i + h for i in range(len(prompt) - h, len(real) - h + 1) if real[i:i + h] == self.header]
        turns = self.scripts[prompt]
        if not starts or len(starts) > len(turns):
            return self.end
        done = real[starts[-1]:]
        turn = turns[len(starts) - 1]
        return turn[len(done)] if len(done) < len(turn) else self.end

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor, position_ids: Tensor, kv_cache: Any = None,
                logits_to_keep: int = 0, **_: Any) -> Tensor:
        self.fed.append(input_ids.shape[1])
        ids = input_ids[:, None, :, None].double()
        if kv_cache is not None:
            ids, _ = kv_cache.update(self, ids, ids)
            kv_cache.advance(input_ids.shape[1])
        every = ids[:, 0, :, 0].long()
        logits = torch.full((input_ids.shape[0], 1, self.vocab), -1e4)
        for row, (tokens, mask) in enumerate(zip(every.tolist(), attention_mask.bool().tolist())):
            logits[row, 0, self._next([t for t, m in zip(tokens, mask) if m])] = 0.0
        return logits


def scripted_run(tok: Any, chat: Any, envs: Any, renderer: Any, scripts: list[list[str]], records: list[dict[str, Any]],
                 *, env: Any, header: str) -> tuple[list[Any], ScriptedPolicy]:
    """Episodes of ``records`` (each ``{"prompt", "messages", ...}``) rolled out by a :class:`ScriptedPolicy` whose turns
    are ``scripts`` (texts, each record's; every turn ends with the template's end-of-turn token); ``header``: the
    template's generation prompt. Returns (episodes, policy)."""
    episodes = [Episode(key=i, index=i, record=rec) for i, rec in enumerate(records)]
    open_episodes(episodes, envs, renderer)
    policy = ScriptedPolicy({tuple(e.prompt_ids): [tok(t, add_special_tokens=False)["input_ids"] + [chat.end_of_turn_id]
                                                   for t in script] for e, script in zip(episodes, scripts)},
                            header=tok(header, add_special_tokens=False)["input_ids"], vocab=len(tok),
                            end=chat.end_of_turn_id)
    cfg = GenerationConfig(max_new_tokens=160, eos_token_id=chat.stop_token_ids, pad_token_id=tok.pad_token_id or 0)
    run_episodes(policy, episodes, envs=envs, renderer=renderer, cfg=cfg, env=env, device=torch.device("cpu"),
                 decode=lambda ids, keep: tok.decode(ids, skip_special_tokens=not keep))
    return episodes, policy


def check_against_template(tok: Any, episode: Any, generation: str, *, tools: Any = None) -> dict[str, int]:
    """Assert that ``episode``'s tokens are transformers' rendering of its conversation (with ``tools``' schemas) by
    the ``{% generation %}`` template ``generation``, its learned tokens exactly that rendering's assistant mask, and
    every token counted in one message; returns the counts (tokens, learned, reference)."""
    ref = tok.apply_chat_template(episode.conversation, tools=tools, chat_template=generation, tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    ids = episode.prompt_ids + episode.tokens
    mask = [False] * len(episode.prompt_ids) + episode.learned
    assert ref["input_ids"][:len(ids)] == ids and not any(ref["assistant_masks"][len(ids):])
    assert [bool(x) for x in ref["assistant_masks"][:len(ids)]] == mask
    assert sum(n for n, _ in episode.counts) == len(ids)
    assert [learned for _, learned in episode.counts] == [m["role"] == "assistant" for m in episode.conversation]
    return {"tokens": len(ids), "learned": sum(mask), "reference": len(ref["input_ids"])}


def check_prefills(episode: Any, fed: list[int]) -> list[int]:
    """Assert that a :class:`ScriptedPolicy` alone in its batch was fed each column once (the KV cache kept): the first
    forward the prompt, each later turn's first forward the previous turn's last token and what was appended after
    it, the rest one-token steps (up to 7 per turn of them padding after a turn's stop token, until the next check
    of whether every row ended). Returns the prefill widths."""
    blocks, run = [], 0
    for n, learned in episode.counts[1:]:
        if learned and run:
            blocks.append(1 + run)
        run = 0 if learned else run + n
    prefills = [w for w in fed if w > 1]
    total = episode.length
    assert prefills == [len(episode.prompt_ids), *blocks] and fed.count(1) == len(fed) - len(prefills)
    assert total - 1 <= sum(fed) <= total - 1 + 7 * episode.turns
    return prefills


EOS = [258, *range(97, 107)]
"""Where the layout tests' responses end: the byte tokenizer's EOS and 10 letters (a random policy's responses then
end now and then within 8 tokens, so some are truncated and some not)."""
_GRPO = {"num_generations": 4, "epochs": 2, "num_mini_batches": 1}
_SAMPLED = {"max_new_tokens": 8, "do_sample": True, "eos_token_id": EOS}
PAIRED = {"fn": "lightning_llm.testing.rl:PairedDigits"}
GRPO_SPECS: dict[str, dict[str, Any]] = {
    # today's settings: the dapo reduction with the KL term, a missing-EOS penalty, 4 rollouts
    "dapo": {"generation": _SAMPLED, "rewards": [PAIRED], "log_rollouts": True,
             "grpo": {**_GRPO, "loss_type": "dapo", "beta": 0.04, "missing_eos_penalty": 0.1}},
    # the 2026 recipe: clip-higher, delta, truncated responses masked, no reference, dynamic sampling, two sources
    "rlvr": {"generation": _SAMPLED, "log_rollouts": True,
             "rewards": [PAIRED, {"fn": "lightning_llm.rl.rewards:FormatReward", "kwargs": {"pattern": r"\d+"},
                                  "weight": 0.5, "name": "format"}],
             "grpo": {**_GRPO, "loss_type": "dapo", "beta": 0.0, "clip_range_high": 0.28, "delta": 1.5,
                      "mask_truncated_completions": True, "dynamic_sampling": True, "max_sampling_rounds": 3}},
    # GSPO's sequence-level ratio with Dr. GRPO's constant normaliser, centred advantages, a length penalty source
    "gspo_dr": {"generation": _SAMPLED, "log_rollouts": True,
                "rewards": [PAIRED, {"fn": "lightning_llm.rl.rewards:SoftOverlong", "weight": 0.3,
                                     "kwargs": {"max_new_tokens": 8, "buffer": 4}}],
                "grpo": {**_GRPO, "loss_type": "dr_grpo", "importance_sampling_level": "sequence",
                         "clip_range": 0.02, "beta": 0.04, "scale_rewards": False}},
    "cispo": {"generation": _SAMPLED, "rewards": [PAIRED], "log_rollouts": True,
              "grpo": {**_GRPO, "loss_type": "cispo", "clip_range_high": 0.28, "beta": 0.04}},
}
"""The GRPO layout tests' settings (:func:`build_task`'s specs): every setting of the loss family in one of them."""
PPO_SPEC: dict[str, Any] = {
    "generation": {"max_new_tokens": 8, "do_sample": False}, "rewards": [PAIRED], "log_rollouts": True,
    "ppo": {"ppo_epochs": 2, "num_mini_batches": 1, "kl_coef": 0.05, "adaptive_kl": True, "kl_target": 0.5,
            "kl_horizon": 50, "whiten_rewards": True, "missing_eos_penalty": 0.1}}
"""The PPO layout tests' settings: greedy rollouts, adaptive KL, whitened rewards, a missing-EOS penalty."""

LAYOUTS: dict[str, Callable[[], tuple[Any, int]]] = {
    "1": lambda: ("auto", 1),
    "ddp": lambda: ("ddp", 2),
    "zero3": lambda: ("zero3", 2),
    "deepspeed_zero2": lambda: ("deepspeed_zero2", 2),
    "tp": lambda: ("tp", 1),
    "3d": lambda: (HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True), 1),
    "pp": lambda: ("pp", 1),
    "pp_stages": lambda: (PipelineParallelStrategy(gather_for_decoding="per_layer"), 1),
    "zero3_per_layer": lambda: (ZeroStrategy(3, gather_for_decoding="per_layer"), 2),
    "dp2_tp2": lambda: (HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), 2),
    "dp2_pp2": lambda: (HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2), 2),
}
"""Layout name -> (strategy, data-parallel replicas). ``3d`` is tp2 with sequence parallelism; ``pp_stages`` decodes
through the pipeline's stages (the others decode with whole copies under tp and pp); ``zero3_per_layer`` decodes
with ZeRO-3's per-layer all-gathers (the data-parallel ranks decode in lock-step); ``dp2_*`` need 4 processes."""


def rl_layout(name: str) -> tuple[Any, int, int]:
    """(strategy, prompts per replica, processes) of a layout for :data:`GLOBAL_PROMPTS` prompts per rollout."""
    strategy, replicas = LAYOUTS[name]()
    world = 1 if name == "1" else 4 if name.startswith("dp2_") else 2
    return strategy, GLOBAL_PROMPTS // replicas, world


def build_task(kind: str, spec: dict[str, Any]) -> GRPOTask | PPOTask:
    """A ``debug`` 2-layer PPO or GRPO task from a JSON-able ``spec`` (the task's arguments, configs as dicts)."""
    kw = dict(spec)
    kw["generation"] = GenerationConfig(**kw.get("generation", {"max_new_tokens": 8, "do_sample": kind == "grpo"}))
    kw["optim"] = OptimConfig(**{"lr": 3e-3, "scheduler": "constant", "weight_decay": 0.0, "eps": 1e-3,
                                 **kw.get("optim", {})})
    for name, cls in (("grpo", GRPOConfig), ("ppo", PPOConfig), ("lora", LoraArgs), ("env", EnvConfig)):
        if name in kw:
            kw[name] = cls(**kw[name])
    kw["reward"] = RewardConfig(**kw["reward"]) if "reward" in kw else None
    kw["rewards"] = [RewardConfig(**r) for r in kw.get("rewards", [])]
    return (GRPOTask if kind == "grpo" else PPOTask)("debug", model_overrides={"num_layers": 2}, **kw)


def rl_fit(kind: str, spec: dict[str, Any], out: Path, *, prompts: Path, layout: str = "1", steps: int = 8,
           resume: str | None = None, fault: str | None = None, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """One fit of :func:`build_task` on ``layout`` (``steps`` optimizer steps; ``fault``: a
    :data:`~lightning_llm.reliability.FAULT_ENV` spec, its ``RuntimeError`` returned as ``error``; with a
    fault or a ``resume``, ``last.ckpt`` under ``out/ckpt`` after every step; ``data``: more arguments of the
    ``PromptDataModule``, e.g. a chat template). A refusal before training (a
    ``ValueError``) is returned as ``refused``. Writes ``out`` (see the module docstring)."""
    strategy, batch, world = rl_layout(layout)
    pl.seed_everything(3)
    out.mkdir(parents=True, exist_ok=True)
    rows = MetricRows()
    callbacks: list[pl.Callback] = [rows, StepRecorder(str(out / "steps.json"), save_params=True),
                                    RolloutRecorder(str(out / "rollouts.json"))]
    checkpoints = fault is not None or resume is not None
    if checkpoints:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_train_steps=1,
                                                      save_top_k=0))
    if fault:  # read by the task's own FaultInjector (it replaces any the trainer is given)
        os.environ[FAULT_ENV] = fault
    try:
        task = build_task(kind, spec)
        dm = PromptDataModule(str(prompts), **{"max_prompt_len": 32, "batch_size": batch, **(data or {})})
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                             enable_checkpointing=checkpoints, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
                             default_root_dir=str(out))
        trainer.fit(task, dm, ckpt_path=resume)
    except ValueError as e:
        return {"refused": str(e)}
    except RuntimeError as e:
        if fault is None:
            raise
        return {"error": str(e)}
    finally:
        os.environ.pop(FAULT_ENV, None)
    logged = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows.rows]
    if int(os.environ.get("RANK", "0")) == 0:
        with atomic_open(out / "rows.json", "w") as f:
            json.dump(logged, f)
    return {"rows": logged}


def fit_rollouts(task: pl.LightningModule, dm: PromptDataModule, rollouts: int, root: Path) -> list[dict[str, float]]:
    """Fit ``task`` on ``dm`` for ``rollouts`` rollouts on the CPU (one device, no logger, no checkpoints, no
    validation; ``root`` the run's directory, where ``rollouts.jsonl`` goes); the metrics logged at each rollout."""
    rec = MetricRows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", max_steps=rollouts * task.update_schedule.updates_per_rollout, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                   limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(root)).fit(task, dm)
    return rec.rows


def layout_runs(script: str | Path, out: Path, reference: Callable[[], Any], *, nproc: int = 2,
                timeout: float = 1800) -> Path:
    """The RL layout files' fixture: the prompt file, the one-device runs (``reference()``, before the launch, not
    beside it), then ONE launch of ``script layouts OUT`` on ``nproc`` processes running every layout; returns
    ``out``."""
    write_rl_prompts(out / "prompts.jsonl")
    reference()
    wait(launch(script, nproc, "layouts", str(out)), timeout=timeout)
    return out


def _rollout_lines(out: Path) -> list[dict[str, Any]]:
    path = out / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _line_error(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of two rollout records' numbers; their other fields must be equal."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    err = 0.0
    for k, x in a.items():
        if isinstance(x, float) or isinstance(b[k], float):
            err = max(err, 0.0 if x is None and b[k] is None else abs(x - b[k]))
        else:
            assert x == b[k], (k, x, b[k])
    return err


def compare_fits(one: Path, other: Path) -> dict[str, float]:
    """Largest differences between two fits' outputs (:func:`rl_fit`): every logged statistic at every rollout
    (``stats``, relative to the statistic where it is above 1: a fresh critic's value loss is tens), the final parameters (``params``), the ``rollouts.jsonl`` records' numbers (``rollouts``, their texts,
    columns and token counts equal); the rollouts' tokens must be equal for every prompt."""
    a, b = (json.loads((d / "rows.json").read_text()) for d in (one, other))
    assert len(a) == len(b) > 0 and a[0].keys() == b[0].keys(), (len(a), len(b))
    stats = max(abs(x[k] - y[k]) / max(1.0, abs(y[k])) for x, y in zip(a, b) for k in x)  # relative past 1
    p1, p2 = torch.load(one / "steps.json.pt"), torch.load(other / "steps.json.pt")
    assert sorted(p1) == sorted(p2)
    params = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
    t1, t2 = (json.loads((d / "rollouts.json").read_text())["rollouts"] for d in (one, other))
    assert t1 == t2 and len(t1) >= len(a), "the layout drew other tokens than one device"
    l1, l2 = _rollout_lines(one), _rollout_lines(other)
    assert len(l1) == len(l2)
    rollouts = max((_line_error(x, y) for x, y in zip(l1, l2)), default=0.0)
    return {"stats": stats, "params": params, "rollouts": rollouts}


def held_bytes(out: Path, what: str) -> list[int]:
    """Bytes each rank held of the task's ``frozen`` (the reference copy) or ``scoring`` (reward model) models."""
    return json.loads((out / "rollouts.json").read_text())[f"{what}_bytes"]
