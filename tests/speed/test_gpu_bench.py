"""benchmarks/gpu/suite.py (the GPU suite) on CPU: its ``--smoke`` run end to end, and checks that the checks can fail.

The smoke run is the suite's own ``main`` in this process (Triton interpreter, tiny shapes, fp32, ``debug``
backbones): the kernels, fused loss and attention parts run here (no process launched); the end-to-end and MoE
parts' ``python -m lightning_llm fit`` runs are forked, one after another, from the test launcher's zygote (one
process each, the ZeRO presets with one rank), which imported the package once for all of them, instead of each
starting an interpreter (``multiprocess``).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch.nn.functional as F

from lightning_llm.testing import cli_process

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "gpu"
BENCH_MODULES = tuple(p.stem for p in BENCH.glob("*.py"))
E2E_ROWS = [("encoder debug", "1 device", "auto", "4"), ("encoder debug", "zero1", "auto", "4"),
            ("encoder debug", "zero2", "auto", "4"), ("encoder debug", "zero3_offload", "auto", "1"),
            ("encoder debug", "deepspeed_zero3_offload", "auto", "1"), ("decoder debug", "1 device", "torch", "1"),
            ("decoder debug", "1 device", "triton", "1"), ("decoder debug", "1 device", "auto+compile", "1")]


@pytest.fixture
def bench_modules() -> Iterator[None]:
    """benchmarks/gpu's modules importable by their names for one test, and the names given back after (the timing
    module is ``kernel_bench.py``, not ``kernels.py``: that name would stand for pip's ``kernels``, which transformers
    imports, while the folder is on ``sys.path``)."""
    saved_path, saved = list(sys.path), {name: sys.modules.pop(name) for name in BENCH_MODULES if name in sys.modules}
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in BENCH_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def bench_module(name: str) -> ModuleType:
    return importlib.import_module(name)


def suite() -> ModuleType:
    """benchmarks/gpu/suite.py, asking no ``nvidia-smi`` for a driver (a process; none on CPU): the module is the
    test's own (:func:`bench_modules`)."""
    gpu = bench_module("suite")
    gpu._driver = lambda: "n/a"
    return gpu


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


def smoke(out: Path, *parts: str, work: Path | None = None) -> str:
    """The suite's ``--smoke`` run of ``parts`` (``main``, as ``python benchmarks/gpu/suite.py`` runs it): its results
    file, checked for what every run writes."""
    gpu = suite()
    argv = ["--smoke", *(a for p in parts for a in ("--only", p)), "--out", str(out),
            *(["--work", str(work)] if work else [])]
    assert gpu.main(argv) == 0, out.read_text() if out.exists() else "no results file"
    text = out.read_text()
    assert "TRITON_INTERPRET=1" in text and "command: `python benchmarks/gpu/suite.py --smoke" in text
    assert not list(out.parent.glob("*.tmp*")), "the results file is written through a temp file + rename"
    assert {r[0]: r[1] for r in table_after(text, "- total:")} == dict.fromkeys(parts, "ok")
    return text


@pytest.mark.usefixtures("bench_modules")
def test_smoke_run_checks_every_kernel_the_fused_loss_and_attention(tmp_path: Path) -> None:
    text = smoke(tmp_path / "results" / "gpu-smoke.md", "kernels", "flce", "attention")
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

    attention = {r[0]: r for r in table_after(text, "## Attention: varlen path vs dense mask")}
    for case in ("sft packed 2 x 128", "one GPU, packed row of 128"):  # before (dense mask) and after (varlen)
        before, after = attention[f"{case}, before"], attention[f"{case}, after"]
        assert before[1].startswith("sdpa") and after[1].startswith("varlen") and before[2] == after[2] == "ok"
        assert float(before[3]) > 0 and float(after[3]) > 0 and abs(float(before[6]) - float(after[6])) < 1e-3
    assert {r[1] for r in table_after(text, "## Attention: GQA")} == {
        "repeat_interleave + SDPA", "SDPA enable_gqa", "varlen path (enable_gqa)"}


def _forked_fit(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float, **_: object
                ) -> subprocess.CompletedProcess:
    """``subprocess.run`` of the suite's ``python -m lightning_llm ...`` runs (stdout and stderr captured as text),
    forked from the zygote."""
    assert cmd[:3] == [sys.executable, "-m", "lightning_llm"], cmd
    return cli_process(cmd[3:], cwd=cwd, env=env, replace_env=True, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.usefixtures("bench_modules")
def test_smoke_run_runs_every_e2e_row_and_the_moe_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_module("e2e"), "subprocess",
                        SimpleNamespace(run=_forked_fit, TimeoutExpired=subprocess.TimeoutExpired))
    text = smoke(tmp_path / "results" / "gpu-smoke.md", "e2e", "moe", work=tmp_path / "work")
    e2e = {tuple(r[:4]): r for r in table_after(text, "## End to end")}
    for key in E2E_ROWS:
        assert key in e2e, f"missing end-to-end row {key}: {sorted(e2e)}"
        assert e2e[key][5] == "ok" and float(e2e[key][6]) > 0 and float(e2e[key][7].replace(",", "")) > 0
    assert "`auto+compile`: `--model.compile=true`" in text  # the compiled row says what it is
    assert len(table_after(text, "### Largest encoder batch")) == 3
    assert len(table_after(text, "### ZeRO-3 offload")) == 2
    (moe,) = table_after(text, "## Mixture of Experts")
    assert moe[0] == "moe debug-moe x2 layers" and moe[3] == "ok" and float(moe[5].replace(",", "")) > 0
    assert "active per token" in moe[8] and '"experts_impl": "grouped"' in text  # MFU on active parameters


@pytest.mark.usefixtures("bench_modules")
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


@pytest.mark.usefixtures("bench_modules")
def test_failing_part_is_recorded_and_the_others_still_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = suite()

    def crash(ctx: object) -> object:
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu.PARTS, "kernels", crash)
    monkeypatch.setitem(gpu.PARTS, "flce", lambda ctx: gpu.PartResult("flce", sections=["## flce ran"]))
    out = tmp_path / "r.md"
    assert gpu.main(["--smoke", "--only", "kernels", "--only", "flce", "--out", str(out), "--copy-mib", "1"]) == 1
    text = out.read_text()
    assert "| kernels | **failed** |" in text and "planted failure" in text
    assert "| flce | ok |" in text and "## flce ran" in text


@pytest.mark.usefixtures("bench_modules")
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


@pytest.mark.usefixtures("bench_modules")
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
