"""GPU benchmark and correctness suite of lightning_llm, one command on a CUDA machine:

1. kernels: every Triton kernel of ``lightning_llm.kernels`` (compiled, never interpreted) against its plain-torch path
   and a float64 reference, forward + backward, in fp32/bf16/fp16 at Liger-Kernel's benchmark shapes (any mismatch
   fails the run, naming kernel/dtype/tensor); then each kernel timed vs eager torch, ``torch.compile`` and
   Liger-Kernel (when ``liger_kernel`` imports): median time (``triton.testing.do_bench``), GB/s of the ideal traffic
   vs the measured device-to-device copy bandwidth, and peak extra memory;
2. flce: fused linear cross-entropy at 32k tokens x hidden 4096 x vocab 128256 (bf16) vs eager ``F.linear`` +
   ``F.cross_entropy``, ``torch.compile`` of that, and Liger's ``LigerFusedLinearCrossEntropyLoss``;
3. e2e: ``lightning_llm fit`` runs (see ``e2e.py``): Erlangshen-1.3B-shaped encoder on AFQMC-shaped pairs (seq 512,
   bf16-mixed) at batch 4 and the largest batch that fits under 1 device / zero1 / zero2, ZeRO-3 offload peak GPU
   memory at batch 1 (native and DeepSpeed) vs 5 GB, and a ~1B Llama decoder (seq 2048) with torch vs Triton kernels;
4. attention (see ``attention.py``): the varlen path vs the dense-mask path: SFT with packing (``llama-1b``,
   4 x 4096, bf16) and one GPU on a 32k-token row (``attention-sft``, ``attention-long``), and GQA without repeated
   keys/values (``attention-gqa``): step time, tokens/s, peak memory.
5. moe: ``lightning_llm fit`` of a Qwen3-30B-A3B-shaped Mixture-of-Experts decoder with fewer layers (``--moe-layers``,
   128 experts top-8, bf16-mixed, the experts' GEMMs grouped): step time, tokens/s and MFU counted on the parameters
   a token uses (``e2e.run_moe``).

Results: ``benchmarks/results/gpu-<device>.md`` (or ``--out``), written atomically; exit 1 if any part failed.

    python benchmarks/gpu/suite.py                                   # everything (~20 min on an H100)
    python benchmarks/gpu/suite.py --only kernels --only flce --out $OUT/gpu-kernels.md --time-budget-s 540
    python benchmarks/gpu/suite.py --only e2e --out $OUT/gpu-e2e.md --time-budget-s 540
    python benchmarks/gpu/suite.py --only attention --out $OUT/gpu-attention.md --time-budget-s 540
    python benchmarks/gpu/suite.py --only moe --out $OUT/gpu-moe.md --time-budget-s 540
    python benchmarks/gpu/suite.py --smoke --out /tmp/gpu-smoke.md   # CPU: Triton interpreter, tiny shapes, debug models
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]
ONLY = ("kernels", "flce", "e2e", "e2e-encoder", "e2e-offload", "e2e-decoder", "attention", "attention-sft",
        "attention-long", "attention-gqa", "moe")
ATTENTION_GROUPS = ("sft", "long", "gqa")
E2E_GROUPS = ("encoder", "offload", "decoder")
FULL = dict(dtypes=["fp32", "bf16", "fp16"], time_dtype="bf16", compile_backend="inductor", copy_mib=1024,
            flce_tokens=32768, flce_hidden=4096, flce_vocab=128256, e2e_steps=20, e2e_warmup=5, e2e_offload_steps=6,
            e2e_max_batch=256, e2e_seq=512, decoder_seq=2048, decoder_batch=4, encoder_backbone="erlangshen-1.3b",
            decoder_backbone="llama-1b", precision="bf16-mixed", moe_backbone="qwen3-30b-a3b", moe_layers=4,
            moe_batch=4, moe_seq=2048)
SMOKE = dict(FULL, dtypes=["fp32"], time_dtype="fp32", compile_backend="eager", copy_mib=8, flce_tokens=13,
             flce_hidden=24, flce_vocab=131, e2e_steps=4, e2e_warmup=1, e2e_offload_steps=3, e2e_max_batch=4,
             e2e_seq=64, decoder_seq=16, decoder_batch=1, encoder_backbone="debug", decoder_backbone="debug",
             moe_backbone="debug-moe", moe_layers=2, moe_batch=1, moe_seq=16)
OFFLOAD_LIMIT_GB = 5.0  # ZeRO-3 offload at batch 1 must stay under this much GPU memory (10^9 bytes)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU check of the whole suite: TRITON_INTERPRET=1, tiny "
                   "shapes, fp32, debug backbones, 1-2 repetitions")
    p.add_argument("--only", action="append", choices=ONLY, help="run only these parts (repeatable; default: all)")
    p.add_argument("--out", type=Path, help="results markdown (default: benchmarks/results/gpu-<device>.md)")
    p.add_argument("--time-budget-s", type=float, default=1320.0, help="skip what is left (with a note) after this")
    p.add_argument("--work", type=Path, help="scratch directory for the e2e runs and their logs (default: a temp dir)")
    g = p.add_argument_group("kernels / flce")
    g.add_argument("--kernels", nargs="+", help="only cases whose name starts with one of these")
    g.add_argument("--providers", nargs="+", default=["triton", "eager", "compile", "liger"])
    g.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16", "fp16"], help="correctness dtypes")
    g.add_argument("--time-dtype", choices=["fp32", "bf16", "fp16"], help="dtype of the timings")
    g.add_argument("--compile-backend", help="torch.compile backend of the 'compile' provider")
    g.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up (ms)")
    g.add_argument("--rep-ms", type=int, default=100, help="do_bench repetitions (ms)")
    g.add_argument("--flce-rep-ms", type=int, default=1000, help="do_bench repetitions of the flce part (ms)")
    g.add_argument("--cpu-reps", type=int, default=2, help="timed repetitions on CPU (--smoke)")
    g.add_argument("--copy-mib", type=int, help="size of the copy_ that measures memory bandwidth")
    for name in ("flce-tokens", "flce-hidden", "flce-vocab"):
        g.add_argument(f"--{name}", type=int)
    g = p.add_argument_group("e2e")
    for name in ("e2e-steps", "e2e-warmup", "e2e-offload-steps", "e2e-max-batch", "e2e-seq", "decoder-seq",
                 "decoder-batch"):
        g.add_argument(f"--{name}", type=int)
    g.add_argument("--encoder-backbone")
    g.add_argument("--decoder-backbone")
    g.add_argument("--precision")
    g.add_argument("--run-timeout-s", type=float, default=420.0, help="limit of one lightning_llm fit")
    g = p.add_argument_group("moe")
    g.add_argument("--moe-backbone", help="named MoE size (default qwen3-30b-a3b)")
    g.add_argument("--moe-layers", type=int, help="its layers (default 4: AdamW states of 3.1B parameters fit 80 GB)")
    g.add_argument("--moe-batch", type=int)
    g.add_argument("--moe-seq", type=int)
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.only = a.only or ["kernels", "flce", "e2e", "attention", "moe"]
    return a


def setup_env(a: argparse.Namespace) -> None:
    """Before torch/triton are imported: the interpreter on CPU for --smoke, compiled kernels otherwise."""
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif os.environ.pop("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "no", "off"):
        log.warning("TRITON_INTERPRET was set: removed, the kernels are checked and timed compiled")
    for path in (str(REPO), str(BENCH)):  # the working tree's package and the helper modules
        if path not in sys.path:
            sys.path.insert(0, path)


@dataclass
class Ctx:
    a: argparse.Namespace
    device: Any
    bench: Any
    deadline: float
    copy_gbps: float | None = None
    device_name: str = ""
    peak_tflops: float | None = None

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline


@dataclass
class PartResult:
    name: str
    status: str = "ok"  # ok | failed | skipped
    seconds: float = 0.0
    note: str = ""
    sections: list[str] = field(default_factory=list)


def fnum(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(header: list[str], rows: list[list[str]]) -> str:
    from kernel_bench import md_table

    return md_table(header, rows)


# ---------------------------------------------------------------------------------------------------------- parts


def _check_section(rows: list[Any], failures: list[str], skipped: list[str], smoke: bool) -> str:
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.shape, r.dtype), []).append(r)
    out = []
    for (kernel, shape, dtype), rs in groups.items():
        w64, wt = max(rs, key=lambda r: r.err_fp64), max(rs, key=lambda r: r.err_torch)
        out.append([kernel, shape, dtype, f"{w64.err_fp64:.2e} ({w64.tensor})", f"{wt.err_torch:.2e} ({wt.tensor})",
                    f"{max(r.torch_err_fp64 for r in rs):.2e}", f"{max(r.tolerance for r in rs):.1e}",
                    "ok" if all(r.ok for r in rs) else "**FAIL**"])
    how = "interpreted: --smoke" if smoke else "compiled"
    text = [f"## Kernel correctness (Triton {how}, vs float64 and vs the torch path in the same dtype)", "",
            "Max relative error `max|out - ref| / max|ref|` over the forward output and every input gradient (worst "
            "tensor named); `torch vs fp64` is the plain-torch path's own error, for scale. `tol`: 1e-4 in fp32; in bf16/fp16 "
            "3e-2/1e-2, or 1.25x torch's own error where that is larger (vs torch: the sum of both).", "",
            table(["kernel", "shape", "dtype", "max err vs fp64", "max err vs torch", "torch vs fp64", "tol", "result"],
                  out)]
    if failures:
        text += ["", "### Correctness failures", "", *[f"- {f}" for f in failures]]
    if skipped:
        text += ["", f"Not checked (time budget spent): {', '.join(skipped)}"]
    return "\n".join(text)


def part_kernels(ctx: Ctx) -> PartResult:
    import kernel_cases as G
    import kernel_bench as KB

    a, res = ctx.a, PartResult("kernels")
    cases = G.build_cases(G.SMOKE_SHAPES if a.smoke else G.LIGER_SHAPES)
    if a.kernels:
        cases = [c for c in cases if any(c.name.startswith(k) for k in a.kernels)]
    rows, failures, skipped = G.check_all(cases, a.dtypes, ctx.device, ctx.out_of_time)
    timings, not_timed = [], []
    for case in [c for c in cases if c.time_shape is not None]:
        if ctx.out_of_time():
            not_timed.append(case.name)
            continue
        timings += KB.time_case(case, a.time_dtype, ctx.device, ctx.bench, a.providers, a.compile_backend)
    res.sections = [_check_section(rows, failures, skipped, a.smoke),
                    KB.timing_section(timings, ctx.copy_gbps, a.time_dtype, ctx.device)]
    if not_timed:
        res.sections.append(f"Not timed (time budget spent): {', '.join(not_timed)}")
    if failures:
        res.status, res.note = "failed", f"{len(failures)} correctness failure(s): {failures[0]}"
    elif skipped or not_timed:
        res.note = "incomplete: time budget spent"
    return res


def part_flce(ctx: Ctx) -> PartResult:
    import kernel_bench as KB

    a, res = ctx.a, PartResult("flce")
    rows = KB.flce_bench(ctx.device, KB.Bench(ctx.device, a.warmup_ms, a.flce_rep_ms, a.cpu_reps), rows=a.flce_tokens,
                        hidden=a.flce_hidden, vocab=a.flce_vocab, dtype=a.time_dtype, providers=a.providers,
                        compile_backend=a.compile_backend)
    eager = next((r for r in rows if r.provider == "eager" and r.fwd_bwd_ms), None)
    out = []
    for r in rows:
        t = f"{eager.fwd_bwd_ms / r.fwd_bwd_ms:.2f}x" if eager and r.fwd_bwd_ms else "-"
        m = f"{r.peak_mib / eager.peak_mib:.2f}x" if eager and eager.peak_mib and r.peak_mib else "-"
        dl = f"{abs(r.loss - eager.loss):.1e}" if eager and eager.loss is not None and r.loss is not None else "-"
        out.append([r.provider, fnum(r.fwd_ms), fnum(r.fwd_bwd_ms), fnum(r.tflops, ".1f"),
                    fnum(None if r.peak_mib is None else r.peak_mib / 1024, ".2f"), fnum(r.loss, ".5f"), dl, t, m,
                    r.note])
    res.sections = ["\n".join([
        f"## Fused linear cross-entropy: {a.flce_tokens} tokens x hidden {a.flce_hidden} x vocab {a.flce_vocab} "
        f"({a.time_dtype})", "",
        "eager = `F.cross_entropy(F.linear(h, W), t)`; compile = torch.compile of eager; liger = "
        "`LigerFusedLinearCrossEntropyLoss`. TFLOP/s = 6 N H V / forward+backward time; peak = extra memory of one "
        "forward+backward; abs dloss = absolute loss difference vs eager.", "",
        table(["provider", "fwd ms", "fwd+bwd ms", "TFLOP/s", "peak GiB", "loss", "abs dloss", "time vs eager",
               "memory vs eager", "note"], out)])]
    bad = [r for r in rows if r.provider == "triton" and (r.note or r.fwd_bwd_ms is None)]
    if bad:
        res.status, res.note = "failed", f"triton: {bad[0].note}"
    return res


def _e2e_config(ctx: Ctx) -> Any:
    import e2e as E

    a = ctx.a
    env = ({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"} if a.smoke
           else {"TRITON_INTERPRET": "0"})
    work = a.work or Path(tempfile.mkdtemp(prefix="lightning_llm_gpu_"))
    return E.E2EConfig(work=work.resolve(), accelerator="cpu" if a.smoke else "gpu", precision=a.precision,
                       encoder_backbone=a.encoder_backbone, decoder_backbone=a.decoder_backbone, seq=a.e2e_seq,
                       decoder_seq=a.decoder_seq, decoder_batch=a.decoder_batch, steps=a.e2e_steps, warmup=a.e2e_warmup,
                       offload_steps=a.e2e_offload_steps, offload_warmup=1, max_batch=a.e2e_max_batch,
                       run_timeout_s=a.run_timeout_s, peak_tflops=ctx.peak_tflops,
                       env={**env, "LIGHTNING_LLM_LOG": "WARNING", "TOKENIZERS_PARALLELISM": "false"})


def _e2e_sections(report: Any, cfg: Any) -> list[str]:
    def cells(r: Any) -> list[str]:
        return [r.model, r.strategy, r.kernels, str(r.batch), r.role, r.status, fnum(r.step_ms, ".1f"),
                fnum(r.tokens_per_s, ",.0f"), "-" if r.mfu is None else f"{100 * r.mfu:.1f}%",
                fnum(r.peak_alloc_gib, ".2f"), fnum(r.peak_reserved_gib, ".2f"), fnum(r.rss_gib, ".1f"),
                f"{r.wall_s:.0f}", r.note]

    largest = [[s, "-" if b is None else str(b.batch), fnum(b and b.step_ms, ".1f"),
                fnum(b and b.tokens_per_s, ",.0f"), "-" if b is None or b.mfu is None else f"{100 * b.mfu:.1f}%",
                fnum(b and b.peak_alloc_gib, ".2f"), note] for s, b, note in report.largest]
    offload = [[r.strategy, str(r.batch), r.status, fnum(r.peak_alloc_gib, ".2f"),
                "-" if r.peak_alloc_gib is None else ("yes" if r.peak_alloc_gib * 2**30 < OFFLOAD_LIMIT_GB * 1e9
                                                      else "**no**"),
                fnum(r.rss_gib, ".1f"), fnum(r.step_ms, ".0f")] for r in report.rows if r.role == "offload"]
    return ["\n".join([
        "## End to end: `lightning_llm fit`", "",
        f"Encoder `--model.backbone={cfg.encoder_backbone}` (ClassificationTask, `configs/afqmc.yaml`) on generated "
        f"AFQMC-format pairs cut to `--data.max_length={cfg.seq}` (every batch is {cfg.seq} tokens wide), "
        f"`--trainer.precision={cfg.precision}`, {cfg.steps} steps ({cfg.warmup} warm-up); decoder "
        f"`--model.backbone={cfg.decoder_backbone}` (CausalLMTask, `configs/pretrain_debug.yaml`, generated corpus) "
        f"at `--data.block_size={cfg.decoder_seq}`, batch {cfg.decoder_batch}, `--model.model_overrides` "
        "`{kernels: torch}` vs `{kernels: triton}`, and `auto+compile`: `--model.compile=true` (each block compiled by "
        "inductor, which then takes the torch path inside it; the fused loss stays Triton) (encoder rows: the default "
        "`auto`). Step = median interval between "
        "train-batch ends after warm-up (CUDA synchronised); MFU = (6 N + 12 L H S) x tokens/s / peak "
        f"({fnum(cfg.peak_tflops, '.0f')} TFLOP/s dense bf16; N without embedding tables). Peak alloc/reserved = "
        "torch.cuda.max_memory_allocated/reserved of the run; RSS = the process's peak resident memory.", "",
        table(["model", "strategy", "kernels", "batch", "role", "status", "step ms", "tokens/s", "MFU",
               "peak alloc GiB", "peak reserved GiB", "peak RSS GiB", "wall s", "note"],
              [cells(r) for r in report.rows])]),
        "\n".join(["### Largest encoder batch that fits (doubling from 4 until CUDA OOM)", "",
                   table(["strategy", "largest batch", "step ms", "tokens/s", "MFU", "peak alloc GiB", "note"],
                         largest)]),
        "\n".join([f"### ZeRO-3 offload at batch 1: peak GPU memory vs {OFFLOAD_LIMIT_GB:.0f} GB", "",
                   table(["strategy", "batch", "status", "peak alloc GiB", f"< {OFFLOAD_LIMIT_GB:.0f} GB",
                          "peak RSS GiB", "step ms"], offload)])]


def part_e2e(ctx: Ctx) -> PartResult:
    import e2e as E

    groups = {g for g in E2E_GROUPS if "e2e" in ctx.a.only or f"e2e-{g}" in ctx.a.only}
    cfg = _e2e_config(ctx)
    report = E.run_e2e(cfg, groups, ctx.deadline)
    res = PartResult("e2e", sections=_e2e_sections(report, cfg))
    bad = [r for r in report.rows if r.status == "error" or (r.status == "oom" and r.role != "search")]
    res.sections.append(f"Logs of every run: `{cfg.work / 'out'}`")
    if bad:
        res.status = "failed"
        res.note = "; ".join(f"{r.model} {r.strategy} {r.kernels} batch {r.batch}: {r.status} {r.note}" for r in bad)
    elif any(r.status == "skipped" for r in report.rows):
        res.note = "incomplete: time budget spent"
    return res


def part_attention(ctx: Ctx) -> PartResult:
    import attention as A

    cfg = dict(A.SMOKE if ctx.a.smoke else A.FULL)
    groups = [g for g in ATTENTION_GROUPS if "attention" in ctx.a.only or f"attention-{g}" in ctx.a.only]
    report = A.Report()
    for group in groups:
        if ctx.out_of_time():
            return PartResult("attention", note=f"incomplete: time budget spent before {group}",
                              sections=A.sections(report, cfg))
        if group == "gqa":
            A.run_gqa(cfg, ctx.device, ctx.bench, report)
        else:
            {"sft": A.run_sft, "long": A.run_long}[group](cfg, ctx.device, report)
    res = PartResult("attention", sections=A.sections(report, cfg))
    bad = [r for r in report.rows if r.status != "ok" and "before" not in r.case]  # the mask path may run out
    if bad:
        res.status, res.note = "failed", "; ".join(f"{r.case}: {r.status} {r.note}" for r in bad)
    return res


def part_moe(ctx: Ctx) -> PartResult:
    import e2e as E

    a, cfg = ctx.a, _e2e_config(ctx)
    r = E.run_moe(cfg, ctx.deadline, backbone=a.moe_backbone, layers=a.moe_layers, batch=a.moe_batch, seq=a.moe_seq)
    row = [r.model, str(r.batch), str(a.moe_seq), r.status, fnum(r.step_ms, ".1f"), fnum(r.tokens_per_s, ",.0f"),
           "-" if r.mfu is None else f"{100 * r.mfu:.1f}%", fnum(r.peak_alloc_gib, ".2f"), r.note]
    res = PartResult("moe", sections=["\n".join([
        "## Mixture of Experts: `lightning_llm fit`, one device", "",
        f"`--model.backbone={a.moe_backbone}` with `--model.model_overrides` "
        f"`{json.dumps(E.moe_overrides(a.moe_backbone, a.moe_layers))}` (CausalLMTask, `configs/pretrain_debug.yaml`, "
        f"generated corpus), `--trainer.precision={cfg.precision}`, "
        f"{cfg.steps} steps ({cfg.warmup} warm-up). MFU = (6 N + 12 L A S) x tokens/s / peak "
        f"({fnum(cfg.peak_tflops, '.0f')} TFLOP/s dense bf16) with N the non-embedding parameters a token uses (its "
        "top-k routed experts, not all of them), A the attention width.", "",
        table(["model", "batch", "seq", "status", "step ms", "tokens/s", "MFU (active parameters)",
               "peak alloc GiB", "note"], [row])])])
    if r.status in ("error", "oom"):
        res.status, res.note = "failed", f"{r.model} batch {r.batch}: {r.status} {r.note}"
    elif r.status == "skipped":
        res.note = "incomplete: time budget spent"
    return res


PARTS: dict[str, Callable[[Ctx], PartResult]] = {"kernels": part_kernels, "flce": part_flce, "e2e": part_e2e,
                                                 "attention": part_attention, "moe": part_moe}


def run_part(name: str, fn: Callable[[Ctx], PartResult], ctx: Ctx) -> PartResult:
    """Run one part; an exception or a skip becomes its result, never the end of the run."""
    if ctx.out_of_time():
        return PartResult(name, "skipped", note=f"time budget of {ctx.a.time_budget_s:.0f} s spent before it started")
    t0 = time.monotonic()
    try:
        res = fn(ctx)
    except Exception as e:  # noqa: BLE001 - recorded; the other parts still run
        tb = traceback.format_exc().strip().splitlines()
        res = PartResult(name, "failed", note=f"{type(e).__name__}: {e}",
                         sections=["\n".join([f"## {name}: crashed", "", "```", *tb[-25:], "```"])])
    res.seconds = time.monotonic() - t0
    log.info("part %s: %s in %.0f s %s", name, res.status, res.seconds, res.note)
    return res


# ------------------------------------------------------------------------------------------------------ reporting


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], check=False,
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def environment(ctx: Ctx, argv: list[str]) -> list[str]:
    import torch

    versions = ", ".join(f"{p} {_version(p)}" for p in ("torch", "triton", "transformers", "deepspeed", "lightning",
                                                           "liger-kernel"))
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    return [f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            f"- device: {ctx.device_name}; driver {_driver()}; {cuda}; Python {platform.python_version()}",
            f"- versions: {versions}",
            f"- TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')} "
            f"({'interpreted: smoke run' if ctx.a.smoke else 'compiled kernels'})",
            f"- device-to-device copy bandwidth: {fnum(ctx.copy_gbps, '.0f')} GB/s (read + write of a "
            f"{ctx.a.copy_mib} MiB `copy_`); peak dense bf16 used for MFU: {fnum(ctx.peak_tflops, '.0f')} TFLOP/s",
            f"- command: `{shlex.join(['python', 'benchmarks/gpu/suite.py', *argv])}`",
            f"- time budget: {ctx.a.time_budget_s:.0f} s"]


def render(ctx: Ctx, results: list[PartResult], argv: list[str], total_s: float) -> str:
    title = f"# lightning_llm GPU suite on {ctx.device_name}"
    parts = table(["part", "status", "seconds", "note"],
                  [[r.name, r.status if r.status == "ok" else f"**{r.status}**", f"{r.seconds:.0f}", r.note[:400]]
                   for r in results])
    body = [title, "", *environment(ctx, argv), f"- total: {total_s:.0f} s", "", parts]
    for r in results:
        body += ["", *[s for sec in r.sections for s in (sec, "")]]
    return "\n".join(body).rstrip() + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # a plain open: the umask's mode (mkstemp's is 0600)
    tmp.write_text(text)
    os.replace(tmp, path)


def make_ctx(a: argparse.Namespace) -> Ctx:
    import e2e as E
    import kernel_bench as KB
    import torch

    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu/suite.py needs a CUDA GPU; use --smoke for the CPU check")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks against float64 need full fp32 matmuls (the default)
    device = torch.device("cpu" if a.smoke else "cuda")
    name = "CPU (smoke)" if a.smoke else torch.cuda.get_device_name()
    ctx = Ctx(a, device, KB.Bench(device, a.warmup_ms, a.rep_ms, a.cpu_reps), time.monotonic() + a.time_budget_s,
              device_name=name, peak_tflops=None if a.smoke else E.peak_tflops(name))
    if "kernels" in a.only:
        ctx.copy_gbps = KB.copy_bandwidth_gbps(device, ctx.bench, a.copy_mib * 2**20)
    return ctx


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_env(a)
    t0 = time.monotonic()
    ctx = make_ctx(a)
    wanted = [p for p in PARTS if p in a.only or any(o.startswith(f"{p}-") for o in a.only)]
    results = [run_part(name, PARTS[name], ctx) for name in wanted]
    slug = re.sub(r"[^a-z0-9]+", "-", ctx.device_name.lower()).strip("-")
    out = a.out or REPO / "benchmarks" / "results" / f"gpu-{slug}.md"
    write_atomic(out, render(ctx, results, argv, time.monotonic() - t0))
    failed = [r for r in results if r.status == "failed"]
    for r in results:
        print(f"{r.name}: {r.status} ({r.seconds:.0f} s) {r.note}", file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
