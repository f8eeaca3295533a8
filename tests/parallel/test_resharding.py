"""Layout-free ``strategy=3d`` checkpoints: save at one (dp, tp, pp) layout, resume at another.

Each resumed run's 3 losses after the checkpoint (steps 4-6) must equal those of an uninterrupted single-device run
within 1e-5 - weights, AdamW moments and step counts, the LR scheduler and the data position all carry over. The
global batch stays 8 (per-rank batch 8 / dp), so the data position is counted in global samples.

Pairs (4, both directions across pipeline/non-pipeline): dp2 -> tp2, dp2 -> pp2, pp2 -> 1 device,
1 device -> dp2 with ZeRO-1; and a chain across the engine's presets (1 device -> tp2 -> zero3 -> zero2 offloaded ->
pp2 -> 1 device). Processes, one after the other: a 1-process ``strategy=3d`` run saves the single-device checkpoints
(with the uninterrupted references: their first-step gradients are the reference of the harness's check,
``testing.run_layouts_and_reference``), one torchrun launch (2 procs) saves dp2 and pp2 (their first-step gradients
compared with one device's), runs the three 2-process resumes and the chain's 2-process segments, and another
1-process run resumes pp2 and ends the chain.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.parallel.test_hybrid import global_losses, max_err

from lightning_llm.testing import gradient_summary, run_layouts_and_reference, wait

HALF = 3
TOL = 1e-5
SAVES: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel_size=2),
    "pp2": dict(data_parallel_size=1, pipeline_parallel_size=2, n_microbatches=2),
}
# (saved at, resumed at, resume layout args)
PAIRS: list[tuple[str, str, dict[str, Any]]] = [
    ("dp2", "tp2", dict(data_parallel_size=1, tensor_parallel_size=2)),
    ("dp2", "pp2", dict(data_parallel_size=1, pipeline_parallel_size=2, n_microbatches=2)),
    ("single", "dp2_zero1", dict(data_parallel_size=2, zero_stage=1)),
    ("pp2", "single", dict(data_parallel_size=1)),
]


# The chain across presets of the one engine: each segment resumes the previous segment's checkpoint for 2 steps.
# (tag, strategy preset, its args, processes, per-rank batch)
CHAIN: list[tuple[str, str, dict[str, Any], int, int]] = [
    ("single", "HybridParallelStrategy", dict(data_parallel_size=1), 1, 8),
    ("tp2", "TensorParallelStrategy", dict(tensor_parallel_size=2), 2, 8),
    ("zero3", "ZeroStrategy", dict(stage=3), 2, 4),
    ("zero2_offload", "ZeroStrategy", dict(stage=2, offload_optimizer=True), 2, 4),
    ("pp2", "PipelineParallelStrategy", dict(pipeline_parallel_size=2, n_microbatches=2), 2, 8),
    ("single_again", "HybridParallelStrategy", dict(data_parallel_size=1), 1, 8),
]
SEGMENT = 2


def _chain(out: Path, first: int, last: int) -> None:
    """Run chain segments ``first..last`` (same process count), each resumed from its predecessor's checkpoint."""
    from tests.parallel.test_hybrid import fit

    import lightning_llm.strategies as strategies

    for i in range(first, last + 1):
        tag, cls, args, devices, batch = CHAIN[i]
        fit(out, getattr(strategies, cls)(**args), devices, tag=f"chain-{tag}", batch_size=batch,
            steps=SEGMENT * (i + 1), ckpt_path=str(out / f"chain-{CHAIN[i - 1][0]}") if i else None,
            save_to=str(out / f"chain-{tag}"))


def _strategy(args: dict[str, Any]) -> Any:
    from lightning_llm.strategies import HybridParallelStrategy

    return HybridParallelStrategy(**args)


def _worker(mode: str, out: Path) -> None:
    from tests.parallel.test_hybrid import fit

    def run(saved: str, resumed: str, args: dict[str, Any], devices: int) -> None:
        fit(out, _strategy(args), devices, tag=f"{saved}-to-{resumed}", batch_size=8 // args["data_parallel_size"],
            steps=2 * HALF, ckpt_path=str(out / f"ckpt-{saved}"))

    if mode == "single_save":  # one process: the uninterrupted references, 3d checkpoints after 3 and 2 steps
        fit(out, "auto", 1, tag="reference", batch_size=8, steps=2 * HALF)
        fit(out, "auto", 1, tag="chain-reference", batch_size=8, steps=SEGMENT * len(CHAIN))
        fit(out, _strategy(dict(data_parallel_size=1)), 1, tag="single", batch_size=8, steps=HALF,
            save_to=str(out / "ckpt-single"))
        _chain(out, 0, 0)
    elif mode == "single_load":  # pp2 -> 1 device; the chain's end
        for saved, resumed, args in PAIRS:
            if resumed == "single":
                run(saved, resumed, args, 1)
        _chain(out, len(CHAIN) - 1, len(CHAIN) - 1)
    else:
        for tag, args in SAVES.items():
            fit(out, _strategy(args), 2, tag=tag, batch_size=8 // args["data_parallel_size"], steps=HALF,
                save_to=str(out / f"ckpt-{tag}"))
        for saved, resumed, args in PAIRS:
            if resumed != "single":
                run(saved, resumed, args, 2)
        _chain(out, 1, len(CHAIN) - 2)  # tp2 -> zero3 -> zero2_offload -> pp2


