"""A crash at every moment of a checkpoint save, under every sharded layout: the resume loads the previous or the
new checkpoint whole, and the curve continues exactly from it.

One torchrun launch (2 CPU processes) runs, per layout of :data:`LAYOUTS` and moment of
:data:`~lightning_llm.reliability.SAVE_MOMENTS`: a fit that saves ``last.ckpt`` every step and crashes on every rank
in step 2's save (``LIGHTNING_LLM_FAULT=raise:save=2:at=MOMENT``), then a fresh Trainer that resumes from
``last.ckpt`` to the end. The pytest process runs one uninterrupted device meanwhile (and the same crashes for the
single-file checkpoint of one device). Asserted: the resume starts at step 1 (crash before publishing) or 2 (after),
and every resumed loss equals the uninterrupted one (fp32, dropout 0). ``tests/checkpoints/test_reliability.py`` adds real
SIGKILLs, of all ranks and of one rank between the ranks' writes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.reliability import SAVE_MOMENTS
from lightning_llm.testing import (
    checkpointed_fit,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    write_json_on_rank0,
)

STEPS = 4
CRASHED_SAVE = 2  # the save of step 2's last.ckpt (one save per step)
TOL = 1e-5
LAYOUTS = ["zero3", "pp", "3d", "deepspeed_zero2", "deepspeed_zero3"]


def _fit(layout: str, devices: int, out: Path, *, fault: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Train to ``STEPS`` (from ``last.ckpt`` when ``resume``); the losses logged and the step it started from."""
    from lightning_llm.strategies import HybridParallelStrategy

    strategy: Any = ("auto" if layout == "1" else
                     (lambda: HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)) if layout == "3d"
                     else layout)
    return checkpointed_fit(out, strategy=strategy, devices=devices, steps=STEPS, fault=fault,
                            batch=8 if devices == 1 or layout in ("pp", "3d") else 4,
                            ckpt_path=str(out / "ckpt" / "last.ckpt") if resume else None)


def _cells(layout: str, devices: int, out: Path) -> dict[str, Any]:
    cells = {}
    for moment in SAVE_MOMENTS:
        run = out / f"{layout}-{moment}"
        crashed = _fit(layout, devices, run, fault=f"raise:save={CRASHED_SAVE}:at={moment}")
        cells[moment] = {"crash": crashed.get("error", ""), **_fit(layout, devices, run, resume=True)}
    return cells


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        ref = {"uninterrupted": _fit("1", 1, out / "ref"), "cells": _cells("1", 1, out)}
        (out / "reference.json").write_text(json.dumps(ref))
        return
    write_json_on_rank0(out / "layouts.json", {layout: gathered(_cells(layout, 2, out)) for layout in LAYOUTS})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("save_faults")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", SAVE_MOMENTS)
@pytest.mark.parametrize("layout", ["1 device", *LAYOUTS])
def test_crash_during_save_resumes_from_a_whole_checkpoint(runs: Path, layout: str, moment: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())
    full = ref["uninterrupted"]["losses"]
    assert len(full) == STEPS and "error" not in ref["uninterrupted"]
    per_rank = ([ref["cells"]] if layout == "1 device"
                else json.loads((runs / "layouts.json").read_text())[layout])
    expected_start = CRASHED_SAVE if moment == "published" else CRASHED_SAVE - 1
    for cells in per_rank:
        cell = cells[moment]
        assert cell["crash"].startswith(f"injected fault at checkpoint save #{CRASHED_SAVE}"), cell["crash"]
        assert "error" not in cell, cell["error"]
        assert cell["start"] == expected_start, cell
        resumed = cell["losses"]
        assert len(resumed) == STEPS - expected_start
        err = max_abs_err(resumed, full[expected_start:])
        assert err <= TOL, (resumed, full)
    print(f"{layout}, crash at '{moment}' of step {CRASHED_SAVE}'s save: resumed from step {expected_start}, "
          f"max |loss - uninterrupted| = {err:.2e}")


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
