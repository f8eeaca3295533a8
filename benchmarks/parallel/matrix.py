"""Benchmark matrix on CPU: every layout of ``lightning_llm`` against a peer on the same model, data and optimizer.

For each decoder size (``debug``, ``small``) and configuration, one fresh run of the real command
(``lightning_llm fit --config configs/pretrain_debug.yaml`` + overrides; 2 processes under torchrun where needed)
with the :class:`BenchMeter` callback, which records per rank:

* step time: interval between consecutive ``on_train_batch_end`` calls (forward, backward, optimizer step, data
  loading), median over the steps after ``--warmup``; the table shows the slowest rank's median;
* tokens/s: tokens of one global step (per-rank batch x data-parallel replicas) / that step time;
* peak RSS: ``VmHWM`` of the rank's process at the end (whole process: Python, torch, the data, the model);
* model-state bytes: parameters + gradients + optimizer state in live tensors after backward of step
  ``--measure-step`` (local shards of DTensors / FSDP2 / DeepSpeed partitions; storages counted once);
* exposed communication and collectives per step, from ``torch.profiler`` over ``--profile-steps`` extra steps after
  the timed ones (:func:`comm_profile`): the time a collective of the process group's backend (``gloo:*`` /
  ``nccl:*`` events, on the backend's threads) is in flight while the training thread runs no ATen op, i.e.
  communication no compute hides; and the number of those collectives (every group: dp, tp, logging, norms).

Peers: Lightning's DDP (``--trainer.strategy=ddp``), Lightning's ``ModelParallelStrategy`` with a hand-written TP
plan (``peers.TPPeerTask``) or with FSDP2 applied as Lightning documents it (``peers.FSDP2PeerTask``; Lightning's
``FSDPStrategy`` wraps torch's FSDP1, which refuses to run without an accelerator), and the DeepSpeed engine in a
plain torch loop (``peers.py deepspeed``). A row may have several peers (ratios in the same order).

    python benchmarks/parallel/matrix.py --sizes debug small --steps 10 --out benchmarks/results/matrix-cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
TP_CLS = "lightning_llm.strategies.presets.TensorParallelStrategy"
PP_CLS = "lightning_llm.strategies.presets.PipelineParallelStrategy"
MP_CLS = "lightning.pytorch.strategies.ModelParallelStrategy"
HYB_CLS = "lightning_llm.strategies.presets.HybridParallelStrategy"


# ------------------------------------------------------------------------------------------------------------------
# Measurement (runs inside the benchmarked processes)
# ------------------------------------------------------------------------------------------------------------------


def memory_kib() -> dict[str, int]:
    """Peak resident set size of this process: ``VmHWM`` from /proc (Linux) and ``ru_maxrss`` (both KiB)."""
    import resource

    out = {"ru_maxrss_kib": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), "vmhwm_kib": 0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                out["vmhwm_kib"] = int(line.split()[1])
    except OSError:
        pass
    return out


def gather_and_write(record: dict[str, Any], output: str, *, rank: int, world: int) -> None:
    """Collect every rank's record on rank 0 and write ``[record_rank0, record_rank1, ...]`` as JSON."""
    import torch.distributed as dist

    records: list[Any] = [record]
    if world > 1 and dist.is_available() and dist.is_initialized():
        records = [None] * world
        dist.all_gather_object(records, record)
    if rank == 0:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(output).with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(output)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def comm_profile(events: Any, steps: int) -> dict[str, float]:
    """From ``torch.profiler`` events of ``steps`` training steps: ``collectives`` per step (the backend's
    ``gloo:*``/``nccl:*`` ops) and ``exposed_ms`` per step: time in which a collective is in flight and the training
    thread (the one running the most ATen ops) runs none, summed over the union of those intervals."""
    main = Counter(e.thread for e in events if e.name.startswith("aten::")).most_common(1)[0][0]
    comm = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith(("gloo:", "nccl:"))]
    compute = _union([(e.time_range.start, e.time_range.end) for e in events
                      if e.thread == main and e.name.startswith("aten::")])
    exposed = 0.0
    for a, b in _union(comm):
        covered = sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute if c < b and d > a)
        exposed += (b - a) - covered
    return {"collectives": len(comm) / steps, "exposed_ms": exposed / 1e3 / steps}  # profiler times are in us


