"""PPO and GRPO on the 4-process layouts, 2 data-parallel replicas of 2 tensor- or pipeline-parallel ranks, against one
device, in one launch of 4 processes: statistics are summed over the replicas (not the world), a replica's ranks draw
the same tokens for its prompts, and a prompt's columns stay with it. The 2-process layouts are test_ppo.py's and
test_grpo.py's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.testing import run_worker
from lightning_llm.testing.rl import GRPO_SPECS, PPO_SPEC, compare_fits, held_bytes, layout_runs, rl_fit

LAYOUTS = ["dp2_tp2", "dp2_pp2"]
RUNS = {"ppo/base": 8, "grpo/dapo": 8, "grpo/rlvr": 4}
"""Spec -> optimizer steps (PPO: today's settings; GRPO: today's, and the 2026 recipe's with dynamic sampling)."""


def _fit(run: str, layout: str, out: Path) -> dict[str, Any]:
    kind, _, spec = run.partition("/")
    return rl_fit(kind, PPO_SPEC if kind == "ppo" else GRPO_SPECS[spec], out / f"{kind}-{spec}-{layout}",
                  prompts=out / "prompts.jsonl", layout=layout, steps=RUNS[run])


def _worker(mode: str, out: Path) -> None:
    for run in RUNS:
        for layout in (["1"] if mode == "reference" else LAYOUTS):
            _fit(run, layout, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rl_replicas")
    return layout_runs(__file__, out, lambda: _worker("reference", out), nproc=4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("run", list(RUNS))
def test_two_replicas_of_two_ranks_match_one_device(runs: Path, run: str, layout: str) -> None:
    name = run.replace("/", "-")
    one, other = runs / f"{name}-1", runs / f"{name}-{layout}"
    errs = compare_fits(one, other)
    frozen, whole = held_bytes(other, "frozen"), held_bytes(one, "frozen")[0]
    rows = json.loads((other / "rows.json").read_text())
    print(f"{run} under {layout}: max |stat - one device| {errs['stats']:.1e}, params {errs['params']:.1e}, "
          f"rollouts.jsonl {errs['rollouts']:.1e}; reference bytes per rank {frozen} (one device {whole}); scores "
          f"{[round(r['objective/scores'], 4) for r in rows]}")
    assert errs["stats"] < 1e-5 and errs["params"] < 1e-4 and errs["rollouts"] < 1e-5
    assert max(frozen) <= 0.55 * whole if whole else max(frozen) == 0


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
