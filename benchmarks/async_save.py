"""The training loop's stand-still per checkpoint save, synchronous vs ``--trainer.strategy.async_save=true``.

Run::

    python benchmarks/async_save.py --out benchmarks/results/async-save-cpu.md     # CPU rows (~6 min, 2 cores)
    python benchmarks/async_save.py --device cuda --budget-s 60 --out FILE.md      # one GPU row, <= 60 s
    python benchmarks/async_save.py --device cuda --smoke --out /tmp/smoke.md      # that row's code path on CPU

Every fit saves ``last.ckpt`` every ``--every`` optimizer steps (``ModelCheckpoint(every_n_train_steps, save_last=True,
save_top_k=0)``: one save per event). The stand-still of a save is the wall time of ``Trainer.save_checkpoint`` (what
the loop waits for: Lightning's checkpoint dict, then the write, or with ``async_save`` the wait for a previous write
still running plus the copy to host memory), the slowest rank's per save. Also the fit's time per step with no
checkpoint, and with each kind of save (the background write shares the CPU with training). Modes alternate within a
round (``--rounds``) so that the machine's noise falls on both; medians over the saves after each fit's first (the
first async save also allocates the staging buffers: its time is reported apart).

CPU rows: ``small`` under ``zero3`` x2 (2 processes, gloo, 1 thread each) and on one device (``3d`` with all degrees
1). The GPU row: one device (``3d``), ``llama-1b`` with ``--gpu-layers`` layers in bf16-mixed (fp32 weights and AdamW
states: 16 bytes a parameter to write), staging pinned and non-blocking; a row that cannot run writes its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "async", "none")


def fit(mode: str, *, layout: str, devices: int, accelerator: str, backbone: str, overrides: dict[str, Any],
        precision: str, steps: int, every: int, batch: int, block: int, work: Path) -> dict[str, Any]:
    """One fit; this rank's stand-still per save and time per step."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.strategies import HybridParallelStrategy, ZeroStrategy
    from lightning_llm.strategies.engine.async_save import BackgroundSaves
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    class Steps(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    asyn = mode == "async"
    strategy = (ZeroStrategy(stage=3, async_save=asyn) if layout == "zero3"
                else HybridParallelStrategy(data_parallel_size=1, async_save=asyn))
    pl.seed_everything(1, verbose=False)
    task = CausalLMTask(backbone, dropout=0.0, model_overrides=overrides,
                        optim=OptimConfig(lr=1e-4, scheduler="constant"))
    data = TextDataModule(block_size=block, batch_size=batch, cache_dir=str(work / "cache"), generated_docs=400)
    steps_cb = Steps()
    callbacks: list[Any] = [steps_cb]
    if mode != "none":
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(work / mode / "ckpt"), save_last=True,
                                                      every_n_train_steps=every, save_top_k=0))
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, precision=precision,
                         max_steps=steps, logger=False, enable_checkpointing=mode != "none",
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=str(work))
    saves: list[float] = []
    waits: list[float] = []  # of each save's stand-still: waiting for the previous background write
    save, wait = trainer.save_checkpoint, BackgroundSaves.wait

    def timed(*args: Any, **kwargs: Any) -> None:
        waits.append(0.0)
        t = time.perf_counter()
        save(*args, **kwargs)
        saves.append(time.perf_counter() - t)

    def timed_wait(self: BackgroundSaves) -> None:
        t = time.perf_counter()
        wait(self)
        if len(waits) > len(saves):  # inside a save (not the end of fit's)
            waits[-1] += time.perf_counter() - t

    trainer.save_checkpoint = timed  # type: ignore[method-assign]
    BackgroundSaves.wait = timed_wait  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        trainer.fit(task, datamodule=data)
    finally:
        BackgroundSaves.wait = wait  # type: ignore[method-assign]
    total = time.perf_counter() - t0
    ends = steps_cb.ends
    return {"saves": saves, "waits": waits, "step_s": [b - a for a, b in zip(ends, ends[1:])], "fit_s": total}


def worker(args: argparse.Namespace) -> None:
    """One process of a row: every mode, ``--rounds`` times, alternating; writes rank 0's JSON (saves: max over
    ranks)."""
    import torch.distributed as dist

    from lightning_llm.reliability import shutdown_process_group

    spec = json.loads(args.spec)
    work = Path(args.work)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    deadline = spec.pop("deadline", None)  # single-process rows: no fit started that would end past it
    longest = 0.0
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            if deadline is not None and time.time() + longest > deadline:
                print(f"[{spec['layout']}] {mode}: skipped, the time budget ran out", flush=True)
                continue
            t0 = time.time()
            run = fit(mode, work=work / f"r{r}", **spec)
            longest = max(longest, time.time() - t0)
            if dist.is_initialized() and dist.get_world_size() > 1:
                every: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(every, run["saves"])
                run["saves"] = [max(xs) for xs in zip(*every)]
            results[mode].append(run)
            print(f"[{spec['layout']}] round {r} {mode}: saves {[round(s, 3) for s in run['saves']]}", flush=True)
            if int(os.environ.get("RANK", "0")) == 0:  # after every fit: a timeout keeps what was measured
                Path(args.result).write_text(json.dumps(results))
    shutdown_process_group()


