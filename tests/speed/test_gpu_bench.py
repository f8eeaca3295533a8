"""benchmarks/gpu/suite.py (the GPU suite) on CPU: its ``--smoke`` run end to end, and checks that the checks can fail.

The smoke run is one subprocess (Triton interpreter, tiny shapes, fp32, ``debug`` backbones); its ``lightning_llm fit``
children run one after another, single process each (the ZeRO presets with one rank), so no multiprocess mark.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "gpu"
E2E_ROWS = [("encoder debug", "1 device", "auto", "4"), ("encoder debug", "zero1", "auto", "4"),
            ("encoder debug", "zero2", "auto", "4"), ("encoder debug", "zero3_offload", "auto", "1"),
            ("encoder debug", "deepspeed_zero3_offload", "auto", "1"), ("decoder debug", "1 device", "torch", "1"),
            ("decoder debug", "1 device", "triton", "1"), ("decoder debug", "1 device", "auto+compile", "1")]


def bench_module(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def table_after(text: str, heading: str) -> list[list[str]]:
    """Cells of the first markdown table after the line starting with ``heading`` (header and rule dropped)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(heading))
    rows = []
    for ln in lines[start + 1:]:
        if ln.startswith("|"):
            rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path, float]:
    tmp = tmp_path_factory.mktemp("gpu_smoke")
    out = tmp / "results" / "gpu-smoke.md"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH / "suite.py"), "--smoke", "--out", str(out), "--work",
                           str(tmp / "work")], check=False, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=900)
    return proc, out, time.monotonic() - t0


def test_smoke_run_checks_every_kernel_and_runs_every_e2e_row(smoke: tuple) -> None:
    proc, out, seconds = smoke
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-6000:]}"
    text = out.read_text()
    assert "TRITON_INTERPRET=1" in text and "command: `python benchmarks/gpu/suite.py --smoke" in text
    assert not list(out.parent.glob("*.tmp")), "the results file is written through a temp file + rename"

    parts = {r[0]: r[1] for r in table_after(text, "- total:")}
    assert parts == {"kernels": "ok", "flce": "ok", "e2e": "ok", "attention": "ok", "moe": "ok"}, parts

    checked = {}
    for kernel, _shape, dtype, err64, err_torch, _t64, tol, result in table_after(text, "## Kernel correctness"):
        checked[kernel] = float(err64.split()[0])
        assert dtype == "fp32" and result == "ok"
        assert checked[kernel] <= float(tol) and float(err_torch.split()[0]) <= float(tol)
    kernels = bench_module("kernel_cases")
    assert set(checked) == set(kernels.SMOKE_SHAPES)
    for public in ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "cross_entropy",
                   "vocab_parallel_cross_entropy", "fused_linear_cross_entropy"):
        assert public in checked

    timed = {(r[0], r[2]) for r in table_after(text, "## Kernel timings") if r[4] != "-"}
    assert {("rms_norm", "triton"), ("rms_norm", "eager"), ("rms_norm", "compile"),
            ("cross_entropy", "triton")} <= timed
    flce = {r[0]: r for r in table_after(text, "## Fused linear cross-entropy")}
    assert flce["triton"][2] != "-" and flce["eager"][2] != "-"

    e2e = {tuple(r[:4]): r for r in table_after(text, "## End to end")}
    for key in E2E_ROWS:
        assert key in e2e, f"missing end-to-end row {key}: {sorted(e2e)}"
        assert e2e[key][5] == "ok" and float(e2e[key][6]) > 0 and float(e2e[key][7].replace(",", "")) > 0
    assert "`auto+compile`: `--model.compile=true`" in text  # the compiled row says what it is
    assert len(table_after(text, "### Largest encoder batch")) == 3
    assert len(table_after(text, "### ZeRO-3 offload")) == 2
    attention = {r[0]: r for r in table_after(text, "## Attention: varlen path vs dense mask")}
    for case in ("sft packed 2 x 128", "one GPU, packed row of 128"):  # before (dense mask) and after (varlen)
        before, after = attention[f"{case}, before"], attention[f"{case}, after"]
        assert before[1].startswith("sdpa") and after[1].startswith("varlen") and before[2] == after[2] == "ok"
        assert float(before[3]) > 0 and float(after[3]) > 0 and abs(float(before[6]) - float(after[6])) < 1e-3
    assert {r[1] for r in table_after(text, "## Attention: GQA")} == {
        "repeat_interleave + SDPA", "SDPA enable_gqa", "varlen path (enable_gqa)"}
    (moe,) = table_after(text, "## Mixture of Experts")
    assert moe[0] == "moe debug-moe x2 layers" and moe[3] == "ok" and float(moe[5].replace(",", "")) > 0
    assert "active per token" in moe[8] and '"experts_impl": "grouped"' in text  # MFU on active parameters
    print(f"smoke run: {seconds:.1f} s")


