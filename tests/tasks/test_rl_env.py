"""Environments in multi-turn rollouts: a scripted environment and a scripted policy show the conversation appended
turn by turn and the learned tokens exact (against transformers' ``{% generation %}`` rendering); the KV cache kept
over turns decodes what ``generate`` decodes from the whole conversation; a step that raises or times out ends its
episode with a line naming the class and the record; GRPO and PPO train on episodes (the loss, KL and entropy over
the policy's tokens only; rollouts.jsonl's messages); bad environments are refused before training."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import PromptDataModule
from lightning_llm.data.chat.encode import ChatEncoder
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.rl import RewardConfig, gae
from lightning_llm.rl.multiturn.env import EnvConfig, env_class
from lightning_llm.rl.multiturn.episodes import Episode, open_episodes, run_episodes
from lightning_llm.rl.multiturn.turns import EpisodeEnvs, TurnRenderer
from lightning_llm.tasks import GRPOTask, OptimConfig, PPOTask
from lightning_llm.testing.rl import (
    DigitsEnv,
    build_task,
    check_against_template,
    fit_rollouts,
    scripted_run,
    write_rl_prompts,
)
from tests.chat_fixtures import QWEN2_GENERATION, build_tokenizer

QUESTIONS = ["Count to three.", "Name a prime.", "Say hi."]


class Scripted:
    """A scripted environment: it keeps the conversations it was shown; its messages (user, then system too), rewards
    and end follow the turn; record 1 opens with a system message of its own."""

    shown: list[list[dict[str, Any]]] = []

    def __init__(self, *, bonus: float = 0.5) -> None:
        self.bonus = bonus

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        if record["prompt"] != QUESTIONS[1]:
            return None
        return [{"role": "system", "content": "Be terse."}, {"role": "user", "content": record["prompt"]}]

    def step(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        Scripted.shown.append(messages)
        turn = sum(m["role"] == "assistant" for m in messages)
        out = [{"role": "user", "content": f"Turn {turn} heard: {messages[-1]['content'][:6]}"}]
        if turn == 2:
            out.append({"role": "system", "content": "Last turn now."})
        return {"messages": out, "reward": self.bonus / turn, "done": turn == 3}


class Failing(Scripted):
    """Raises at the second step of record 0, sleeps past the timeout at the second step of record 1, and returns a
    bad role at record 2's second step when ``bad`` is set."""

    def __init__(self, *, bad: bool = False) -> None:
        super().__init__()
        self.bad, self.prompt = bad, ""

    def reset(self, record: dict[str, Any]) -> list[dict[str, Any]] | None:
        self.prompt = record["prompt"]
        return None

    def step(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if len(messages) > 2 and self.prompt == QUESTIONS[0]:
            raise RuntimeError("sandbox lost")
        if len(messages) > 2 and self.prompt == QUESTIONS[1]:
            time.sleep(2)
        if len(messages) > 2 and self.bad:
            return {"messages": [{"role": "assistant", "content": "I answer for you."}], "reward": 0, "done": False}
        return {"messages": [{"role": "user", "content": "Go on."}], "reward": 1.0, "done": False}


def _chat(tmp_path: Path) -> tuple[Any, ChatEncoder]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / "qwen2", "qwen2")))
    return tok, ChatEncoder(tok, resolve_template("tokenizer", tok, fallback=None), eos_token_id=tok.eos_token_id)


def _records() -> list[dict[str, Any]]:
    return [{"prompt": q, "messages": [{"role": "user", "content": q}], "number": i} for i, q in enumerate(QUESTIONS)]


