"""Muon on the mixes that need 4 ranks equals one device, 6 steps, in one launch of 4 processes.

Tensor parallelism beside data parallelism: dp2 x tp2 with ZeRO-3 (a hidden matrix is a tp shard of an FSDP2 shard:
Newton-Schulz must gather it over both meshes), with ZeRO-1 (each parameter's owner on the data-parallel mesh holds a
tp shard) and with ZeRO-0 (both replicas hold the same tp shards), and pp2 x tp2. Compared as ``test_muon_layouts`` compares its 2-rank layouts (its tolerances): ``train_loss`` at every
step, the weights after the first and the last step, every step's gradients, the hidden matrices on Muon on every
rank, and Newton-Schulz called per step as often as one device, per matrix shape (ZeRO-3 x tp: the stacked experts
twice, by both tp ranks), no rank more than 60% of them (before, ZeRO-1/2 x tp orthogonalised the experts on every tp
rank and ZeRO-3 x tp every matrix on every rank). The
one-device reference is trained before the launch.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.parallel.test_muon_layouts import FIRST_TOL, GRAD_TOL, STEPS, TOL

LAYOUTS = ["dp2_tp2_zero3", "dp2_tp2_zero1", "dp2_tp2_zero0", "pp2_tp2"]


def _strategy(layout: str) -> tuple[Any, int]:
    """(strategy, per-rank batch): 8 rows per optimizer step in all."""
    from lightning_llm.strategies import HybridParallelStrategy

    if layout == "pp2_tp2":  # gpipe: the load-balancing loss of the global batch needs every micro-batch's routing
        return HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, pipeline_parallel_size=2,
                                      schedule="gpipe"), 8
    stage = int(layout[-1])
    return HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, zero_stage=stage), 4


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing.muon import fit_layouts

    fit_layouts(mode, out, LAYOUTS, _strategy, devices=4, steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing.muon import reference_then_launch

    return reference_then_launch(__file__, tmp_path_factory.mktemp("muon_4ranks"), _worker, "layouts", nproc=4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_on_four_ranks_equals_one_device(runs: Path, layout: str) -> None:
    from lightning_llm.testing.muon import check_layout

    run, ref, wrong, per_rank, total = check_layout(runs, layout, tol=TOL, first_tol=FIRST_TOL, grad_tol=GRAD_TOL)
    assert max(per_rank) <= 0.6 * total
    if layout != "dp2_tp2_zero3":
        assert not wrong, f"the ranks' Newton-Schulz calls by matrix shape differ from one device's at steps {wrong}"
        return
    # ZeRO-3 x tp: the 11 matrices sharded over dp x tp are dealt out over the 4 ranks; the stacked experts (split
    # along their stacked dim over dp, whole on their rank, repeated by its tp peer: 12 of the 23 matrices) are
    # orthogonalised where they are, by both tp ranks (optim/orthogonalize.py says why): 35 calls a step, not 23.
    experts = {(64, 32), (32, 64)}
    for step, want in enumerate(ref["ns_calls"]):
        summed = Counter()
        for calls in run["ns_calls"]:
            summed.update(calls[step])
        assert summed == Counter({s: n * (2 if s in experts else 1) for s, n in want.items()}), (step, summed, want)


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
