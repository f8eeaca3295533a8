"""Optimizer-step time of Muon against AdamW (``--model.optim.name``) on ``small``: one device, zero3 x2 and tp x2.

    python benchmarks/optimizers.py --out benchmarks/results/optimizers-cpu.md      # ~10 min on 2 shared cores

Each row is ``lightning_llm``'s ``fit`` of the ``small`` decoder (8 layers, hidden 256, 56 hidden matrices) on
generated text, fp32, ``--batch`` rows of ``--seq`` tokens per step; AdamW and Muon (the default
``match_rms_adamw``) alternate, whole runs, ``--rounds`` times. Timed per step by callbacks, the maximum over the
ranks: the optimizer step (from the gradients being ready, ``on_before_optimizer_step``, to the step's end: AdamW's
or Muon's update, ZeRO's and Muon's collectives included) and the whole training step; the first ``--warmup`` steps
of each run are left out. Also the Newton-Schulz calls each rank makes per step (one per matrix orthogonalised there:
shared out over the ranks, not duplicated). One device runs in this process (one thread), the 2-rank layouts in one
launch (gloo, one thread per process).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LAYOUTS = ("zero3", "tp")
OPTIMIZERS = ("adamw", "muon")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="results markdown (default: print only)")
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=4, help="rows per optimizer step (all ranks together)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a launched rank: the JSON file it writes
    return p.parse_args(argv)


def _timer() -> Any:
    import lightning.pytorch as pl

    from lightning_llm.optim import orthogonalize

    class StepTimer(pl.Callback):
        """Per step: seconds of the optimizer step and of the whole step; Newton-Schulz calls."""

        def __init__(self) -> None:
            self.opt: list[float] = []
            self.step: list[float] = []
            self.ns = 0
            self._t0 = self._t1 = 0.0
            self._ns = orthogonalize._zeropower_via_newtonschulz

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
                self.ns += 1
                return self._ns(*args, **kwargs)

            orthogonalize._zeropower_via_newtonschulz = counted

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            orthogonalize._zeropower_via_newtonschulz = self._ns

        def on_train_batch_start(self, *args: Any) -> None:
            self._t0 = time.perf_counter()

        def on_before_optimizer_step(self, *args: Any) -> None:
            self._t1 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            t = time.perf_counter()
            self.opt.append(t - self._t1)
            self.step.append(t - self._t0)

    return StepTimer()


def _strategy(layout: str) -> Any:
    """A fresh strategy per run (one holds its accelerator once a Trainer used it)."""
    from lightning_llm.strategies import TensorParallelStrategy

    return {"tp": lambda: TensorParallelStrategy(tensor_parallel_size=2), "zero3": lambda: "zero3",
            "one device": lambda: "auto"}[layout]()


def fit(a: argparse.Namespace, *, optimizer: str, layout: str, devices: int, work: Path) -> dict[str, Any]:
    """One timed run: per-step optimizer and step seconds (this rank), Newton-Schulz calls per step."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask, OptimConfig

    pl.seed_everything(0)
    strategy = _strategy(layout)
    task = CausalLMTask(a.size, dropout=0.0, optim=OptimConfig(name=optimizer, lr=1e-3, scheduler="constant"))
    per_rank = a.batch if layout == "tp" or devices == 1 else a.batch // devices
    dm = TextDataModule(block_size=a.seq, batch_size=per_rank, cache_dir=str(work / "cache"), generated_docs=400,
                        val_fraction=0.0)
    timer = _timer()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=a.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[timer],
                         default_root_dir=str(work / f"{optimizer}-{devices}"))
    trainer.fit(task, dm)
    return {"opt": timer.opt[a.warmup:], "step": timer.step[a.warmup:], "ns": timer.ns // max(1, a.steps)}


def rows_of(a: argparse.Namespace, layout: str, devices: int, work: Path) -> dict[str, dict[str, Any]]:
    """``optimizer -> {opt, step: per-step seconds (max over ranks), ns: calls per rank}`` over the rounds."""
    import torch.distributed as dist

    out: dict[str, dict[str, Any]] = {o: {"opt": [], "step": [], "ns": []} for o in OPTIMIZERS}
    for _ in range(a.rounds):
        for optimizer in OPTIMIZERS:
            run = fit(a, optimizer=optimizer, layout=layout, devices=devices, work=work)
            if devices > 1:
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, run)
                run = {"opt": [max(x) for x in zip(*(r["opt"] for r in every))],
                       "step": [max(x) for x in zip(*(r["step"] for r in every))],
                       "ns": [r["ns"] for r in every]}
            else:
                run["ns"] = [run["ns"]]
            out[optimizer]["opt"] += run["opt"]
            out[optimizer]["step"] += run["step"]
            out[optimizer]["ns"] = run["ns"]
    return out


def worker(a: argparse.Namespace) -> None:
    import json

    work = Path(a.worker).parent
    results = {layout: rows_of(a, layout, 2, work / layout) for layout in LAYOUTS}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.worker).write_text(json.dumps(results))


def ms(ts: list[float]) -> str:
    return f"{statistics.median(ts) * 1e3:.0f} ({min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f})"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = ["| layout | optimizer | optimizer step, ms | training step, ms | optimizer step share | Muon's extra "
             "per step | Newton-Schulz calls per step on each rank |", "|---|---|---|---|---|---|---|"]
    for layout, rows in results.items():
        base = statistics.median(rows["adamw"]["step"])
        for optimizer, r in rows.items():
            share = statistics.median(r["opt"]) / statistics.median(r["step"])
            extra = (statistics.median(r["step"]) - base) / base
            lines.append(f"| {layout} | {optimizer} | {ms(r['opt'])} | {ms(r['step'])} | {share:.0%} | "
                         f"{'' if optimizer == 'adamw' else f'{extra:+.0%}'} | "
                         f"{' / '.join(map(str, r['ns'])) if optimizer == 'muon' else ''} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    import json

    a = parse_args(argv)
    if a.worker:
        worker(a)
        return
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        load_before = os.getloadavg()[0]
        results = {"one device": rows_of(a, "one device", 1, work / "one")}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__, "--worker",
               str(work / "layouts.json"), "--size", a.size, "--batch", str(a.batch), "--seq", str(a.seq), "--steps",
               str(a.steps), "--warmup", str(a.warmup), "--rounds", str(a.rounds)]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results.update(json.loads((work / "layouts.json").read_text()))
    head = [f"# Optimizer step: Muon vs AdamW ({a.size}, CPU)", "",
            f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared "
            f"(load average {load_before:.1f} before), torch {torch.__version__}; commit "
            f"{subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, cwd=REPO).stdout.strip()}.",
            "", f"`python benchmarks/optimizers.py --batch {a.batch} --seq {a.seq} --steps {a.steps} --rounds {a.rounds}`"
            f": {a.batch} x {a.seq} tokens per step, fp32, medians (min-max) over {a.rounds} runs x "
            f"{a.steps - a.warmup} steps, per step the slowest rank.", ""]
    text = "\n".join(head + table(results)) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
