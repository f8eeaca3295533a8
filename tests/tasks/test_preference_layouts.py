"""SimPO, ORPO (DPOTask without a reference) and KTO (KTOTask) against one device under every layout, in one torchrun
launch of 2 ranks: the logged train_loss and rewards/margins of every step, and for SimPO/ORPO that no reference
model exists and no reference pass runs at any layout (KTO's reference passes counted as a check the counter
counts); KTO's precomputed table equals one device's, each data-parallel replica computing half of it.

Resume on changed data (DPO and KTO, precomputed reference) under zero3, tp, pp and deepspeed_zero2 beside one
device: 1 step on a file, then ``ckpt_path`` with one record of the file changed is refused in one line naming the
checkpoint and the first item that differs (its file and line), before any reference log-prob is recomputed; with
the file unchanged it resumes from the checkpoint's table (zero3, deepspeed_zero2: nothing recomputed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.testing import (
    gathered,
    max_abs_err,
    gradient_summary,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
    two_rank_layout,
)
from tests.tasks.test_dpo import Logged, check_reference_table, counted_reference_rows

STEPS = 4
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero3", "deepspeed_zero2", "3d"]
LOSSES = ["simpo", "orpo", "kto"]
RUNS = [f"{loss}@{layout}" for loss in LOSSES for layout in LAYOUTS] + ["kto-on_the_fly@ddp", "kto-on_the_fly@pp"]
RESUME_LAYOUTS = ["zero3", "tp", "pp", "deepspeed_zero2"]
RESUMES = [f"{task}@{layout}" for task in ("dpo", "kto") for layout in RESUME_LAYOUTS]
SAME_DATA = {"dpo@zero3", "kto@deepspeed_zero2"}
"""Where the unchanged file is also resumed (a step on from the checkpoint's table)."""
CHANGED_LINE = 6
EXAMPLES = 16


def _fit(loss: str, layout: str, devices: int, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import PreferenceDataModule, UnpairedPreferenceDataModule
    from lightning_llm.rl.losses.dpo import DPOConfig
    from lightning_llm.rl.losses.kto import KTOConfig
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
    rows = counted_reference_rows(task)
    rec = Logged(grads=loss if devices == 1 else f"{loss}@{layout}", reference=loss)
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    table = task.reference_table.get("fit")
    return {"losses": rec.losses, "margins": rec.margins, "frozen_bytes": rec.frozen_bytes, "passes": len(calls),
            "reference": task.reference is not None or bool(task.frozen_models()) or bool(task.reference_table),
            "table": table.tolist() if table is not None else None, "precomputed_rows": sum(rows)}


def write_data(out: Path) -> None:
    """The resume runs' files: pairs (DPO) and feedback (KTO), and each again with line ``CHANGED_LINE``'s
    response changed."""
    from lightning_llm.data.preference import make_preference_pairs
    from lightning_llm.data.unpaired import make_unpaired_records

    for name, records, key in (("pairs", make_preference_pairs(EXAMPLES, seed=1), "chosen"),
                               ("feedback", make_unpaired_records(EXAMPLES, seed=1), "completion")):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        records[CHANGED_LINE - 1] = {**records[CHANGED_LINE - 1], key: records[CHANGED_LINE - 1][key] + "!"}
        (out / f"{name}-changed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _resume_fit(task_name: str, layout: str, devices: int, out: Path, data: Path, *, steps: int,
                resume: str | None) -> dict[str, Any]:
    """One fit of the resume runs (see the module docstring): the error it ended with, or the step it started from;
    and which splits it precomputed."""
    import lightning.pytorch as pl

    from lightning_llm.data import PreferenceDataModule, UnpairedPreferenceDataModule
    from lightning_llm.rl.losses.dpo import DPOConfig
    from lightning_llm.rl.losses.kto import KTOConfig
    from lightning_llm.tasks import DPOTask, KTOTask
    from lightning_llm.testing import LoggedLoss

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(5)
    common = dict(model_overrides={"num_layers": 2})
    data_args = dict(val_fraction=0.0, cutoff_len=32, max_prompt_len=16, batch_size=batch)
    if task_name == "kto":
        task: Any = KTOTask("debug", kto=KTOConfig(beta=0.5), **common)
        dm: Any = UnpairedPreferenceDataModule(str(data), **data_args)
    else:
        task = DPOTask("debug", dpo=DPOConfig(beta=0.5), **common)
        dm = PreferenceDataModule(str(data), **data_args)
    precomputed: list[str] = []
    passes = task.precompute_reference
    task.precompute_reference = lambda split: precomputed.append(split) or passes(split)
    rec = LoggedLoss()
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=[rec],
                            save_every_step=True)
    row: dict[str, Any] = {"precomputed": precomputed}
    try:
        trainer.fit(task, dm, ckpt_path=resume)
        row["start"] = rec.start
    except ValueError as e:
        row["error"] = str(e)
    return row


def _resume_runs(run: str, devices: int, out: Path) -> dict[str, Any]:
    task_name, layout = run.split("@")
    data = out.parent / ("feedback" if task_name == "kto" else "pairs")
    first = _resume_fit(task_name, layout, devices, out, data.with_suffix(".jsonl"), steps=1, resume=None)
    ckpt = str(out / "ckpt" / "last.ckpt")
    runs = {"first": first, "ckpt": ckpt}
    if devices == 1 or run in SAME_DATA:
        runs["same"] = _resume_fit(task_name, layout, devices, out, data.with_suffix(".jsonl"), steps=2, resume=ckpt)
    runs["changed"] = _resume_fit(task_name, layout, devices, out, data.parent / f"{data.name}-changed.jsonl",
                                  steps=3, resume=ckpt)
    return runs


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        refs = {loss: _fit(loss, "1", 1, out / f"ref-{loss}") for loss in [*LOSSES, "kto-on_the_fly"]}
        refs.update({f"resume-{task}": _resume_runs(f"{task}@1", 1, out / f"ref-resume-{task}") for task in ("dpo", "kto")})
        (out / "reference.json").write_text(json.dumps(refs))
        return
    results = {}
    for run in RUNS:
        loss, layout = run.split("@")
        results[run] = gathered(_fit(loss, layout, 2, out / run.replace("@", "-")))
    for run in RESUMES:  # last: a refused resume leaves its trainer behind
        results[f"resume {run}"] = gathered(_resume_runs(run, 2, out / f"resume-{run.replace('@', '-')}"))
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("preference-layouts")
    write_data(out)
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
              f"reference/KL passes on this rank {row['passes']} (one device {ref['passes']}); "
              f"{gradient_summary(runs, run)}")
        assert err <= TOL, (row["losses"], ref["losses"])
        if loss in ("simpo", "orpo"):  # no reference model, table or pass at any layout
            assert not row["reference"] and not ref["reference"] and row["passes"] == ref["passes"] == 0
            assert row["frozen_bytes"] == 0
        else:  # KTO: the KL pass every step (+ the reference's on the fly; precomputed: its table before step 1)
            assert row["passes"] >= STEPS and ref["reference"]
        if loss == "kto":  # the precomputed table: one device's, each data-parallel replica computing half of it
            check_reference_table(run, layout, row, ref)


