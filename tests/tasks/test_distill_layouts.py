"""Distillation under every layout against one device: ``ddp``, ``tp``, ``pp`` and ``zero3`` (ONE torchrun launch of
2 ranks running them in turn), the one-device run computed before the launch. A Llama student learns from a wider
Qwen2 teacher (both written by transformers: the teacher is placed like the student, its vocabulary-sharded head
beside the student's under tp, its stages under pp, its shards under zero3), half the steps on the student's own
samples (``lmbda=0.5``: the draws and the sampled responses the same at every layout), half on the dataset's. Per
step ``train_loss`` within 1e-5, and the first step's gradients of every student parameter (before AdamW, whose first
step would hide their scale) within 1e-5 of each one's largest value (the layout harness's records,
:func:`~lightning_llm.testing.run_layouts_and_reference`); the path the divergence took (the heads'
vocabulary shards under tp, whole heads elsewhere) and the teacher's bytes on a rank (a share of them, but under
ddp)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest

from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    gradient_summary,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    two_rank_layout,
    write_json_on_rank0,
)

STEPS = 4
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero3"]


class Recorded(LoggedLoss):
    """The losses, whether each step sampled, the teacher's bytes on this rank, and (the harness's records, ``grads``)
    the first step's whole gradients."""

    def __init__(self, grads: str) -> None:
        super().__init__(grads, reference="one-device")
        self.on_policy: list[float] = []
        self.teacher_bytes = 0  # of the teacher's parameters on this rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        super().on_train_start(trainer, pl_module)
        self.teacher_bytes = model_state_bytes(pl_module.teacher_model, [])["params"]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        self.on_policy.append(float(args[0].sampled))


def _fit(layout: str, devices: int, dirs: Path, out: Path) -> dict[str, Any]:
    from lightning_llm.data import InstructionDataModule
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.kernels.loss import head_divergence
    from lightning_llm.tasks import DistillTask
    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(11)
    task = DistillTask(str(dirs / "student"), teacher=str(dirs / "teacher"), divergence="jsd", beta=0.4,
                       temperature=0.9, lmbda=0.5, seed=2,
                       generation=GenerationConfig(max_new_tokens=8, do_sample=True, temperature=1.2),
                       optim=OptimConfig(lr=1e-2, scheduler="constant", weight_decay=0.0))
    dm = InstructionDataModule(tokenizer_dir=str(dirs / "student"), template="alpaca", generated_conversations=64,
                               cutoff_len=96, batch_size=batch)
    rec = Recorded("one-device" if devices == 1 else layout)
    paths: set[str] = set()

    def spy(*args: Any, **kwargs: Any) -> Any:  # which path the student's divergence took
        paths.add("vocab-parallel" if kwargs.get("group") is not None else "chunked")
        return chunked(*args, **kwargs)

    chunked = head_divergence.fused_linear_divergence
    with mock.patch.object(head_divergence, "fused_linear_divergence", spy):
        table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return {"losses": rec.losses, "on_policy": rec.on_policy, "paths": sorted(paths), "teacher_bytes": rec.teacher_bytes}


def _worker(mode: str, out: Path) -> None:
    write_json_on_rank0(out / "layouts.json", {layout: gathered(_fit(layout, 2, out, out / layout)) for layout in LAYOUTS})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import tiny_hf_llama
    from tests.tasks.test_distill import _tiny_qwen2

    out = tmp_path_factory.mktemp("distill-layouts")
    _tiny_qwen2(out / "teacher", tiny_hf_llama(out / "student"))

    def reference() -> None:
        (out / "reference.json").write_text(json.dumps(_fit("1", 1, out, out / "one-device")))

    return run_layouts_and_reference(__file__, out, reference, timeout=1500)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_device(runs: Path, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())
    assert set(ref["on_policy"]) == {0.0, 1.0}, ref["on_policy"]  # both kinds of step are compared
    assert ref["paths"] == ["chunked"] and ref["teacher_bytes"] > 0
    rows = json.loads((runs / "layouts.json").read_text())[layout]
    # the chunked divergence (on a pipeline's last stage), on the heads' vocabulary shards under tp
    paths = sorted({p for row in rows for p in row["paths"]})
    assert paths == (["vocab-parallel"] if layout == "tp" else ["chunked"]), paths
    for row in rows:
        err = max_abs_err(row["losses"], ref["losses"])
        print(f"{layout}: max |train_loss - one device| over {STEPS} steps = {err:.2e}; on-policy steps "
              f"{row['on_policy']}; {gradient_summary(runs, layout)}")
        assert row["on_policy"] == ref["on_policy"]
        assert err <= TOL, (row["losses"], ref["losses"])
        # the teacher placed like the student: a share of it on each rank (whole under ddp)
        assert row["teacher_bytes"] <= (ref["teacher_bytes"] if layout == "ddp" else 0.6 * ref["teacher_bytes"])


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
