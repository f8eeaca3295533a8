"""Kernel timings of lightning_llm.kernels vs torch eager, ``torch.compile`` and Liger-Kernel (when importable):
median time of forward and of forward+backward (``triton.testing.do_bench``), GB/s of the ideal traffic, peak extra
memory of one forward+backward. The library half of ``benchmarks/gpu/suite.py`` (its ``kernels`` and ``flce`` parts; the
cases and the correctness checks live in ``kernel_cases.py``); as a script it times one set of shapes given on the
command line and writes ``benchmarks/results/kernels-<device>.md``. Needs CUDA; ``--help`` works on CPU.

    python benchmarks/gpu/kernel_bench.py --tokens 8192 --hidden 4096 --vocab 128256 --dtype bf16
    python benchmarks/gpu/kernel_bench.py --kernels cross_entropy fused_linear_cross_entropy --providers triton liger
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_cases import (  # noqa: E402 - the helper module next to this file
    DTYPES,
    PROVIDERS,
    Case,
    Inputs,
    as_tuple,
    build_cases,
    flce_inputs,
    fmt_shape,
    free_memory,
    generator,
    liger_functional,
)

from lightning_llm import kernels as K  # noqa: E402

log = logging.getLogger(__name__)
KERNELS = ["rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "cross_entropy", "vocab_parallel_cross_entropy",
           "fused_linear_cross_entropy"]


@dataclass
class TimeRow:
    kernel: str
    shape: str
    provider: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mib: float | None = None
    gbps: float | None = None
    note: str = ""


# ------------------------------------------------------------------------------------------------------ timing


@dataclass
class Bench:
    """Median time of ``fn`` in ms: ``triton.testing.do_bench`` on CUDA, a perf_counter loop on CPU (smoke)."""

    device: torch.device
    warmup_ms: int = 25
    rep_ms: int = 100
    cpu_reps: int = 2

    def __call__(self, fn: Callable[[], Any], grad_to_none: list[Tensor] | None = None) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=grad_to_none,
                                  return_mode="median"))
        fn()
        times = []
        for _ in range(self.cpu_reps):
            for t in grad_to_none or []:
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, bench: Bench, nbytes: int) -> float:
    """Device-to-device ``copy_`` of ``nbytes``, counting bytes read plus bytes written."""
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255),
            torch.empty(nbytes, dtype=torch.uint8, device=device)]
    ms = bench(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    free_memory(device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def bench_one(fn: Callable[..., Any], inputs: Inputs, bench: Bench, device: torch.device,
              gen: torch.Generator) -> tuple[float, float, float | None]:
    """(forward ms, forward+backward ms, peak extra MiB of one forward+backward or None on CPU). The forward is
    timed with inputs that require grad (as Liger's "forward" mode)."""
    leaves, consts = inputs
    outs = as_tuple(fn(*leaves, *consts))
    ups = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
    del outs

    def fwd_bwd() -> None:
        torch.autograd.backward(as_tuple(fn(*leaves, *consts)), ups)

    t_fwd = bench(lambda: fn(*leaves, *consts))
    t_fb = bench(fwd_bwd, grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    if device.type != "cuda":
        return t_fwd, t_fb, None
    free_memory(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    return t_fwd, t_fb, (torch.cuda.max_memory_allocated() - base) / 2**20


def provider_fn(case: Case, provider: str, compile_backend: str) -> tuple[Callable[..., Any] | None, str]:
    """The function timed for ``provider`` (or None and why not)."""
    if provider == "triton":
        return case.fns["triton"], ""
    if provider == "eager":
        return case.fns["torch"], ""
    if provider == "compile":
        return torch.compile(case.fns["torch"], dynamic=False, backend=compile_backend), ""
    if provider == "liger":
        return case.fns.get("liger"), "" if "liger" in case.fns else (liger_functional()[1] or "no Liger op")
    raise ValueError(f"unknown provider {provider!r}")


def time_case(case: Case, dtype: str, device: torch.device, bench: Bench, providers: Sequence[str],
              compile_backend: str = "inductor") -> list[TimeRow]:
    """Time every provider of ``case`` at its time shape; errors (OOM, API mismatch) become the row's note."""
    assert case.time_shape is not None
    shape, rows = case.time_shape, []
    elem = torch.empty((), dtype=DTYPES[dtype]).element_size()
    for provider in [p for p in providers if p in case.providers]:
        row = TimeRow(case.name, fmt_shape(shape), provider)
        rows.append(row)
        fn, why = provider_fn(case, provider, compile_backend)
        if fn is None:
            row.note = why
            continue
        try:
            gen = generator(device, 0)
            row.fwd_ms, row.fwd_bwd_ms, row.peak_mib = bench_one(fn, case.make(shape, DTYPES[dtype], device, gen),
                                                                 bench, device, gen)
            if case.traffic is not None:
                row.gbps = case.traffic(shape, elem)[1] / (row.fwd_bwd_ms * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001 - report and keep going
            row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            log.warning("timing %s/%s failed: %s", case.name, provider, row.note)
        free_memory(device)
        log.debug("timed %s %s: %s", case.name, provider, row)
    return rows


# ------------------------------------------------------------------------------------ fused linear cross-entropy


@dataclass
class FlceRow:
    provider: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    peak_mib: float | None = None
    tflops: float | None = None
    loss: float | None = None
    note: str = ""


def flce_providers(compile_backend: str) -> dict[str, Callable[..., Tensor] | str]:
    """Name -> ``fn(hidden, weight, target)`` (or why it is unavailable)."""
    def eager(h: Tensor, w: Tensor, t: Tensor) -> Tensor:
        return F.cross_entropy(F.linear(h, w), t, ignore_index=-100)

    out: dict[str, Callable[..., Tensor] | str] = {
        "triton": lambda h, w, t: K.fused_linear_cross_entropy(h, w, t, backend="triton"),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False, backend=compile_backend),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        out["liger"] = lambda h, w, t: liger(w, h, t)  # forward(lin_weight, _input, target)
    except Exception as e:  # noqa: BLE001
        out["liger"] = f"liger_kernel not importable ({type(e).__name__})"
    return out


def flce_bench(device: torch.device, bench: Bench, *, rows: int, hidden: int, vocab: int, dtype: str,
               providers: Sequence[str], compile_backend: str = "inductor") -> list[FlceRow]:
    """Forward and forward+backward time, TFLOP/s (6 N H V / time) and peak extra memory of each provider."""
    gen = generator(device, 0)
    leaves, (target,) = flce_inputs(dict(rows=rows, hidden=hidden, vocab=vocab), DTYPES[dtype], device, gen)
    fns, out = flce_providers(compile_backend), []
    for name in providers:
        row = FlceRow(name)
        out.append(row)
        fn = fns.get(name, "unknown provider")
        if isinstance(fn, str):
            row.note = fn
            continue
        try:
            row.fwd_ms, row.fwd_bwd_ms, row.peak_mib = bench_one(fn, (leaves, [target]), bench, device, gen)
            row.tflops = 6 * rows * hidden * vocab / (row.fwd_bwd_ms * 1e-3) / 1e12
            with torch.no_grad():
                row.loss = float(fn(*leaves, target).float())
        except Exception as e:  # noqa: BLE001 - OOM of the eager path is a result too
            row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            log.warning("flce %s failed: %s", name, row.note)
        for t in leaves:
            t.grad = None
        free_memory(device)
    return out


# --------------------------------------------------------------------------------------------------- rendering


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt if x >= 1 or x == 0 else ".3g")


def timing_section(rows: Sequence[TimeRow], copy_gbps: float | None, dtype: str, device: torch.device) -> str:
    """Markdown table of :func:`time_case` rows with GB/s, % of the copy bandwidth and speedup vs eager."""
    eager = {r.kernel: r.fwd_bwd_ms for r in rows if r.provider == "eager"}
    out = []
    for r in rows:
        ref = eager.get(r.kernel)
        speed = f"{ref / r.fwd_bwd_ms:.2f}x" if ref and r.fwd_bwd_ms else "-"
        pct = f"{100 * r.gbps / copy_gbps:.1f}%" if r.gbps and copy_gbps else "-"
        out.append([r.kernel, r.shape, r.provider, _num(r.fwd_ms), _num(r.fwd_bwd_ms), _num(r.gbps, ".0f"), pct,
                    _num(r.peak_mib, ".0f"), speed, r.note])
    timer = "`triton.testing.do_bench`" if device.type == "cuda" else "a perf_counter loop (CPU, not a measurement)"
    return "\n".join([
        f"## Kernel timings ({dtype})", "",
        f"Median ms of {timer}: forward (inputs requiring grad, as Liger's forward mode) and forward+backward. "
        "GB/s = ideal bytes of forward+backward (each input read once, each output written once) / time; "
        f"% copy = share of the measured device-to-device copy bandwidth ({_num(copy_gbps, '.0f')} GB/s). Peak = extra "
        "memory of one forward+backward (max_memory_allocated delta). vs eager = speedup on forward+backward.", "",
        md_table(["kernel", "shape", "provider", "fwd ms", "fwd+bwd ms", "GB/s", "% copy", "peak MiB", "vs eager",
                  "note"], out)])


# --------------------------------------------------------------------------------------------------------- script


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--tokens", type=int, default=8192, help="batch * sequence (rows N)")
    p.add_argument("--batch", type=int, default=4, help="batch size for apply_rotary (seq = tokens // batch)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336, help="MLP width for swiglu/geglu")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    return p.parse_args(argv)


def shapes_from_args(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One timed shape per kernel from the command line (no correctness shapes: gpu.py checks)."""
    rows, seq = a.tokens, a.tokens // a.batch
    shapes = {
        "rms_norm": dict(rows=rows, hidden=a.hidden), "layer_norm": dict(rows=rows, hidden=a.hidden),
        "apply_rotary": dict(batch=a.batch, seq=seq, q_heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim),
        "swiglu": dict(rows=rows, width=a.intermediate), "geglu": dict(rows=rows, width=a.intermediate),
        "cross_entropy": dict(rows=rows, vocab=a.vocab), "vocab_parallel_cross_entropy": dict(rows=rows, vocab=a.vocab),
        "fused_linear_cross_entropy": dict(rows=rows, hidden=a.hidden, vocab=a.vocab),
    }
    return {k: dict(check=[], time=v) for k, v in shapes.items() if k in a.kernels}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("benchmarks/gpu/kernel_bench.py needs a CUDA GPU (the Triton interpreter is far too slow to time); "
              "`python benchmarks/gpu/suite.py --smoke` checks the code path on CPU.")
        return 1
    device = torch.device("cuda")
    bench = Bench(device, a.warmup, a.rep)
    rows = [r for case in build_cases(shapes_from_args(a))
            for r in time_case(case, a.dtype, device, bench, a.providers, a.compile_backend)]
    name = torch.cuda.get_device_name()
    copy = copy_bandwidth_gbps(device, bench, 2**30)
    text = f"# lightning_llm.kernels on {name}\n\ntorch {torch.__version__}\n\n" + timing_section(rows, copy, a.dtype,
                                                                                                 device) + "\n"
    print(text)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"kernels-{re.sub(r'[^A-Za-z0-9_.-]+', '-', name).strip('-')}.md")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
