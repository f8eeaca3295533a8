"""The Chinese-LLaMA-Alpaca-2 flow end to end on a tiny Llama saved by transformers (tied and untied embeddings):
a base tokenizer in the checkpoint, an extended tokenizer (more words) beside it; ``lightning_llm fit`` with LoRA on
the seven projections, ``modules_to_save=[embed_tokens, lm_head]`` and ``--model.resize_embeddings=true``; then
``lightning_llm merge`` (from the fit-end adapter) and ``lightning_llm export`` (from the checkpoint), each reloaded
by ``transformers.AutoModelForCausalLM``, whose validation loss on the run's validation blocks equals the trained
model's (1e-4). The multi-process test trains the resized LoRA model under ZeRO-3 on 2 CPU processes like one
device.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tests.data.test_vocab import corpus_words, write_llama, write_tokenizer  # noqa: E402

TOL = 1e-4
LORA = ["--model.lora.r=4", "--model.lora.alpha=8", "--model.lora.dropout=0.0",
        "--model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        "--model.lora.modules_to_save=[embed_tokens,lm_head]"]


def make_dirs(root: Path, *, tie: bool) -> tuple[Path, Path, int, int]:
    """(base checkpoint with its tokenizer, extended tokenizer, base vocab, extended vocab)."""
    words = corpus_words()
    base, ext = root / "base", root / "ext"
    n_base = write_tokenizer(base, words[:12], filler=20)
    n_ext = write_tokenizer(ext, words, filler=20)
    write_llama(base, n_base, tie=tie)
    return base, ext, n_base, n_ext


def _hf_val_loss(directory: Path, datamodule: Any) -> float:
    """Mean over the validation loader's batches (weighted by batch size, as the logged ``val_loss``) of the token
    cross-entropy of the transformers model in ``directory``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in datamodule.val_dataloader():
            logits = model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
            total += loss.item() * batch["input_ids"].shape[0]
            count += batch["input_ids"].shape[0]
    return total / count


@pytest.mark.parametrize("tie", [False, True])
def test_extended_vocabulary_lora_merge_reloads_in_transformers(tie: bool, tmp_path: Path) -> None:
    from lightning_llm.cli import LLMCLI, main

    base, ext, n_base, n_ext = make_dirs(tmp_path, tie=tie)
    cli = LLMCLI(args=[
        "--seed_everything=1", "--model=lightning_llm.tasks.CausalLMTask", f"--model.backbone={base}",
        "--model.resize_embeddings=true", *LORA, "--model.optim.lr=0.02", "--model.optim.scheduler=constant",
        f"--model.adapter_dir={tmp_path / 'adapter'}", "--data=lightning_llm.data.TextDataModule",
        f"--data.tokenizer_dir={ext}", "--data.generated_docs=40", "--data.block_size=16", "--data.batch_size=4",
        "--data.val_fraction=0.1", f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.accelerator=cpu",
        "--trainer.devices=1", "--trainer.max_steps=8", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    ], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.model.config.vocab_size == n_ext
    trained = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)[0]["val_loss"]
    (ckpt,) = (tmp_path / "run" / "checkpoints").glob("*.ckpt")

    merged, exported = tmp_path / "merged", tmp_path / "exported"
    assert main(["merge", "--base", str(base), "--adapter", str(tmp_path / "adapter"), "--output", str(merged)]) == 0
    assert main(["export", str(ckpt), "--to", str(exported)]) == 0
    for out in (merged, exported):
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["vocab_size"] == n_ext and cfg["tie_word_embeddings"] is False  # trained apart when tied
        assert len(transformers.AutoTokenizer.from_pretrained(str(out))) == n_ext
    got_merged, got_exported = _hf_val_loss(merged, cli.datamodule), _hf_val_loss(exported, cli.datamodule)
    # the new rows trained: the merged rows differ from their mean-resized start (which is ~ the old rows' mean)
    state = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).state_dict()
    new_rows = state["model.embed_tokens.weight"][n_base:]
    assert (new_rows - new_rows.mean(0)).abs().max() > 1e-3
    print(f"tie={tie}: vocab {n_base} -> {n_ext}; val loss trained {trained:.6f}, merge --adapter reloaded "
          f"{got_merged:.6f} (|diff| {abs(got_merged - trained):.2e}), export --ckpt reloaded {got_exported:.6f} "
          f"(|diff| {abs(got_exported - trained):.2e})")
    assert abs(got_merged - trained) <= TOL and abs(got_exported - trained) <= TOL


# ------------------------------------------------------------------------------------------------ ZeRO-3, 2 processes

STEPS = 3
N_EXT = 51  # the extended tokenizer's size


def _fit(out: Path, strategy: Any, devices: int, batch: int) -> list[float]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(3)
    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"],
                    modules_to_save=["embed_tokens", "lm_head"])
    task = CausalLMTask(str(out / "base"), dropout=0.0, lora=lora, resize_embeddings=True,
                        adapter_dir=str(out / f"adapter-{devices}"),
                        optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    dm = TextDataModule(str(out / "docs.txt"), tokenizer_dir=str(out / "ext"), block_size=16, batch_size=batch,
                        cache_dir=str(out / "cache"), val_fraction=0.0)
    rec = LoggedLoss()
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        (out / "reference.json").write_text(json.dumps(_fit(out, "auto", 1, 8)))
        return
    from lightning_llm.strategies import ZeroStrategy

    write_json_on_rank0(out / "layouts.json", {"zero3": gathered(_fit(out, ZeroStrategy(stage=3), 2, 4))})


@pytest.mark.multiprocess
def test_resized_lora_model_trains_under_zero3_like_one_device(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from lightning_llm.data.text import generated_corpus
    from lightning_llm.testing import max_abs_err, run_layouts_and_reference

    assert make_dirs(tmp_path, tie=False)[3] == N_EXT
    (tmp_path / "docs.txt").write_text(" ".join(generated_corpus(12)))
    run_layouts_and_reference(__file__, tmp_path, lambda: _worker("reference", tmp_path), timeout=600)
    ref = json.loads((tmp_path / "reference.json").read_text())
    ranks = json.loads((tmp_path / "layouts.json").read_text())["zero3"]
    err = max(max_abs_err(r, ref) for r in ranks)
    print(f"resized LoRA model, zero3 x 2 vs one device: losses {ref}, max |diff| {err:.2e}")
    assert len(ref) == STEPS and err <= 1e-5
    # the fit-end adapter export gathers the ZeRO-3 shards: the same adapter as one device's
    one, two = (load_file(str(tmp_path / f"adapter-{n}" / "adapter_model.safetensors")) for n in (1, 2))
    assert one.keys() == two.keys() and one["base_model.model.model.embed_tokens.weight"].shape[0] == N_EXT
    adapter_err = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"fit-end adapter, zero3 x 2 vs one device: max |diff| {adapter_err:.2e}")
    assert adapter_err <= 1e-5


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
