"""``--model.compile=true``: each transformer block compiled with ``torch.compile`` (inductor, on CPU here).

One torchrun launch (2 CPU processes) fits the debug decoder eagerly and compiled under ddp, zero3 and pp, and asks
for it under tp; the pytest process runs the one-device pair and a compiled run saved at step 3 and resumed to step 6
meanwhile. Asserted: compiled equals eager within 1e-5 per step (6 steps) on one device and every layout; the resumed
compiled run equals the uninterrupted one exactly; checkpoints keep the eager parameter names (no ``_orig_mod.``);
tensor parallelism refuses it before the first step (torch 2.13 compiles the blocks around DTensor's hooks wrongly:
a crash in backward without sequence parallelism, a loss 8e-2 off eager with it); the run summary says the blocks are
compiled; the CLI flag reaches the task.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.tasks import CausalLMTask
from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
)

STEPS = 6
TOL = 1e-5
LAYOUTS = ["ddp", "zero3", "pp"]


def _fit(strategy: Any, devices: int, out: Path, *, compile: bool, steps: int = STEPS,  # noqa: A002
         ckpt_path: str | None = None, save: bool = False) -> tuple[list[float], CausalLMTask]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks.base import OptimConfig

    pl.seed_everything(5)
    # eps=1e-3: fp32 rounding noise from fused kernels in near-zero gradients must not become lr-sized Adam steps.
    task = CausalLMTask("debug", dropout=0.0, compile=compile,
                        optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-3))
    batch = 8 if strategy in ("tp", "pp") or devices == 1 else 4  # global batch 8
    dm = TextDataModule(block_size=32, batch_size=batch, cache_dir=str(out / "cache"), generated_docs=60)
    rec = LoggedLoss()
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=[rec],
                            save_every_step=save)
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    return rec.losses, task


def _graphs() -> int:
    """Graphs dynamo captured in this process so far: equal losses mean nothing if nothing was compiled."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        eager, _ = _fit("auto", 1, out / "ref-eager", compile=False)
        graphs = _graphs()
        compiled, task = _fit("auto", 1, out / "ref-compiled", compile=True, save=True)
        graphs = _graphs() - graphs
        keys = sorted(task.model.state_dict())
        _fit("auto", 1, out / "stopped", compile=True, steps=3, save=True)
        resumed, _ = _fit("auto", 1, out / "stopped", compile=True,
                          ckpt_path=str(out / "stopped" / "ckpt" / "last.ckpt"))
        saved = sorted(torch.load(out / "ref-compiled" / "ckpt" / "last.ckpt", weights_only=True)["state_dict"])
        (out / "reference.json").write_text(json.dumps({"eager": eager, "compiled": compiled, "resumed": resumed,
                                                        "keys": keys, "saved_keys": saved,
                                                        "graphs": graphs}))
        return
    results: dict[str, Any] = {}
    try:
        _fit("tp", 2, out / "tp-True", compile=True)
    except ValueError as e:
        results["tp/refused"] = str(e)
    for layout in LAYOUTS:
        for compiled in (False, True):
            before = _graphs()
            losses, _ = _fit(layout, 2, out / f"{layout}-{compiled}", compile=compiled)
            results[f"{layout}/{compiled}"] = gathered(losses)
            results[f"{layout}/{compiled}/graphs"] = gathered(_graphs() - before)
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("compile")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
def test_one_device_compiled_equals_eager_and_resumes_exactly(runs: Path) -> None:
    ref = json.loads((runs / "reference.json").read_text())
    err = max_abs_err(ref["compiled"], ref["eager"])
    print(f"1 device: compiled vs eager max |loss err| {err:.2e} over {STEPS} steps; losses {ref['compiled']}")
    assert len(ref["compiled"]) == STEPS and ref["eager"][0] - ref["eager"][-1] > 0.5 and err <= TOL
    assert ref["graphs"] >= 1  # the blocks were compiled (the first block's forward, reused by the others)
    assert ref["resumed"] == ref["compiled"][3:], (ref["resumed"], ref["compiled"])
    assert ref["saved_keys"] == sorted(f"model.{k}" for k in ref["keys"])
    assert not [k for k in ref["saved_keys"] if "_orig_mod" in k]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_equals_eager_under_each_layout(runs: Path, layout: str) -> None:
    results = json.loads((runs / "layouts.json").read_text())
    eager, compiled = results[f"{layout}/False"], results[f"{layout}/True"]
    assert min(results[f"{layout}/True/graphs"]) >= 1 and max(results[f"{layout}/False/graphs"]) == 0
    ref = json.loads((runs / "reference.json").read_text())["eager"]
    for e, c in zip(eager, compiled):
        err = max_abs_err(c, e)
        print(f"{layout}: compiled vs eager max |loss err| {err:.2e}, vs one device {max_abs_err(c, ref):.2e}")
        assert len(c) == STEPS and err <= TOL and max_abs_err(c, ref) <= 1e-4


@pytest.mark.multiprocess
def test_tensor_parallel_refuses_compile(runs: Path) -> None:
    refused = json.loads((runs / "layouts.json").read_text()).get("tp/refused", "")
    assert refused.startswith("--model.compile=true under tensor parallelism (tp=2): torch "), refused


@pytest.mark.multiprocess  # inductor's C++ compiler runs as processes
def test_cli_flag_reaches_the_task_and_the_run_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from lightning_llm.cli import main

    repo = Path(__file__).resolve().parents[2]
    caplog.set_level(logging.INFO, logger="lightning_llm")
    args = ["fit", "--config", str(repo / "configs" / "pretrain_debug.yaml"), "--trainer.max_steps=1",
            "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.generated_docs=20", "--model.compile=true"]
    assert main(args) == 0
    text = caplog.text
    assert "transformer blocks compiled (torch.compile, --model.compile)" in text
    assert "torch.compile: " in text and "transformer blocks of DecoderLM compiled" in text


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
