"""Causal-LM pretraining: block grouping, logged metrics, DDP (with LoRA) vs one device (the token store:
tests/data/test_prepare.py)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_llm.cli import main
from lightning_llm.data import ByteTokenizer, TextDataModule
from lightning_llm.testing import run_cli

REPO = Path(__file__).resolve().parents[2]


def test_block_grouping_on_hand_made_corpus(tmp_path: Path) -> None:
    """Documents are joined with EOS and cut into block_size blocks; labels are the next tokens; remainder dropped."""
    data = tmp_path / "docs"
    data.mkdir()
    (data / "a.txt").write_text("abc", encoding="utf-8")
    (data / "b.jsonl").write_text(json.dumps({"text": "defg"}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    dm = TextDataModule(str(data), block_size=3, val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    eos = ByteTokenizer.eos_token_id
    stream = [*b"abc", eos, *b"defg", eos, *b"hi", eos]  # 12 tokens, files in sorted order
    assert dm.stores[0].tokens.tolist() == stream
    assert dm.stores[0].documents().tolist() == [4, 9, 12]  # the document boundaries
    blocks = [dm.datasets["fit"][i] for i in range(len(dm.datasets["fit"]))]
    assert len(blocks) == (len(stream) - 1) // 3 == 3  # the last token only serves as a label
    for i, b in enumerate(blocks):
        assert b["input_ids"].tolist() == stream[3 * i:3 * i + 3]
        assert b["labels"].tolist() == stream[3 * i + 1:3 * i + 4]
    # Validation takes the last blocks.
    dm2 = TextDataModule(str(data), block_size=2, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    dm2.setup("fit")
    assert dm2.prepared is False  # the same corpus and tokenizer: the store is reused
    assert len(dm2.datasets["fit"]) == 4 and len(dm2.datasets["validate"]) == 1
    assert dm2.datasets["validate"][0]["input_ids"].tolist() == stream[8:10]


def test_pretrain_debug_config_logs_loss_ppl_and_throughput(tmp_path: Path) -> None:
    assert main([
        "fit", f"--config={REPO / 'configs' / 'pretrain_debug.yaml'}", "--trainer.max_steps=4",
        "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_checkpointing=false", "--data.generated_docs=60", f"--data.cache_dir={tmp_path / 'cache'}",
    ]) == 0
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert len([r for r in rows if r.get("train_loss")]) == 4
    assert any(r.get("val_loss") for r in rows) and any(r.get("val_ppl") for r in rows)
    rates = [float(r["train_tokens_per_s"]) for r in rows if r.get("train_tokens_per_s")]
    print(f"train_tokens_per_s: {rates}")
    assert len(rates) == 4 and all(r > 0 for r in rates)


def _fit_args(out: Path, *, batch: int, extra: list[str]) -> list[str]:
    return [
        "fit", "--seed_everything=1", "--model=lightning_llm.tasks.CausalLMTask", "--model.backbone=debug",
        "--model.dropout=0", "--model.lora.r=4", "--model.lora.alpha=8", "--model.lora.dropout=0",
        "--model.lora.target_modules=[q_proj,v_proj,down_proj]", "--model.optim.lr=0.01",
        "--data=lightning_llm.data.TextDataModule", "--data.generated_docs=60", "--data.block_size=32",
        f"--data.cache_dir={out.parent / 'cache'}", f"--data.batch_size={batch}",
        "--trainer.accelerator=cpu", "--trainer.max_steps=4", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out}",
        "--trainer.callbacks+=lightning_llm.testing.StepRecorder", f"--trainer.callbacks.output={out / 'steps.json'}",
        *extra,
    ]


@pytest.mark.multiprocess
def test_ddp_lora_two_processes_match_one_device(tmp_path: Path) -> None:
    """4 LoRA steps: 1 device x batch 8 vs DDP 2 x batch 4 over the same global batches: losses agree to 1e-5."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_cli(_fit_args(single, batch=8, extra=["--trainer.devices=1"]))
    run_cli(_fit_args(ddp, batch=4, extra=["--trainer.devices=2", "--trainer.strategy=ddp"]), nproc=2)
    ref = json.loads((single / "steps.json").read_text())["losses"][0]
    ranks = json.loads((ddp / "steps.json").read_text())["losses"]
    assert len(ref) == 4 and len(ranks) == 2 and all(len(r) == 4 for r in ranks)
    ddp_mean = [(a + b) / 2 for a, b in zip(*ranks)]
    errs = [abs(a - b) for a, b in zip(ref, ddp_mean)]
    print(f"single={ref}\nddp={ddp_mean}\nmax_abs_err={max(errs):.2e}")
    assert max(errs) <= 1e-5
    assert ref[0] != ref[-1]
    assert (ddp / "adapter" / "adapter_model.safetensors").is_file()  # exported once, by rank 0
