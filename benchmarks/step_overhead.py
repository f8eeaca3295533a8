"""What `lightning_llm fit` adds to the model's own training step (issue 56): the same model, batch, tokens and
precision through ``fit`` (the shipped ``configs/pretrain_debug.yaml`` task and Trainer, steps that do not log) and
through a plain torch loop (forward, backward, fused AdamW step), dense and MoE, with transformers' model of the same
shape in the same run (the peer a user would pick: Liger's kernels for Llama, ``grouped_mm`` experts for Qwen3-MoE).

    python benchmarks/step_overhead.py --device cpu --out benchmarks/results/step-overhead-cpu.md
    python benchmarks/step_overhead.py --device cuda --budget-s 240 --out $OUT/step-overhead.md

Each path of a case runs in its own process with a timeout (``step_overhead_rows.py``; one that fails or runs out of
time writes its reason, the rest go on; a case's gradient accumulations are measured in turn in that process); on
the CPU the paths run in 3 interleaved rounds and the median round is reported. Step time: the median interval between optimizer-step ends, taken with CUDA events on a GPU (nothing is
synchronised inside the timed steps: the host may run ahead as in a real run) or the host clock on the CPU, after the
warm-up steps; ``wall``: the timed steps' mean from the host clock, synchronised at both ends. ``syncs/step`` (GPU):
synchronising CUDA calls per step that ``torch.cuda.set_sync_debug_mode`` reports in two extra steps, by where they
come from. TFLOP/s and MFU count ``6 N + 12 L A S`` per token, ``N`` the non-embedding parameters a token uses (an MoE
layer's top-k experts, not all), against the device's dense bf16 peak.

GPU cases, in this order: two kernel rows timing the pieces of the MoE step this issue changed, old against new in
one process; the 4-layer Qwen3-30B-A3B shape in ``bf16-true`` (batch 4 x 2048) with gradient accumulation 1 and 4
(``moe-bf16``, ``moe-bf16-accum4``); ``llama-1b`` with compiled blocks in ``bf16-mixed`` (batch 4 x 2048). A budget
of 240 s is meant to cover the first two (estimated, not yet run on a GPU), 450 s all three. CPU cases: ``debug`` and ``small-moe`` at the shipped
configs' batch (8 x 64, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH / "gpu")]

from step_overhead_rows import CASES, run_row  # noqa: E402 (beside this file; e2e.py's helpers on the path above)

DEFAULT_CASES = {"cpu": ["debug", "small-moe"], "cuda": ["kernels", "moe-bf16", "llama-1b"]}
PATHS = ("fit", "plain", "transformers")


@dataclass
class Row:
    case: str
    path: str
    status: str = "ok"
    step_ms: float | None = None
    wall_ms: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    syncs: float | None = None
    peak_gib: float | None = None
    seconds: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------- driver
def _row(args: argparse.Namespace, case: str, path: str, timeout: float) -> list[Row]:
    """One row's process: a row per accumulation of the case (named ``CASE-accumN`` beyond 1), or its error."""
    row = Row(case, path)
    out = args.work / f"{case}-{path}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", case, path, "--device", args.device,
           "--work", str(args.work), "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out),
           *(["--smoke"] if args.smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=args.work)
        (args.work / f"{case}-{path}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
            row.status, row.note = "error", (errors or lines or [f"exit {proc.returncode}"])[-1].strip()[:300]
    except subprocess.TimeoutExpired:
        row.status, row.note = "error", f"timed out after {timeout:.0f} s"
    row.seconds = time.perf_counter() - t0
    rows = [row]
    if row.status == "ok":
        res = json.loads(out.read_text())
        if "kernels" in res:
            row.extra = res["kernels"]
        else:
            rows = [_filled(Row(case if v["accumulate"] == 1 else f"{case}-accum{v['accumulate']}", path,
                                seconds=row.seconds), v, args.peak) for v in res["variants"]]
    for r in rows:
        print(f"[{r.seconds:5.0f} s] {r.case} {path}: {r.status} "
              f"{f'{r.step_ms:.1f} ms/step' if r.step_ms else ''} {r.note[:160]}", flush=True)
    return rows


def _filled(row: Row, res: dict[str, Any], peak: float | None) -> Row:
    row.step_ms, row.wall_ms, row.peak_gib, row.note = res["step_ms"], res["wall_ms"], res["peak_gib"], res["note"]
    row.tokens_per_s = res["tokens_per_step"] / (row.step_ms / 1e3)
    row.tflops = res["flops_per_token"] * row.tokens_per_s / 1e12
    row.mfu = row.tflops / peak if peak else None
    if res["syncs"]:
        row.syncs = statistics.mean(len(s) for s in res["syncs"])
        where: dict[str, int] = {}
        for step in res["syncs"]:
            for origin in step:
                where[origin] = where.get(origin, 0) + 1
        row.extra["sync_origins"] = {k: v / len(res["syncs"]) for k, v in sorted(where.items())}
    row.extra["params"] = res["params"]
    return row


def _median_row(rounds: list[Row]) -> Row:
    """The round whose step time is the median of the rounds that ran (its other figures with it), else the first."""
    ok = sorted((r for r in rounds if r.step_ms is not None), key=lambda r: r.step_ms)
    if not ok:
        return rounds[0]
    row = ok[(len(ok) - 1) // 2]
    if len(rounds) > 1:
        row.note = (f"median of {len(ok)} rounds ({', '.join(f'{r.step_ms:.1f}' for r in ok)} ms) " + row.note).strip()
    return row


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _markdown(args: argparse.Namespace, rows: list[Row], total_s: float, device: str, versions: str) -> str:
    lines = [f"# `lightning_llm fit` against the model's own step on {device}", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M')}; {versions}; commit {_commit()}",
             f"- command: `python benchmarks/step_overhead.py {' '.join(args.argv)}`",
             f"- {args.warmup} warm-up steps, median of {args.steps}; {args.rounds} round(s); total {total_s:.0f} s "
             f"of a {args.budget_s:.0f} s budget; peak for MFU: {_fmt(args.peak, '.0f')} TFLOP/s; `s`: the seconds "
             "of the row's process (one process measures a case's accumulations in turn)", ""]
    kernels = [r for r in rows if r.case == "kernels"]
    for r in kernels:
        if r.status != "ok":
            lines += [f"Kernel rows: {r.status}: {r.note}", ""]
            continue
        e = r.extra
        n, h, v = e["shape"]
        lines += ["| piece of the MoE step (the Qwen3-30B-A3B shape, bf16) | before | after |", "|---|---|---|",
                  f"| fused head loss fwd+bwd, {n} x {h} x {v} (256-token chunks -> {e['head_chunk']}) | "
                  f"{e['head_old_ms']:.2f} ms | {e['head_new_ms']:.2f} ms |",
                  f"| token gather of {8 * n} assignments x {h}, fwd+bwd (index_select -> gather + sum) | "
                  f"{e['gather_old_ms']:.2f} ms | {e['gather_new_ms']:.2f} ms |", ""]
    lines += ["| case | path | status | step ms | wall ms | tokens/s | TFLOP/s (active) | MFU | vs plain | syncs/step "
              "| peak GiB | s | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.case == "kernels":
            continue
        plain = next((p for p in rows if p.case == r.case and p.path == "plain" and p.step_ms), None)
        ratio = f"{r.step_ms / plain.step_ms:.3f}x" if plain and r.step_ms else "-"
        lines.append(f"| {r.case} | {r.path} | {r.status} | {_fmt(r.step_ms, '.1f')} | {_fmt(r.wall_ms, '.1f')} | "
                     f"{_fmt(r.tokens_per_s, ',.0f')} | {_fmt(r.tflops, '.3g')} | "
                     f"{_fmt(r.mfu * 100 if r.mfu is not None else None, '.1f')}{'%' if r.mfu else ''} | {ratio} | "
                     f"{_fmt(r.syncs, '.1f')} | {_fmt(r.peak_gib, '.1f')} | {r.seconds:.0f} | {r.note} |")
    origins = [(r, r.extra.get("sync_origins")) for r in rows if r.extra.get("sync_origins")]
    if origins:
        lines += ["", "Synchronising CUDA calls per step by origin (`torch.cuda.set_sync_debug_mode`, two steps "
                  "after the timed ones):", ""]
        lines += [f"- {r.case} {r.path}: " + "; ".join(f"{v:g} x {k}" for k, v in o.items()) for r, o in origins]
    lines += ["", *_goals(rows), ""]
    return "\n".join(lines)


def _goals(rows: list[Row]) -> list[str]:
    """The issue's goals, where the rows measured them."""
    get = {(r.case, r.path): r for r in rows if r.step_ms}
    out = ["Goals (issue 56):", ""]
    for case in ("debug", "small-moe", "moe-bf16", "moe-bf16-accum4", "llama-1b"):
        fit, plain, peer = get.get((case, "fit")), get.get((case, "plain")), get.get((case, "transformers"))
        if fit and plain:
            out.append(f"- {case}: fit / plain loop = {fit.step_ms / plain.step_ms:.3f} (goal <= 1.03)")
        if fit and peer and case.startswith("moe"):
            out.append(f"- {case}: fit is {peer.step_ms / fit.step_ms:.2f}x transformers' speed (goal >= 1.2)")
        if fit and case == "moe-bf16-accum4":
            out.append(f"- {case}: fit {fit.tflops:.0f} TFLOP/s on active parameters (goal >= 250)")
        if fit and case == "llama-1b" and fit.mfu is not None:
            out.append(f"- {case}: fit MFU {fit.mfu:.1%} (goal >= 50%)")
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _device_and_versions(device: str) -> tuple[str, str, float | None]:
    import torch

    from e2e import peak_tflops

    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    try:
        import transformers

        versions += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return name, versions, peak_tflops(name)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", versions, None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting rows after this (default: cuda 240, "
                   "cpu 900)")
    p.add_argument("--out", type=Path, required=False, help="markdown results file")
    p.add_argument("--cases", nargs="+", default=None, help=f"of {sorted(CASES)} and 'kernels' (cuda)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default: cuda 8, cpu 6)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: cuda 3, cpu 2)")
    p.add_argument("--row-timeout-s", type=float, default=None, help="per row process (default: cuda 200, cpu 300)")
    p.add_argument("--rounds", type=int, default=None, help="each case's paths run this many times, interleaved; "
                   "the median round is reported (default: cuda 1, cpu 3)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="the GPU cases' code paths on the CPU, tiny models "
                   "(checks the benchmark itself, ~2 minutes)")
    p.add_argument("--row", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and args.device != "cpu":
        p.error("--smoke runs on --device cpu")
    cuda = args.device == "cuda"
    args.steps = args.steps or (8 if cuda else 6)
    args.warmup = args.warmup or (3 if cuda else 2)
    if args.row:
        args.work.mkdir(parents=True, exist_ok=True)
        res = run_row(*args.row, args.device, args.work, args.steps, args.warmup, smoke=args.smoke)
        args.json.write_text(json.dumps(res))
        return 0
    args.argv = argv
    args.rounds = args.rounds or (1 if cuda or args.smoke else 3)
    args.budget_s = args.budget_s or (240.0 if cuda else 900.0)
    args.row_timeout_s = args.row_timeout_s or (200.0 if cuda else 300.0)
    if args.work is None:
        import tempfile

        args.work = Path(tempfile.mkdtemp(prefix="step_overhead-"))
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    device, versions, args.peak = _device_and_versions(args.device)
    start = time.monotonic()
    rows: list[Row] = []
    for case in args.cases or DEFAULT_CASES["cuda" if args.smoke else args.device]:
        rounds: dict[tuple[str, str], list[Row]] = {}
        for _ in range(1 if case == "kernels" else args.rounds):  # the paths interleaved: drift hits them alike
            for path in (["-"] if case == "kernels" else args.paths):
                left = args.budget_s - (time.monotonic() - start)
                got = ([Row(case, path, status="skipped", note="time budget spent")] if left < 20
                       else _row(args, case, path, min(args.row_timeout_s, left)))
                for r in got:
                    rounds.setdefault((r.case, r.path), []).append(r)
        rows += [_median_row(r) for r in rounds.values()]
    order = ["kernels", "debug", "small-moe", "moe-bf16", "moe-bf16-accum4", "llama-1b"]
    rows.sort(key=lambda r: (order.index(r.case) if r.case in order else len(order), PATHS.index(r.path)
                             if r.path in PATHS else -1))
    text = _markdown(args, rows, time.monotonic() - start, device, versions)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