def test_environment_episode_turn_by_turn_and_learned_tokens_exact(tmp_path: Path) -> None:
    """Three scripted policies' episodes in one batch: each step is shown the conversation so far (its last message
    the policy's turn), its messages (user, then a system message too) appended after the turn; the environment's
    opening (reset) replaces the second record's prompt; every episode ends when the step says done (turn 3, under
    max_turns 4; an empty reply is a turn); the tokens and the learned mask are transformers' rendering of the final
    conversation, token by token; the step rewards sum."""
    tok, chat = _chat(tmp_path)
    Scripted.shown = []
    cfg = EnvConfig(cls="tests.tasks.test_rl_env:Scripted", max_turns=4)
    envs = EpisodeEnvs(cfg, env_class(cfg), None)
    scripts = [["One.", "Two.", "Three."], ["Seven.", "Eleven.", "Thirteen.", "Never said."], ["Hi.", "", "Bye."]]
    episodes, policy = scripted_run(tok, chat, envs, TurnRenderer(chat, None), scripts, _records(), env=cfg,
                                    header="<|im_start|>assistant\n")
    for e, script in zip(episodes, scripts):
        replies = [m["content"] for m in e.conversation if m["role"] == "assistant"]
        counts = check_against_template(tok, e, QWEN2_GENERATION)
        print(f"record {e.index}: {[(m['role'], m['content']) for m in e.conversation]}; rewards {e.rewards}; {counts}")
        assert replies == script[:3] and e.rewards == [0.5, 0.25, 0.5 / 3]
        assert e.stopped and e.env_reward == pytest.approx(0.5 + 0.25 + 0.5 / 3)
    assert episodes[1].conversation[0] == {"role": "system", "content": "Be terse."}
    assert [m["role"] for m in episodes[0].conversation] == ["user", "assistant", "user", "assistant", "user",
                                                             "system", "assistant"]
    lengths = sorted(len(m) for m in Scripted.shown)
    assert all(m[-1]["role"] == "assistant" for m in Scripted.shown) and lengths[0] == 2
    print(f"conversations shown to step(): lengths {lengths}; forwards {len(policy.fed)}")