class StepProfiler:
    """``torch.profiler`` (CPU activities) around the last steps of a run, read by :func:`comm_profile`."""

    def __init__(self) -> None:
        self.prof: Any = None

    def start(self) -> None:
        import torch.profiler

        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()

    def stop(self, steps: int) -> dict[str, float]:
        self.prof.__exit__(None, None, None)
        return comm_profile(self.prof.events(), steps)


class BenchMeter(pl.Callback):
    """Per-rank step times, losses, model-state bytes and peak RSS of a Lightning run, written to ``output``."""

    def __init__(self, output: str, measure_step: int = 2, profile_steps: int = 0) -> None:
        """
        Args:
            output: JSON file rank 0 writes at the end of ``fit``.
            measure_step: Optimizer step whose pre-step state (after backward) is counted.
            profile_steps: The last steps of the run, profiled for :func:`comm_profile` (not timed).
        """
        self.output = output
        self.measure_step = measure_step
        self.profile_steps = profile_steps
        self.profiler = StepProfiler()
        self.comm: dict[str, float] = {}
        self.step_ends: list[float] = []
        self.losses: list[float] = []
        self.state: dict[str, int] = {}
        self.state_when = ""
        self.tokens_per_step = 0

    def _state_bytes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int]:
        from lightning_llm.strategies.zero.deepspeed import deepspeed_model_state_bytes
        from lightning_llm.strategies.zero.native import model_state_bytes

        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        return deepspeed_model_state_bytes(engine) if engine is not None else model_state_bytes(
            pl_module, trainer.optimizers)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step_ends = [time.perf_counter()]

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.measure_step and not self.state:
            self.state, self.state_when = self._state_bytes(trainer, pl_module), "before optimizer step"

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.profile_steps and trainer.global_step == trainer.max_steps - self.profile_steps:
            self.profiler.start()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.profile_steps and trainer.global_step == trainer.max_steps:
            self.comm = self.profiler.stop(self.profile_steps)
        else:
            self.step_ends.append(time.perf_counter())
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:  # pipeline ranks without the last stage
            loss = trainer.callback_metrics.get("train_loss")
        self.losses.append(float(loss.detach()) if loss is not None else float("nan"))
        # Ranks of one data-parallel group (TP/PP) see the same batch: count each replica's batch once.
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) or {}
        self.tokens_per_step = int(batch["input_ids"].numel()) * int(kwargs.get("num_replicas", 1))
        if trainer.global_step == self.measure_step + 1 and not self.state:  # hook not reached (e.g. own step)
            self.state, self.state_when = self._state_bytes(trainer, pl_module), "after optimizer step"

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = {"step_ends": self.step_ends[1:], "losses": self.losses, "state": self.state,
                  "state_when": self.state_when, "tokens_per_step": self.tokens_per_step, "comm": self.comm,
                  **memory_kib()}
        gather_and_write(record, self.output, rank=trainer.global_rank, world=trainer.world_size)


# ------------------------------------------------------------------------------------------------------------------
# The matrix (runs in the driver process)
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    name: str
    nproc: int
    args: list[str] = field(default_factory=list)  # CLI overrides; empty for the DeepSpeed-engine peer
    peers: tuple[str, ...] = ()  # names of the rows this one is compared with
    deepspeed_stage: int | None = None  # set: the plain DeepSpeed-engine loop instead of the CLI


def _pp(schedule: str) -> list[str]:
    return ["--trainer.devices=2", f"--trainer.strategy={PP_CLS}", "--trainer.strategy.pipeline_parallel_size=2",
            f"--trainer.strategy.schedule={schedule}", "--trainer.strategy.n_microbatches=4",
            "--trainer.strategy.log_pipeline_stats=false"]


