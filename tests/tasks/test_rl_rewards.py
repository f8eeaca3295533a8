"""Reward sources of the online RL tasks on one device: prompt records' columns reach reward functions (values as read
from the JSON, ``None`` where a record lacks a field, paired with their prompts), the calling conventions, weighted
sources with ``None`` (trl's rule), the built-in verifiers on cases written here (MathAccuracy, FormatReward,
SoftOverlong against trl's own), bad input refused in one line naming the file, record or function, beta=0 building
and running no reference (counted), and rollouts.jsonl (GRPO and PPO) against the logged statistics."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import DataError, PromptDataModule
from lightning_llm.generation import GenerationConfig
from lightning_llm.rl import GRPOConfig, PPOConfig, RewardConfig
from lightning_llm.rl.rewards import FormatReward, MathAccuracy, SoftOverlong
from lightning_llm.rl.rollouts.rollout_log import ROLLOUT_FIELDS
from lightning_llm.rl.rewards.sources import RewardSource, RewardSources
from lightning_llm.tasks import GRPOTask, OptimConfig, PPOTask
from lightning_llm.testing.rl import fit_rollouts

RECORDS = [{"prompt": "one", "answer": 3, "tags": ["a", 1], "meta": {"k": None}, "note": None},
           {"prompt": "two", "answer": "1/2", "level": "hard"},
           {"prompt": "three", "answer": None, "tags": [], "level": 2.5}]


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------------------------ columns
@pytest.mark.parametrize("template", ["none", "chatml"])
def test_every_field_but_the_prompt_is_a_column(tmp_path: Path, template: str) -> None:
    dm = PromptDataModule(str(_write(tmp_path / "p.jsonl", RECORDS)), template=template, batch_size=3)
    dm.setup("fit")
    batch = dm.collate([dm.datasets["fit"][i] for i in range(3)])
    assert dm.column_names == ["answer", "tags", "meta", "note", "level"]
    assert batch["columns"] == [
        {"answer": 3, "tags": ["a", 1], "meta": {"k": None}, "note": None, "level": None},
        {"answer": "1/2", "tags": None, "meta": None, "note": None, "level": "hard"},
        {"answer": None, "tags": [], "meta": None, "note": None, "level": 2.5}]
    messages = [{"messages": [{"role": "user", "content": "hi"}], "answer": 1}]
    chat = PromptDataModule(str(_write(tmp_path / "m.jsonl", messages)), template="chatml")
    chat.setup("fit")
    assert chat.column_names == ["answer"]  # the conversation is the prompt, not a column
    _write(tmp_path / "bad.jsonl", [{"prompt": "x", "completion_ids": 1}])
    with pytest.raises(DataError, match=r"bad.jsonl: a column is named 'completion_ids'"):
        PromptDataModule(str(tmp_path / "bad.jsonl")).setup("fit")


def test_calling_conventions_and_weighted_none() -> None:
    """``(prompts, responses)`` only; ``**kwargs`` (every column and completion_ids); named columns; ``None`` leaves a
    sample to the other sources (the weighted sum of those that scored it; 0 where none did)."""
    seen: dict[str, Any] = {}

    def plain(prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0, 2.0, 3.0]

    def everything(prompts: list[str], responses: list[str], **kw: Any) -> list[float | None]:
        seen["all"] = sorted(kw)
        return [None, 10.0, None]

    def named(prompts: list[str], responses: list[str], answer: list[Any], level: Any = None) -> torch.Tensor:
        seen["named"] = (answer, level)
        return torch.tensor([100.0, 200.0, 300.0])

    def never(prompts: list[str], responses: list[str], **kw: Any) -> list[None]:
        return [None, None, None]

    columns = {"answer": [3, "1/2", None], "level": [None, "hard", 2.5], "completion_ids": [[1], [2, 3], []]}
    sources = RewardSources([RewardSource("plain", plain, weight=0.5), RewardSource("all", everything, weight=2.0),
                             RewardSource("named", named, weight=-1.0), RewardSource("never", never)])
    assert sources.sources[2].required_columns == ["answer"]
    got = sources.score(["a", "b", "c"], ["x", "y", "z"], columns=columns, conversations=None, device=torch.device("cpu"))
    assert seen["all"] == ["answer", "completion_ids", "level"] and seen["named"] == ([3, "1/2", None],
                                                                                       [None, "hard", 2.5])
    want = [0.5 * 1 - 100, 0.5 * 2 + 2 * 10 - 200, 0.5 * 3 - 300]
    assert got.total.tolist() == want and math.isnan(got.per_source[1, 0]) and got.per_source[3].isnan().all()
    alone = RewardSources([RewardSource("never", never)]).score(["a", "b", "c"], ["x", "y", "z"], columns=columns,
                                                                 conversations=None, device=torch.device("cpu"))
    assert alone.total.tolist() == [0.0, 0.0, 0.0]
    stats = sources.statistics(got.per_source, all_sum=lambda x: x)
    assert stats["rewards/all/mean"] == 10.0 and math.isnan(stats["rewards/all/std"])  # one sample scored
    assert abs(stats["rewards/plain/std"] - 1.0) < 1e-12  # unbiased, trl's nanstd


def test_bad_sources_are_refused_naming_them() -> None:
    def raises(prompts: list[str], responses: list[str]) -> list[float]:
        raise KeyError("boom")

    def short(prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0]

    kw = {"columns": {}, "conversations": None, "device": torch.device("cpu")}
    with pytest.raises(ValueError, match=r"reward raises raised KeyError: 'boom' \(the batch's first prompt: 'p0'\)"):
        RewardSources([RewardSource("raises", raises)]).score(["p0", "p1"], ["a", "b"], **kw)
    with pytest.raises(ValueError, match=r"reward short returned \(1,\) scores for 2 responses"):
        RewardSources([RewardSource("short", short)]).score(["p0", "p1"], ["a", "b"], **kw)
    with pytest.raises(ValueError, match="weight of reward MathAccuracy is 'heavy': .* must be a finite number"):
        RewardConfig(fn="lightning_llm.rl.rewards:MathAccuracy", weight="heavy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two reward sources are named 'x'"):
        RewardSources([RewardSource("x", short), RewardSource("x", short)])
    with pytest.raises(ValueError, match=r"--model.rewards\[1\]: set exactly one of reward.fn"):
        GRPOTask("debug", rewards=[RewardConfig(fn="a:b"), RewardConfig()])
    with pytest.raises(ValueError, match="named 'reward', a field of every rollout record"):
        GRPOTask("debug", rewards=[RewardConfig(fn="a:b", name="reward")])
    for bad, choices in (("loss_type", "grpo, dapo, dr_grpo, cispo"), ("importance_sampling_level", "token, sequence")):
        with pytest.raises(ValueError, match=rf"--model.grpo.{bad}='x' is out of range \(one of {choices}\)"):
            GRPOConfig(**{bad: "x"})


def test_cli_refuses_an_unknown_loss_type_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--model=lightning_llm.tasks.GRPOTask", "--model.reward.fn=x:y",
                 "--model.grpo.loss_type=bnpo", "--data=lightning_llm.data.PromptDataModule"]) == 2
    err = capsys.readouterr().err
    assert "lightning_llm: error:" in err and "bnpo" in err and "dr_grpo" in err


# ------------------------------------------------------------------------------------------------ verifiers
def test_math_accuracy_on_cases() -> None:
    cases = [("The answer is 42.", 42, 1.0), ("\\boxed{42}", "42", 1.0), ("so it is \\boxed{0.5}", "1/2", 1.0),
             ("$\\frac{1}{2}$", 0.5, 1.0), ("I think 8", 7, 0.0), ("41 + 1 = 42", 42, 1.0),
             ("12 apples, then 13", 12, 0.0), ("answer: -3", "-3", 1.0), ("no number here", 5, 0.0),
             ("anything", None, None), ("\\boxed{3}", "\\frac{6}{2}", 1.0)]
    verifier = MathAccuracy()
    got = verifier([""] * len(cases), [c[0] for c in cases], answer=[c[1] for c in cases])
    assert got == [c[2] for c in cases], list(zip(cases, got))
    assert MathAccuracy(answer="solution").required_columns == ["solution"]


def test_format_reward_and_soft_overlong() -> None:
    fmt = FormatReward()
    assert fmt([""] * 4, ["<think>2+2</think> 4", "<think>\nx\n</think>\n\\boxed{4}", "4", "<think>x</think>"]) == \
        [1.0, 1.0, 0.0, 0.0]
    assert FormatReward(r"\d+")([""] * 2, ["123", "12a"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="FormatReward: pattern='\\(' is not a regular expression"):
        FormatReward("(")
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in range(0, 13)]
    ours = SoftOverlong(max_new_tokens=10, buffer=4)([""] * len(ids), [""] * len(ids), completion_ids=ids)
    assert ours == get_soft_overlong_punishment(10, 4)(ids) and ours[10] == -1.0 and ours[6] == 0.0


# ------------------------------------------------------------------------------------------------ tasks
def _grpo(**grpo: Any) -> GRPOTask:
    return GRPOTask("debug", model_overrides={"num_layers": 2}, log_rollouts=True,
                    generation=GenerationConfig(max_new_tokens=6, do_sample=True),
                    rewards=[RewardConfig(fn="lightning_llm.rl.rewards:MathAccuracy", weight=1.0),
                             RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", weight=0.5, name="digits")],
                    grpo=GRPOConfig(num_generations=4, **grpo), optim=OptimConfig(lr=3e-3, scheduler="constant"))


def _fit(task: Any, path: Path, out: Path, rollouts: int = 2) -> list[dict[str, float]]:
    pl.seed_everything(0)
    return fit_rollouts(task, PromptDataModule(str(path), batch_size=3, max_prompt_len=16), rollouts, out)


def test_a_verifier_without_its_column_is_refused_before_the_first_rollout(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "solution": 2, "level": 1}] * 3)
    task = _grpo()
    with pytest.raises(ValueError, match=rf"reward MathAccuracy needs the column 'answer', which "
                                         rf"--data.train_path={path} does not have \(its columns: solution, level\)"):
        _fit(task, path, tmp_path)
    assert task.rollouts_done == 0 and not (tmp_path / "rollouts.jsonl").exists()


def test_beta_zero_builds_and_runs_no_reference(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """beta=0: no reference module (no frozen copy, nothing placed), no reference forward (counted), the run summary
    says ``reference: none`` and objective/kl is not logged; beta=0.04 runs one reference forward per rollout."""
    path = _write(tmp_path / "p.jsonl", [{"prompt": f"{i}+{i}=", "answer": 2 * i} for i in range(6)])
    counts = {}
    for beta in (0.0, 0.04):
        task = _grpo(beta=beta)
        calls = []
        run_reference = task.run_reference
        task.run_reference = lambda *a, **k: calls.append(1) or run_reference(*a, **k)  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO, logger="lightning_llm"):
            rows = _fit(task, path, tmp_path / str(beta))
        counts[beta] = (len(calls), task.reference, task.frozen_models(), rows[-1])
        summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary"))
        assert ("reference: none" in summary) == (beta == 0)
        caplog.clear()
    calls, reference, frozen, row = counts[0.0]
    print(f"reference forwards over 2 rollouts: beta=0 {calls}, beta=0.04 {counts[0.04][0]}")
    assert calls == 0 and reference is None and frozen == {} and "objective/kl" not in row and "policy/kl_avg" not in row
    assert counts[0.04][0] == 2 and counts[0.04][1] is not None and "objective/kl" in counts[0.04][3]


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]


def test_rollouts_jsonl_of_grpo_and_ppo(tmp_path: Path) -> None:
    """One line per response with exactly the fields listed (GRPO and PPO), the reward the weighted sum of the
    sources, the logged per-source means and stds those of the lines, the columns of each prompt's record."""
    path = _write(tmp_path / "p.jsonl", [{"prompt": f"What is {i}+{i}?", "answer": 2 * i, "id": i} for i in range(6)])
    rows = _fit(_grpo(), path, tmp_path / "grpo")
    lines = _lines(tmp_path / "grpo")
    fields = ["step", "prompt", "response", "reward", "MathAccuracy", "digits", "advantage", "response_tokens",
              "truncated", "columns"]
    assert len(lines) == 2 * 3 * 4 and all(list(x) == fields for x in lines)
    for step, row in enumerate(rows):
        mine = [x for x in lines if x["step"] == step]
        assert len(mine) == 12 and all(x["columns"]["id"] == int(x["prompt"].split()[2].split("+")[0]) for x in mine)
        for name in ("MathAccuracy", "digits"):
            v = torch.tensor([x[name] for x in mine], dtype=torch.float64)
            assert abs(float(v.mean()) - row[f"rewards/{name}/mean"]) < 1e-6
            assert abs(float(v.std()) - row[f"rewards/{name}/std"]) < 1e-6
        assert all(abs(x["reward"] - (x["MathAccuracy"] + 0.5 * x["digits"])) < 1e-6 for x in mine)
        assert abs(sum(x["reward"] for x in mine) / 12 - row["objective/scores"]) < 1e-6
        for k in range(0, 12, 4):  # a group's advantages: its rewards centred (and scaled)
            group = mine[k:k + 4]
            assert abs(sum(x["advantage"] for x in group)) < 1e-4 and len({x["prompt"] for x in group}) == 1
    ppo = PPOTask("debug", model_overrides={"num_layers": 2}, log_rollouts=True,
                  generation=GenerationConfig(max_new_tokens=6), ppo=PPOConfig(ppo_epochs=1),
                  rewards=[RewardConfig(fn="lightning_llm.rl.rewards:MathAccuracy")])
    _fit(ppo, path, tmp_path / "ppo")
    lines = _lines(tmp_path / "ppo")
    assert len(lines) == 2 * 3 and [list(x) for x in lines] == [list(ROLLOUT_FIELDS[:4]) + ["MathAccuracy"] +
                                                                list(ROLLOUT_FIELDS[4:])] * 6
    assert all(x["response_tokens"] > 0 and isinstance(x["truncated"], bool) for x in lines)
