"""Muon (``--model.optim.name=muon``) under every layout equals one device, 6 steps, in one launch of 2 processes.

The model (:data:`lightning_llm.testing.muon.MODEL`) holds every kind of hidden matrix: Baichuan's fused ``W_pack``
(q, k, v orthogonalised apart), a dense MLP and stacked experts (each expert's gate, up and down apart). Layouts: ddp
(Newton-Schulz shared out over the replicas, results broadcast), zero1 and zero2 (each parameter's owner), zero3
(FSDP2 shards sent whole to an owner rank by all-to-all and back), tp with sequence parallelism (column and row shards
the same way over the tp mesh), pp, cp (replicas over dp x cp), ep (a rank's experts whole on it), 3d = ep2 x
ZeRO-3 (the experts' and the rest's shards), and DeepSpeed's deepspeed_zero1/2/3 (the task's optimizer
stepped by DeepSpeed on its flat fp32 partitions, each parameter's runs sent whole to an owner rank by all-to-all and
back), ZeRO-3 also with small sub-groups (several partitions, each stepped apart, per param group). The one-device reference is trained before the launch.

Compared with one device: ``train_loss`` at every step on every rank and the weights after the last step (1e-5) and
after the first (4e-6), and the full gradients before each optimizer step (relative: 1e-5 at the first step, 1e-4 at
any: a gradient off by a factor, which Muon's orthogonalisation and Adam's normalisation would hide in the weights,
is off by ~1); every rank's optimizer holds the hidden matrices in its Muon groups, the rest in AdamW's; and at every
step the ranks together call Newton-Schulz as often as one device, per matrix shape (a matrix left on AdamW, or trained
as SGD, orthogonalised twice or in pieces, changes the count), each rank at most 3/4 of them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 6
TOL = 1e-5
FIRST_TOL = 4e-6
"""The first step's update comes from gradients equal up to fp32 rounding: a bf16 rounding of Newton-Schulz's input
flips here and there (measured 9e-7); Newton-Schulz on each shard instead of whole matrices (Megatron's blockwise)
is off by 1.5e-5 there, and by 8e-5 after 6 steps."""
GRAD_TOL = 1e-4
"""Relative, at any step: the weights' rounding differences of the steps before (measured 2e-5; blockwise: 5e-3)."""
LAYOUTS = ["ddp", "zero1", "zero2", "zero3", "tp", "pp", "cp", "ep", "3d", "deepspeed_zero1", "deepspeed_zero2",
           "deepspeed_zero3", "deepspeed_zero3_subgroups"]


def _strategy(layout: str) -> tuple[Any, int]:
    """(strategy, per-rank batch): 8 rows per optimizer step in all."""
    from lightning_llm.strategies import (DeepSpeedZeroStrategy, HybridParallelStrategy, PipelineParallelStrategy,
                                          TensorParallelStrategy)

    if layout == "pp":  # gpipe: the load-balancing loss of the global batch needs every micro-batch's routing first
        return PipelineParallelStrategy(pipeline_parallel_size=2, schedule="gpipe"), 8
    if layout == "tp":
        return TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=True), 8
    if layout == "3d":
        return HybridParallelStrategy(data_parallel_size=2, expert_parallel_size=2, zero_stage=3), 4
    if layout == "deepspeed_zero3_subgroups":  # ~10 sub-groups a rank: several partitions (and steps) per param group
        return DeepSpeedZeroStrategy(stage=3, config={"zero_optimization": {"sub_group_size": 6000}}), 4
    return layout, 8 if layout in ("pp", "cp") else 4


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing.muon import fit_layouts

    fit_layouts(mode, out, LAYOUTS, _strategy, devices=2, steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing.muon import reference_then_launch

    return reference_then_launch(__file__, tmp_path_factory.mktemp("muon_layouts"), _worker, "layouts")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_layout_equals_one_device(runs: Path, layout: str) -> None:
    from lightning_llm.testing.muon import check_layout

    _, ref, wrong, per_rank, total = check_layout(runs, layout, tol=TOL, first_tol=FIRST_TOL, grad_tol=GRAD_TOL)
    assert len(ref["losses"]) == STEPS
    # each matrix orthogonalised once per step, by one rank: every rank does about half of them
    assert not wrong, f"the ranks' Newton-Schulz calls by matrix shape differ from one device's at steps {wrong}"
    assert max(per_rank) <= 0.75 * total

if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
