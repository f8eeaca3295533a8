"""QLoRA (``--model.quantize=nf4``) under ddp x2, zero3 x2 (FSDP2 shards torchao's NF4Tensor: packed data, block
scales and double-quantization factors by rows) and pp x2 (each stage holds its blocks' NF4 weights) equals one
device: every LoRA factor's first-step gradient (per tensor within 1e-5 of its largest entry:
``testing.gradients``) and ``train_loss`` over 6 fp32 steps within 1e-5. tp is refused before anything is built, with
one line.

One device: the same global batch (4 rows) in one process; the 2-rank layouts: 2 rows per rank. Compared: the
first-step gradients and the logged ``train_loss`` (the global batch's loss at every layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from safetensors.torch import load_file

from lightning_llm.cli import main
from lightning_llm.models import build_model, save_hf
from lightning_llm.testing import logged_rows, max_abs_err, one_error_line_from_ranks, run_cli, torchrun_cli_fails
from lightning_llm.testing.gradients import check_gradient_records, recorder_cli_args

pytest.importorskip("torchao", reason="--model.quantize needs torchao (the [quant] extra)")

STEPS = 6
ALL_PROJ = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return save_hf(build_model("debug", family="decoder", vocab_size=264), tmp_path_factory.mktemp("base") / "hf")


def _args(base: Path, out: Path, *, batch: int, extra: list[str]) -> list[str]:
    return ["fit", "--seed_everything=0", "--model=CausalLMTask", f"--model.backbone={base}", "--model.lora.r=4",
            "--model.lora.alpha=8", "--model.lora.dropout=0", f"--model.lora.target_modules={ALL_PROJ}",
            "--model.optim.lr=0.02", "--model.optim.weight_decay=0", "--model.quantize=nf4",
            # 16 scales per double-quantization block: every weight's pieces split over 2 ranks
            "--model.quantization.scaler_block_size=16", f"--model.adapter_dir={out / 'adapter'}",
            "--data=TextDataModule", "--data.tokenizer_dir=byte", "--data.generated_docs=40", "--data.block_size=32",
            "--data.val_fraction=0.1", f"--data.batch_size={batch}", f"--data.cache_dir={out / 'cache'}",
            "--trainer.accelerator=cpu", f"--trainer.max_steps={STEPS}", "--trainer.logger=CSVLogger",
            f"--trainer.logger.save_dir={out}", "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false", "--trainer.callbacks+=ModelCheckpoint",
            f"--trainer.callbacks.dirpath={out / 'ckpt'}", "--trainer.callbacks.save_last=true",
            "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=-1",
            "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={out}",
            *extra]


def _losses(out: Path) -> list[float]:
    return [r["train_loss"] for r in logged_rows(out, key="train_loss")]


@pytest.mark.multiprocess
def test_ddp_and_zero3_equal_one_device(base_dir: Path, tmp_path: Path) -> None:
    one, grads = tmp_path / "one", tmp_path / "gradients"
    run_cli(_args(base_dir, one, batch=4, extra=recorder_cli_args(grads, "one")))
    reference = _losses(one)
    for strategy in ("ddp", "zero3", "pp"):
        out = tmp_path / strategy
        batch = 4 if strategy == "pp" else 2  # the two pipeline stages share one batch of 4 rows
        proc = run_cli(_args(base_dir, out, batch=batch, extra=[f"--trainer.strategy={strategy}",
                                                                "--trainer.devices=2",
                                                                *recorder_cli_args(grads, strategy, "one")]), nproc=2)
        got = _losses(out)
        err = max_abs_err(got, reference)
        print(f"{strategy} x2 vs one device: max |train_loss diff| over {STEPS} steps = {err:.2e}")
        assert len(got) == STEPS and err <= 1e-5, (got, reference)
        held = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "quantized frozen weights" in ln]
        assert held, "the run summary states the quantized bytes"
        print(held[0].split("; quantized")[-1])
    summary = check_gradient_records(grads)  # raises naming a run and a parameter
    for run, row in summary.items():
        print(f"{run} x2: first-step gradients, max relative |g - one device| = {row['max_rel']:.1e} over "
              f"{row['tensors']} tensors (worst {row['worst']})")
    assert sorted(summary) == ["ddp", "pp", "zero3"]
    assert (tmp_path / "zero3" / "adapter" / "quantization.json").is_file()
    # The zero3 checkpoint (DCP shards) holds the adapters and the settings, not the NF4 weights (the engine keeps
    # the plain frozen ones, embeddings and norms, as for any PEFT run); it exports to the same merged weights as the
    # one-device checkpoint.
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "zero3" / "ckpt" / "last.ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert any("lora_A" in k for k in model_keys) and not [k for k in model_keys if "base_layer" in k]
    merged = {}
    for name in ("one", "zero3"):
        assert main(["export", str(tmp_path / name / "ckpt" / "last.ckpt"), "--to", str(tmp_path / f"hf_{name}")]) == 0
        merged[name] = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
    worst = max((merged["one"][k] - merged["zero3"][k]).abs().max().item() for k in merged["one"])
    print(f"merged export of the zero3 checkpoint vs one device: max |weight diff| = {worst:.1e}")
    assert merged["one"].keys() == merged["zero3"].keys() and worst <= 1e-5
    # zero3 resumes from its step-3 checkpoint (the NF4 base rebuilt from the backbone) onto the same curve
    resumed = tmp_path / "zero3_resumed"
    run_cli(_args(base_dir, resumed, batch=2, extra=["--trainer.strategy=zero3", "--trainer.devices=2",
                                                     f"--ckpt_path={tmp_path / 'zero3' / 'ckpt' / 'epoch=0-step=3.ckpt'}"]),
            nproc=2)
    again = _losses(resumed)
    print(f"zero3 resumed at step 3: max |train_loss diff| vs the straight run = "
          f"{max_abs_err(again, _losses(tmp_path / 'zero3')[3:]):.1e}")
    assert max_abs_err(again, _losses(tmp_path / "zero3")[3:]) <= 1e-6


@pytest.mark.multiprocess
def test_tensor_parallel_refused_with_one_line(base_dir: Path, tmp_path: Path) -> None:
    out = torchrun_cli_fails(_args(base_dir, tmp_path, batch=2, extra=["--trainer.strategy=tp", "--trainer.devices=2"]),
                             tmp_path)
    line = one_error_line_from_ranks(out)
    assert "--model.quantize=nf4 is not supported under tensor parallelism" in line, line
