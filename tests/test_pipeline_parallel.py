"""Pipeline-parallel strategy (``strategy=pp``): parity with one device, activation memory, checkpoints, errors.

The multi-process test launches this file twice: once as a plain single-device reference run and once under
torchrun (2 CPU processes, gloo) running every schedule one after the other in the same process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_llm.models import build_model
from lightning_llm.strategies.pipeline_parallel import PipelineParallelStrategy
from lightning_llm.strategies.pipeline_split import (
    prune_model, split_layers, stage_module, stage_ranks, stage_specs,
)
from lightning_llm.testing import free_port

STEPS = 10
# (schedule, stages_per_rank, measure_activations)
PP_RUNS = [("gpipe", 1, True), ("1f1b", 1, True), ("interleaved_1f1b", 2, False)]


# ---------------------------------------------------------------------------------------------------- worker
def _fit(out: Path, strategy: Any, devices: int, *, tag: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import full_parameters

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.val: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.losses.append(float(outputs["loss"]))

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                self.val.append(float(trainer.callback_metrics["val_loss"]))

    def make() -> tuple[Any, Any]:
        pl.seed_everything(1)
        task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-3, scheduler="constant"))
        dm = TextDataModule(block_size=32, batch_size=8, cache_dir=str(out / "cache"), generated_docs=100)
        return task, dm

    rec = Record()
    task, dm = make()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=0.5, limit_val_batches=2, val_check_interval=5, num_sanity_val_steps=1,
                         callbacks=[rec], default_root_dir=str(out))
    trainer.fit(task, dm)
    params = full_parameters(task)
    result: dict[str, Any] = {"losses": rec.losses, "val": rec.val}
    if devices > 1:  # each pipeline rank holds its shard: merge the names
        shards: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shards, params)
        params = {k: v for s in shards for k, v in s.items()}
        result["step_stats"] = trainer.strategy.step_stats
        if tag == "1f1b":  # checkpoint: save the shards, load them into a fresh split model, validate
            ckpt = out / "pp-ckpt"
            trainer.save_checkpoint(ckpt)
            task2, dm2 = make()
            strat = PipelineParallelStrategy(schedule="1f1b", n_microbatches=4)
            t2 = pl.Trainer(accelerator="cpu", devices=2, strategy=strat, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=2)
            (metrics,) = t2.validate(task2, dm2, ckpt_path=str(ckpt), verbose=False)
            result["val_after_load"] = metrics["val_loss"]
            result["ckpt_files"] = sorted(p.name for p in ckpt.iterdir())
    else:
        (metrics,) = trainer.validate(task, dm, verbose=False)
        result["val_after_load"] = metrics["val_loss"]
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(params, out / f"{tag}.pt")
        (out / f"{tag}.json").write_text(json.dumps(result))
    return result


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        _fit(out, "auto", 1, tag="reference")
        return
    for schedule, v, measure in PP_RUNS:
        strat = PipelineParallelStrategy(schedule=schedule, n_microbatches=4, stages_per_rank=v,
                                         measure_activations=measure)
        _fit(out, strat, 2, tag=schedule)


def _launch(mode: str, out: Path, nproc: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, __file__, mode, str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *cmd[1:]]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)} failed\n{out[-8000:]}")


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
def test_schedules_match_single_device(tmp_path: Path) -> None:
    """10 steps of the debug decoder (fp32, AdamW, grad clipping 0.5, validation every 5 steps): GPipe, 1F1B and
    interleaved 1F1B (2 virtual stages per rank) on 2 processes equal one device within 1e-5 in every step's
    loss, the final parameters and the validation loss; 1F1B's checkpoint shards load back."""
    # The reference (1 process) and the pipeline runs (torchrun, 2 processes) are independent: run them together.
    ref_proc, pp_proc = _launch("reference", tmp_path, 1), _launch("pp", tmp_path, 2)
    _wait(ref_proc)
    _wait(pp_proc)
    ref = json.loads((tmp_path / "reference.json").read_text())
    ref_params = torch.load(tmp_path / "reference.pt")
    assert len(ref["losses"]) == STEPS and ref["losses"][0] != ref["losses"][-1]
    for schedule, _, measure in PP_RUNS:
        got = json.loads((tmp_path / f"{schedule}.json").read_text())
        params = torch.load(tmp_path / f"{schedule}.pt")
        assert sorted(params) == sorted(ref_params)
        loss_err = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        param_err = max((params[k] - ref_params[k]).abs().max().item() for k in ref_params)
        assert len(got["val"]) == 2  # validation after steps 5 and 10 (ref["val"][2] is its final validate())
        val_err = max(abs(a - b) for a, b in zip(got["val"], ref["val"][:2], strict=True))
        print(f"{schedule}: max |loss err| {loss_err:.2e}  max |param err| {param_err:.2e}  "
              f"max |val_loss err| {val_err:.2e}  losses {[round(x, 5) for x in got['losses']]}")
        assert loss_err <= 1e-5 and param_err <= 1e-5 and val_err <= 1e-5
        stats = got["step_stats"]
        assert len(stats) == STEPS and all(0.0 <= f < 1.0 for s in stats for f in s["idle_frac"])
        if measure:  # peak live activations in micro-batches, per pipeline rank (steps after the first)
            peak = [max(s["peak_act_bytes"][r] / s["act_bytes_per_mb"][r] for s in stats[1:]) for r in range(2)]
            print(f"{schedule}: peak live activations per rank = {[round(p, 2) for p in peak]} micro-batches (m=4)")
            if schedule == "gpipe":
                assert all(p >= 3.5 for p in peak)  # all m=4 micro-batches alive at the end of the forwards
            else:
                assert peak[0] <= 2.5 and peak[1] <= 1.5  # 1F1B: stage r holds at most p - r micro-batches
    got = json.loads((tmp_path / "1f1b.json").read_text())
    print(f"val_loss after loading the 1f1b checkpoint {got['val_after_load']:.6f} vs reference "
          f"{ref['val_after_load']:.6f}; files {got['ckpt_files']}")
    assert got["ckpt_files"] == ["pp-stage-rank-00.ckpt", "pp-stage-rank-01.ckpt"]
    assert abs(got["val_after_load"] - ref["val_after_load"]) <= 1e-5


