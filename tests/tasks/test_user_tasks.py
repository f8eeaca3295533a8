"""User-style task subclasses under every layout: each matches one device, or is refused before its first step.

Three subclasses of :class:`CausalLMTask`, written as a user would (no knowledge of DTensor or pipelines):

* ``SmoothedZLoss`` overrides ``loss_from_output``: label smoothing plus a z-loss ``logsumexp(logits)^2`` (under tp
  it used to crash on the vocab-sharded logits);
* ``TwoViews`` overrides ``compute_loss`` and calls the model twice (the batch, then its first half-sequence), as a
  consistency/DPO/contrastive loss does (under pp it used to train with a different loss, silently);
* ``LogitProbe`` adds its own module (a linear probe on the top-8 logits) trained with an auxiliary loss;
* ``SparseLabels`` masks a data-dependent share of the labels (as prompt masking does): ranks and micro-batches hold
  different numbers of labelled tokens.

One torchrun launch (2 CPU processes) fits each subclass for ``STEPS`` steps under every layout of :data:`LAYOUTS`
while the pytest process runs the same steps on one device. Compared per step: the ``train_loss`` every rank logs
(the mean over data-parallel replicas) against the one-device loss, bound 1e-5 (fp32, dropout 0). Layouts that cannot
run a subclass must refuse it before the first step with the message in :data:`REFUSED`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.tasks import CausalLMTask
from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
)

STEPS = 6
GLOBAL_BATCH = 8
TOL = 1e-5


class SmoothedZLoss(CausalLMTask):
    """Label smoothing + z-loss on the logits (PaLM's auxiliary loss)."""

    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        logits = output.float()
        ce = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, label_smoothing=0.1)
        return ce + 1e-3 * torch.logsumexp(logits, -1).pow(2).mean(), {}


class TwoViews(CausalLMTask):
    """Two model calls per step: the whole sequence and its first half, losses averaged."""

    def compute_loss(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        ids, labels = batch["input_ids"], batch["labels"]
        half = ids.shape[1] // 2
        full = self.model(ids)
        short = self.model(ids[:, :half])
        loss = (F.cross_entropy(full.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
                + F.cross_entropy(short.flatten(0, 1).float(), labels[:, :half].flatten(), ignore_index=-100))
        return loss / 2, {}


class LogitProbe(CausalLMTask):
    """Its own module: a probe on the top-8 logits, trained with an auxiliary loss."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.probe = nn.Linear(8, 1)

    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        loss, out = super().loss_from_output(output, batch, stage)
        top = output.float().topk(8, dim=-1).values  # [B, S, 8]
        return loss + 0.1 * (self.probe(top) - 1.0).pow(2).mean(), out


class SparseLabels(CausalLMTask):
    """Only some tokens carry a label, as in prompt-masked SFT data: ranks and micro-batches hold different numbers
    of them, so the one-device loss is a mean over tokens, not over ranks."""

    def on_after_batch_transfer(self, batch: dict[str, torch.Tensor], dataloader_idx: int) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"]  # [B, S]; the mask depends on the content only (samplers order rows differently)
        keep = (ids % 3 != 0) & (ids.sum(1, keepdim=True) % 4 != 1)
        return {**batch, "labels": batch["labels"].masked_fill(~keep, -100)}


SUBCLASSES = {"SmoothedZLoss": SmoothedZLoss, "TwoViews": TwoViews, "LogitProbe": LogitProbe,
              "SparseLabels": SparseLabels}


def _layouts() -> dict[str, tuple[Any, int]]:
    """name -> (strategy, per-rank batch size) for 2 processes."""
    from lightning_llm.strategies import (
        HybridParallelStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
        ZeroStrategy,
    )

    half = GLOBAL_BATCH // 2
    return {
        "ddp": ("ddp", half),
        "tp": (TensorParallelStrategy(), GLOBAL_BATCH),
        "pp_gpipe": (PipelineParallelStrategy(schedule="gpipe", n_microbatches=2), GLOBAL_BATCH),
        "pp_1f1b": (PipelineParallelStrategy(schedule="1f1b", n_microbatches=2), GLOBAL_BATCH),
        "zero1": (ZeroStrategy(stage=1), half),
        "zero2": (ZeroStrategy(stage=2), half),
        "zero3": (ZeroStrategy(stage=3), half),
        "deepspeed_zero2": (ZeroStrategy(stage=2, engine="deepspeed"), half),
        "3d_tp2_sp": (HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True),
                      GLOBAL_BATCH),
    }


LAYOUT_NAMES = ["ddp", "tp", "pp_gpipe", "pp_1f1b", "zero1", "zero2", "zero3", "deepspeed_zero2", "3d_tp2_sp"]
# (layout prefix, subclass) -> the start of the one-line refusal every rank raises before the first step
REFUSED = {
    ("pp", "TwoViews"): "--trainer.strategy=pp: TwoViews overrides compute_loss(). A pipeline runs the model once",
    ("pp", "LogitProbe"): "--trainer.strategy=pp: LogitProbe has trainable parameters outside self.model (probe.weight",
}


def _fit(cls: type, strategy: Any, devices: int, batch_size: int, out: Path) -> list[float]:
    """``STEPS`` steps; returns the ``train_loss`` this rank logged at each step."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks.base import OptimConfig

    pl.seed_everything(3)
    task = cls("debug", dropout=0.0, optim=OptimConfig(lr=3e-3, scheduler="constant"))
    dm = TextDataModule(block_size=32, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=100)
    rec = LoggedLoss()
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    results: dict[str, Any] = {}
    if mode == "reference":
        for name, cls in SUBCLASSES.items():
            results[name] = _fit(cls, "auto", 1, GLOBAL_BATCH, out)
        (out / "reference.json").write_text(json.dumps(results))
        return
    for layout in LAYOUT_NAMES:
        for name, cls in SUBCLASSES.items():
            strategy, batch = _layouts()[layout]
            try:
                row: dict[str, Any] = {"logged": _fit(cls, strategy, 2, batch, out)}
            except ValueError as e:
                row = {"error": str(e)}
            results[f"{layout}/{name}"] = gathered(row)
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("user_tasks")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("name", list(SUBCLASSES))
def test_user_subclass_under_layout(runs: Path, layout: str, name: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())[name]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05  # it learns
    per_rank = json.loads((runs / "layouts.json").read_text())[f"{layout}/{name}"]
    refusal = REFUSED.get((layout.split("_")[0], name))
    if refusal is not None:
        messages = [r.get("error", "") for r in per_rank]
        print(f"{layout} x {name}: refused: {messages[0]}")
        assert all(m.startswith(refusal) for m in messages), messages
        return
    assert all("error" not in r for r in per_rank), per_rank
    err = max(max_abs_err(r["logged"], ref) for r in per_rank)
    print(f"{layout} x {name}: max |logged train_loss - one device| over {STEPS} steps = {err:.2e}")
    assert err <= TOL


def test_contract_markers() -> None:
    """Only a loss whose every method from the model output on is marked receives vocab-sharded logits."""
    from lightning_llm.contract import task_accepts_sharded_logits

    assert task_accepts_sharded_logits(CausalLMTask("debug"))
    assert not task_accepts_sharded_logits(SmoothedZLoss("debug"))
    assert not task_accepts_sharded_logits(TwoViews("debug"))
    assert not task_accepts_sharded_logits(LogitProbe("debug"))


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
