"""QK-Clip (``--model.optim.qk_clip_tau``, Kimi K2's MuonClip) clips the same heads on tp, cp and ddp as on one
device, in one launch of 2 processes (the one-device reference trained before it).

The Muon test model (fused ``W_pack``: q and k rows of a clipped head times sqrt(tau / max)) at tau = 0.095, which
clips 1 to 3 of its 8 heads at each of 6 steps. Compared with one device at every step: each head's largest logit
(reduced over the replicas; under tp each rank's own heads, under cp each rank's queries against the whole rows'
keys: an all-gather of the keys) and which heads were clipped, the logged ``qk_clip/max_logit`` and
``qk_clip/heads_clipped``; after the last step the weights (1e-5) and every step's gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parallel.test_muon_layouts import GRAD_TOL, TOL

TAU = 0.095
STEPS = 6
LAYOUTS = ["ddp", "tp", "cp"]


def _fit(strategy: Any, devices: int, out: Path, batch: int) -> dict[str, Any]:
    from lightning_llm.testing.muon import QKClipRecord, muon_fit

    rec = QKClipRecord()
    run = muon_fit(strategy, devices, out, batch=batch, steps=STEPS, optim={"qk_clip_tau": TAU}, callbacks=(rec,))
    return {**run, "history": rec.history, "logged": rec.logged}


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.strategies import TensorParallelStrategy
    from lightning_llm.testing import gathered
    from lightning_llm.testing.muon import merged

    if mode == "reference":
        torch.save(_fit("auto", 1, out / "ref", batch=8), out / "reference.pt")
        return
    results = {}
    for layout in LAYOUTS:
        strategy = TensorParallelStrategy(tensor_parallel_size=2) if layout == "tp" else layout
        every = gathered(_fit(strategy, 2, out / layout, batch=4 if layout == "ddp" else 8))
        results[layout] = {**merged(every), "history": [r["history"] for r in every],
                           "logged": [r["logged"] for r in every]}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "layouts.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing.muon import reference_then_launch

    return reference_then_launch(__file__, tmp_path_factory.mktemp("muon_qk_clip"), _worker, "layouts")


def _heads(history: list[list[dict[str, torch.Tensor]]], layout: str) -> list[dict[str, torch.Tensor]]:
    """Every step's per-layer maxima over all heads: a tp rank's heads concatenated in rank order; replicas (ddp,
    cp) hold the same ones."""
    if layout == "tp":
        return [{k: torch.cat([rank[i][k] for rank in history]) for k in history[0][i]} for i in range(STEPS)]
    for step0, step1 in zip(*history, strict=True):
        assert all(torch.equal(step0[k], step1[k]) for k in step0)
    return history[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_qk_clip_clips_the_same_heads(runs: Path, layout: str) -> None:
    from lightning_llm.testing.muon import compare_runs

    ref = torch.load(runs / "reference.pt")
    run = torch.load(runs / "layouts.pt")[layout]
    want, got = ref["history"], _heads(run["history"], layout)
    assert len(want) == len(got) == STEPS
    every = torch.cat([m for step in want for m in step.values()])
    clipped = [sum(int((m > TAU).sum()) for m in step.values()) for step in want]
    # a clip decision no rounding can flip, and a table that clips some heads and spares others
    assert (every - TAU).abs().min() > 1e-5 and all(0 < c < every.numel() // STEPS for c in clipped)
    err = max((g[k] - w[k]).abs().max().item() / TAU for g, w in zip(got, want) for k in w)
    same = all(torch.equal(g[k] > TAU, w[k] > TAU) for g, w in zip(got, want) for k in w)
    logged = max(abs(a - b) for rank in run["logged"] for x, y in zip(rank, ref["logged"], strict=True)
                 for a, b in zip(x, y))
    assert [round(x[1]) for x in ref["logged"]] == clipped and all(
        abs(x[0] - max(m.max().item() for m in step.values())) < 1e-7 for x, step in zip(ref["logged"], want))
    err_run = compare_runs(run, ref)
    print(f"{layout}: heads clipped per step {clipped} (one device) - the same heads: {same}; per-head max logit "
          f"vs one device (relative to tau) {err:.1e}; logged max_logit/heads_clipped {logged:.1e}; weights after "
          f"{STEPS} steps {err_run['params']:.1e}, gradients (relative) {err_run['grads']:.1e}")
    assert same and err <= TOL and logged <= TOL
    assert err_run["loss"] <= TOL and err_run["params"] <= TOL and err_run["grads"] <= GRAD_TOL


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