def test_wrong_reference_fails_the_check() -> None:
    G = bench_module("kernel_cases")
    import torch

    (case,) = [c for c in G.build_cases(G.SMOKE_SHAPES, with_liger=False) if c.name == "swiglu"]
    rows, failures, _ = G.check_all([case], ["fp32"], torch.device("cpu"))
    assert rows and not failures  # the real reference agrees

    case.fns["fp64"] = lambda a, b: F.silu(a) * b * 1.01  # deliberately wrong float64 reference
    rows, failures, _ = G.check_all([case], ["fp32"], torch.device("cpu"))
    assert not all(r.ok for r in rows)
    assert failures and all(f.startswith("MISMATCH swiglu fp32 ") for f in failures)
    assert any(" out " in f for f in failures) and "vs float64" in failures[0]

    case.fns["torch"] = lambda a, b: torch.zeros_like(a)  # a broken torch path is caught too (and shape errors)
    case.fns["fp64"] = lambda a, b: F.silu(a) * b
    _, failures, _ = G.check_all([case], ["fp32"], torch.device("cpu"))
    assert failures
    assert G.rel_err(torch.ones(3), torch.ones(4)) == float("inf")
    assert G.rel_err(torch.tensor([float("nan")]), torch.ones(1)) == float("inf")
    assert G.rel_err(torch.ones(1), torch.tensor([float("nan")])) == float("inf")


def test_failing_part_is_recorded_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = bench_module("suite")

    def crash(ctx: object) -> object:
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu.PARTS, "kernels", crash)
    monkeypatch.setitem(gpu.PARTS, "flce", lambda ctx: gpu.PartResult("flce", sections=["## flce ran"]))
    out = tmp_path / "r.md"
    assert gpu.main(["--smoke", "--only", "kernels", "--only", "flce", "--out", str(out), "--copy-mib", "1"]) == 1
    text = out.read_text()
    assert "| kernels | **failed** |" in text and "planted failure" in text
    assert "| flce | ok |" in text and "## flce ran" in text


def test_batch_search_doubles_until_oom_and_halves_from_an_oom_start() -> None:
    E = bench_module("e2e")
    fits = 16

    def measure(b: int, role: str) -> object:
        return E.RunResult("m", "s", "k", b, role, status="ok" if b <= fits else "oom")

    runs, best = E.search_max_batch(measure, 4, 4, 256)
    assert [r.batch for r in runs] == [4, 8, 16, 32] and best.batch == 16
    runs, best = E.search_max_batch(measure, 64, 4, 256)
    assert [r.batch for r in runs] == [64, 32, 16] and best.batch == 16
    runs, best = E.search_max_batch(measure, 4, 4, 8)
    assert [r.batch for r in runs] == [4, 8] and best.batch == 8
    assert E.peak_tflops("NVIDIA H100 80GB HBM3") == 989 and E.peak_tflops("NVIDIA A100-SXM4-80GB") == 312


def test_mfu_counts_the_parameters_a_token_uses() -> None:
    """An MoE run's MFU counts its active parameters (6 N + 12 L A S, N without embeddings), a dense run's all."""
    E = bench_module("e2e")
    record = {"step_ends": [0.0, 1.0, 2.0], "tokens_per_step": 1000, "total": 10_000, "active": 4_000,
              "embedding": 1_000, "layers": 2, "hidden": 64, "attention": 128, "peak_alloc": None,
              "peak_reserved": None, "rss_kib": 1}
    res = E.RunResult("m", "s", "k", 1, "moe")
    E.summarize(res, record, warmup=0, seq=100, peak=1e-6)  # 1 MFLOP/s peak
    assert res.tokens_per_s == 1000 and res.mfu == pytest.approx((6 * 3_000 + 12 * 2 * 128 * 100) * 1000 / 1e6)
    dense = E.RunResult("m", "s", "k", 1, "kernels")
    E.summarize(dense, {**record, "active": 10_000}, warmup=0, seq=100, peak=1e-6)
    assert dense.mfu == pytest.approx((6 * 9_000 + 12 * 2 * 128 * 100) * 1000 / 1e6)
