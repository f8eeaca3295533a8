"""Per-rank peak host memory at set-up and after the first step, by layout: sharded construction at work.

Run (CPU, gloo; about 10 minutes on 2 cores, 6 GB of RAM and 2 GB of disk for the checkpoint)::

    python benchmarks/memory.py --out benchmarks/results/memory-cpu.md

A decoder of ``--layers`` LLaMA-1B blocks (8: 483M parameters, 1.93 GB in fp32) is set up by a ``CausalLMTask`` under
each layout (1 device, zero3 x2, tp x2, pp x2, 3d dp2 x tp2 on 4 ranks), once from the named size (random init) and
once from a sharded HF safetensors checkpoint that ``save_hf(max_shard_size=...)`` wrote. Every rank is a fresh
process that reads from ``/proc/self/status``:

* ``bare``: VmHWM after imports, before anything is built;
* ``setup``: VmHWM at ``on_train_start`` (model built, split, sharded, materialized; optimizer created);
* ``step``: VmHWM after the first optimizer step (gradients and AdamW states exist).

The set-up cost of a rank is ``setup - bare``; with sharded construction it shrinks with the number of ranks the
model is split over. ``lightning_llm estimate`` predicts it (``setup_peak`` in its JSON) and the table compares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VOCAB = 32000  # LLaMA's (the byte tokenizer of the generated data needs 259 ids of it)
LAYOUTS = {  # name -> (ranks, --trainer.strategy, estimate arguments)
    "1 device": (1, "auto", ["--strategy", "ddp", "--devices", "1"]),
    # The same layout with the model built whole on every rank first (a task with deferred_init = False: how every
    # layout set up before sharded construction); the estimate is the one-device figure.
    "zero3 x2, built whole": (2, "zero3-whole", ["--strategy", "ddp", "--devices", "1"]),
    "zero3 x2": (2, "zero3", ["--strategy", "zero3", "--devices", "2"]),
    "tp x2": (2, "tp", ["--strategy", "tp", "--devices", "2"]),
    "pp x2": (2, "pp", ["--strategy", "pp", "--devices", "2"]),
    "3d dp2 x tp2 zero3": (4, "3d", ["--strategy", "3d", "--devices", "4", "--tp", "2", "--zero-stage", "3"]),
}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmHWM: peak resident set; VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _strategy(name: str) -> Any:
    from lightning_llm.strategies import (
        HybridParallelStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
        ZeroStrategy,
    )

    return {"auto": lambda: "auto", "zero3": lambda: ZeroStrategy(stage=3), "tp": lambda: TensorParallelStrategy(),
            "zero3-whole": lambda: ZeroStrategy(stage=3),
            "pp": lambda: PipelineParallelStrategy(n_microbatches=2),
            "3d": lambda: HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3)}[name]()


def worker(strategy: str, backbone: str, layers: int, out: Path) -> None:
    """One rank: set up, take one step, record the three marks (JSON line per rank in ``out``)."""
    import lightning.pytorch as pl
    import torch

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    bare = _status("VmHWM")
    marks: dict[str, Any] = {"bare": bare}

    class Marks(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, task: pl.LightningModule) -> None:
            marks["setup"] = _status("VmHWM")
            marks["params_local_bytes"] = sum(
                (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in {id(p): p for p in task.parameters()}.values())
            marks["materialized"] = getattr(trainer.strategy, "materialized_params", 0)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            marks["step"] = _status("VmHWM")
            trainer.should_stop = True

    class BuiltWhole(CausalLMTask):
        deferred_init = False

    pl.seed_everything(0)
    overrides = {"num_layers": layers, "vocab_size": VOCAB} if backbone == "llama-1b" else {}
    task = (BuiltWhole if strategy.endswith("-whole") else CausalLMTask)(backbone, dropout=0.0,
                                                                         model_overrides=overrides)
    dm = TextDataModule(block_size=16, batch_size=2, cache_dir=str(out.parent / "cache"), generated_docs=40)
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=_strategy(strategy), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Marks()])
    trainer.fit(task, dm)
    marks["rank"] = int(os.environ.get("RANK", "0"))
    with open(out, "a") as f:
        f.write(json.dumps(marks) + "\n")
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


def _out_file(work: Path, layout: str, backbone: str) -> Path:
    return work / f"{layout.replace(' ', '_')}-{Path(backbone).name}.jsonl"


def _read(out: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["rank"])


def _run(layout: str, backbone: str, layers: int, work: Path) -> list[dict[str, Any]]:
    ranks, strategy, _ = LAYOUTS[layout]
    out = _out_file(work, layout, backbone)
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = [__file__, "--worker", strategy, backbone, str(layers), str(out)]
    cmd = [sys.executable, *args] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
        f"--master_port={_port()}", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} / {backbone} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return _read(out)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _estimate(layout: str, hf: Path, init: str) -> dict[str, Any]:
    """``lightning_llm estimate`` of the layout (the named run's model has the checkpoint's config)."""
    _, _, est_args = LAYOUTS[layout]
    cmd = [sys.executable, "-m", "lightning_llm.cli", "estimate", "--model", str(hf), "--init", init, *est_args,
           "--precision", "32-true", "--batch-size", "2", "--seq-len", "16", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"estimate failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, list[dict[str, Any]]]],
           estimates: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """One row per source and layout: every rank's set-up cost (``setup - bare``), its ratio to one device, and the
    estimate of the fullest rank against the fullest measured rank."""
    gib = 1024**3
    rows = ["| source | layout | set-up peak - bare, per rank (GiB) | max / 1 device | estimate (GiB) | est. err "
            "| after step 1 - bare, max (GiB) | local params (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for source, by_layout in results.items():
        one = by_layout["1 device"][0]
        base = one["setup"] - one["bare"]
        for layout, ranks in by_layout.items():
            costs = [r["setup"] - r["bare"] for r in ranks]
            est = estimates[source][layout]["setup_peak_bytes"]
            rows.append(f"| {source} | {layout} | {' / '.join(f'{c / gib:.3f}' for c in costs)} | "
                        f"{max(costs) / base:.2f} | {est / gib:.3f} | {100 * (est - max(costs)) / max(costs):+.1f}% | "
                        f"{max(r['step'] - r['bare'] for r in ranks) / gib:.3f} | "
                        f"{max(r['params_local_bytes'] for r in ranks) / gib:.3f} |")
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, strategy, backbone, layers, out = sys.argv
        return worker(strategy, backbone, int(layers), Path(out))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="LLaMA-1B blocks (8: 483M parameters)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory-cpu.md"))
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the runs in --work")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="llm-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = work / "hf"
    if not (hf / "model.safetensors.index.json").is_file():
        import torch

        from lightning_llm.models import build_model, save_hf

        torch.manual_seed(0)
        save_hf(build_model("llama-1b", family="decoder", num_layers=args.layers, vocab_size=VOCAB), hf,
                max_shard_size="400MB")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"named": {}, "hf (sharded safetensors)": {}}
    for layout in args.layouts:
        for source, backbone in (("named", "llama-1b"), ("hf (sharded safetensors)", str(hf))):
            print(f"{layout} / {source} ...", flush=True)
            results[source][layout] = (_read(_out_file(work, layout, backbone)) if args.report_only
                                       else _run(layout, backbone, args.layers, work))
    estimates = {source: {layout: _estimate(layout, hf, "random" if source == "named" else "checkpoint")
                          for layout in args.layouts} for source in results}
    import torch

    from lightning_llm.models import build_model

    with torch.device("meta"):
        nparams = sum(p.numel() for p in build_model("llama-1b", family="decoder", num_layers=args.layers,
                                                      vocab_size=VOCAB).parameters())
    lines = [f"# Set-up memory per rank (CPU, gloo): a {nparams / 1e6:.0f}M-parameter decoder (LLaMA-1B blocks x "
             f"{args.layers}, fp32)", "", f"Command: `python benchmarks/memory.py --layers {args.layers}`", "",
             *_table(results, estimates), "", "```json", json.dumps(results), "```", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines[:-4]))


if __name__ == "__main__":
    main()
