"""Rollout speed: tokens/s of batched generation with the KV cache, on one device and under tp x2 / pp x2 (CPU).

    python benchmarks/generation.py --out benchmarks/results/generation-cpu.md            # one device, then both
    python -m torch.distributed.run --nproc_per_node=2 benchmarks/generation.py --layout tp   # one layout by hand

The ``small`` decoder (random weights; ``--size``) continues ``--batch`` left-padded prompts of 32-64 tokens for
``--new`` tokens greedily (every row runs to the end: no EOS), through ``task.decoding_model()`` under the engine's
layout, after one warm-up call; median of ``--repeats``. Where the time goes: ``torch.profiler`` over one more call,
its CPU self time grouped into matmuls, attention, collectives (the tensor-parallel all-reduces and all-gathers,
the pipeline's send/recv and logits broadcast) and the rest; per rank, the wall time a pipeline rank spends waiting
in ``recv``/``broadcast`` is in the collectives share.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.testing import free_port, run_worker

GROUPS = {"matmul": ("mm", "addmm", "bmm", "linear", "matmul"), "attention": ("scaled_dot_product", "attention"),
          "collectives": ("gloo", "all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "send", "recv",
                          "c10d", "wait")}


def _prompts(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 65, (batch,), generator=g)
    width = int(lengths.max())
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, width - n:] = torch.randint(4, 250, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def _group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS.items() if any(k in low for k in keys)), "other")


class _Measure(pl.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.result: dict[str, Any] = {}

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        a = self.args
        ids, mask = (t.to(pl_module.device) for t in _prompts(a.batch))
        cfg = GenerationConfig(max_new_tokens=a.new, eos_token_id=None)
        pl_module.eval()
        model = pl_module.decoding_model()
        generate(model, ids, mask, config=cfg)  # warm-up
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            generate(model, ids, mask, config=cfg)
            times.append(time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            generate(model, ids, mask, config=cfg)
        shares: dict[str, float] = {}
        for ev in prof.key_averages():
            shares[_group(ev.key)] = shares.get(_group(ev.key), 0.0) + ev.self_cpu_time_total
        total = sum(shares.values()) or 1.0
        seconds = statistics.median(times)
        self.result = {"seconds": seconds, "tokens_per_s": a.batch * a.new / seconds,
                       "shares": {k: v / total for k, v in sorted(shares.items())}}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_llm.data import TextDataModule
    from lightning_llm.strategies import HybridParallelStrategy
    from lightning_llm.tasks import CausalLMTask

    torch.set_num_threads(1)
    pl.seed_everything(0)
    task = CausalLMTask(args.size, dropout=0.0)
    dm = TextDataModule(block_size=16, batch_size=2, cache_dir=str(Path(args.work) / "cache"), generated_docs=40)
    kw = {"tp": dict(tensor_parallel_size=2), "pp": dict(pipeline_parallel_size=2)}.get(args.layout)
    strategy = HybridParallelStrategy(**kw) if kw else "auto"
    cb = _Measure(args)
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kw else 1, strategy=strategy, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=1, callbacks=[cb], default_root_dir=args.work)
    trainer.validate(task, dm, verbose=False)
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps({"layout": args.layout, **cb.result}), flush=True)
    return cb.result


def _launch(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    base = [__file__, "--layout", layout, "--size", args.size, "--batch", str(args.batch), "--new", str(args.new),
            "--repeats", str(args.repeats), "--work", args.work, "--worker"]
    cmd = ([sys.executable, *base] if layout == "1 device" else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *base])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default=None, help="1 device, tp or pp (default: all three, each in fresh processes)")
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="/tmp/lightning_llm-generation-bench")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        run_worker(measure, a) if a.layout != "1 device" else measure(a)
        return
    rows = [_launch(layout, a) for layout in ([a.layout] if a.layout else ["1 device", "tp", "pp"])]
    groups = sorted({g for r in rows for g in r["shares"]})
    lines = [f"# Generation with the KV cache: `{a.size}` decoder, batch {a.batch}, {a.new} new tokens (CPU)", "",
             f"`python benchmarks/generation.py --size {a.size} --batch {a.batch} --new {a.new}` (median of "
             f"{a.repeats}; 1 thread per process; shares: `torch.profiler` CPU self time of one more call, rank 0)",
             "", "| layout | seconds | tokens/s | vs 1 device | " + " | ".join(groups) + " |",
             "|---|---|---|---|" + "---|" * len(groups)]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['seconds']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / base:.2f}x | " + " | ".join(f"{r['shares'].get(g, 0):.0%}"
                                                                       for g in groups) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