def _first_changed(task_name: str, runs: Path) -> tuple[int, str]:
    """The first item whose rows differ between the file and the changed file (the rows compared here, not their
    digests), and its record's place."""
    from lightning_llm.data import PreferenceDataModule, UnpairedPreferenceDataModule

    cls = UnpairedPreferenceDataModule if task_name == "kto" else PreferenceDataModule
    name = "feedback" if task_name == "kto" else "pairs"
    rows = []
    for path in (runs / f"{name}.jsonl", runs / f"{name}-changed.jsonl"):
        dm = cls(str(path), val_fraction=0.0, cutoff_len=32, max_prompt_len=16)
        dm.setup("fit")
        rows.append([(r["chosen"], r["rejected"]) for r in dm.split_dataset("fit")])
    first = next(i for i, (a, b) in enumerate(zip(*rows)) if a != b)
    return first, f"{runs / name}-changed.jsonl:{first + 1}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RESUMES)
def test_resume_on_changed_data_is_refused_on_every_layout(runs: Path, run: str) -> None:
    task_name, layout = run.split("@")
    first, record = _first_changed(task_name, runs)
    assert task_name == "dpo" and first == CHANGED_LINE - 1 or task_name == "kto" and first <= CHANGED_LINE - 1
    item = "example" if task_name == "kto" else "pair"
    expected = f"the first that differs is {item} {first} ({record})"
    ref = json.loads((runs / "reference.json").read_text())[f"resume-{task_name}"]
    for name, rows in (("one device", [ref]), (layout, json.loads((runs / "layouts.json").read_text())[f"resume {run}"])):
        for row in rows:
            error = row["changed"].get("error", "")
            print(f"{run} ({name}): {error}")
            assert error.startswith(f"--ckpt_path={row['ckpt']}: its precomputed reference log-probs were computed "
                                    f"on other fit {item}s than the datamodule holds") and "\n" not in error
            assert expected in error, error
            assert row["first"]["precomputed"] == ["fit", "validate"] and row["changed"]["precomputed"] == []
            if "same" in row:  # the unchanged file: resumed on the checkpoint's table, nothing recomputed
                assert row["same"] == {"precomputed": [], "start": 1}, row["same"]


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
