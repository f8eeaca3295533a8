"""The memory model's optimizer states follow ``--model.optim.name``: with Muon the hidden weight matrices keep one
momentum buffer (4 bytes per parameter in fp32, 2 in bf16) where AdamW keeps m and v (8, 4), the rest AdamW's.
Measured on the real optimizer after a step (live tensors, storages counted once: ``model_state_bytes``) on one device
(fp32 and bf16-true) and, in one torchrun launch of 2 ranks, under zero3 and tp: every rank's optimizer bytes equal
the estimate (``lightning_llm estimate --optim muon``'s function) up to AdamW's 0-d step counters, and the run
summary's memory line states the same figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

LAYOUTS = ["zero3", "tp"]


def _fit(strategy: Any, devices: int, out: Path, *, precision: str = "32-true", optimizer: str = "muon"
         ) -> dict[str, Any]:
    """Two steps of the debug decoder with ``optimizer``: this rank's model-state bytes before the second optimizer
    step (the states exist from the first on), the AdamW groups' tensors it holds, the estimate for the model as
    built (its vocabulary padded to the tokenizer's) with Muon's and with AdamW's states, and the run summary's
    memory line."""
    import lightning.pytorch as pl

    from lightning_llm import run_summary
    from lightning_llm.data import TextDataModule
    from lightning_llm.memory import estimate_layout
    from lightning_llm.strategies.zero.native import model_state_bytes
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    measured: dict[str, int] = {}
    adamw_tensors = [0]

    class Meter(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, task: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:
                measured.update(model_state_bytes(task, trainer.optimizers))
                adamw_tensors[0] = sum(len(g["params"]) for g in optimizer.param_groups if not g.get("muon"))

    pl.seed_everything(0, verbose=False)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(name=optimizer, lr=1e-3))
    data = TextDataModule(block_size=32, batch_size=2, cache_dir=str(out / "cache"), generated_docs=60,
                          val_fraction=0.0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Meter()], precision=precision,
                         default_root_dir=str(out / f"{strategy}-{precision}"))
    with mock.patch.object(run_summary.log, "info") as said:  # what the run summary logs
        trainer.fit(task, data)
    lines = [call.args[0] % call.args[1:] for call in said.call_args_list]
    layout = {"zero3": dict(dp=2, tp=1, stage=3), "tp": dict(dp=1, tp=2, stage=0)}.get(str(strategy),
                                                                                      dict(dp=1, tp=1, stage=0))
    est = {name: estimate_layout(task.model.config, pp=1, engine="native", batch_size=2, seq_len=32,
                                 precision=precision, fused_loss=True, optimizer=name, **layout)[0]
           for name in ("muon", "adamw")}
    memory = [ln for block in lines for ln in block.splitlines() if "estimated memory per rank" in ln]
    return {"measured": measured, "adamw_tensors": adamw_tensors[0], "summary": memory,
            "estimate": {name: {"params": e.params, "grads": e.grads, "optim": e.optim} for name, e in est.items()}}


def _check(name: str, run: dict[str, Any], *, bytes_per_value: int) -> None:
    """Optimizer bytes = the Muon estimate up to AdamW's step counters (a 4-byte 0-d tensor per tensor of its
    groups); the AdamW estimate would be off by the matrices' second state tensor."""
    got, est = run["measured"], run["estimate"]
    muon, adamw = est["muon"]["optim"], est["adamw"]["optim"]
    extra = got["optim"] - muon
    print(f"{name}: measured optimizer states {got['optim']:,} B; estimate with Muon {muon:,} B (+{extra} B of AdamW's "
          f"step counters over {run['adamw_tensors']} tensors), with AdamW's states {adamw:,} B")
    assert 0 <= extra <= 4 * run["adamw_tensors"], (got, est)
    assert adamw - muon > 8 * 4 * run["adamw_tensors"]  # the AdamW figure is far off: m and v for every matrix
    assert (adamw - muon) % bytes_per_value == 0
    assert got["params"] == est["muon"]["params"] and got["grads"] == est["muon"]["grads"]
    (line,) = run["summary"]
    assert f"optimizer (muon) {muon / 2**20:.1f}" in line, line


@pytest.mark.parametrize(("precision", "bytes_per_value"), [("32-true", 4), ("bf16-true", 2)])
def test_muon_states_on_one_device_equal_the_estimate(tmp_path: Path, precision: str, bytes_per_value: int) -> None:
    run = _fit("auto", 1, tmp_path, precision=precision)
    _check(f"one device {precision}", run, bytes_per_value=bytes_per_value)
    # the matrices hold half AdamW's bytes: what the AdamW figure overstates is their momentum's size again
    est = run["estimate"]
    assert est["adamw"]["optim"] - est["muon"]["optim"] > 0.3 * est["adamw"]["optim"]


def _worker(out: Path) -> None:
    from lightning_llm.testing import gathered, write_json_on_rank0

    write_json_on_rank0(out / "muon.json", {layout: gathered(_fit(layout, 2, out)) for layout in LAYOUTS})


@pytest.mark.multiprocess
def test_muon_states_under_zero3_and_tp_equal_the_estimate(tmp_path: Path) -> None:
    from lightning_llm.testing import launch, wait

    wait(launch(__file__, 2, str(tmp_path)), timeout=900)
    res = json.loads((tmp_path / "muon.json").read_text())
    for layout, ranks in res.items():
        for rank, run in enumerate(ranks):
            if rank:
                run["summary"] = ranks[0]["summary"]  # rank 0 logs the run summary
            _check(f"{layout} x2 rank {rank}", run, bytes_per_value=4)


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, Path(sys.argv[1]))


def test_muon_under_deepspeed_is_estimated_not_refused() -> None:
    """DeepSpeed steps the task's Muon on its fp32 partitions (``strategies/zero/deepspeed_partitions.py``): a hidden
    matrix holds DeepSpeed's fp32 master copy and one fp32 momentum buffer (8 bytes) where AdamW holds the master, m and
    v (12), in any precision; the run summary's estimate once refused this layout and stopped the run."""
    from lightning_llm.memory import optimizer_bytes_per_param

    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        assert optimizer_bytes_per_param("muon", "deepspeed", precision) == (12, 8)
        assert optimizer_bytes_per_param("adamw", "deepspeed", precision) == (12, 12)
    assert optimizer_bytes_per_param("muon", "native", "32-true") == (8, 4)