DDP = "ddp (Lightning)"
CONFIGS: list[Config] = [
    Config("1 device", 1, ["--trainer.devices=1"], peers=(DDP,)),
    Config(DDP, 2, ["--trainer.devices=2", "--trainer.strategy=ddp"]),
    Config("3d dp=2 zero0", 2, ["--trainer.devices=2", f"--trainer.strategy={HYB_CLS}",
                                "--trainer.strategy.data_parallel_size=2"], peers=(DDP,)),
    Config("tp=2", 2, ["--trainer.devices=2", f"--trainer.strategy={TP_CLS}", "--trainer.strategy.tensor_parallel_size=2",
                       "--trainer.strategy.loss_parallel=false"], peers=("tp=2 peer: ModelParallelStrategy",)),
    Config("tp=2 peer: ModelParallelStrategy", 2,
           ["--trainer.devices=2", f"--trainer.strategy={MP_CLS}", "--trainer.strategy.data_parallel_size=1",
            "--trainer.strategy.tensor_parallel_size=2", "--model=peers.TPPeerTask"]),
    Config("pp=2 gpipe m=4", 2, _pp("gpipe"), peers=(DDP,)),
    Config("pp=2 1f1b m=4", 2, _pp("1f1b"), peers=(DDP,)),
    *[Config(f"zero{s} native", 2, ["--trainer.devices=2", f"--trainer.strategy=zero{s}"],
             peers=(DDP, f"zero{s} peer: DeepSpeed engine") + (("zero3 peer: Lightning FSDP2",) if s == 3 else ()))
      for s in (1, 2, 3)],
    *[Config(f"deepspeed_zero{s}", 2, ["--trainer.devices=2", f"--trainer.strategy=deepspeed_zero{s}"],
             peers=(f"zero{s} peer: DeepSpeed engine",)) for s in (1, 2, 3)],
    *[Config(f"zero{s} peer: DeepSpeed engine", 2, deepspeed_stage=s) for s in (1, 2, 3)],
    Config("zero3 peer: Lightning FSDP2", 2,
           ["--trainer.devices=2", f"--trainer.strategy={MP_CLS}", "--trainer.strategy.data_parallel_size=2",
            "--trainer.strategy.tensor_parallel_size=1", "--model=peers.FSDP2PeerTask"]),
    # 4 processes on the same cores: compare these two rows with each other only.
    Config("dp=2 x tp=2", 4, ["--trainer.devices=4", f"--trainer.strategy={HYB_CLS}",
                              "--trainer.strategy.data_parallel_size=2", "--trainer.strategy.tensor_parallel_size=2",
                              "--trainer.strategy.loss_parallel=false"], peers=("ddp (Lightning) x4",)),
    Config("ddp (Lightning) x4", 4, ["--trainer.devices=4", "--trainer.strategy=ddp"]),
]


def _command(cfg: Config, *, size: str, steps: int, measure_step: int, profile_steps: int, work: Path,
             output: Path) -> list[str]:
    from lightning_llm.testing import free_port

    if cfg.deepspeed_stage is not None:
        prog = [str(BENCH / "peers.py"), "deepspeed", f"--stage={cfg.deepspeed_stage}", f"--size={size}",
                f"--steps={steps + profile_steps}", f"--profile-steps={profile_steps}",
                f"--measure-step={measure_step}", f"--cache-dir={work / 'cache'}", f"--output={output}"]
    else:
        meter = json.dumps({"class_path": "matrix.BenchMeter",
                            "init_args": {"output": str(output), "measure_step": measure_step,
                                          "profile_steps": profile_steps}})
        prog = ["-m", "lightning_llm", "fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"),
                f"--model.backbone={size}", "--model.dropout=0.0", f"--trainer.max_steps={steps + profile_steps}",
                "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0",
                f"--trainer.default_root_dir={work / 'root'}", f"--data.cache_dir={work / 'cache'}",
                f"--trainer.callbacks+={meter}", *cfg.args]
    if cfg.nproc == 1:
        return [sys.executable, *prog]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg.nproc}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *prog]


