"""Per-step work that does not grow with the number of parameter tensors (issue 36): from the end of backward to the
end of the step (gradient reduction, the non-finite check, global-norm clipping, the fused AdamW step), a debug
decoder of 8 layers dispatches at most 0.5 more aten calls per extra parameter tensor than one of 2 layers, on one
device and under the engine's presets (before: 17.8 per tensor - an amax and an amin per gradient, a foreach AdamW's
per-tensor step counters and host syncs, and the engine's per-tensor fp64 norm)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_llm.data import TextDataModule
from lightning_llm.tasks import CausalLMTask
from lightning_llm.tasks.base import OptimConfig
from lightning_llm.testing import StepTailCounter, table_trainer


def _tail_calls(layers: int, strategy: str, out: Path) -> tuple[int, int, bool]:
    """(trainable tensors, aten calls after backward in the last step, whether the optimizer is fused)."""
    pl.seed_everything(0)
    task = CausalLMTask("debug", dropout=0.0, model_overrides={"num_layers": layers}, optim=OptimConfig(lr=1e-3))
    dm = TextDataModule(block_size=32, batch_size=4, cache_dir=str(out / "cache"), generated_docs=60)
    counter = StepTailCounter()
    trainer = table_trainer(out / f"{strategy}-{layers}", strategy=strategy, devices=1, max_steps=3,
                            callbacks=[counter])
    trainer.gradient_clip_val = 1.0  # clipping on: its global norm is per-step work too
    trainer.fit(task, dm)
    opt = trainer.optimizers[0]
    inner = getattr(opt, "local_optimizer", opt)
    fused = all(g["fused"] for g in inner.param_groups)
    tensors = sum(1 for p in task.parameters() if p.requires_grad)
    return tensors, sum(counter.steps[-1].values()), fused


@pytest.mark.parametrize("strategy", ["auto", "zero1", "zero3", "3d"])
def test_step_tail_does_not_grow_with_the_parameter_count(tmp_path: Path, strategy: str) -> None:
    small, large = _tail_calls(2, strategy, tmp_path), _tail_calls(8, strategy, tmp_path)
    per_tensor = (large[1] - small[1]) / (large[0] - small[0])
    print(f"{strategy}: {small[0]} -> {large[0]} tensors, {small[1]} -> {large[1]} aten calls after backward "
          f"({per_tensor:.2f} per extra tensor)")
    assert small[2] and large[2], "AdamW is not fused"
    assert per_tensor <= 0.5


def test_fused_adamw_steps_on_unscaled_gradients_with_a_grad_scaler() -> None:
    """fp16 training: the GradScaler unscales the gradients before clipping and the step. A fused AdamW must not
    claim to unscale inside its kernel: Lightning's mixed precision asks ``_optimizer_handles_unscaling`` and then
    skips ``unscale_`` (clipping scaled gradients) and refuses ``clip_gradients`` (bf16 too). Scaled, unscaled,
    clipped and stepped, the weights equal an unscaled foreach AdamW's."""
    import torch
    from lightning.fabric.plugins.precision.amp import _optimizer_handles_unscaling

    from lightning_llm.tasks.base import build_adamw

    torch.manual_seed(0)
    w_ref = torch.randn(64, 32, requires_grad=True)
    w = w_ref.detach().clone().requires_grad_(True)
    x = torch.randn(8, 32)
    cfg = OptimConfig(lr=1e-2)
    fused, ref = build_adamw([{"params": [w]}], cfg), build_adamw([{"params": [w_ref]}], OptimConfig(lr=1e-2,
                                                                                                      fused=False))
    assert fused.param_groups[0]["fused"] and not ref.param_groups[0]["fused"]
    assert not _optimizer_handles_unscaling(fused)  # so Lightning unscales before clipping, and lets it clip
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        scaler.scale((x @ w.t()).pow(2).mean()).backward()
        scaler.unscale_(fused)
        torch.nn.utils.clip_grad_norm_([w], 0.5)
        scaler.step(fused)
        scaler.update()
        fused.zero_grad()
        (x @ w_ref.t()).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_([w_ref], 0.5)
        ref.step()
        ref.zero_grad()
    assert (w - w_ref).abs().max().item() <= 1e-6


def test_bf16_mixed_with_clipping_trains_with_the_fused_optimizer(tmp_path: Path) -> None:
    pl.seed_everything(0)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-3))
    dm = TextDataModule(block_size=32, batch_size=4, cache_dir=str(tmp_path / "cache"), generated_docs=60)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, precision="bf16-mixed", gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)
    trainer.fit(task, dm)
    assert trainer.optimizers[0].param_groups[0]["fused"] and trainer.global_step == 2
