"""Chat SFT and chat DPO (conversations with a system message and history, rendered with Qwen2's ChatML template on a
tokenizer built here) under ddp x2 / tp x2 / pp x2 / zero3 x2: every parameter's first-step gradient equals one
device's (per tensor: the harness's check, ``testing.run_layouts_and_reference``) and the logged train_loss of every
step one device's within 1e-5. One torchrun launch runs every layout of both tasks after this process ran the
one-device references."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.chat_fixtures import build_tokenizer

from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    gradient_summary,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
)

STEPS = 6
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero3"]
TASKS = ["sft", "dpo"]


def _write_data(out: Path) -> None:
    """The tokenizer and the two data files, written before the launch (every rank reads the same)."""
    from lightning_llm.data.chat.messages import make_conversations

    build_tokenizer(out / "tokenizer", "qwen2")
    convs = make_conversations(64, seed=3)
    (out / "sft.jsonl").write_text("".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs))
    pairs = [{"prompt": c["messages"][:-1], "chosen": c["messages"][-1]["content"],
              "rejected": c["messages"][-1]["content"][::-1] + "?"} for c in convs]
    (out / "dpo.jsonl").write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))


def _fit(task_name: str, layout: str, devices: int, out: Path) -> list[float]:
    """``STEPS`` steps of ``task_name``; the first step's gradients recorded as ``task_name/layout`` (one device:
    ``task_name``)."""
    import lightning.pytorch as pl

    import lightning_llm.strategies  # noqa: F401 - registers tp, pp, zero3
    from lightning_llm.data import InstructionDataModule, PreferenceDataModule
    from lightning_llm.rl.losses.dpo import DPOConfig
    from lightning_llm.tasks import DPOTask, SFTTask
    from lightning_llm.tasks.base import OptimConfig

    strategy = layout if devices > 1 else "auto"
    batch = 8 if devices == 1 or layout in ("tp", "pp") else 4  # global batch 8 (pairs for DPO)
    pl.seed_everything(7)
    optim = OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0)
    tokenizer = str(out.parent / "tokenizer")
    if task_name == "sft":
        task: Any = SFTTask("debug", model_overrides={"num_layers": 2}, dropout=0.0, generate_in=[], optim=optim)
        dm: Any = InstructionDataModule(str(out.parent / "sft.jsonl"), tokenizer, cutoff_len=96, batch_size=batch)
    else:
        task = DPOTask("debug", model_overrides={"num_layers": 2}, dpo=DPOConfig(beta=0.5), optim=optim)
        dm = PreferenceDataModule(str(out.parent / "dpo.jsonl"), tokenizer, cutoff_len=96, max_prompt_len=64,
                                  generated_val_pairs=0, batch_size=batch)
    rec = LoggedLoss(grads=f"{task_name}/{layout}" if devices > 1 else task_name, reference=task_name)
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        ref = {task: _fit(task, "1", 1, out / f"ref-{task}") for task in TASKS}
        (out / "reference.json").write_text(json.dumps(ref))
        return
    results = {f"{task}/{layout}": gathered(_fit(task, layout, 2, out / f"{task}-{layout}"))
               for task in TASKS for layout in LAYOUTS}
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chat_layouts")
    _write_data(out)
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chat_layout_matches_one_device(runs: Path, task: str, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())[task]
    assert len(ref) == STEPS and ref[-1] < ref[0]  # it learns
    print(f"chat {task} {layout}: {gradient_summary(runs, f'{task}/{layout}')}")
    for rank, losses in enumerate(json.loads((runs / "layouts.json").read_text())[f"{task}/{layout}"]):
        err = max_abs_err(losses, ref)
        print(f"chat {task} {layout} rank {rank}: max |train_loss - one device| over {STEPS} steps = {err:.2e}")
        assert err <= TOL, (losses, ref)


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
