"""The tests' launcher (``lightning_llm/testing/zygote.py``) gives a rank what torchrun gives it.

A script launched on 2 ranks through the zygote and through ``torchrun`` reports its environment, thread count,
Lightning's rank-zero flag, argv and working directory, and all-reduces over gloo: the two launches must agree. A rank
that fails ends the job (the other rank, sleeping, is stopped), and a CLI run's error reaches the caller.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lightning_llm.testing import launch, run_cli, wait

SCRIPT = '''
import json, os, sys, time
import torch, torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

out, mode = sys.argv[1], sys.argv[2]
if mode == "fail":
    if os.environ["RANK"] == "1":
        sys.exit(3)
    time.sleep(120)
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS")
report = {"env": {k: os.environ.get(k) for k in keys}, "run_id": "TORCHELASTIC_RUN_ID" in os.environ,
          "threads": torch.get_num_threads(), "rank_zero": rank_zero_only.rank, "argv": sys.argv[1:],
          "cwd": os.getcwd(), "sum": t.item(), "name": __name__, "path0": sys.path[0]}
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
'''


def _reports(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, launcher: str) -> list[dict]:
    monkeypatch.setenv("LIGHTNING_LLM_TEST_LAUNCHER", launcher)
    out = tmp_path / name
    out.mkdir()
    wait(launch(tmp_path / "script.py", 2, str(out), "ok"), 300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
def test_a_rank_sees_what_torchrun_gives_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    forked = _reports(tmp_path, "zygote", monkeypatch, "zygote")
    real = _reports(tmp_path, "torchrun", monkeypatch, "torchrun")
    for r, (got, want) in enumerate(zip(forked, real, strict=True)):
        print(f"rank {r}: zygote {got}\n        torchrun {want}")
        assert got["argv"][1:] == want["argv"][1:] == ["ok"]
        assert {k: v for k, v in got.items() if k != "argv"} == {k: v for k, v in want.items() if k != "argv"}
        assert got["env"]["RANK"] == str(r) and got["rank_zero"] == r and got["sum"] == 3.0 and got["threads"] == 1


@pytest.mark.multiprocess
def test_a_failed_rank_ends_the_job(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) failed: exit code 3; stopping the others"):
        wait(launch(tmp_path / "script.py", 2, str(tmp_path), "fail"), 100)
    assert time.monotonic() - t0 < 60  # rank 0 (sleeping 120 s) was stopped


@pytest.mark.multiprocess
def test_a_cli_error_reaches_the_caller(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="--trainer.strategy='zero4': unknown strategy"):
        run_cli(["fit", "--config", str(Path(__file__).parents[2] / "configs" / "pretrain_debug.yaml"),
                 "--trainer.strategy=zero4"], cwd=tmp_path)


PROBE = '''
import json, sys
import huggingface_hub.constants

with open(sys.argv[1], "w") as f:
    json.dump({"offline": huggingface_hub.constants.HF_HUB_OFFLINE, "path": sys.path}, f)
'''


@pytest.mark.multiprocess
def test_a_launch_sees_its_own_import_time_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zygote keeps what it read at start and import (``sys.path`` from ``PYTHONPATH``, huggingface_hub's
    ``HF_HUB_OFFLINE``): a launch asking for other values gets a zygote started with them, and the next launch with
    the session's values still gets the session's."""
    (tmp_path / "probe.py").write_text(PROBE)
    extra = tmp_path / "on_path"
    extra.mkdir()

    def probe(name: str) -> dict:
        wait(launch(tmp_path / "probe.py", 1, str(tmp_path / name)), 300)
        return json.loads((tmp_path / name).read_text())

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = probe("before.json")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(extra), os.environ.get("PYTHONPATH")])))
    other = probe("other.json")
    monkeypatch.undo()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    after = probe("after.json")
    assert other["offline"] is True and str(extra) in other["path"]
    assert before["offline"] is after["offline"] is False
    assert str(extra) not in before["path"] and str(extra) not in after["path"]
