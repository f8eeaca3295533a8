"""Muon's checkpoints hold the momentum and resume exactly: at the same layout and resharded, in one launch of 2.

A zero3 x2 run saves after each of 3 Muon steps (the layout-free format: every Muon tensor's ``momentum_buffer``
beside AdamW's moments, keyed by name); from step 3 it resumes at zero3 x2 and, resharded, at tp x2 (its column and
row shards read from the FSDP2 shards' checkpoint) to step 6. Under DeepSpeed, deepspeed_zero2 and deepspeed_zero3 x2
runs save their own tag directories (the flat partitions' momentum in each rank's optimizer states) and resume at the
same preset; after their first resumed step, their momentum buffers, gathered by DeepSpeed's own
``safe_get_full_optimizer_state``, are one device's. All must be the uninterrupted one-device run from step 4 on
(train_loss, every step's gradients, the weights after the last step: the tolerances of ``test_muon_layouts``), and the
zero3 checkpoint's momentum buffers the one-device run's after step 3 (a lost or zeroed momentum is off by ~1). An AdamW
checkpoint resumed with Muon is refused in one line, and so is Muon with DeepSpeed's offloaded optimizer states. The
one-device reference is trained before the launch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.parallel.test_muon_layouts import GRAD_TOL, TOL

STEPS, HALF = 6, 3
TARGETS = ["zero3", "tp", "deepspeed_zero2", "deepspeed_zero3"]
DEEPSPEED = ["deepspeed_zero2", "deepspeed_zero3"]


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.strategies import TensorParallelStrategy, ZeroStrategy
    from lightning_llm.testing import gathered
    from lightning_llm.testing.muon import MomentumAt, merged, muon_fit

    if mode == "reference":
        momentum = MomentumAt(HALF, HALF + 1)
        ref = muon_fit("auto", 1, out / "ref", batch=8, steps=STEPS, callbacks=(momentum,))
        torch.save({**ref, "momentum": momentum.buffers}, out / "reference.pt")
        return
    muon_fit(ZeroStrategy(stage=3), 2, out / "save", batch=4, steps=HALF, save=True)
    ckpt = out / "save" / "ckpt" / "last.ckpt"
    results = {
        "zero3": merged(gathered(muon_fit(ZeroStrategy(stage=3), 2, out / "zero3", batch=4, steps=STEPS,
                                          ckpt_path=ckpt))),
        "tp": merged(gathered(muon_fit(TensorParallelStrategy(tensor_parallel_size=2), 2, out / "tp", batch=8,
                                       steps=STEPS, ckpt_path=ckpt)))}
    for preset in DEEPSPEED:  # DeepSpeed's own checkpoints, resumed at the same preset
        muon_fit(preset, 2, out / f"save-{preset}", batch=4, steps=HALF, save=True)
        momentum = MomentumAt(HALF + 1)
        results[preset] = merged(gathered(muon_fit(preset, 2, out / preset, batch=4, steps=STEPS, callbacks=(momentum,),
                                                   ckpt_path=out / f"save-{preset}" / "ckpt" / "last.ckpt")))
        results[preset]["momentum"] = momentum.buffers[HALF + 1]
    try:
        muon_fit("deepspeed_zero3_offload", 2, out / "offload", batch=4, steps=1)
        results["offload"] = ""
    except ValueError as e:
        results["offload"] = str(e)
    muon_fit(ZeroStrategy(stage=3), 2, out / "adamw", batch=4, steps=1, save=True, optim={"name": "adamw"})
    try:
        muon_fit(ZeroStrategy(stage=3), 2, out / "refused", batch=4, steps=2,
                 ckpt_path=out / "adamw" / "ckpt" / "last.ckpt")
        results["refused"] = ""
    except ValueError as e:
        results["refused"] = str(e)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "resumed.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing.muon import reference_then_launch

    return reference_then_launch(__file__, tmp_path_factory.mktemp("muon_resume"), _worker, "resume")


@pytest.mark.multiprocess
def test_checkpoint_holds_the_momentum(runs: Path) -> None:
    from lightning_llm.strategies.engine.hybrid_checkpoint import dcp_contents

    ref = torch.load(runs / "reference.pt")["momentum"][HALF]
    saved = dcp_contents(runs / "save" / "ckpt" / "last.ckpt")["optim_0"]
    buffers = {k.rpartition("/")[0]: v for k, v in saved.items() if k.endswith("/momentum_buffer")}
    assert set(buffers) == set(ref)  # every Muon tensor's, nothing else has one
    assert not any(k.rpartition("/")[0] in ref for k in saved if k.endswith("/exp_avg"))
    err = max((buffers[n] - b).abs().max().item() / b.abs().max().item() for n, b in ref.items())
    print(f"momentum buffers in the zero3 x2 checkpoint after step {HALF} vs one device's: max relative {err:.1e}")
    assert err <= GRAD_TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", TARGETS)
def test_resume_equals_one_device(runs: Path, target: str) -> None:
    from lightning_llm.testing.muon import compare_runs

    ref = torch.load(runs / "reference.pt")
    run = torch.load(runs / "resumed.pt")[target]
    assert run["start"] == HALF and all(len(c) == STEPS - HALF for c in run["losses"])
    err = compare_runs(run, ref, start=HALF)
    saved = target if target in DEEPSPEED else "zero3"
    print(f"{saved} x2 saved at step {HALF}, resumed at {target} x2 vs uninterrupted one device: train_loss "
          f"{err['loss']:.1e}, weights after the last step {err['params']:.1e}, gradients (relative) at the first resumed "
          f"step {err['grads0']:.1e}, at any {err['grads']:.1e}")
    assert err["loss"] <= TOL and err["params"] <= TOL and err["grads"] <= GRAD_TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", DEEPSPEED)
def test_deepspeed_resume_restores_the_momentum(runs: Path, preset: str) -> None:
    ref = torch.load(runs / "reference.pt")["momentum"][HALF + 1]
    got = torch.load(runs / "resumed.pt")[preset]["momentum"]
    assert set(got) == set(ref)  # every Muon tensor's
    err = max((got[n] - b).abs().max().item() / b.abs().max().item() for n, b in ref.items())
    print(f"{preset} x2 resumed at step {HALF}: momentum buffers after step {HALF + 1} vs one device's: max relative "
          f"{err:.1e}")
    assert err <= GRAD_TOL


@pytest.mark.multiprocess
def test_deepspeed_offloaded_states_refused(runs: Path) -> None:
    msg = torch.load(runs / "resumed.pt")["offload"]
    print(msg)
    assert "offloaded optimizer states" in msg and "--trainer.strategy=zero1/zero2/zero3" in msg and "\n" not in msg


@pytest.mark.multiprocess
def test_adamw_checkpoint_refused_by_muon(runs: Path) -> None:
    msg = torch.load(runs / "resumed.pt")["refused"]
    print(msg)
    assert "its optimizer has 2 param groups (AdamW), this run's has" in msg and "\n" not in msg


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
