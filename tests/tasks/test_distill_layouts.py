"""Distillation under every layout against one device: ``ddp``, ``tp``, ``pp`` and ``zero3`` (ONE torchrun launch of
2 ranks running them in turn), the one-device run computed before the launch. A Llama student learns from a wider
Qwen2 teacher (both written by transformers: the teacher is placed like the student, its vocabulary-sharded head
beside the student's under tp, its stages under pp, its shards under zero3), half the steps on the student's own
samples (``lmbda=0.5``: the draws and the sampled responses the same at every layout), half on the dataset's. Per
step ``train_loss`` within 1e-5, and the first step's gradients of every student parameter (before AdamW, whose first
step would hide their scale) within 1e-5 of their largest value; the path the divergence took (the heads'
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
import torch

from lightning_llm.testing import (
    LoggedLoss,
    full_gradients,
    gathered,
    launch,
    max_abs_err,
    run_worker,
    table_trainer,
    two_rank_layout,
    wait,
    write_json_on_rank0,
)

STEPS = 4
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero3"]


class FirstGradients(LoggedLoss):
    """The losses, whether each step sampled, and the student's whole gradients before the first optimizer step (a
    collective: every rank gathers; under a pipeline each rank has its stages')."""

    def __init__(self) -> None:
        super().__init__()
        self.on_policy: list[float] = []
        self.grads: dict[str, torch.Tensor] = {}
        self.teacher_bytes = 0  # of the teacher's parameters on this rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        super().on_train_start(trainer, pl_module)
        self.teacher_bytes = model_state_bytes(pl_module.teacher_model, [])["params"]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:
            self.grads = {k: v.float().cpu() for k, v in full_gradients(pl_module.model).items()}

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
    rec = FirstGradients()
    paths: set[str] = set()

    def spy(*args: Any, **kwargs: Any) -> Any:  # which path the student's divergence took
        paths.add("vocab-parallel" if kwargs.get("group") is not None else "chunked")
        return chunked(*args, **kwargs)

    chunked = head_divergence.fused_linear_divergence
    with mock.patch.object(head_divergence, "fused_linear_divergence", spy):
        table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return {"losses": rec.losses, "on_policy": rec.on_policy, "grads": rec.grads, "paths": sorted(paths),
            "teacher_bytes": rec.teacher_bytes}


def _worker(mode: str, out: Path) -> None:
    results = {}
    for layout in LAYOUTS:
        rows = gathered(_fit(layout, 2, out, out / layout))
        grads: dict[str, torch.Tensor] = {}
        for row in rows:  # a pipeline rank holds its stages' gradients: their union is the model's
            grads.update(row.pop("grads"))
        results[layout] = rows
        if torch.distributed.get_rank() == 0:
            torch.save(grads, out / f"{layout}.grads.pt")
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.conftest import tiny_hf_llama
    from tests.tasks.test_distill import _tiny_qwen2

    out = tmp_path_factory.mktemp("distill-layouts")
    _tiny_qwen2(out / "teacher", tiny_hf_llama(out / "student"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the one-device run, before the launch
        ref = _fit("1", 1, out, out / "one-device")
    finally:
        torch.set_num_threads(threads)
    torch.save(ref.pop("grads"), out / "one-device.grads.pt")
    (out / "reference.json").write_text(json.dumps(ref))
    wait(launch(__file__, 2, "layouts", str(out)), timeout=1500)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_device(runs: Path, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())
    assert set(ref["on_policy"]) == {0.0, 1.0}, ref["on_policy"]  # both kinds of step are compared
    assert ref["paths"] == ["chunked"] and ref["teacher_bytes"] > 0
    ref_grads = torch.load(runs / "one-device.grads.pt")
    grads = torch.load(runs / f"{layout}.grads.pt")
    assert sorted(grads) == sorted(ref_grads) and len(ref_grads) > 10
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
    rows = json.loads((runs / "layouts.json").read_text())[layout]
    # the chunked divergence (on a pipeline's last stage), on the heads' vocabulary shards under tp
    paths = sorted({p for row in rows for p in row["paths"]})
    assert paths == (["vocab-parallel"] if layout == "tp" else ["chunked"]), paths
    for row in rows:
        err = max_abs_err(row["losses"], ref["losses"])
        print(f"{layout}: max |train_loss - one device| over {STEPS} steps = {err:.2e}; first-step gradients "
              f"max |diff| = {grad_err:.2e} (largest {scale:.2e}); on-policy steps {row['on_policy']}")
        assert row["on_policy"] == ref["on_policy"]
        assert err <= TOL, (row["losses"], ref["losses"])
        # the teacher placed like the student: a share of it on each rank (whole under ddp)
        assert row["teacher_bytes"] <= (ref["teacher_bytes"] if layout == "ddp" else 0.6 * ref["teacher_bytes"])
    assert grad_err <= TOL * scale, grad_err


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
