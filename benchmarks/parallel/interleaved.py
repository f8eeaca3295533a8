"""Step times of several data-parallel layouts, interleaved in one launch, for a machine whose load drifts.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=2 benchmarks/parallel/interleaved.py \\
        --layouts ddp 3d_dp2 zero1 zero2 deepspeed_zero1 deepspeed_zero2 --rounds 5 --size small

The matrix (``matrix.py``) runs each layout once, minutes apart, so on a shared machine a change of load between two
rows is read as a speed difference. Here every round fits each layout in turn for ``--steps`` steps with a fresh
Trainer in the same two processes (same model, data and optimizer as the matrix: ``--size`` decoder, byte tokenizer,
batch 8 x 64 per rank, AdamW, fp32), and the per-step times after ``--warmup`` of every round are pooled per layout;
each layout's median is then compared with the first layout's. ``3d_dp2`` is the engine's pure data-parallel layout
(ZeRO 0); ``deepspeed_zeroN`` is DeepSpeed's engine under our strategy.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from lightning_llm.testing import run_worker


class _Steps(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_start(self, *args: Any) -> None:
        self.ends = [time.perf_counter()]

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def _strategy(layout: str) -> Any:
    import lightning_llm.strategies  # noqa: F401 - registers zero*, deepspeed_zero*
    from lightning_llm.strategies import HybridParallelStrategy

    return HybridParallelStrategy(data_parallel_size=2) if layout == "3d_dp2" else layout


def _fit(layout: str, *, size: str, steps: int, cache: Path) -> list[float]:
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    pl.seed_everything(42, verbose=False)
    task = CausalLMTask(size, dropout=0.0, optim=OptimConfig(lr=3e-3, warmup_steps=5))
    dm = TextDataModule(block_size=64, batch_size=8, cache_dir=str(cache))
    meter = _Steps()
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=_strategy(layout),
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[meter])
    trainer.fit(task, dm)
    return [b - a for a, b in zip(meter.ends, meter.ends[1:])]


def main(layouts: list[str], size: str, rounds: int, steps: int, warmup: int, cache: str) -> None:
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in layouts}
    load0 = os.getloadavg()
    for _ in range(rounds):
        for name in layouts:
            step_s = torch.tensor(_fit(name, size=size, steps=steps, cache=Path(cache))[warmup:], dtype=torch.float64)
            dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            times[name] += step_s.tolist()
    if dist.get_rank() != 0:
        return
    ref = statistics.median(times[layouts[0]])
    print(f"{size}, {rounds} rounds x {steps} steps ({warmup} warm-up) per layout; load average before "
          f"{' / '.join(f'{x:.2f}' for x in load0)}, after {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"| layout | steps | median step ms | tokens/s vs {layouts[0]} |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {len(ts)} | {med * 1e3:.0f} | {ref / med:.2f}x |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["ddp", "3d_dp2", "zero1", "zero2"])
    p.add_argument("--size", default="small")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="steps per fit")
    p.add_argument("--warmup", type=int, default=2, help="step intervals of each fit left out")
    p.add_argument("--cache-dir", default="/tmp/lightning_llm_interleaved")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    run_worker(main, a.layouts, a.size, a.rounds, a.steps, a.warmup, a.cache_dir)
