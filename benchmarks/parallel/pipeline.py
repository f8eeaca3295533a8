"""Pipeline bubble and activation memory of ``strategy=pp``, measured inside Lightning's loop.

Run on 2 CPU processes (gloo)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 benchmarks/parallel/pipeline.py \
        --out benchmarks/results/pipeline-cpu.json

For each schedule (GPipe, 1F1B) and micro-batch count m it trains a 4-block decoder for ``--steps`` steps and
reports, per pipeline rank, the median over the steps after ``--warmup`` of

* busy time (inside stage forward/backward and the loss) and idle fraction = 1 - busy / step wall time,
  next to the ideal bubble (p-1)/(m+p-1);
* peak live saved activations (saved-tensor hooks, parameters excluded) in bytes and in micro-batches
  (peak / bytes saved per micro-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_llm.data import TextDataModule
from lightning_llm.strategies import PipelineParallelStrategy
from lightning_llm.tasks import CausalLMTask
from lightning_llm.tasks.base import OptimConfig


def run_one(*, schedule: str, m: int, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    pl.seed_everything(0)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-4, scheduler="constant"),
                        model_overrides={"hidden_size": args.hidden, "intermediate_size": args.hidden * 11 // 4,
                                         "num_heads": 8, "num_kv_heads": 8, "num_layers": 4})
    dm = TextDataModule(block_size=args.seq, batch_size=args.batch, cache_dir=cache, generated_docs=400)
    strategy = PipelineParallelStrategy(schedule=schedule, n_microbatches=m, measure_activations=True)  # type: ignore[arg-type]
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(task, dm)
    stats = strategy.step_stats[args.warmup:]
    p = len(stats[0]["busy_s"])
    med = lambda key, r: statistics.median(s[key][r] for s in stats)  # noqa: E731
    return {
        "schedule": schedule, "m": m, "p": p, "ideal_bubble": (p - 1) / (m + p - 1),
        "wall_s": [med("wall_s", r) for r in range(p)],
        "busy_s": [med("busy_s", r) for r in range(p)],
        "idle_frac": [med("idle_frac", r) for r in range(p)],
        "peak_act_bytes": [max(s["peak_act_bytes"][r] for s in stats) for r in range(p)],
        "peak_act_microbatches": [max(s["peak_act_bytes"][r] / s["act_bytes_per_mb"][r] for s in stats)
                                  for r in range(p)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/pipeline-cpu.json")
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for schedule in args.schedules:
            for m in args.microbatches:
                rows.append(run_one(schedule=schedule, m=m, args=args, cache=cache))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"config": vars(args), "threads": torch.get_num_threads(),
                                              "rows": rows}, indent=1))
        print("| schedule | m | ideal bubble | idle frac rank0 / rank1 | busy s rank0 / rank1 | step s | "
              "peak act (micro-batches) rank0 / rank1 | peak act MiB rank0 / rank1 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['schedule']} | {r['m']} | {r['ideal_bubble']:.3f} | "
                  f"{r['idle_frac'][0]:.3f} / {r['idle_frac'][1]:.3f} | "
                  f"{r['busy_s'][0]:.3f} / {r['busy_s'][1]:.3f} | {max(r['wall_s']):.3f} | "
                  f"{r['peak_act_microbatches'][0]:.2f} / {r['peak_act_microbatches'][1]:.2f} | "
                  f"{r['peak_act_bytes'][0] / 2**20:.1f} / {r['peak_act_bytes'][1] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