def run_config(cfg: Config, *, size: str, steps: int, warmup: int, measure_step: int, profile_steps: int, work: Path,
               timeout: float, retries: int = 1) -> dict[str, Any]:
    """One fresh run; returns the summary row (or ``error``)."""
    output = work / "out" / f"{size}-{cfg.name.replace(' ', '_').replace(':', '').replace('=', '')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.unlink(missing_ok=True)
    cmd = _command(cfg, size=size, steps=steps, measure_step=measure_step, profile_steps=profile_steps, work=work,
                   output=output)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "LIGHTNING_LLM_LOG": "WARNING",
           "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    failures: list[str] = []
    for attempt in range(1 + retries):  # a crash on the shared box is retried once and reported in the row
        log_file = output.with_suffix(f".attempt{attempt}.log")
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO, env=env,
                                  timeout=timeout)
            log_file.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
            if proc.returncode == 0 and output.is_file():
                break
            errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln or "Signal" in ln]
            failures.append((errors[-1] if errors else f"exit code {proc.returncode}").strip()[:160])
        except subprocess.TimeoutExpired:
            failures.append(f"timed out after {timeout:.0f} s")
        print(f"[{size}] {cfg.name}: attempt {attempt} FAILED: {failures[-1]} (log: {log_file})", file=sys.stderr)
    row: dict[str, Any] = {"size": size, "config": cfg.name, "nproc": cfg.nproc, "load": load,
                           "wall_s": time.perf_counter() - t0, "failed_attempts": failures}
    if not output.is_file():
        row["error"] = failures[-1] if failures else "no output"
        return row
    ranks = json.loads(output.read_text())
    medians = []
    for r in ranks:
        ends = r["step_ends"]
        intervals = [b - a for a, b in itertools.pairwise(ends)][warmup:]
        medians.append(statistics.median(intervals) if intervals else float("nan"))
    step_s = max(medians)
    row.update(step_s=step_s, tokens_per_s=ranks[0]["tokens_per_step"] / step_s,
               rss_mib=[r["vmhwm_kib"] / 1024 for r in ranks], state=[r["state"] for r in ranks],
               state_when=ranks[0].get("state_when", "after backward"), loss=ranks[-1]["losses"][-1],
               tokens_per_step=ranks[0]["tokens_per_step"],
               exposed_ms=max((r["comm"].get("exposed_ms", float("nan")) for r in ranks), default=float("nan")),
               collectives=ranks[0]["comm"].get("collectives", float("nan")))
    print(f"[{size}] {cfg.name}: {step_s * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
          f"RSS {'/'.join(f'{m:.0f}' for m in row['rss_mib'])} MiB, state "
          f"{'/'.join(str(sum(s.values())) for s in row['state'])} B, exposed comm {row['exposed_ms']:.1f} ms/step, "
          f"{row['collectives']:.0f} collectives/step, load {load:.2f}", file=sys.stderr)
    return row


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def to_markdown(rows: list[dict[str, Any]], *, command: str, steps: int, warmup: int, measure_step: int,
                profile_steps: int, load_before: tuple[float, ...], load_after: tuple[float, ...],
                minutes: float) -> str:
    import torch

    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), {platform.system()}, "
               f"torch {torch.__version__}, lightning {pl.__version__}, OMP_NUM_THREADS=1 per process")
    loads = (f"before: {' / '.join(f'{x:.2f}' for x in load_before)}, after: "
             f"{' / '.join(f'{x:.2f}' for x in load_after)}; whole matrix {minutes:.1f} min")
    what = ("`lightning_llm fit --config configs/pretrain_debug.yaml --model.backbone=SIZE` (byte tokenizer, vocab 264, "
            "generated corpus, batch 8 x 64 tokens per data-parallel rank, AdamW, fp32, dropout 0) for "
            f"{steps} steps, except the DeepSpeed-engine peer (same model/data/optimizer in a plain torch loop)")
    how = (f"median of the steps after {warmup} warm-up steps, slowest rank; tokens/s = global tokens per step / "
           "step time; peak RSS = VmHWM per rank (whole process); state = params + grads + optimizer bytes per rank "
           f"after backward of step {measure_step}")
    comm = (f"`torch.profiler` over {profile_steps} more steps (not timed): exposed comm = ms per step in which a "
            "gloo collective is in flight and the training thread runs no ATen op (slowest rank); collectives = "
            "gloo ops per step on rank 0, every group (dp, tp, logging, norms)")
    header = ("| size | config | procs | step ms | tokens/s | exposed comm ms/step | collectives/step | peak RSS MiB "
              "r0 / r1 | state B r0 / r1 (params+grads+optim) | peers | tokens/s vs peers | state r0 vs peer 1 | "
              "peak RSS vs peer 1 | last loss | load |")
    lines = [
        "# Benchmark matrix on CPU: every layout vs its peers (2 processes, gloo; the x4 rows 4)",
        "",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- machine: {machine}",
        f"- load average (1/5/15 min) {loads}",
        f"- command: `{command}`",
        f"- every row: {what}",
        f"- step ms: {how}",
        f"- communication: {comm}",
        "",
        header,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["size"], r["config"]): r for r in rows}
    notes: list[str] = []
    peers_of = {c.name: c.peers for c in CONFIGS}
    for r in rows:
        names = peers_of.get(r["config"], ())
        if "error" in r:
            lines.append(f"| {r['size']} | {r['config']} | {r['nproc']} | did not run: {r['error']} | | | | | | "
                         f"{' / '.join(names) or '-'} | | | | | {r['load']:.1f} |")
            continue
        found = [by_key.get((r["size"], n)) for n in names]
        peers = [p if p and "error" not in p else None for p in found]
        totals = [sum(s.values()) for s in r["state"]]
        s0 = r["state"][0]
        state = " / ".join(f"{t:,}" for t in totals)
        state += f" ({s0.get('params', 0):,}+{s0.get('grads', 0):,}+{s0.get('optim', 0):,})" if s0 else ""
        tps = " / ".join(_fmt_ratio(r["tokens_per_s"] / p["tokens_per_s"] if p else None) for p in peers) or "-"
        first = peers[0] if peers else None
        st = totals[0] / sum(first["state"][0].values()) if first and first["state"][0] else None
        rss = max(r["rss_mib"]) / max(first["rss_mib"]) if first else None
        lines.append(
            f"| {r['size']} | {r['config']} | {r['nproc']} | {r['step_s'] * 1e3:.0f} | {r['tokens_per_s']:,.0f} | "
            f"{r.get('exposed_ms', float('nan')):.0f} | {r.get('collectives', float('nan')):.0f} | "
            f"{' / '.join(f'{m:.0f}' for m in r['rss_mib'])} | {state} | {' / '.join(names) or '-'} | {tps} | "
            f"{_fmt_ratio(st)} | {_fmt_ratio(rss)} | {r['loss']:.3f} | {r['load']:.1f} |")
        if r.get("failed_attempts"):
            notes.append(f"- {r['size']} / {r['config']}: first attempt failed ({r['failed_attempts'][0]}); "
                         "the row is the retry")
    if notes:
        lines += ["", "Retried runs:", "", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["debug", "small"])
    p.add_argument("--configs", nargs="*", default=None,
                   help="config names, or substrings of them, to run (default: all)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run")
    p.add_argument("--warmup", type=int, default=3, help="step intervals left out of the median")
    p.add_argument("--measure-step", type=int, default=2, help="step whose model-state bytes are counted")
    p.add_argument("--profile-steps", type=int, default=2, help="steps after the timed ones, under torch.profiler")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--retries", type=int, default=1, help="re-runs of a configuration that crashed")
    p.add_argument("--work", type=Path, default=Path("/tmp/lightning_llm_matrix"))
    p.add_argument("--out", type=Path, default=None, help="markdown table (also printed)")
    p.add_argument("--json", type=Path, default=None, help="raw rows as JSON")
    a = p.parse_args(argv)
    if a.steps < a.warmup + 2 or a.measure_step >= a.steps - 1:
        p.error(f"--steps={a.steps} must leave at least 1 timed step after --warmup={a.warmup} and cover "
                f"--measure-step={a.measure_step}")
    names = {c.name for c in CONFIGS}  # a selector naming a config exactly selects only it, else every one containing it
    configs = [c for c in CONFIGS if not a.configs
               or any(c.name == s if s in names else s in c.name for s in a.configs)]
    load_before, t0 = os.getloadavg(), time.perf_counter()
    rows = [run_config(c, size=size, steps=a.steps, warmup=a.warmup, measure_step=a.measure_step,
                       profile_steps=a.profile_steps, work=a.work, timeout=a.timeout, retries=a.retries)
            for size in a.sizes for c in configs]
    command = "python benchmarks/parallel/matrix.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    table = to_markdown(rows, command=command, steps=a.steps, warmup=a.warmup, measure_step=a.measure_step,
                        profile_steps=a.profile_steps, load_before=load_before, load_after=os.getloadavg(), minutes=(time.perf_counter() - t0) / 60)
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
