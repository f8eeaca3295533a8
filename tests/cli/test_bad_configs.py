"""Bad configurations fail before training with ONE clear line naming the parameter, and no Python traceback.

Each case runs the real CLI (``lightning_llm fit --config configs/pretrain_debug.yaml ...``): on one device in this
process, what it writes to the file descriptors of stdout and stderr captured (what a user sees on the terminal); on
two devices in fresh processes (forked by the tests' zygote as ``python -m lightning_llm`` runs it). Layout errors
(unknown strategy, degrees that do not fit the device count) must also fail before any process group is
initialised.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed

from lightning_llm.cli import main
from lightning_llm.testing import cli_process

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pretrain_debug.yaml"
Run = Callable[..., subprocess.CompletedProcess]
TP = "lightning_llm.strategies.presets.TensorParallelStrategy"
PP = "lightning_llm.strategies.presets.PipelineParallelStrategy"


def _args(tmp_path: Path, *args: str) -> list[str]:
    return ["fit", "--config", str(CONFIG), "--trainer.max_steps=1", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.generated_docs=40", *args]


def _fit(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """The command on the devices it names, in fresh processes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("LIGHTNING_LLM_DEBUG", None)
    return cli_process(_args(tmp_path, *args), timeout=timeout, cwd=tmp_path, env=env, replace_env=True)


@pytest.fixture
def fit_here(tmp_path: Path, capfd: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> Run:
    """``fit_here(*args)``: the one-device command in this process, as the completed process it would be (exit code,
    what reached stdout and stderr); a process group it initialised is named in its stdout as Lightning names it."""
    monkeypatch.delenv("LIGHTNING_LLM_DEBUG", raising=False)
    groups = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: groups.append(k))

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        rc = main(_args(tmp_path, *args))
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["lightning_llm", *args], rc,
                                           out + "Initializing distributed\n" * len(groups), err)
    return run


def _assert_one_line_error(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """Non-zero exit; the last meaningful stderr line is our one-line error and contains ``expected``. Log records
    (``INFO``/``WARNING`` lines) are not meaningful here: another rank may still log its progress (e.g. "model
    built") after rank 0 printed the error, before it exits."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith("(set LIGHTNING_LLM_DEBUG")
             and not ln.startswith(("INFO ", "WARNING "))]
    last = lines[-1] if lines else ""
    print(f"rc={proc.returncode} last line: {last}")
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert last.startswith("lightning_llm: error: "), proc.stderr[-3000:]
    for text in expected:
        assert text in last, f"{text!r} not in {last!r}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return last


def _assert_no_process_group(proc: subprocess.CompletedProcess) -> None:
    # Lightning prints this line when a strategy initialises torch.distributed.
    assert "Initializing distributed" not in proc.stdout + proc.stderr


def test_unknown_strategy_name(fit_here: Run) -> None:
    proc = fit_here("--trainer.strategy=nope")
    _assert_one_line_error(proc, "strategy='nope'")
    _assert_no_process_group(proc)


@pytest.mark.multiprocess
def test_tp_degree_not_dividing_devices(tmp_path: Path) -> None:
    proc = _fit(tmp_path, f"--trainer.strategy={TP}", "--trainer.strategy.tensor_parallel_size=3",
                "--trainer.devices=2")
    _assert_one_line_error(proc, "tensor_parallel_size=3", "does not divide", "devices")
    _assert_no_process_group(proc)


@pytest.mark.multiprocess
def test_pp_degree_not_dividing_devices(tmp_path: Path) -> None:
    proc = _fit(tmp_path, f"--trainer.strategy={PP}", "--trainer.strategy.pipeline_parallel_size=3",
                "--trainer.devices=2")
    _assert_one_line_error(proc, "pipeline_parallel_size=3", "world size 2")
    _assert_no_process_group(proc)


@pytest.mark.multiprocess
def test_tp_size_not_dividing_heads(tmp_path: Path) -> None:
    # The head count is only known once the model is built (in configure_model, after the process group is up):
    # both ranks must still stop with the one line, and the command must exit non-zero instead of hanging.
    proc = _fit(tmp_path, "--trainer.strategy=tp", "--trainer.devices=2",
                '--model.model_overrides={"num_heads": 3, "num_kv_heads": 3, "hidden_size": 48}')
    _assert_one_line_error(proc, "tensor_parallel_size=2", "num_heads=3")


def test_missing_data_dir(tmp_path: Path, fit_here: Run) -> None:
    missing = tmp_path / "no_such_corpus"
    proc = fit_here(f"--data.data_path={missing}")
    _assert_one_line_error(proc, f"--data.data_path={missing}", "no such file or directory")


def test_missing_tokenizer_dir(tmp_path: Path, fit_here: Run) -> None:
    missing = tmp_path / "no_such_tokenizer"
    proc = fit_here(f"--data.tokenizer_dir={missing}")
    _assert_one_line_error(proc, f"--data.tokenizer_dir={missing}", "directory not found")


@pytest.mark.parametrize("content", ["corrupt", "empty"])
def test_unreadable_tokenizer_dir(tmp_path: Path, fit_here: Run, content: str) -> None:
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    if content == "corrupt":
        (tok / "tokenizer.json").write_text("{not json")
    proc = fit_here(f"--data.tokenizer_dir={tok}")
    expected = "cannot load tokenizer" if content == "corrupt" else "no tokenizer.json"
    _assert_one_line_error(proc, f"--data.tokenizer_dir={tok}", expected)
