"""The non-finite guard under every layout: NaN gradients behind a finite loss, and a learning rate that diverges.

One torchrun launch (2 CPU processes) fits :class:`NaNGradAt` (a user-style subclass whose loss gains a term of value 0
and NaN gradient at one step) and a diverging learning rate under every layout of :data:`LAYOUTS`, with a
``ModelCheckpoint`` saving ``last.ckpt`` every step; the pytest process runs the one-device references meanwhile.
Asserted per layout:

* ``stop`` (default): the run stops at the poisoned step with the one message (every rank), and ``last.ckpt`` is the
  previous step's, every tensor finite;
* ``skip``: the run goes on, one step skipped, and its logged losses equal one device's skipping run (so the skipped
  step changed no weight, moment or step counter on any layout);
* ``lr=1e30``: the run stops within two steps, and every tensor of ``last.ckpt`` is finite.
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
    two_rank_layout,
)

STEPS = 5
BAD_STEP = 2
DIVERGING_LR = 1e30
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero1", "zero2", "zero3", "zero2_offload", "3d", "deepspeed_zero2", "deepspeed_zero3"]


class NaNGradAt(CausalLMTask):
    """At step ``BAD_STEP`` the loss gains ``sqrt(0 * sum(logits))``: value 0, gradient NaN for every weight."""

    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        loss, out = super().loss_from_output(output, batch, stage)
        if stage == "train" and self.global_step == BAD_STEP:
            loss = loss + (output.float().sum() * 0).sqrt()
        return loss, out


def _fit(layout: str, devices: int, out: Path, *, policy: str, lr: float = 3e-3) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(3)
    task = NaNGradAt("debug", dropout=0.0, nonfinite_loss=policy, optim=OptimConfig(lr=lr, scheduler="constant"))
    dm = TextDataModule(block_size=32, batch_size=batch, cache_dir=str(out / "cache"), generated_docs=100)
    rec = LoggedLoss()
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec],
                            save_every_step=True)
    row: dict[str, Any] = {}
    try:
        trainer.fit(task, dm)
    except Exception as e:  # noqa: BLE001 - the message is what is asserted
        row["error"] = f"{type(e).__name__}: {e}"
    return {**row, "losses": rec.losses, "skipped": task.guard.skipped, "ckpt": str(out / "ckpt" / "last.ckpt")}


CASES = {"stop": {"policy": "stop"}, "skip": {"policy": "skip"}, "diverge": {"policy": "stop", "lr": DIVERGING_LR}}


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        ref = {case: _fit("1", 1, out / f"ref-{case}", **kw) for case, kw in CASES.items()}
        (out / "reference.json").write_text(json.dumps(ref))
        return
    results = {f"{layout}/{case}": gathered(_fit(layout, 2, out / f"{layout}-{case}", **kw))
               for layout in LAYOUTS for case, kw in CASES.items()}
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nonfinite")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


def _checkpoint(path: str) -> dict[str, Any]:
    from lightning_llm.export import read_checkpoint

    ckpt = read_checkpoint(path)
    bad = [k for k, v in ckpt["state_dict"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert not bad, f"{path}: non-finite tensors {bad[:4]}"
    return ckpt


def _rows(runs: Path, layout: str, case: str) -> list[dict[str, Any]]:
    return json.loads((runs / "layouts.json").read_text())[f"{layout}/{case}"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1 device", *LAYOUTS])
def test_nan_gradients_stop_before_the_step_and_keep_a_finite_checkpoint(runs: Path, layout: str) -> None:
    rows = ([json.loads((runs / "reference.json").read_text())["stop"]] if layout == "1 device"
            else _rows(runs, layout, "stop"))
    expected = (f"DeepSpeed skipped the optimizer step at step {BAD_STEP} " if layout.startswith("deepspeed")
                else f"the gradients hold NaN/inf (the loss was finite) at step {BAD_STEP} ")
    for row in rows:
        assert row.get("error", "").startswith(f"NonFiniteLossError: {expected}"), row.get("error")
        assert "last.ckpt, was saved before it and holds finite weights" in row["error"]
    print(f"{layout}: {rows[0]['error'][:160]}")
    assert _checkpoint(rows[0]["ckpt"])["global_step"] == BAD_STEP


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nan_gradients_skipped_like_one_device(runs: Path, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())["skip"]
    assert "error" not in ref and ref["skipped"] == 1 and len(ref["losses"]) == STEPS
    for row in _rows(runs, layout, "skip"):
        assert "error" not in row, row["error"]
        assert row["skipped"] == 1
        err = max_abs_err(row["losses"], ref["losses"])
        assert err <= TOL, (row["losses"], ref["losses"])
    print(f"{layout}: 1 step skipped, max |loss - one device's skipping run| = {err:.2e}")
    _checkpoint(_rows(runs, layout, "skip")[0]["ckpt"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["1 device", *LAYOUTS])
def test_diverging_lr_stops_with_a_finite_last_checkpoint(runs: Path, layout: str) -> None:
    rows = ([json.loads((runs / "reference.json").read_text())["diverge"]] if layout == "1 device"
            else _rows(runs, layout, "diverge"))
    for row in rows:
        assert row.get("error", "").startswith("NonFiniteLossError: "), row
    ckpt = _checkpoint(rows[0]["ckpt"])
    print(f"{layout}: lr={DIVERGING_LR:g} stopped after {ckpt['global_step']} step(s), last.ckpt finite; "
          f"{rows[0]['error'][:120]}")
    assert 1 <= ckpt["global_step"] < STEPS


class NaNGradFrom(CausalLMTask):
    """NaN gradients at every step from ``BAD_STEP`` on (a run that has diverged for good)."""

    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict]:
        loss, out = super().loss_from_output(output, batch, stage)
        if stage == "train" and self.global_step >= BAD_STEP:
            loss = loss + (output.float().sum() * 0).sqrt()
        return loss, out


@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_skips_in_a_row_beyond_the_bound_stop_the_run(tmp_path: Path, precision: str) -> None:
    """``skip`` (and an fp16 loss scaler, whatever the policy) goes on past a bad step, but not past
    ``max_consecutive_skips`` of them in a row: the run stops at the end of the step that exceeds it (its update
    skipped on the device by the fused optimizer's ``found_inf``, or by the scaler)."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins import MixedPrecision

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.tasks.callbacks.guard import NonFiniteLossError

    pl.seed_everything(3)
    policy = "stop" if precision == "16-mixed" else "skip"  # the scaler skips even under "stop"
    task = NaNGradFrom("debug", nonfinite_loss=policy, optim=OptimConfig(max_consecutive_skips=2))
    dm = TextDataModule(block_size=32, batch_size=4, cache_dir=str(tmp_path / "cache"), generated_docs=40)
    # Lightning turns a "16-mixed" string into bf16 on CPU; the plugin itself runs fp16 autocast with a GradScaler.
    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if precision == "16-mixed" else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0, plugins=plugins)
    with pytest.raises(NonFiniteLossError, match=r"^3 optimizer steps in a row were skipped .* at step 4 "):
        trainer.fit(task, dm)
    assert task.guard.skipped == 3 and trainer.global_step == BAD_STEP + 3  # stopped after the third, not applied


