"""``--trainer.strategy.async_save=true``: checkpoints staged in host memory and written in the background.

One torchrun launch (2 CPU processes) runs: zero3 x2 with background saves every step for 3 steps; a tp x2 run
resumed from that checkpoint to step 6; a zero3 x2 run whose last background write fails (raised at the end of fit on
both ranks, the previous ``last.ckpt`` whole). The pytest process meanwhile runs the uninterrupted one-device curve
and, on one process, a failed write raised at a later step. Unit tests: a checkpoint appears under its name only once
written, a save of the same state does not wait, a new one does; the refusals. ``tests/checkpoints/test_reliability.py`` SIGKILLs
a background write.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.reliability import shutdown_process_group
from lightning_llm.testing import (
    checkpointed_fit,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    write_json_on_rank0,
)

STEPS, HALF = 6, 3
TOL = 1e-6


def _saved_step(path: Path) -> int:
    from lightning_llm.export import read_checkpoint

    return int(read_checkpoint(path)["global_step"])


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.strategies import HybridParallelStrategy, TensorParallelStrategy, ZeroStrategy

    if mode == "reference":
        ref = {"uninterrupted": checkpointed_fit(out / "ref", strategy="auto", devices=1, steps=STEPS, batch=8)}
        one = out / "one-failed"  # the write of save #2 (step 2) fails on the worker thread
        ref["failed_write"] = checkpointed_fit(one, strategy=lambda: HybridParallelStrategy(
            data_parallel_size=1, async_save=True), devices=1, steps=STEPS, batch=8, fault="raise:save=2:at=shards")
        ref["failed_write"]["last_step"] = _saved_step(one / "ckpt" / "last.ckpt")
        shutdown_process_group()  # the one-process engine's group, in the pytest process
        (out / "reference.json").write_text(json.dumps(ref))
        return
    zero3 = lambda: ZeroStrategy(stage=3, async_save=True)  # noqa: E731 - built while the fault is set
    runs = {"async": checkpointed_fit(out / "zero3", strategy=zero3, devices=2, steps=HALF, batch=4)}
    runs["resumed_tp2"] = checkpointed_fit(
        out / "tp2", strategy=lambda: TensorParallelStrategy(tensor_parallel_size=2, async_save=True), devices=2,
        steps=STEPS, batch=8, ckpt_path=str(out / "zero3" / "ckpt" / "last.ckpt"))
    failed = out / "zero3-failed"  # the last save's write fails: raised when fit ends
    runs["failed_last"] = checkpointed_fit(failed, strategy=zero3, devices=2, steps=HALF, batch=4,
                                           fault=f"raise:save={HALF}:at=shards")
    runs["failed_last"]["last_step"] = _saved_step(failed / "ckpt" / "last.ckpt")
    write_json_on_rank0(out / "layouts.json", gathered(runs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_save")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
def test_async_checkpoint_resumes_at_another_layout(runs: Path) -> None:
    """zero3 x2 saving in the background every step, resumed from its step-3 checkpoint under tp x2: both halves on
    the uninterrupted one-device curve."""
    full = json.loads((runs / "reference.json").read_text())["uninterrupted"]["losses"]
    for rank in json.loads((runs / "layouts.json").read_text()):
        first, resumed = rank["async"], rank["resumed_tp2"]
        assert "error" not in first and "error" not in resumed, (first, resumed)
        assert resumed["start"] == HALF and len(resumed["losses"]) == STEPS - HALF
        before, after = max_abs_err(first["losses"], full[:HALF]), max_abs_err(resumed["losses"], full[HALF:])
        print(f"zero3 x2 async steps 0-2: {before:.2e}; resumed from its checkpoint under tp x2, steps 3-5: "
              f"{after:.2e} (max |loss - one device|)")
        assert before <= TOL and after <= TOL


@pytest.mark.multiprocess
def test_failed_background_write_is_raised_naming_the_checkpoint(runs: Path) -> None:
    """The last save's write fails on the worker threads: fit ends with the error on both ranks, naming the
    checkpoint, and last.ckpt is the previous one, whole. On one process a failed write is raised before the run
    goes on for long (at the next step, or the next save, which waits for it)."""
    for rank in json.loads((runs / "layouts.json").read_text()):
        failed = rank["failed_last"]
        assert len(failed["losses"]) == HALF, failed  # every step ran: raised at the end of fit
        assert "last.ckpt: its background write failed" in failed.get("error", ""), failed
        assert f"injected fault at checkpoint save #{HALF}" in failed["error"]
        assert failed["last_step"] == HALF - 1
    one = json.loads((runs / "reference.json").read_text())["failed_write"]
    assert "last.ckpt: its background write failed" in one.get("error", ""), one
    assert len(one["losses"]) <= 3 < STEPS and one["last_step"] == 1, one


def _write_blocked(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    from lightning_llm.strategies.engine import hybrid_checkpoint as hc

    release = threading.Event()
    real = hc.dcp.save

    def slow(state: Any, checkpoint_id: Any, **kwargs: Any) -> Any:
        assert release.wait(30)
        return real(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(hc.dcp, "save", slow)
    return release


def test_a_checkpoint_is_listed_only_once_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While its shards are written, a background save exists only as ``.last.ckpt.partial``; the previous
    ``last.ckpt`` stays whole under its name; once written the new one replaces it. The staged copy is what gets
    written: the live weights changed meanwhile."""
    import torch

    from lightning_llm.strategies.engine import hybrid_checkpoint as hc
    from lightning_llm.strategies.engine.async_save import BackgroundSaves

    module = torch.nn.Linear(4, 4)
    path = tmp_path / "last.ckpt"
    module.weight.data.fill_(1.0)
    hc.save_hybrid(path, module=module, optimizers=[], metadata={"global_step": 1}, layout={}, is_global_zero=True)
    saves = BackgroundSaves(device=torch.device("cpu"))
    release = _write_blocked(monkeypatch)
    module.weight.data.fill_(2.0)
    state, _ = hc.checkpoint_state(module, [])
    staged = saves.stage(state, version=2)
    meta = hc.meta_bytes({"global_step": 2}, layout={}, optimizer_meta=[])
    saves.submit(path, lambda: hc.write_hybrid(path, staged, meta, is_global_zero=True))
    module.weight.data.fill_(3.0)  # training goes on
    time.sleep(0.2)
    assert saves.pending(path) and hc.consolidated_state_dict(path)["global_step"] == 1
    release.set()
    saves.close(raise_errors=True)
    loaded = hc.consolidated_state_dict(path)
    assert loaded["global_step"] == 2 and bool((loaded["state_dict"]["weight"] == 2.0).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_save_of_the_same_state_does_not_wait_a_new_one_does() -> None:
    import torch

    from lightning_llm.strategies.engine.async_save import BackgroundSaves

    saves = BackgroundSaves(device=torch.device("cpu"))
    release = threading.Event()
    state = {"w": torch.ones(3)}
    first = saves.stage(state, version=(1, 1))
    saves.submit("a.ckpt", lambda: release.wait(30))
    t = time.perf_counter()
    assert saves.stage(state, version=(1, 1)) is first  # top-k file and last.ckpt of one step: one copy
    assert time.perf_counter() - t < 0.5
    threading.Timer(0.5, release.set).start()
    t = time.perf_counter()
    state["w"].fill_(7.0)
    second = saves.stage(state, version=(2, 2))  # waits for the write reading the buffers it reuses
    assert time.perf_counter() - t >= 0.4 and float(second["w"][0]) == 7.0
    assert second["w"].data_ptr() == first["w"].data_ptr() != state["w"].data_ptr()  # copied into the same buffer
    state["v"] = torch.full((2,), 5.0)  # another structure (a new optimizer state): staged anew
    third = saves.stage(state, version=(3, 3))
    assert float(third["v"][1]) == 5.0 and float(third["w"][0]) == 7.0
    assert third["v"].data_ptr() != state["v"].data_ptr()
    saves.close(raise_errors=True)


def test_refusals(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_llm.strategies import HybridParallelStrategy, ZeroStrategy
    from lightning_llm.strategies.zero.deepspeed import DeepSpeedZeroStrategy

    with pytest.raises(ValueError, match="async_save=true is not available with DeepSpeed"):
        ZeroStrategy(stage=3, engine="deepspeed", async_save=True)
    with pytest.raises(ValueError, match="async_save=true is not available with DeepSpeed"):
        DeepSpeedZeroStrategy(stage=2, async_save=True)
    strategy = HybridParallelStrategy(data_parallel_size=1, async_save=True)
    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=str(tmp_path),
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), save_last="link")])
    with pytest.raises(ValueError, match=r"save_last='link'"):
        strategy.setup_background_saves(trainer)


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
