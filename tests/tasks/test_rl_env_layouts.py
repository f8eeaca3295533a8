"""Multi-turn rollouts under every layout: GRPO and PPO with a 3-turn environment (``testing.rl.DigitsEnv``, its
opening and messages a function of the record and the conversation) under ddp, tp, pp and zero3 (GRPO also through
the pipeline's stages and with ZeRO-3's per-layer gathers) against one device, in
one launch of 2 processes (the one-device runs before it): the same episodes token by token, the same messages in
rollouts.jsonl, every logged statistic within 1e-5 and the parameters within 1e-4."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.testing import run_worker
from lightning_llm.testing.rl import compare_fits, layout_runs, rl_fit

_ENV = {"cls": "lightning_llm.testing.rl:DigitsEnv", "kwargs": {"greeting": "Count with me, briefly."},
        "max_turns": 3, "max_total_tokens": 200}
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # sampled from per-prompt draws; turns end at a lower-case letter or EOS (then the template's end-of-turn token is appended)
    "grpo": ("grpo", {"generation": {"max_new_tokens": 8, "do_sample": True, "eos_token_id": [258, *range(97, 123)]},
                      "rewards": [{"fn": "lightning_llm.testing.rl:PairedDigits", "weight": 0.5}], "env": _ENV,
                      "log_rollouts": True, "grpo": {"num_generations": 4, "epochs": 2, "beta": 0.04,
                                                     "loss_type": "dapo"}}),
    # greedy; a quarter of the tokens end a turn; a budget that ends the episodes with a longer opening (odd records:
    # a system message) after their second turn
    "ppo": ("ppo", {"generation": {"max_new_tokens": 8, "do_sample": False, "eos_token_id": [258, *range(5, 258, 4)]},
                    "rewards": [{"fn": "lightning_llm.testing.rl:PairedDigits"}], "env": {**_ENV, "max_total_tokens": 170},
                    "log_rollouts": True,
                    "ppo": {"ppo_epochs": 2, "num_mini_batches": 1, "kl_coef": 0.05, "whiten_rewards": True}}),
}
LAYOUTS = ["ddp", "tp", "pp", "zero3"]
RUNS = [(spec, layout) for spec in SPECS for layout in LAYOUTS] + [("grpo", "pp_stages"), ("grpo", "zero3_per_layer")]
"""Both specs under ddp, tp, pp and zero3; GRPO also decoding through the pipeline's stages (a lock-step decoder that
keeps each stage's cache) and with ZeRO-3's per-layer all-gathers (the replicas decode every turn together, the
rows of ended episodes kept and masked)."""
DATA = {"template": "chatml", "max_prompt_len": 40}


def _fit(spec: str, layout: str, out: Path) -> dict[str, Any]:
    kind, settings = SPECS[spec]
    return rl_fit(kind, settings, out / f"{spec}-{layout}", prompts=out / "prompts.jsonl", layout=layout, steps=4,
                  data=DATA)


def _worker(mode: str, out: Path) -> None:
    for spec, layout in ([(s, "1") for s in SPECS] if mode == "reference" else RUNS):
        _fit(spec, layout, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout of both specs in one launch of 2 processes; the one-device runs computed before it."""
    out = tmp_path_factory.mktemp("rl_env_layouts")
    return layout_runs(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("spec", "layout"), RUNS)
def test_environment_episodes_match_one_device(runs: Path, spec: str, layout: str) -> None:
    """Data-parallel replicas run their own prompts' episodes (their own environments); the ranks of a tensor- or
    pipeline-parallel replica run the same episodes, the environments stepped on the replica's first rank and their
    messages broadcast; every turn decoded with the KV cache kept, the whole conversation scored in one forward with
    the policy's tokens alone learned: 2 ranks reproduce one device."""
    one, other = runs / f"{spec}-1", runs / f"{spec}-{layout}"
    errs = compare_fits(one, other)
    lines = [json.loads(x) for x in (other / "rollouts.jsonl").read_text().splitlines()]
    turns = [sum(m["learned"] for m in x["messages"]) for x in lines]
    rows = json.loads((other / "rows.json").read_text())
    print(f"{spec} under {layout}: max |stat - one device| {errs['stats']:.1e}, params {errs['params']:.1e}, "
          f"rollouts.jsonl {errs['rollouts']:.1e}; turns per episode {[turns.count(k) for k in (1, 2, 3)]} (1, 2, 3); "
          f"env reward {[round(r['rewards/env/mean'], 4) for r in rows]}")
    assert errs["stats"] < 1e-5 and errs["params"] < 1e-4 and errs["rollouts"] < 1e-5
    assert max(turns) == 3 and min(turns) < 3  # 3-turn episodes, and some that ended earlier
    assert all(x["messages"][0]["role"] == ("system" if x["columns"]["number"] % 2 else "user") for x in lines)


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
