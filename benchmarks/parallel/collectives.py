"""Collective calls per optimizer step, by function and process group, under a layout of the native engine.

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/parallel/collectives.py --layouts zero1 zero2 --size small
    python -m torch.distributed.run --nproc_per_node=4 benchmarks/parallel/collectives.py --layouts dp2_tp2 --size small

Each layout trains ``lightning_llm``'s decoder (``--size``, byte tokenizer, batch 8 x 64 per data-parallel rank,
AdamW, fp32) for ``--step + 1`` steps; optimizer step ``--step`` is counted two ways:

* :class:`lightning_llm.testing.CollectiveCounter`: calls of ``torch.distributed``'s Python collectives, by function
  and group (``dp``/``tp``/``pp`` of the engine's mesh, ``world``); elements of the largest call;
* ``torch.profiler``: the gloo ops that ran (every collective: also DTensor's tensor-parallel ones, which do not go
  through the Python API).

Rank 0 prints one markdown row per layout (and appends it to ``--out``).

``--primitives`` instead times the collectives a bucketed reduction could use on the gradients of ``--size`` (fp32,
one flat buffer vs one call per tensor; median of 7), which is how ZeRO-2's reduce to owners was chosen over
``reduce_scatter_tensor`` on gloo::

    python -m torch.distributed.run --nproc_per_node=2 benchmarks/parallel/collectives.py --primitives --size small
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import StepProfiler

from lightning_llm.testing import CollectiveCounter, run_worker


def _strategy(layout: str) -> Any:
    from lightning_llm.strategies import HybridParallelStrategy

    if layout == "dp2_tp2":
        return HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    return layout  # a registered name: zero1, zero2, zero3, ...


class _ProfileStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step, self.profiler, self.result = step, StepProfiler(), {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.profiler.start()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step + 1:
            self.result = self.profiler.stop(1)


def count(layout: str, *, size: str, step: int, cache: Path) -> str:
    import torch.distributed as dist

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(1, verbose=False)
    task = CausalLMTask(size, dropout=0.0)
    dm = TextDataModule(block_size=64, batch_size=8, cache_dir=str(cache))
    counter, prof = CollectiveCounter(), _ProfileStep(step)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                         strategy=_strategy(layout), max_steps=step + 1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[counter, prof])
    trainer.fit(task, dm)
    mesh = trainer.strategy.device_mesh
    names = {",".join(map(str, range(dist.get_world_size()))): "world"}
    for dim in ("pp", "tp", "dp"):
        if mesh[dim].size() > 1:
            key = ",".join(map(str, dist.get_process_group_ranks(mesh[dim].get_group())))
            names[key] = f"{dim} (= world)" if key in names else dim
    calls = Counter((fn, names.get(g, g)) for fn, g, _ in counter.steps[step])
    largest = Counter()
    for fn, g, n in counter.steps[step]:
        largest[(fn, names.get(g, g))] = max(largest[(fn, names.get(g, g))], n)
    tensors = sum(1 for p in task.parameters() if p.requires_grad)
    by = ", ".join(f"{fn} over {g}: {k} (largest {largest[(fn, g)]:,} el.)" for (fn, g), k in sorted(calls.items()))
    return (f"| {layout} | {size} | {tensors} | {sum(calls.values())} | {by} | "
            f"{prof.result.get('collectives', float('nan')):.0f} |")


def primitives(size: str) -> None:
    """Median ms of gloo collectives over the ``size`` decoder's gradients: flat, per tensor, async, reduce-scatter."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from lightning_llm.models import build_model

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    shapes = [p.shape for p in build_model(size, family="decoder", vocab_size=264).parameters()]
    parts = [torch.randn(s) for s in shapes]
    world = dist.get_world_size()
    n = sum(p.numel() for p in parts) // world * world
    flat, out = torch.randn(n), torch.empty(n // world)

    def ms(fn: Any) -> float:
        times = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    rows = {
        f"all_reduce, one flat buffer ({n * 4 / 2**20:.1f} MiB)": lambda: dist.all_reduce(flat),
        f"all_reduce, one call per tensor ({len(parts)}, blocking)": lambda: [dist.all_reduce(p) for p in parts],
        "all_reduce, one call per tensor, async_op then wait": lambda: [
            w.wait() for w in [dist.all_reduce(p, async_op=True) for p in parts]],
        "reduce to rank 0, one flat buffer": lambda: dist.reduce(flat, dst=0),
        "reduce of each 1/N of the flat buffer to its owner (ZeRO-2's owner buckets)": lambda: [
            dist.reduce(chunk, dst=r) for r, chunk in enumerate(flat.chunk(world))],
        "reduce, one call per tensor (owners alternate)": lambda: [dist.reduce(p, dst=i % world)
                                                                  for i, p in enumerate(parts)],
        "reduce_scatter_tensor, one flat buffer": lambda: dist.reduce_scatter_tensor(out, flat),
        "broadcast from each rank, 1/N of the flat buffer": lambda: [dist.broadcast(out, src=r) for r in range(world)],
        "torch.cat of every tensor into one buffer (the bucket copy)": lambda: torch.cat([p.reshape(-1) for p in parts]),
    }
    result = {name: ms(fn) for name, fn in rows.items()}
    if dist.get_rank() == 0:
        print(f"| {size}: gloo, {world} processes | median ms |\n|---|---|")
        for name, t in result.items():
            print(f"| {name} | {t:.1f} |")


def main(layouts: list[str], size: str, step: int, out: str | None, cache: str) -> None:
    rows = [count(layout, size=size, step=step, cache=Path(cache)) for layout in layouts]
    import torch.distributed as dist

    if dist.get_rank() == 0:
        text = "\n".join(rows)
        print("| layout | size | trainable tensors | Python collective calls | by function and group | gloo ops "
              "(profiler) |\n|---|---|---|---|---|---|\n" + text)
        if out:
            with open(out, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=[], help="zero1, zero2, zero3 (2 processes) or dp2_tp2 (4)")
    p.add_argument("--primitives", action="store_true", help="time gloo collectives on the model's gradients")
    p.add_argument("--size", default="small")
    p.add_argument("--step", type=int, default=2, help="the optimizer step counted")
    p.add_argument("--out", default=None, help="markdown rows appended here")
    p.add_argument("--cache-dir", default="/tmp/lightning_llm_collectives")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if a.primitives:
        run_worker(primitives, a.size)
    run_worker(main, a.layouts, a.size, a.step, a.out, a.cache_dir)