def test_diverging_run_through_the_cli_is_one_line_and_exit_2(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """As a user meets it: ``lightning_llm fit`` at lr=1e30 exits 2 with one line naming the step."""
    from lightning_llm.cli import main

    config = Path(__file__).resolve().parents[2] / "configs" / "pretrain_debug.yaml"
    rc = main(["fit", "--config", str(config), "--trainer.max_steps=5", "--trainer.logger=false",
               "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
               "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
               f"--data.cache_dir={tmp_path / 'cache'}", "--data.generated_docs=40", f"--model.optim.lr={DIVERGING_LR}"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("lightning_llm: error: ")]
    assert rc == 2 and len(lines) == 1, lines
    assert "hold NaN/inf" in lines[0] and " at step " in lines[0], lines[0]
    print(lines[0])


def test_all_finite_is_exact() -> None:
    """NaN and inf anywhere are caught; huge finite values (whose squared norm overflows) are not."""
    from lightning_llm.tasks.callbacks.guard import all_finite

    big = torch.full((4, 4), 1e30)
    assert all_finite([big, None, torch.zeros(0)])
    assert all_finite([torch.full((4,), 3e38)])  # finite, though its L1 sum overflows fp32 to inf
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = big.clone()
        t[2, 3] = bad
        assert not all_finite([torch.ones(3), t])
    assert not all_finite([torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])



def test_gradient_check_is_exact_and_leaves_the_values() -> None:
    """The per-step gradient check (one fused pass): NaN and inf anywhere are caught, huge finite values are not,
    and every gradient keeps its exact values (-0.0, subnormals, fp32 and bf16)."""
    from lightning_llm.tasks.callbacks.guard import gradients_nonfinite

    big = torch.full((4, 4), 3e38)
    odd = torch.tensor([-0.0, 1e-45, -3e38, 1.0])
    before = [big.clone(), odd.clone()]
    assert not bool(gradients_nonfinite([big, None, torch.zeros(0), odd]))
    assert all(torch.equal(a, b) and torch.equal(a.signbit(), b.signbit()) for a, b in zip([big, odd], before))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = big.clone()
        t[2, 3] = bad
        assert bool(gradients_nonfinite([torch.ones(3), t]))
    assert bool(gradients_nonfinite([torch.ones(2), torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)]))
    assert gradients_nonfinite([None]) is None


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
