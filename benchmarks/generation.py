"""Rollout speed: batched generation with the KV cache per layout (and against transformers' ``generate``), the GRPO
rollout time of ``configs/grpo.yaml`` per layout, and the static cache with a compiled decoding step (issue 57).

    python benchmarks/generation.py --out benchmarks/results/generation-cpu.md            # every CPU part
    python benchmarks/generation.py --part decode --size small --batch 8 --new 32         # decoding only
    python benchmarks/generation.py --part grpo --compare /tmp/base                       # + another source tree
    python -m torch.distributed.run --nproc_per_node=2 benchmarks/generation.py --layout tp   # one layout by hand
    python benchmarks/generation.py --part static --out benchmarks/results/generation-static-cpu.md   # CPU rows
    python benchmarks/generation.py --part gpu --device cuda --budget-s 200 --out $OUT/generation-gpu.md  # GPU, ~4 min

**Static cache + compiled step** (``--part static`` on the CPU, ``--part gpu`` on a CUDA machine;
``benchmarks/decode_speed.py``): in one process, our eager decoding (the dynamic cache) against our static cache with
the compiled step, and transformers' ``generate`` on the same weights with its dynamic cache and with its static cache
+ ``torch.compile``; greedy, no EOS, prompts of 32-64 tokens; each row's warm-up (compilation, CUDA-graph recording)
timed apart. ``--part gpu``: ``llama-1b`` in bf16 at batch 8, 1 and 64 (that order), 256 new tokens, then the GRPO
rollout time of ``configs/grpo.yaml`` at a ~0.5B size (``--grpo-overrides``) with each of our settings. Every row is
guarded and the whole part keeps to ``--budget-s`` (rows that do not fit say so).

**Decoding.** The ``small`` decoder (random weights; ``--size``) continues ``--batch`` left-padded prompts of 32-64
tokens for ``--new`` tokens greedily (every row runs to the end: no EOS), through ``task.decoding()`` under the
engine's layout, after one warm-up call; median of ``--repeats``. On one device the same weights are also saved with
``save_hf``, loaded by transformers (SDPA attention) and decoded by its ``generate`` with the same settings; the
tokens must be identical, and the two alternate call by call. Where the time goes: ``torch.profiler`` over one more
call, its CPU self time grouped into matmuls, attention, collectives (tensor-parallel all-reduces, the pipeline's
send/recv and broadcasts, ZeRO-3 all-gathers) and the rest.

**GRPO rollouts.** ``lightning_llm fit --config configs/grpo.yaml`` (64 responses of up to 12 tokens per rank and
rollout: 8 prompts x 8) for ``--rollouts`` rollouts under each layout, ``--rounds`` times in turn; the median of
``time/rollout_s`` (sampling, scoring, old and reference log-probs) over every rollout but each run's first. The
tokens are the same under every layout with the same prompts per replica (per-prompt seeds): 1 device = pp x2 =
tp x2 (one replica), ddp x2 = zero3 x2 (two). ``--compare DIR`` also runs the source tree ``DIR`` (e.g. an
exported earlier commit) in the same rounds, as a "before" column.

**Reference bytes.** The bytes of the frozen reference each rank holds in a GRPO full fine-tune of ``small`` under
1 device, zero3 x2, tp x2 and pp x2 (measured with ``model_state_bytes`` on every rank).
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.testing import free_port, run_worker

import decode_speed  # noqa: E402 (benchmarks/decode_speed.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {"matmul": ("mm", "addmm", "bmm", "linear", "matmul"), "attention": ("scaled_dot_product", "attention"),
          "collectives": ("gloo", "all_reduce", "allreduce", "all_gather", "allgather", "broadcast", "send", "recv",
                          "c10d", "wait")}
OWN = "gather_for_decoding"  # per_layer: the layout decodes as it trains (tp through its shards, pp its stages)
DECODE_LAYOUTS = {"1 device": None, "tp x2": dict(tensor_parallel_size=2),
                  "tp x2 (shards)": dict(tensor_parallel_size=2, **{OWN: "per_layer"}),
                  "pp x2": dict(pipeline_parallel_size=2),
                  "pp x2 (stages)": dict(pipeline_parallel_size=2, **{OWN: "per_layer"}),
                  "zero3 x2": dict(data_parallel_size=2, zero_stage=3)}
GRPO_LAYOUTS = {"1 device": [], "ddp x2": ["--trainer.strategy=ddp"], "pp x2": ["--trainer.strategy=pp"],
                "pp x2 (stages)": ["--trainer.strategy=pp", f"--trainer.strategy.{OWN}=per_layer"],
                "tp x2": ["--trainer.strategy=tp"],
                "tp x2 (shards)": ["--trainer.strategy=tp", f"--trainer.strategy.{OWN}=per_layer"],
                "zero3 x2": ["--trainer.strategy=zero3"]}


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


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _group(name: str) -> str:
    low = name.lower()
    return next((g for g, keys in GROUPS.items() if any(k in low for k in keys)), "other")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _transformers_twin(model: torch.nn.Module, work: str) -> Any:
    """The same weights as a transformers model (``save_hf`` -> ``from_pretrained``, SDPA attention)."""
    import transformers

    from lightning_llm.models import save_hf

    path = Path(work) / "hf-twin"
    save_hf(model, path)
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


class _Measure(pl.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.result: dict[str, Any] = {}

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        a = self.args
        ids, mask = (t.to(pl_module.device) for t in _prompts(a.batch))
        cfg = GenerationConfig(max_new_tokens=a.new, eos_token_id=None)
        pl_module.eval()

        def ours() -> torch.Tensor:
            with pl_module.decoding() as model:
                return generate(model, ids, mask, config=cfg)

        tokens = ours()  # warm-up
        calls = {"ours": ours}
        if a.layout == "1 device":
            hf = _transformers_twin(pl_module.model, a.work)

            def theirs() -> torch.Tensor:
                with torch.no_grad():
                    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.new, min_new_tokens=a.new,
                                      do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
                return out[:, ids.shape[1]:]

            if not torch.equal(theirs(), tokens):
                raise AssertionError("transformers' generate chose other tokens than ours")
            calls["transformers"] = theirs
        times: dict[str, list[float]] = {k: [] for k in calls}
        for _ in range(a.repeats):  # alternating, so drifts of a shared machine hit both alike
            for name, fn in calls.items():
                times[name].append(_timed(fn))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ours()
        shares: dict[str, float] = {}
        for ev in prof.key_averages():
            shares[_group(ev.key)] = shares.get(_group(ev.key), 0.0) + ev.self_cpu_time_total
        total = sum(shares.values()) or 1.0
        self.result = {name: {"seconds": statistics.median(t), "tokens_per_s": a.batch * a.new / statistics.median(t)}
                       for name, t in times.items()}
        self.result["ours"]["shares"] = {k: v / total for k, v in sorted(shares.items())}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_llm.data import TextDataModule
    from lightning_llm.strategies import HybridParallelStrategy
    from lightning_llm.tasks import CausalLMTask

    torch.set_num_threads(1)
    pl.seed_everything(0)
    task = CausalLMTask(args.size, dropout=0.0)
    dm = TextDataModule(block_size=16, batch_size=2, cache_dir=str(Path(args.work) / "cache"), generated_docs=40)
    kw = DECODE_LAYOUTS[args.layout]
    cb = _Measure(args)
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kw else 1, strategy=HybridParallelStrategy(**kw) if kw
                         else "auto", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1, callbacks=[cb], default_root_dir=args.work)
    trainer.validate(task, dm, verbose=False)
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps({"layout": args.layout, **cb.result}), flush=True)
    return cb.result


def _launch(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    base = [__file__, "--layout", layout, "--size", args.size, "--batch", str(args.batch), "--new", str(args.new),
            "--repeats", str(args.repeats), "--work", args.work, "--worker"]
    cmd = ([sys.executable, *base] if DECODE_LAYOUTS[layout] is None else
           [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *base])
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"{layout} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def decode_table(a: argparse.Namespace) -> list[str]:
    rows = [_launch(layout, a) for layout in DECODE_LAYOUTS]
    groups = sorted({g for r in rows for g in r["ours"]["shares"]})
    base = rows[0]["ours"]["tokens_per_s"]
    lines = [f"## Decoding with the KV cache: `{a.size}` decoder, batch {a.batch}, {a.new} new tokens, greedy", "",
             f"`python benchmarks/generation.py --part decode --size {a.size} --batch {a.batch} --new {a.new}` "
             f"(median of {a.repeats}; 1 thread per process; shares: `torch.profiler` CPU self time of one more call, "
             "rank 0)", "", "| layout | seconds | tokens/s | vs 1 device | " + " | ".join(groups) + " |",
             "|---|---|---|---|" + "---|" * len(groups)]
    hf = rows[0]["transformers"]
    lines.append(f"| transformers `generate`, 1 device | {hf['seconds']:.3f} | {hf['tokens_per_s']:.1f} | "
                 f"{hf['tokens_per_s'] / base:.2f}x |" + " |" * len(groups))
    for r in rows:
        ours = r["ours"]
        lines.append(f"| {r['layout']} | {ours['seconds']:.3f} | {ours['tokens_per_s']:.1f} | "
                     f"{ours['tokens_per_s'] / base:.2f}x | " + " | ".join(f"{ours['shares'].get(g, 0):.0%}"
                                                                          for g in groups) + " |")
    lines += ["", f"One device against transformers' `generate` on the same weights and tokens: "
              f"**{hf['seconds'] / rows[0]['ours']['seconds']:.2f}x** its speed.", ""]
    return lines


# ---------------------------------------------------------------------------------------------------- GRPO rollouts
def _grpo_run(layout: str, source: Path, a: argparse.Namespace) -> list[float]:
    """``time/rollout_s`` of every rollout but the first of one ``fit --config configs/grpo.yaml``."""
    with tempfile.TemporaryDirectory(dir=a.work) as out:
        flags = [f"--trainer.max_steps={4 * a.rollouts}", f"--trainer.logger.init_args.save_dir={out}",
                 "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
                 "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={out}"]
        cli = ["-m", "lightning_llm", "fit", "--config", str(ROOT / "configs" / "grpo.yaml"), *flags]
        if GRPO_LAYOUTS[layout]:
            # an earlier tree (--compare) has no gather_for_decoding under tp and pp: it decodes as they train
            layout_flags = [f for f in GRPO_LAYOUTS[layout] if source == ROOT or OWN not in f]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", *cli, "--trainer.devices=2", *layout_flags]
        else:
            cmd = [sys.executable, *cli]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(source)}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=a.work)
        if done.returncode:
            raise RuntimeError(f"{layout} ({source}) failed:\n{done.stderr[-3000:]}")
        path = next(Path(out).rglob("metrics.csv"))
        rows = [r for r in csv.DictReader(path.open()) if r.get("time/rollout_s")]
        return [float(r["time/rollout_s"]) for r in rows[1:]]


def grpo_table(a: argparse.Namespace) -> list[str]:
    sources = {"after": ROOT, **({"before": Path(a.compare)} if a.compare else {})}
    runs: dict[tuple[str, str], list[list[float]]] = {(s, layout): [] for s in sources for layout in GRPO_LAYOUTS}
    for _ in range(a.rounds):
        for layout in GRPO_LAYOUTS:
            for name, source in sources.items():
                runs[(name, layout)].append(_grpo_run(layout, source, a))
    med = {k: statistics.median(t for run in v for t in run) for k, v in runs.items()}
    best = {k: min(statistics.median(run) for run in v) for k, v in runs.items()}  # the least disturbed run
    cols = [s for s in ("before", "after") if s in sources]
    lines = ["## GRPO rollout time (`configs/grpo.yaml`, `time/rollout_s`)", "",
             f"`python benchmarks/generation.py --part grpo --rollouts {a.rollouts} --rounds {a.rounds}"
             + (" --compare DIR" if a.compare else "") + f"`: median over {a.rounds} runs x {a.rollouts - 1} rollouts "
             "(each run's first left out) and, in brackets, the median of the least disturbed run; 1 thread per "
             "process; the ratios are of the medians (of the best runs in brackets).", "",
             "| layout | " + " | ".join(f"{c} (s)" for c in cols) + " | vs 1 device | vs ddp x2 |",
             "|---|" + "---|" * len(cols) + "---|---|"]

    def ratio(layout: str, base: str) -> str:
        return (f"{med[('after', layout)] / med[('after', base)]:.2f}x "
                f"({best[('after', layout)] / best[('after', base)]:.2f}x)")

    for layout in GRPO_LAYOUTS:
        lines.append(f"| {layout} | " + " | ".join(f"{med[(c, layout)]:.4f} ({best[(c, layout)]:.4f})" for c in cols)
                     + f" | {ratio(layout, '1 device')} | {ratio(layout, 'ddp x2')} |")
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------------- reference bytes
def _reference_bytes(layout: str, a: argparse.Namespace) -> list[int]:
    """Bytes of the frozen reference each rank holds (``model_state_bytes``, by ``testing.RolloutRecorder``) in a
    GRPO full fine-tune of ``--reference-size`` under ``layout`` (one rollout)."""
    with tempfile.TemporaryDirectory(dir=a.work) as out:
        flags = ["--trainer.max_steps=1", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                 "--trainer.callbacks=[]", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                 f"--model.backbone={a.reference_size}", "--model.model_overrides={}", "--data.batch_size=4",
                 "--model.grpo.num_generations=2", "--model.grpo.num_mini_batches=1",
                 "--model.generation.max_new_tokens=2", "--trainer.callbacks+=lightning_llm.testing.RolloutRecorder",
                 f"--trainer.callbacks.output={out}/rollouts.json", f"--trainer.default_root_dir={out}"]
        cli = ["-m", "lightning_llm", "fit", "--config", str(ROOT / "configs" / "grpo.yaml"), *flags]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                f"--master_port={free_port()}", *cli, "--trainer.devices=2", *GRPO_LAYOUTS[layout]]
               if GRPO_LAYOUTS[layout] else [sys.executable, *cli])
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              cwd=a.work)
        if done.returncode:
            raise RuntimeError(f"{layout} failed:\n{done.stderr[-3000:]}")
        return json.loads((Path(out) / "rollouts.json").read_text())["frozen_bytes"]


def reference_table(a: argparse.Namespace) -> list[str]:
    held = {layout: _reference_bytes(layout, a) for layout in ("1 device", "zero3 x2", "tp x2", "pp x2")}
    one = held["1 device"][0]
    lines = [f"## Bytes of the frozen reference per rank (GRPO full fine-tune of `{a.reference_size}`)", "",
             f"`python benchmarks/generation.py --part reference --reference-size {a.reference_size}`: "
             "`strategies.zero.native.model_state_bytes` of `task.frozen_models()` on every rank at the start of fit "
             "(`testing.RolloutRecorder`); the vocabulary is the byte tokenizer's (264 rows).", "",
             "| layout | bytes per rank | largest vs 1 device |", "|---|---|---|"]
    for layout, per_rank in held.items():
        lines.append(f"| {layout} | {', '.join(f'{b:,}' for b in per_rank)} | {max(per_rank) / one:.3f}x |")
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------------- static + compiled
GRPO_05B = ("{num_layers: 28, hidden_size: 1024, num_heads: 16, num_kv_heads: 4, intermediate_size: 4352, "
            "max_position_embeddings: 1024}")
"""``--grpo-overrides`` of ``--part gpu``: a Qwen2.5-0.5B-like shape on the byte vocabulary (448M parameters)."""


def static_part(a: argparse.Namespace, head: list[str]) -> list[str]:
    """Our eager vs static + compiled decoding against transformers' (one process), and GRPO rollouts with each.
    ``--part gpu``: fp32 parity first, then the first batch size's rows, the GRPO rollouts, the other batch sizes;
    the results file is rewritten after each part (a later crash leaves what was measured)."""
    device = torch.device(a.device)
    budget = decode_speed.Budget(a.budget_s)
    gpu, part_gpu = device.type == "cuda", a.part == "gpu"  # --part gpu --device cpu: its code path on the CPU
    dtype = torch.bfloat16 if gpu else torch.float32
    size = a.gpu_size if part_gpu else a.size
    batches = a.batches or ([8, 1, 64] if part_gpu else [a.batch])
    new = a.new if a.new_set else (256 if part_gpu else 32)
    cmd = " ".join(["python", *sys.argv]).replace(str(ROOT) + "/", "")
    if not gpu:
        torch.set_num_threads(1)
    lines = list(head)

    def write(*more: str) -> None:
        lines.extend(more)
        if a.out:
            a.out.write_text("\n".join([*lines, f"{budget.seconds - budget.left():.0f} s of {budget.seconds:.0f} s "
                                         "used so far.", ""]) + "\n")

    if part_gpu:
        write(*decode_speed.parity_lines(device, budget))
    model = decode_speed.build(size, device, dtype)
    hf = None
    try:
        hf = decode_speed.transformers_twin(model, a.work, dtype, device)
    except Exception as e:  # noqa: BLE001 - the rows of ours still run
        print(f"[decode] transformers twin failed: {e}", flush=True)
    where = torch.cuda.get_device_name(device) if gpu else "the 2-core CPU, 1 thread"
    title = f"Decoding `{size}` ({str(dtype).removeprefix('torch.')}) on {where}: {new} new tokens, greedy"
    rows = decode_speed.decode_rows(model, hf, batches=batches[:1], new=new, device=device, budget=budget,
                                    repeats=a.repeats, static_eager=not part_gpu)
    first, start = decode_speed.decode_table(rows, title=title, command=cmd), len(lines)
    write(*first)
    flags = [f"--trainer.accelerator={'gpu' if gpu else 'cpu'}", "--trainer.devices=1"]
    if gpu:
        flags += ["--trainer.precision=bf16-mixed"]
    if part_gpu:
        flags += [f"--model.model_overrides={a.grpo_overrides}"]
    runs: dict[str, tuple[list[float], str]] = {}
    for name, settings in (("dynamic", {}), ("static + compile",
                                           {"cache_implementation": "static", "compile": "true"})):
        need = 60.0 if gpu else 90.0
        t0 = time.perf_counter()
        if budget.left() < need:
            runs[name] = ([], f"skipped: {budget.left():.0f} s of the budget left, about {need:.0f} s needed")
        else:
            try:
                runs[name] = decode_speed.grpo_rollouts(flags=flags, settings=settings, rollouts=a.rollouts,
                                                        work=a.work, timeout_s=max(budget.left(), 30.0))
            except Exception as e:  # noqa: BLE001 - a timeout or failure is the row's result
                runs[name] = ([], f"failed: {type(e).__name__}: {str(e)[:200]}")
        print(f"[grpo] {name}: {runs[name]} ({time.perf_counter() - t0:.0f} s; {budget.left():.0f} s left)",
              flush=True)
    shape = f"model_overrides `{a.grpo_overrides}`" if part_gpu else "its 2-layer `debug`"
    write(*decode_speed.grpo_table(runs, title=f"GRPO rollout time (`configs/grpo.yaml`, {shape}, {a.rollouts} "
                                   "rollouts of 64 responses x 12 tokens, `time/rollout_s`)", command=cmd))
    if len(batches) > 1:
        rows += decode_speed.decode_rows(model, hf, batches=batches[1:], new=new, device=device, budget=budget,
                                         repeats=a.repeats, static_eager=not part_gpu)
        lines[start:start + len(first)] = decode_speed.decode_table(rows, title=title, command=cmd)  # every batch's
        write()
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["decode", "grpo", "reference", "all", "static", "gpu"], default="all")
    p.add_argument("--device", default="cpu", help="--part static/gpu: the device (cuda for the GPU rows)")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="--part static/gpu: seconds for all its rows (a row that would not fit is skipped, saying so)")
    p.add_argument("--gpu-size", default="llama-1b", help="--part gpu: the decoder of the decoding rows")
    p.add_argument("--batches", type=int, nargs="*", default=None, help="--part static/gpu: batch sizes, in order")
    p.add_argument("--grpo-overrides", default=GRPO_05B, help="--part gpu: model_overrides of the GRPO run")
    p.add_argument("--reference-size", default="small", help="the backbone of --part reference")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=6, help="GRPO rollouts per run (--part static/gpu: 4)")
    p.add_argument("--rounds", type=int, default=3, help="GRPO runs per layout (in turn)")
    p.add_argument("--compare", default=None, help="GRPO: another source tree to time beside this one (before)")
    p.add_argument("--work", default="/tmp/lightning_llm-generation-bench")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.new_set = "--new" in sys.argv
    if a.part in ("static", "gpu") and "--rollouts" not in sys.argv:
        a.rollouts = 3 if a.part == "gpu" else 4  # the first compiles where compile is on
    if a.part in ("static", "gpu") and "--repeats" not in sys.argv:
        a.repeats = 2 if a.part == "gpu" else 4  # timed calls of a compiled row (eager rows: half)
    Path(a.work).mkdir(parents=True, exist_ok=True)
    if a.worker:
        run_worker(measure, a) if DECODE_LAYOUTS[a.layout] else measure(a)
        return
    lines = ["# Rollout speed on CPU", "", f"Measured {time.strftime('%Y-%m-%d')} on the shared 2-core development "
             f"machine (gloo; load average at the start {os.getloadavg()[0]:.1f}).", ""]
    if a.part in ("static", "gpu"):
        lines = [f"# Decoding with the static cache and a compiled step ({a.device})", "",
                 f"Measured {time.strftime('%Y-%m-%d')}: torch {torch.__version__}, transformers "
                 f"{_version('transformers')}, load average at the start {os.getloadavg()[0]:.1f}.", ""]
    t0 = time.perf_counter()
    if a.part in ("static", "gpu"):
        lines = static_part(a, lines)
    if a.part in ("decode", "all"):
        lines += decode_table(a)
    if a.part in ("grpo", "all"):
        lines += grpo_table(a)
    if a.part in ("reference", "all"):
        lines += reference_table(a)
    lines += [f"Load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - t0:.0f} s in all.", ""]
    text = "\n".join(lines) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text, flush=True)
    if a.part in ("static", "gpu"):  # torch 2.11 once segfaulted tearing CUDA-graph pools down: the file is written
        os._exit(0)


if __name__ == "__main__":
    main()