def _one_process(mode: str, out: Path) -> None:
    """``mode`` in a fresh process without torchrun (the engine on one device sets up its own process group)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    wait(subprocess.Popen([sys.executable, __file__, mode, str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reshard")
    t0 = time.perf_counter()
    run_layouts_and_reference(__file__, out, lambda: _one_process("single_save", out))
    _one_process("single_load", out)
    print(f"\nresharding runs: {time.perf_counter() - t0:.1f} s")
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved,resumed", [(a, b) for a, b, _ in PAIRS])
def test_resume_at_another_layout(runs: Path, saved: str, resumed: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())["losses"][0]
    first = global_losses(json.loads((runs / f"{saved}.json").read_text())["losses"])
    after = global_losses(json.loads((runs / f"{saved}-to-{resumed}.json").read_text())["losses"])
    assert len(ref) == 2 * HALF and len(first) == HALF and len(after) == HALF
    err_before, err_after = max_err(first, ref[:HALF]), max_err(after, ref[HALF:])
    grads = f"; {gradient_summary(runs, saved)}" if saved != "single" else ""
    print(f"{saved} -> {resumed}: max |loss err| steps 1-3 {err_before:.2e}, resumed steps 4-6 {err_after:.2e}; "
          f"resumed losses {[round(x, 5) for x in after]} vs {[round(x, 5) for x in ref[HALF:]]}{grads}")
    assert err_before <= TOL and err_after <= TOL


@pytest.mark.multiprocess
def test_resume_chain_across_strategies(runs: Path) -> None:
    """1 device -> tp2 -> zero3 (2 ranks) -> zero2 with the optimizer offloaded -> pp2 -> 1 device, 2 steps each,
    every segment resumed from the previous one's checkpoint (weights, AdamW moments, step, LR schedule, data
    position): the 12 losses equal one uninterrupted single-device run within 1e-5."""
    tmp_path = runs
    ref = json.loads((tmp_path / "chain-reference.json").read_text())["losses"][0]
    got: list[float] = []
    rows = []
    for i, (tag, *_rest) in enumerate(CHAIN):
        seg = global_losses(json.loads((tmp_path / f"chain-{tag}.json").read_text())["losses"])
        assert len(seg) == SEGMENT
        rows.append(f"{tag} (steps {SEGMENT * i + 1}-{SEGMENT * (i + 1)}): "
                    f"{max_err(seg, ref[SEGMENT * i:SEGMENT * (i + 1)]):.2e}")
        got += seg
    print("resume chain, max |loss err| vs uninterrupted 1 device per segment: " + "; ".join(rows))
    assert len(ref) == len(got) == SEGMENT * len(CHAIN) and ref[0] - ref[-1] > 0.05
    assert max_err(got, ref) <= TOL


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))


@pytest.mark.multiprocess
def test_export_any_layout(runs: Path, tmp_path: Path) -> None:
    """``lightning_llm export`` of the checkpoints saved at dp2, pp2 (one stage per rank) and on one device after the
    same 3 steps: ``transformers`` loads each, the logits agree across layouts and with our model rebuilt from the
    consolidated weights, within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_llm.cli import main as cli_main
    from lightning_llm.export import read_checkpoint, rebuild_model

    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    with torch.no_grad():
        ours, _ = rebuild_model(read_checkpoint(runs / "ckpt-single"))
        ref = ours(ids)
        for tag in ("dp2", "pp2", "single"):
            assert cli_main(["export", str(runs / f"ckpt-{tag}"), "--to", str(tmp_path / tag)]) == 0
            model = AutoModelForCausalLM.from_pretrained(str(tmp_path / tag), dtype=torch.float32).eval()
            logits[tag] = model(ids).logits
    errs = {tag: (v - ref).abs().max().item() for tag, v in logits.items()}
    print("exported 3d checkpoints -> transformers, max |logit err| vs ours (1-device ckpt): "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert all(e <= TOL for e in errs.values())
