"""SimPO, ORPO (DPOTask without a reference) and KTO (KTOTask) against one device under every layout, in one torchrun
launch of 2 ranks: the logged train_loss and rewards/margins of every step, and for SimPO/ORPO that no reference
model exists and no reference pass runs at any layout (KTO's reference passes counted as a check the counter
counts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.testing import (
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
    two_rank_layout,
)
from tests.tasks.test_dpo import Logged

STEPS = 4
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero3", "deepspeed_zero2", "3d"]
LOSSES = ["simpo", "orpo", "kto"]
RUNS = [f"{loss}@{layout}" for loss in LOSSES for layout in LAYOUTS] + ["kto-on_the_fly@ddp", "kto-on_the_fly@pp"]


def _fit(loss: str, layout: str, devices: int, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import PreferenceDataModule, UnpairedPreferenceDataModule
    from lightning_llm.rl.dpo import DPOConfig
    from lightning_llm.rl.kto import KTOConfig
    from lightning_llm.tasks import DPOTask, KTOTask
    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(5)
    optim = OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0)
    name, _, reference = loss.partition("-")
    data = dict(cutoff_len=32, max_prompt_len=16, batch_size=batch)
    task: Any
    if name == "kto":
        task = KTOTask("debug", model_overrides={"num_layers": 2}, optim=optim,
                       kto=KTOConfig(beta=0.5, reference=reference or "precomputed"))
        dm: Any = UnpairedPreferenceDataModule(generated_examples=64, generated_val_examples=8, **data)
    else:
        cfg = DPOConfig(beta=2.0, loss_type=name, simpo_gamma=0.5) if name == "simpo" else DPOConfig(beta=0.5,
                                                                                                   loss_type=name)
        task = DPOTask("debug", model_overrides={"num_layers": 2}, optim=optim, dpo=cfg)
        dm = PreferenceDataModule(generated_pairs=64, generated_val_pairs=8, **data)
    calls = []
    passes = task.no_grad_logps
    task.no_grad_logps = lambda *a, **k: calls.append(1) or passes(*a, **k)  # every reference (and KL) pass
    rec = Logged()
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return {"losses": rec.losses, "margins": rec.margins, "frozen_bytes": rec.frozen_bytes, "passes": len(calls),
            "reference": task.reference is not None or bool(task.frozen_models()) or bool(task.reference_table)}


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        refs = {loss: _fit(loss, "1", 1, out / f"ref-{loss}") for loss in [*LOSSES, "kto-on_the_fly"]}
        (out / "reference.json").write_text(json.dumps(refs))
        return
    results = {}
    for run in RUNS:
        loss, layout = run.split("@")
        results[run] = gathered(_fit(loss, layout, 2, out / run.replace("@", "-")))
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("preference-layouts")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RUNS)
def test_layout_matches_one_device(runs: Path, run: str) -> None:
    loss, layout = run.split("@")
    refs = json.loads((runs / "reference.json").read_text())
    ref = refs[loss]
    assert max_abs_err(refs["kto-on_the_fly"]["losses"], refs["kto"]["losses"]) <= TOL  # both reference modes agree
    assert ref["margins"][-1] > ref["margins"][0] + 0.1  # it learns: the reward margin grows
    for row in json.loads((runs / "layouts.json").read_text())[run]:
        err = max(max_abs_err(row["losses"], ref["losses"]), max_abs_err(row["margins"], ref["margins"]))
        print(f"{run}: max |train_loss, rewards/margins - one device| over {STEPS} steps = {err:.2e}; "
              f"reference/KL passes on this rank {row['passes']} (one device {ref['passes']})")
        assert err <= TOL, (row["losses"], ref["losses"])
        if loss in ("simpo", "orpo"):  # no reference model, table or pass at any layout
            assert not row["reference"] and not ref["reference"] and row["passes"] == ref["passes"] == 0
            assert row["frozen_bytes"] == 0
        else:  # KTO: the KL pass every step (+ the reference's on the fly; precomputed: its table before step 1)
            assert row["passes"] >= STEPS and ref["reference"]


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