def test_steps_that_raise_or_time_out_end_their_episode(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tok, chat = _chat(tmp_path)
    cfg = EnvConfig(cls="tests.tasks.test_rl_env:Failing", max_turns=3, step_timeout=0.5)
    envs = EpisodeEnvs(cfg, env_class(cfg), None, where="prompts.jsonl")
    scripts = [["A.", "B.", "C."]] * 3
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        episodes, _ = scripted_run(tok, chat, envs, TurnRenderer(chat, None), scripts, _records(), env=cfg,
                                   header="<|im_start|>assistant\n")
    took = time.monotonic() - start
    lines = [r.getMessage() for r in caplog.records if "the episode ends here" in r.getMessage()]
    print(f"{took:.2f} s; turns {[e.turns for e in episodes]}; rewards {[e.rewards for e in episodes]}")
    print("\n".join(lines))
    assert [e.turns for e in episodes] == [2, 2, 3] and took < 1.8
    assert lines[0].startswith("Failing on record 0 of prompts.jsonl (prompt 'Count to three.'): step() raised "
                               "RuntimeError: sandbox lost")
    assert lines[1].startswith("Failing on record 1 of prompts.jsonl (prompt 'Name a prime.'): step() timed out")
    assert episodes[0].rewards == [1.0, None] and episodes[2].rewards == [1.0, 1.0, 1.0]
    bad = EnvConfig(cls="tests.tasks.test_rl_env:Failing", kwargs={"bad": True}, max_turns=3)
    with pytest.raises(ValueError, match=r"Failing on record 0 \(prompt 'Say hi.'\): step\(\)\['messages'\]\[0\] is "
                                         ".*'assistant'"):
        scripted_run(tok, chat, EpisodeEnvs(bad, env_class(bad), None), TurnRenderer(chat, None), scripts[2:],
                     _records()[2:], env=bad, header="<|im_start|>assistant\n")


@pytest.mark.parametrize("sampled", [False, True])
def test_kept_cache_decodes_what_generate_decodes_from_the_whole_conversation(sampled: bool) -> None:
    """A random 2-layer decoder's episodes with the deterministic DigitsEnv, 6 in one batch (some end early: their
    rows leave the cache): each turn's tokens are what ``generate`` decodes from the whole conversation before it
    (no cache reuse), greedy or from the same per-row draws."""
    pl.seed_everything(0)
    dm = PromptDataModule(generated_prompts=8, max_prompt_len=32, template="chatml", batch_size=6)
    dm.setup("fit")
    task = PPOTask("debug", model_overrides={"num_layers": 2, "vocab_size": dm.vocab_size},
                   reward=RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward"))
    task.configure_model()
    model = task.policy.eval()
    cfg = GenerationConfig(max_new_tokens=8, do_sample=sampled, eos_token_id=[*dm.stop_token_ids, *range(5, 259, 4)],
                           pad_token_id=dm.pad_token_id)
    env = EnvConfig(cls="lightning_llm.testing.rl:DigitsEnv", max_turns=3, max_total_tokens=150)
    envs, renderer = EpisodeEnvs(env, DigitsEnv, None), TurnRenderer(dm.chat, None)
    episodes = []
    for i in range(6):
        row = dm.datasets["fit"][i]
        episodes.append(Episode(key=i, index=i, record={"prompt": row["prompt"], "number": i,
                                                        "messages": row["conversation"].messages}))
    open_episodes(episodes, envs, renderer)
    uniforms = torch.rand(6, 3 * 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) if sampled else None
    dec = run_episodes(model, episodes, envs=envs, renderer=renderer, cfg=cfg, env=env, uniforms=uniforms,
                       device=torch.device("cpu"), decode=lambda ids, keep: dm.tokenizer.decode(ids))
    checked = 0
    for row, e in enumerate(episodes):
        starts = [i for i, (a, b) in enumerate(zip([False, *e.learned], e.learned)) if b and not a]
        for turn, at in enumerate(starts):
            context = torch.tensor([e.prompt_ids + e.tokens[:at]])
            u = None if uniforms is None else uniforms[row:row + 1, turn * 8:(turn + 1) * 8]
            want = generate(model, context, config=cfg, uniforms=u)[0].tolist()
            end = next((k for k, t in enumerate(want) if t in cfg.eos_ids), len(want) - 1)
            got = e.tokens[at:at + end + 1]
            assert got == want[:end + 1], (row, turn, got, want)
            checked += 1
    print(f"sampled={sampled}: turns per episode {[e.turns for e in episodes]}; {checked} turns equal generate()'s; "
          f"{dec.prefilled} prefills, {dec.decoded} one-token forwards for {sum(e.length for e in episodes)} tokens")
    assert checked == sum(e.turns for e in episodes) and max(e.turns for e in episodes) == 3
    assert min(e.turns for e in episodes) < 3  # some episodes ended early and left the batch


def test_gae_chains_the_learned_tokens_across_gaps() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):
        idx = mask[row].nonzero().squeeze(1)
        a, r = gae(rewards[row:row + 1, idx], values[row:row + 1, idx], torch.ones(1, len(idx), dtype=torch.bool),
                   gamma=0.9, lam=0.8)
        assert torch.equal(adv[row, idx], a[0]) and torch.equal(ret[row, idx], r[0])
    assert float(adv[~mask].abs().max()) == 0 and float(ret[~mask].abs().max()) == 0


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_training_counts_the_policys_tokens_only(kind: str, tmp_path: Path) -> None:
    """GRPO (with dynamic sampling: the kept groups' episodes packed again) and PPO on DigitsEnv episodes: every
    rollout's loss mask is the episodes' learned tokens (the labels -100
    on the environment's tokens and the template's markers), ``response_length`` their mean count; rollouts.jsonl
    holds each episode's messages with their token counts (the learned ones summing to ``response_tokens``), the
    ``env`` source's reward beside the other source's, their sum the reward."""
    pl.seed_everything(0)
    spec = {"generation": {"max_new_tokens": 8, "do_sample": kind == "grpo", "eos_token_id": [258, *range(5, 258, 4)]},
            "env": {"cls": "lightning_llm.testing.rl:DigitsEnv", "max_turns": 3, "max_total_tokens": 90},
            "rewards": [{"fn": "lightning_llm.testing.rl:PairedDigits", "weight": 0.5}], "log_rollouts": True,
            kind: {"num_generations": 4, "beta": 0.04, "dynamic_sampling": True, "max_sampling_rounds": 2}
            if kind == "grpo" else {"ppo_epochs": 1}}
    task = build_task(kind, spec)
    seen: list[tuple[Any, Any]] = []
    make = task.make_rollout

    def recorded(batch: dict[str, Any], **kw: Any) -> Any:
        r = make(batch, **kw)
        seen.append((r, r.samples))
        return r

    task.make_rollout = recorded  # type: ignore[method-assign]
    dm = PromptDataModule(str(write_rl_prompts(tmp_path / "prompts.jsonl")), max_prompt_len=40, template="chatml",
                          batch_size=2)
    rows = fit_rollouts(task, dm, 2, tmp_path)
    for r, s in seen:
        learned = torch.zeros_like(r.response_mask)
        for i, e in enumerate(s.episodes):
            learned[i, :len(e.learned)] = torch.tensor(e.learned)
            assert sum(e.learned) < len(e.tokens) or e.turns == 1
        assert torch.equal(r.response_mask, learned)
        labels = r.labels()[:, r.context_length - 1:-1]
        assert bool((labels[~learned] == -100).all()) and bool((labels[learned] >= 0).all())
    lines = [json.loads(x) for x in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    for line in lines:
        msgs = line["messages"]
        assert sum(m["tokens"] for m in msgs if m["learned"]) == line["response_tokens"]
        assert [m["learned"] for m in msgs] == [m["role"] == "assistant" for m in msgs]
        other = 0.5 * line["PairedDigits"]
        assert line["reward"] == pytest.approx(other + (line["env"] or 0.0), abs=1e-6)
    multi = [x for x in lines if sum(m["learned"] for m in x["messages"]) > 1]
    print(f"{kind}: {rows[-1]}; {len(multi)}/{len(lines)} episodes of several turns; one: "
          f"{[(m['role'], m['tokens']) for m in multi[0]['messages']]}")
    assert multi and "rewards/env/mean" in rows[0]
    means = [float(r.response_mask.sum(-1).float().mean()) for r, _ in seen]
    assert [round(r["response_length"], 4) for r in rows] == [round(m, 4) for m in means]


def test_bad_environments_are_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digits = RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward")
    for path, message in [
        ("tests.tasks.test_rl_env:Nowhere", r"--model.env.cls='tests.tasks.test_rl_env:Nowhere': cannot import it"),
        ("no_such_package.envs:Env", r"--model.env.cls='no_such_package.envs:Env': cannot import it \(No module"),
        ("tests.tasks.test_rl_env:QUESTIONS", "is not a class"),
        ("tests.tasks.test_rl_env:_records", "is not a class"),
        ("tests.tasks.test_rl_env:Stepless", r"the class has no method step\(...\)")]:
        with pytest.raises(ValueError, match=message):
            GRPOTask("debug", reward=digits, env=EnvConfig(cls=path))
    with pytest.raises(ValueError, match="--model.env.max_turns=0 is out of range"):
        EnvConfig(max_turns=0)
    assert main(["fit", "--model=lightning_llm.tasks.GRPOTask", "--model.env.cls=tests.tasks.test_rl_env:Stepless",
                 "--data=lightning_llm.data.PromptDataModule"]) == 2
    err = capsys.readouterr().err
    print(err.strip().splitlines()[-1])
    assert "--model.env.cls='tests.tasks.test_rl_env:Stepless': the class has no method step(...)" in err
    # An environment without a reward source is accepted (its step rewards score the episodes); without a chat
    # template it is refused at the start of the fit, before the first rollout.
    task = PPOTask("debug", model_overrides={"num_layers": 2}, env=EnvConfig(cls="lightning_llm.testing.rl:DigitsEnv"),
                   optim=OptimConfig(lr=1e-3))
    with pytest.raises(ValueError, match="multi-turn rollouts render conversations with a chat template"):
        fit_rollouts(task, PromptDataModule(generated_prompts=4, batch_size=2), 1, tmp_path)


class Stepless:
    """Not an environment: no step."""

    def reset(self, record: dict[str, Any]) -> None:
        return None
