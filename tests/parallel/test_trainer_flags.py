"""Lightning trainer flags under every strategy (a strategy x flag matrix), and a 2-node x 2-process run.

Matrix: one torchrun launch (2 CPU processes, gloo) runs every case below with a fresh Trainer, 4 tiny steps each,
after the pytest process ran the same cases on one device. fp32 cases must match one device within 1e-5 per step
(loss of the global batch; validation losses too) and in every parameter's first-step gradient (per tensor: the
harness's check, ``testing.run_layouts_and_reference``; with accumulation, the gradient summed over the window);
mixed-precision cases within a loose tolerance (reduction order differs in half precision). Unsupported combinations
must raise a ``ValueError`` naming the flag before training.

Multi-node: two torchrun invocations (``--nnodes=2 --node_rank=0/1``, 2 processes each, loopback) run
``lightning_llm fit --trainer.num_nodes=2 --trainer.strategy=3d`` (dp2 x tp2) and must match one process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.parallel.test_hybrid import global_losses, max_err

from lightning_llm.testing import free_port, gradient_summary, run_layouts_and_reference, run_worker, wait

TOL = 1e-5
LOOSE = 5e-3  # bf16 autocast (CPU runs 16-mixed as bf16-mixed): per-step loss of a sharded run vs one device
LOOSE_GRADS = 5e-2  # and per tensor of the first step's gradients (a gradient counted twice is off by 1)
STEPS = 4
ACC = dict(accumulate_grad_batches=2, max_steps=2)  # 4 batches -> 2 optimizer steps
VAL = dict(val_check_interval=2, limit_val_batches=2)

# tag -> (strategy name, strategy args, trainer flags, per-rank batch, expected error or None)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], int, str | None]] = {
    # --- strategy=3d
    "3d_tp2_accum_clip": ("3d", dict(data_parallel_size=1, tensor_parallel_size=2), ACC, 8, None),
    "3d_pp2_accum_clip_ac_val": ("3d", dict(data_parallel_size=1, pipeline_parallel_size=2, n_microbatches=2,
                                            activation_checkpointing=True), {**ACC, **VAL}, 8, None),
    "3d_dp2_zero2_accum_clip": ("3d", dict(data_parallel_size=2, zero_stage=2), ACC, 4, None),
    "3d_dp2_zero3_ac_epochs": ("3d", dict(data_parallel_size=2, zero_stage=3, activation_checkpointing=True),
                               dict(max_epochs=2, max_steps=-1, limit_train_batches=2), 4, None),
    "3d_tp2_val_sp": ("3d", dict(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True), VAL, 8, None),
    "3d_dp2_zero1_bf16": ("3d", dict(data_parallel_size=2, zero_stage=1), dict(precision="bf16-mixed"), 4, None),
    "3d_dp2_fp16": ("3d", dict(data_parallel_size=2), dict(precision="16-mixed"), 4, None),
    "3d_tp2_fp16": ("3d", dict(data_parallel_size=1, tensor_parallel_size=2), dict(precision="16-mixed"), 8, None),
    # --- single-dimension strategies
    "tp_accum_clip_val": ("tp", dict(tensor_parallel_size=2), {**ACC, **VAL}, 8, None),
    "tp_bf16": ("tp", dict(tensor_parallel_size=2), dict(precision="bf16-mixed"), 8, None),
    "pp_accum_clip": ("pp", dict(n_microbatches=2), ACC, 8, None),
    "pp_bf16": ("pp", dict(n_microbatches=2), dict(precision="bf16-mixed"), 8, None),
    "zero2_accum_clip_val": ("zero2", {}, {**ACC, **VAL}, 4, None),
    "zero3_clip_epochs": ("zero3", {}, dict(max_epochs=2, max_steps=-1, limit_train_batches=2), 4, None),
    "zero1_fp16": ("zero1", {}, dict(precision="16-mixed"), 4, None),  # ZeRO-1 keeps gradients whole: scaler-safe
    "zero3_bf16_true": ("zero3", {}, dict(precision="bf16-true"), 4, None),
    "3d_pp2_zero2": ("3d", dict(pipeline_parallel_size=2, zero_stage=2), {}, 8, "zero_stage=2 with pipeline"),
}


def _strategy(name: str, args: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llm.strategies  # noqa: F401 - registers our names

    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **args})


def _case(out: Path, tag: str, devices: int) -> None:
    from tests.parallel.test_hybrid import fit

    name, args, flags, batch, error = CASES[tag]
    from lightning_llm.tasks.base import OptimConfig

    # eps=1 makes AdamW's update ~ lr x gradient for these tiny gradients (plain Adam is almost invariant to the
    # gradient's scale, which would hide a wrong clipping norm); clipping to 0.05 is active at every step.
    optim = OptimConfig(lr=2.0, eps=1.0, weight_decay=0.0, scheduler="constant")
    kwargs = dict(steps=STEPS, gradient_clip_val=0.05, task_kwargs={"optim": optim}, **flags)
    kwargs["steps"] = kwargs.pop("max_steps", STEPS)
    if devices == 1:
        if error is None:
            fit(out, "auto", 1, tag=f"{tag}-ref", batch_size=8, **kwargs)  # the same global batch
        return
    try:
        fit(out, _strategy(name, args), 2, tag=tag, batch_size=batch, reference=f"{tag}-ref",
            rtol=LOOSE_GRADS if "precision" in flags else None, **kwargs)
    except ValueError as e:
        if error is None or error not in str(e):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            (out / f"{tag}.json").write_text(json.dumps({"error": str(e)}))


def _worker(mode: str, out: Path, only: str | None = None) -> None:
    times = {}
    for tag in CASES:
        if only and tag not in only.split(","):
            continue
        t0 = time.perf_counter()
        _case(out, tag, 1 if mode == "reference" else 2)
        times[tag] = round(time.perf_counter() - t0, 1)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / f"times-{mode}.json").write_text(json.dumps(times))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("flags")
    t0 = time.perf_counter()
    run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))
    print(f"\nflag matrix: {time.perf_counter() - t0:.1f} s; per case {(out / 'times-layouts.json').read_text()}")
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("tag", list(CASES))
def test_flag_matrix(runs: Path, tag: str) -> None:
    got = json.loads((runs / f"{tag}.json").read_text())
    error = CASES[tag][4]
    if error is not None:
        print(f"{tag}: raised as documented: {got.get('error')}")
        assert error in got.get("error", "")
        return
    ref = json.loads((runs / f"{tag}-ref.json").read_text())
    tol = LOOSE if "precision" in CASES[tag][2] else TOL
    losses, ref_losses = global_losses(got["losses"]), ref["losses"][0]
    err = max_err(losses, ref_losses)
    val_err = max_err(global_losses(got["val"]), ref["val"][0]) if ref["val"][0] else 0.0
    print(f"{tag}: {len(losses)} steps, max |loss err| {err:.2e}, {len(ref['val'][0])} val losses, max |val err| "
          f"{val_err:.2e} (tol {tol:g}); {gradient_summary(runs, tag)}")
    assert len(losses) == len(ref_losses) > 0 and len(got["val"][0]) == len(ref["val"][0])
    assert err <= tol and val_err <= tol


# ---------------------------------------------------------------------------------------------------- multi-node
def _cli_args(out: Path, batch: int, extra: list[str]) -> list[str]:
    return ["fit", "--config", str(Path(__file__).parents[2] / "configs" / "pretrain_debug.yaml"),
            "--seed_everything=1", "--model.dropout=0", "--model.optim.warmup_steps=0", "--trainer.max_steps=4",
            "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={out}",
            f"--data.batch_size={batch}", "--data.block_size=32", f"--data.cache_dir={out / 'cache'}",
            "--trainer.callbacks+=lightning_llm.testing.StepRecorder", f"--trainer.callbacks.output={out / 'steps.json'}",
            *extra]


@pytest.mark.multiprocess
def test_two_nodes_match_one_process(tmp_path: Path) -> None:
    """2 "nodes" x 2 processes on loopback (dp2 x tp2 over 4 ranks, per-rank batch 4) vs 1 process (batch 8), with
    docs/cli.md's multi-node command (``--trainer.strategy=3d --trainer.strategy.tensor_parallel_size=2``). Node 0's
    log states each fact about the run once (the run summary included); node 1 prints none of them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    port = free_port()
    multi = tmp_path / "nodes"
    args = _cli_args(multi, 4, ["--trainer.devices=2", "--trainer.num_nodes=2", "--trainer.strategy=3d",
                                "--trainer.strategy.tensor_parallel_size=2"])
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=2",
                               f"--node_rank={r}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               "-m", "lightning_llm", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in (0, 1)]
    single = tmp_path / "single"
    ref_proc = subprocess.Popen([sys.executable, "-m", "lightning_llm", *_cli_args(single, 8, ["--trainer.devices=1"])],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        logs = [wait(p) for p in (*nodes, ref_proc)]
    finally:
        for p in (*nodes, ref_proc):
            if p.poll() is None:
                p.kill()
                p.wait()
    ranks = json.loads((multi / "steps.json").read_text())["losses"]
    ref = json.loads((single / "steps.json").read_text())["losses"][0]
    assert len(ranks) == 4 and len(ref) == 4
    err = max_err(global_losses(ranks), ref)
    print(f"2 nodes x 2 procs (dp2 x tp2) vs 1 process: max |loss err| {err:.2e} over {len(ref)} steps; {ref}")
    assert err <= TOL and ref[0] != ref[-1]
    facts = [ln for ln in logs[0].splitlines() if ln.startswith(("INFO lightning_llm", "WARNING lightning_llm"))]
    print("\n".join(facts))
    assert facts and len(facts) == len(set(facts)), "a fact logged more than once on node 0"
    summary = logs[0][logs[0].index("run summary"):]
    assert "layout: 4 rank(s) = pp 1 x dp 2 x tp 2, ZeRO stage 0 (HybridParallelStrategy); 2 nodes x 2: tp inside " \
           "a node; dp across nodes" in summary
    assert "batch: 4 samples per replica x 2 replica(s) x 1 accumulation = global batch 8; 256 tokens per " \
           "optimizer step (32 per sample)" in summary
    # Node 1 states no run fact; only per-rank lines, which name their rank (here: its local rank 0 waits while node
    # 0 prepares the shared cache, as on a shared filesystem).
    assert not [ln for ln in logs[1].splitlines() if ln.startswith("INFO lightning_llm")
                and not re.search(r"\(rank \d+\)$", ln)]


if __name__ == "__main__":
    sys.argv.pop(0)
    run_worker(_worker, sys.argv[0], Path(sys.argv[1]), *sys.argv[2:3])