def test_split_views_compose_to_full_model() -> None:
    """Stage views run in sequence reproduce the full model; pruning keeps only the local shard, with global names."""
    torch.manual_seed(0)
    model = build_model("debug", family="decoder")
    ids = torch.randint(0, 256, (2, 16))
    full = model(ids)
    layers = split_layers(model, 4)
    assert layers == [("0",), ("1",), ("2",), ("3",)]
    owners = stage_ranks(2, 2)
    assert owners == [0, 1, 0, 1] and stage_ranks(2, 2, style="v") == [0, 1, 1, 0]
    x = ids
    for s in range(4):
        (spec,) = [sp for sp in stage_specs(layers, owners[s], owners) if sp.index == s]
        x = stage_module(model, spec)(x)
    err = (x - full).abs().max().item()
    print(f"composed stages vs full model: max abs err {err:.2e}")
    assert err == 0.0
    prune_model(model, stage_specs(layers, 1, owners))  # rank 1: stages 1 and 3 (last)
    names = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers") else "") for n, _ in
             model.named_parameters()}
    assert names == {"layers.1", "layers.3", "norm", "lm_head"}


def test_split_balance_and_points() -> None:
    model = build_model("debug", family="decoder", num_layers=6)
    assert split_layers(model, 4) == [("0", "1"), ("2", "3"), ("4",), ("5",)]
    assert split_layers(model, 2, split_points=[4]) == [("0", "1", "2", "3"), ("4", "5")]
    # by parameters the encoder's 21128 x 64 embedding weighs on the first stage: it gets fewer blocks
    enc6 = build_model("debug", family="encoder", num_layers=6, num_labels=2)
    assert split_layers(enc6, 2) == [("0", "1", "2"), ("3", "4", "5")]
    assert split_layers(enc6, 2, balance="params") == [("0",), ("1", "2", "3", "4", "5")]
    enc = build_model("debug", family="encoder", num_labels=2)
    assert split_layers(enc, 2) == [("0",), ("1",)]


def test_configuration_errors() -> None:
    model = build_model("debug", family="decoder")
    with pytest.raises(ValueError, match="5 stages, but the model has only 4 layers"):
        split_layers(model, 5)
    with pytest.raises(ValueError, match="split_points"):
        split_layers(model, 2, split_points=[0])
    with pytest.raises(ValueError, match="schedule="):
        PipelineParallelStrategy(schedule="pipedream")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stages_per_rank=2: must be 1"):
        PipelineParallelStrategy(schedule="1f1b", stages_per_rank=2)
    from lightning.pytorch.trainer.states import TrainerFn

    strat = PipelineParallelStrategy(n_microbatches=4)
    fake = SimpleNamespace(datamodule=SimpleNamespace(batch_size=6), state=SimpleNamespace(fn=TrainerFn.FITTING))
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by n_microbatches=4"):
        strat._check_batch_size(fake)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="bubble"):
        PipelineParallelStrategy(schedule="gpipe", n_microbatches=1)._check_microbatches(2)
    with pytest.raises(ValueError, match="n_microbatches=1"), pytest.warns(UserWarning):
        PipelineParallelStrategy(schedule="1f1b", n_microbatches=1)._check_microbatches(2)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