def run_row(name: str, spec: dict[str, Any], *, nproc: int, rounds: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="async-save-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={29500 + os.getpid() % 1000}"] if nproc > 1 else [sys.executable]
        cmd += [__file__, "--worker", "--spec", json.dumps(spec), "--work", tmp, "--result", str(result),
                "--rounds", str(rounds)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            if result.is_file():  # the fits that ended in time
                return json.loads(result.read_text())
            return {"error": f"did not finish within {timeout:.0f} s"}
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if proc.returncode != 0 or not result.is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return {"error": f"exit {proc.returncode}: {' / '.join(tail)}"}
        return json.loads(result.read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(res: dict[str, Any]) -> dict[str, float]:
    """Medians: stand-still per save after each fit's first, the first save, time per step."""
    out: dict[str, float] = {}
    for mode in MODES:
        runs = res.get(mode) or []
        out[f"{mode}_save"] = _median([s for run in runs for s in run["saves"][1:]])
        out[f"{mode}_first"] = _median([run["saves"][0] for run in runs if run["saves"]])
        out[f"{mode}_step"] = _median([s for run in runs for s in run["step_s"]])
        out[f"{mode}_wait"] = _median([s for run in runs for s in run["waits"][1:]])
        out[f"{mode}_fit"] = _median([run["fit_s"] for run in runs])
    out["ratio"] = out["async_save"] / out["sync_save"]
    return out


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = ["| row | stand-still per save, sync | async (of it: waiting for the previous write) | async / sync | "
             "first save sync / async | time per step: no checkpoint / sync / async (median, with the save steps) | "
             "fit: no checkpoint / sync / async |",
             "|---|---|---|---|---|---|---|"]
    for name, res in rows:
        missing = [m for m in ("sync", "async") if "error" not in res and not res.get(m)]  # "none" may be skipped
        if "error" in res or missing:
            why = res.get("error") or f"{', '.join(missing)} skipped: the time budget ran out"
            lines.append(f"| {name} | not run: {why} | | | | | |")
            continue
        s = summarize(res)
        lines.append(f"| {name} | {s['sync_save'] * 1e3:.0f} ms | {s['async_save'] * 1e3:.0f} ms "
                     f"({s['async_wait'] * 1e3:.0f} ms) | "
                     f"**{s['ratio']:.3f}x** | {s['sync_first'] * 1e3:.0f} / {s['async_first'] * 1e3:.0f} ms | "
                     f"{s['none_step'] * 1e3:.0f} / {s['sync_step'] * 1e3:.0f} / {s['async_step'] * 1e3:.0f} ms | "
                     f"{s['none_fit']:.1f} / {s['sync_fit']:.1f} / {s['async_fit']:.1f} s |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, help="the markdown results file (required)")
    p.add_argument("--budget-s", type=float, default=900, help="wall-clock budget of the whole run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, help="per fit (default: 12 on CPU, 40 on CUDA)")
    p.add_argument("--every", type=int, help="optimizer steps between saves (default: 2 on CPU, 20 on CUDA: longer "
                   "than a write, as checkpoint intervals are)")
    p.add_argument("--size", default="small", help="CPU rows: the backbone")
    p.add_argument("--gpu-layers", type=int, default=2, help="GPU row: llama-1b's layers (2: 0.22B parameters, "
                   "3.5 GB of fp32 weights and AdamW states to write)")
    p.add_argument("--smoke", action="store_true", help="with --device cuda: the same code path with the debug "
                   "backbone and 6 steps, on the CPU when there is no GPU (checks the command)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.out is None:
        p.error("--out FILE is required")
    start = time.perf_counter()
    cuda = args.device == "cuda"
    args.steps = args.steps or (40 if cuda else 12)
    args.every = args.every or (20 if cuda else 2)
    rows: list[tuple[str, dict[str, Any]]] = []
    if not cuda:
        common = dict(accelerator="cpu", backbone=args.size, overrides={}, precision="32-true", steps=args.steps,
                      every=args.every, block=128)
        plan = [(f"`{args.size}`, zero3 x2 (CPU, gloo)", dict(common, layout="zero3", devices=2, batch=4), 2),
                (f"`{args.size}`, 1 device (CPU)", dict(common, layout="3d", devices=1, batch=8), 1)]
        rounds = args.rounds
    else:
        plan = [(f"`llama-1b` x {args.gpu_layers} layers, 1 GPU, bf16-mixed",
                 dict(accelerator="gpu", backbone="llama-1b", overrides={"num_layers": args.gpu_layers},
                      precision="bf16-mixed", steps=args.steps, every=args.every, batch=8, block=1024,
                      layout="3d", devices=1), 1)]
        if args.smoke:
            plan = [("`debug`, smoke", dict(plan[0][1], backbone="debug", overrides={}, steps=6, every=2, batch=2,
                                            block=64, accelerator="auto"), 1)]
        rounds = 1
    for name, spec, nproc in plan:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 5:
            rows.append((name, {"error": "the time budget ran out"}))
            continue
        if nproc == 1:
            spec = dict(spec, deadline=time.time() + left - 3)
        rows.append((name, run_row(name, spec, nproc=nproc, rounds=rounds, timeout=left)))
    head = [f"# Stand-still per checkpoint save: synchronous vs async_save ({args.device})", "",
            f"{date.today()}, {platform.node() or 'host'}, `python benchmarks/async_save.py "
            f"{' '.join(sys.argv[1:])}`; {args.steps} steps, a save every {args.every}, {rounds} round(s).", "",
            "Stand-still: the wall time of `Trainer.save_checkpoint`, the slowest rank's, median over the saves after "
            "each fit's first. Time per step: between batch ends (the save steps included); fit: the whole `fit` "
            "call. On CPU the background write shares the cores with training.", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(head + table(rows)) + "\n")
    print("\n".join(table(rows)))
    if any("error" in res or not (res.get("sync") and res.get("async")) for _, res in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
