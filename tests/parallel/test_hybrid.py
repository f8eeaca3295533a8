"""3-D strategy (``strategy=3d``): per-step parity with one device at six 4-process layouts, and config errors.

One torchrun launch of this file (4 CPU processes, gloo) trains the debug decoder for 6 steps at each layout in
turn, each with a fresh Trainer: dp2 x tp2, tp2 x pp2, dp2 x pp2 with ZeRO-1 on dp, dp2 x tp2 with ZeRO-3
(FSDP2 over dp on top of the TP shards) and with ZeRO-2 (owners of TP shards), and dp2 x tp2 with sequence
parallelism and 0.02 MiB gradient buckets, after the pytest process ran the same 6 steps on one device (every
parameter's first-step gradient compared per tensor: ``testing.run_layouts_and_reference``). The
global batch is 8 everywhere (per-rank batch 8 / dp); fp32, dropout 0, AdamW with eps=1 (update ~ lr x gradient),
gradient clipping by global norm 0.05 (active at every step, so a wrong norm across shards/stages changes the losses).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.testing import gradient_summary, max_abs_err, recorder_for, run_layouts_and_reference, run_worker

STEPS = 6
GLOBAL_BATCH = 8
CLIP = 0.05
TOL = 1e-5
# tag -> HybridParallelStrategy args (4 processes)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2_tp2": dict(data_parallel_size=2, tensor_parallel_size=2),
    "tp2_pp2": dict(data_parallel_size=1, tensor_parallel_size=2, pipeline_parallel_size=2, n_microbatches=2),
    "dp2_pp2_zero1": dict(data_parallel_size=2, pipeline_parallel_size=2, zero_stage=1, n_microbatches=2),
    "dp2_tp2_zero3": dict(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3),
    # owners over dp of TP shards: reduced to the owner, broadcast unpacked (a DTensor's shard cannot be packed)
    "dp2_tp2_zero2": dict(data_parallel_size=2, tensor_parallel_size=2, zero_stage=2),
    # Partial (sequence-parallel norm) and vocab-sharded gradients through many small dp buckets
    "dp2_tp2_sp_buckets": dict(data_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                               bucket_size_mb=0.02),
}


def fit(out: Path, strategy: Any, devices: int, *, tag: str, batch_size: int, steps: int = STEPS,
        ckpt_path: str | None = None, save_to: str | None = None, task_kwargs: dict[str, Any] | None = None,
        reference: str = "reference", rtol: float | None = None, **trainer_kwargs: Any) -> Any:
    """``steps`` steps of the debug decoder (optionally resumed from ``ckpt_path``, then saved to ``save_to``);
    rank 0 writes ``{tag}.json`` with every rank's per-step losses; the first step's gradients of a fit from scratch
    are recorded as ``tag``, against the one-device run named ``reference`` (within ``rtol``: the harness's default
    if None)."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.val: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(outputs["loss"]))

        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                self.val.append(float(trainer.callback_metrics["val_loss"]))

    pl.seed_everything(1)
    task_kwargs = {"optim": OptimConfig(lr=3e-3, scheduler="constant"), **(task_kwargs or {})}
    task = CausalLMTask("debug", dropout=0.0, **task_kwargs)
    dm = TextDataModule(block_size=32, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=100)
    class SaveAtEnd(pl.Callback):
        """Save in the last step's on_train_batch_end, as ModelCheckpoint does: mid-epoch loop state (a checkpoint
        saved after fit() returns records the epoch as finished)."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if save_to is not None and trainer.global_step == steps:
                trainer.save_checkpoint(save_to)

    rec = Record()
    grads = recorder_for(None if ckpt_path else tag, reference, rtol=rtol)  # a resumed fit's first step is not step 1
    kwargs = dict(max_steps=steps, gradient_clip_val=CLIP, limit_val_batches=0, num_sanity_val_steps=0)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(out), callbacks=[rec, SaveAtEnd(), *grads], **kwargs)
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    gathered: list[Any] = [(rec.losses, rec.val)]
    if torch.distributed.is_initialized():
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (rec.losses, rec.val))
    if int(os.environ.get("RANK", "0")) == 0:
        (out / f"{tag}.json").write_text(json.dumps({"losses": [g[0] for g in gathered],
                                                     "val": [g[1] for g in gathered]}))
    return trainer


def _worker(mode: str, out: Path, only: str | None = None) -> None:
    from lightning_llm.strategies import HybridParallelStrategy
    from lightning_llm.tasks.base import OptimConfig

    # eps=1: AdamW's update ~ lr x gradient for these tiny gradients, so a wrong global clipping norm changes the
    # losses (plain Adam is nearly invariant to the gradient's scale).
    task_kwargs = {"optim": OptimConfig(lr=2.0, eps=1.0, weight_decay=0.0, scheduler="constant")}
    times = {}
    if mode == "reference":
        fit(out, "auto", 1, tag="reference", batch_size=GLOBAL_BATCH, task_kwargs=task_kwargs)
        return
    for tag, args in LAYOUTS.items():
        if only and tag not in only.split(","):
            continue
        t0 = time.perf_counter()
        fit(out, HybridParallelStrategy(**args), 4, tag=tag, batch_size=GLOBAL_BATCH // args["data_parallel_size"],
            task_kwargs=task_kwargs)
        times[tag] = round(time.perf_counter() - t0, 1)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "times.json").write_text(json.dumps(times))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid")
    t0 = time.perf_counter()
    run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), nproc=4)
    print(f"\nwall time {time.perf_counter() - t0:.1f} s; seconds per layout {(out / 'times.json').read_text()}")
    return out


def global_losses(per_rank: list[list[float]]) -> list[float]:
    """Per-step loss of the global batch: the mean over ranks of each rank's loss (each reports its data-parallel
    group's loss - TP ranks compute it, pipeline ranks receive it from the last stage - and the groups have equal
    batches)."""
    assert len({len(r) for r in per_rank}) == 1
    return [sum(step) / len(step) for step in zip(*per_rank)]


max_err = max_abs_err


@pytest.mark.multiprocess
@pytest.mark.parametrize("tag", list(LAYOUTS))
def test_layout_matches_single_device(runs: Path, tag: str) -> None:
    """Every rank's per-step loss equals the single-device run within 1e-5 (pipeline ranks without the last stage
    report the loss broadcast from it)."""
    ref = json.loads((runs / "reference.json").read_text())["losses"][0]
    got = json.loads((runs / f"{tag}.json").read_text())["losses"]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05  # it learns
    losses = global_losses(got)
    err = max_err(losses, ref)
    print(f"{tag}: max |loss err| over {STEPS} steps = {err:.2e}; losses {[round(x, 5) for x in losses]}; "
          f"{gradient_summary(runs, tag)}")
    assert err <= TOL


def test_configuration_errors() -> None:
    import lightning.pytorch as pl

    from lightning_llm.strategies import HybridParallelStrategy

    with pytest.raises(ValueError, match="zero_stage=5"):
        HybridParallelStrategy(zero_stage=5)
    with pytest.raises(ValueError, match="zero_stage=3 with pipeline_parallel_size=2"):
        HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=3)
    with pytest.raises(ValueError, match="only one parallel degree may be -1"):
        HybridParallelStrategy(data_parallel_size=-1, tensor_parallel_size=-1)
    with pytest.raises(ValueError, match="multiply to 4, but the world size is 2"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=HybridParallelStrategy(data_parallel_size=2,
                                                                                 tensor_parallel_size=2))
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llm.strategies  # noqa: F401 - registers "3d"

    assert "3d" in StrategyRegistry


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]), *sys.argv[3:4])
