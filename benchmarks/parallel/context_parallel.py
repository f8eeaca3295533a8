"""Activation memory per rank under context parallelism: one 16k-token row of the ``small`` decoder at cp = 1, 2, 4.

Run (CPU, gloo; about 10 minutes on 2 cores)::

    python benchmarks/parallel/context_parallel.py --out benchmarks/results/context-parallel-cpu.md

Each degree is a fresh ``torchrun`` launch of ``cp`` processes training ``CausalLMTask("small")`` (8 layers, hidden
256, 8 query / 4 kv heads, vocabulary 8192; fp32, the fused LM-head loss) for one step on one row of ``--seq`` byte
tokens under ``ContextParallelStrategy`` (cp = 1: the same engine on one process). Per rank:

* ``saved``: the peak of activation bytes saved for backward and alive (saved-tensor hooks, storages counted once,
  parameters excluded: the pipeline's ``ActivationMeter``) over the step's forward and backward;
* ``rss step``: the growth of the process's peak resident set (VmHWM) over the step (activations, gradients, the
  optimizer's first states, attention and loss transients);
* ``estimate``: :func:`lightning_llm.memory.estimate_layout` activations at that ``cp``;
* the step's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

DEGREES = (1, 2, 4)


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM: peak resident set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class StepMeter(pl.Callback):
    """Saved-activation peak (hooks around the step's forward and backward), VmHWM growth and wall time of step 0."""

    def __init__(self) -> None:
        self.meter: Any = None
        self.hooks: Any = None
        self.row: dict[str, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        from lightning_llm.strategies.pipeline.stats import ActivationMeter

        self.meter = ActivationMeter(list(pl_module.parameters()))
        self.meter.reset()
        self.hooks = self.meter.hooks()
        self.hooks.__enter__()
        self.row = {"hwm0": _status("VmHWM"), "t0": time.perf_counter()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.hooks.__exit__(None, None, None)
        self.row = {"saved": self.meter.peak, "rss_step": _status("VmHWM") - self.row["hwm0"],
                    "wall_s": time.perf_counter() - self.row["t0"]}


def _worker(seq: int, out: Path) -> None:
    from lightning_llm.data import TextDataModule
    from lightning_llm.memory import estimate_layout
    from lightning_llm.models import named_config
    from lightning_llm.strategies import ContextParallelStrategy
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import gathered

    cp = int(os.environ["WORLD_SIZE"])
    pl.seed_everything(0)
    dm = TextDataModule(block_size=seq, batch_size=1, cache_dir=str(out / "cache"), generated_docs=400,
                        val_fraction=0.0)
    task = CausalLMTask("small", dropout=0.0, optim=OptimConfig(lr=1e-3, scheduler="constant"))
    meter = StepMeter()
    pl.Trainer(accelerator="cpu", devices=cp, strategy=ContextParallelStrategy(), max_steps=1, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               limit_val_batches=0, num_sanity_val_steps=0, callbacks=[meter]).fit(task, dm)
    est, _ = estimate_layout(named_config("small", family="decoder"), tp=1, pp=1, dp=1, cp=cp, stage=0,
                             engine="native", batch_size=1, seq_len=seq, precision="32-true", fused_loss=True)
    rows = gathered(meter.row)
    if torch.distributed.get_rank() == 0:
        (out / f"cp{cp}.json").write_text(json.dumps({"ranks": rows, "estimate": est.activations}))


def _table(results: dict[int, dict[str, Any]]) -> str:
    mib = 2**20
    base = max(r["saved"] for r in results[1]["ranks"])
    base_est = results[1]["estimate"]
    lines = [("| cp | saved activations per rank, max (MiB) | / cp=1 | estimate (MiB) | / cp=1 | peak RSS growth "
              "over the step, max (MiB) | step (s) |"), "|---|---|---|---|---|---|---|"]
    for cp, r in sorted(results.items()):
        saved = max(x["saved"] for x in r["ranks"])
        rss = max(x["rss_step"] for x in r["ranks"])
        wall = max(x["wall_s"] for x in r["ranks"])
        lines.append(f"| {cp} | {saved / mib:.0f} | {saved / base:.2f} | {r['estimate'] / mib:.0f} | "
                     f"{r['estimate'] / base_est:.2f} | {rss / mib:.0f} | {wall:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--degrees", type=int, nargs="+", default=list(DEGREES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        from lightning_llm.testing import run_worker

        run_worker(_worker, args.seq, args.worker)
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.degrees:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}",
                   "--master_addr=127.0.0.1", "--master_port=29771", __file__, "--seq", str(args.seq),
                   "--worker", tmp]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            results[cp] = json.loads((Path(tmp) / f"cp{cp}.json").read_text())
    table = _table(results)
    print(table)
    if args.out is not None:
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python benchmarks/parallel/context_parallel.py" + (f" --seq {args.seq}" if args.seq != 16384 else "") \
              + f" --out {args.out}"
        args.out.write_text(f"# Context parallelism: activation memory per rank, `small`, one row of {args.seq} "
                            f"tokens (CPU)\n\n{when}, shared 2-core machine, gloo, `OMP_NUM_THREADS=1` per rank; "
                            f"`{cmd}`\n\n{table}\n")


if __name__ == "__main__":
    main()
