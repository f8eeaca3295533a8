"""``lightning_llm export``: checkpoints of every layout -> HF directories that ``transformers``/``peft`` load with
the same logits as our model (within 1e-5).

Single process: a plain Lightning checkpoint, a LoRA run (merged, and adapter-only + base loaded with
``PeftModel``), and the same weights re-written in the other strategies' directory layouts (DCP of tp/ZeRO-3,
pipeline shards, ZeRO-1/2). Checkpoints of real multi-process runs (3d at dp2 / pp2 / 1 device) are exported in
tests/parallel/test_resharding.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.cli import main as cli_main

TOL = 1e-5


def _fit(out: Path, task: Any, steps: int = 2) -> Path:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule

    dm = TextDataModule(tokenizer_dir="byte", block_size=32, batch_size=4, cache_dir=str(out / "cache"),
                        generated_docs=100)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(out))
    trainer.fit(task, dm)
    ckpt = out / f"{id(task)}.ckpt"
    trainer.save_checkpoint(ckpt)
    return ckpt


def _ids() -> torch.Tensor:
    return torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _ours(task: Any) -> torch.Tensor:
    task.model.eval()
    return task.model(_ids()).float()


@torch.no_grad()
def _hf(directory: Path, adapter: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    return model(_ids()).logits.float()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    import lightning.pytorch as pl

    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    out = tmp_path_factory.mktemp("export")
    pl.seed_everything(3)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"))
    return _fit(out, task), task


def _export(ckpt: Path, to: Path, *extra: str) -> Path:
    assert cli_main(["export", str(ckpt), "--to", str(to), *extra]) == 0
    return to


def test_plain_checkpoint_loads_in_transformers(plain: tuple[Path, Any], tmp_path: Path) -> None:
    ckpt, task = plain
    hf = _export(ckpt, tmp_path / "hf")
    err = (_hf(hf) - _ours(task)).abs().max().item()
    print(f"plain .ckpt -> HF: max |logit err| {err:.2e}")
    assert err <= TOL


def test_other_layouts_export_the_same_weights(plain: tuple[Path, Any], tmp_path: Path) -> None:
    """The plain checkpoint's weights re-written as a DCP directory (tp / ZeRO-3 layout), pipeline-rank files, a
    ZeRO-1/2 directory and a strategy=3d directory (``from_lightning_checkpoint``): every export equals the plain one
    exactly."""
    from safetensors.torch import load_file

    from lightning_llm.export.legacy import save_sharded, stage_checkpoint_file

    ckpt, _ = plain
    full = torch.load(ckpt, weights_only=False)
    meta = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
    sd = full["state_dict"]
    dcp_dir = save_sharded(tmp_path / "dcp", model_state=sd, metadata=meta)
    pp_dir = tmp_path / "pp"
    pp_dir.mkdir()
    keys = sorted(sd)
    for r, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        torch.save({**meta, "state_dict": {k: sd[k] for k in part}}, stage_checkpoint_file(pp_dir, r))
    zero_dir = tmp_path / "zero"
    zero_dir.mkdir()
    torch.save(full, zero_dir / "model.pt")
    from lightning_llm.strategies.engine.hybrid_checkpoint import from_lightning_checkpoint

    hybrid_dir = from_lightning_checkpoint(ckpt, tmp_path / "3d")  # the .ckpt -> strategy=3d converter
    ref = load_file(str(_export(ckpt, tmp_path / "hf-plain") / "model.safetensors"))
    for name, d in (("dcp", dcp_dir), ("pp", pp_dir), ("zero", zero_dir), ("3d", hybrid_dir)):
        got = load_file(str(_export(d, tmp_path / f"hf-{name}") / "model.safetensors"))
        err = max((got[k] - ref[k]).abs().max().item() for k in ref)
        print(f"{name} layout -> HF: {len(got)} tensors, max |err| vs plain export {err:.1e}")
        assert sorted(got) == sorted(ref) and err == 0.0


def test_lora_merged_and_adapter_only(plain: tuple[Path, Any], tmp_path: Path) -> None:
    """A LoRA run on an HF base (checkpoint = adapter weights only): ``--merge-lora`` gives full weights, and
    ``--adapter-only`` a peft adapter + base that ``PeftModel`` loads; both equal our LoRA model's logits."""
    import lightning.pytorch as pl

    from lightning_llm.models import save_hf
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    _, base_task = plain
    base = save_hf(base_task.model, tmp_path / "base")
    pl.seed_everything(4)
    task = CausalLMTask(str(base), dropout=0.0, optim=OptimConfig(lr=2e-2, scheduler="constant"),
                        lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]),
                        adapter_dir=str(tmp_path / "adapter-at-fit-end"))
    ckpt = _fit(tmp_path, task, steps=3)
    assert "lora_B" in " ".join(torch.load(ckpt, weights_only=False)["state_dict"])
    ours = _ours(task)
    merged = _export(ckpt, tmp_path / "merged", "--merge-lora")
    adapter = _export(ckpt, tmp_path / "adapter", "--adapter-only")
    err_merged = (_hf(merged) - ours).abs().max().item()
    err_adapter = (_hf(adapter / "base", adapter) - ours).abs().max().item()
    moved = (_hf(base) - ours).abs().max().item()  # the adapter changed the model (so the checks can fail)
    print(f"LoRA -> HF merged: max |logit err| {err_merged:.2e}; adapter-only via PeftModel {err_adapter:.2e}; "
          f"base vs trained {moved:.2e}")
    assert err_merged <= TOL and err_adapter <= TOL and moved > 1e-3


def test_errors(tmp_path: Path, plain: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["export", str(tmp_path / "missing"), "--to", str(tmp_path / "x")]) == 2
    assert cli_main(["export", str(plain[0]), "--to", str(tmp_path / "x"), "--adapter-only"]) == 2
    err = capsys.readouterr().out
    assert "no such file" in err and "not from a PEFT" in err
