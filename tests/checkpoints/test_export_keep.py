"""Exports keep what was trained: ``lightning_llm export`` / ``merge`` write the model the run trained, reloaded by
``transformers``/``peft`` with the same outputs, plus its tokenizer and generation config, atomically.

* a classification run on a base / MLM / sequence-classification encoder directory exports as
  ``...ForSequenceClassification`` with the trained pooler + classifier and the run's label names, from the
  checkpoint alone (backbone moved away) and, for older checkpoints without the stored config, via the backbone;
* LoRA on a tied-embedding Llama with ``modules_to_save=[embed_tokens, lm_head]`` (the ``pretrain_lora.yaml``
  setting) or a LoRA on ``lm_head``: ``merge`` and ``export --merge-lora`` untie and keep the trained validation loss;
  ``export --adapter-only`` writes peft's format that ``PeftModel`` loads with our logits;
* a decoder full fine-tune exports without its backbone directory (config and generation config from the checkpoint);
* an error in the middle of an export leaves neither the target nor a temporary directory.

Tiny random models written by ``transformers`` into temporary directories; nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_llm.export.merge import main as merge_main
from lightning_llm.export.to_hf import main as export_main
from lightning_llm.peft import LoraArgs
from lightning_llm.tasks import CausalLMTask, ClassificationTask, OptimConfig

LABELS = ["different", "same"]


def _trainer(root: Path, steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      num_sanity_val_steps=0, default_root_dir=str(root))


def _fit(root: Path, task: Any, dm: Any, steps: int) -> Path:
    trainer = _trainer(root, steps)
    trainer.fit(task, dm)
    ckpt = root / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    task.model.eval()
    return ckpt


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- tiny sources


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sentence pairs labelled ``different``/``same`` (so generic LABEL_0/1 would be wrong) + a bare vocab.txt."""
    from lightning_llm.data import generate_pair_dataset

    d = generate_pair_dataset(tmp_path_factory.mktemp("pairs"), n_train=48, n_val=16, n_test=8, seed=0)
    for split in ("train.json", "dev.json"):
        rows = [json.loads(line) for line in (d / split).read_text().splitlines()]
        (d / split).write_text("".join(json.dumps({**r, "label": LABELS[int(r["label"])]}) + "\n" for r in rows))
    return d


def _encoder_dir(root: Path, arch: str) -> Path:
    import transformers

    common = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64}
    config_cls = transformers.MegatronBertConfig if arch.startswith("Megatron") else transformers.BertConfig
    torch.manual_seed(0)
    if arch.endswith("ForSequenceClassification"):  # a head of its own, with another label map
        common["id2label"] = {0: "negative", 1: "positive"}
    model = getattr(transformers, arch)(config_cls(**common))
    out = root / arch
    _quiet(model.save_pretrained, str(out))
    return out


@pytest.fixture(scope="module")
def llama(tiny_llama: Callable[..., Path]) -> Path:
    """A tied-embedding LlamaForCausalLM with a ``tokenizers`` BPE tokenizer and a generation config."""
    return tiny_llama(tie_word_embeddings=True, max_new_tokens=17)


def _same_tokenizer(exported: Path, source: Path) -> None:
    from transformers import AutoTokenizer

    from lightning_llm.data.base import load_tokenizer

    texts = ["The cat sees a tree. A dog helps the moon!", "一丁七万丈三上下不与丐丑专且丕世丗丘丙业丛东丝"]
    theirs = _quiet(AutoTokenizer.from_pretrained, str(exported))
    ours = load_tokenizer(str(source))
    assert theirs(*texts)["input_ids"] == ours(*texts)["input_ids"]


def _moved(path: Path) -> Path:
    away = path.with_name(path.name + "-moved")
    shutil.move(str(path), str(away))
    return away


# ---------------------------------------------------------------------------------------------------- classification


@pytest.mark.parametrize("arch", ["MegatronBertModel", "BertForMaskedLM", "BertForSequenceClassification"])
def test_classifier_export_keeps_head_pooler_and_labels(arch: str, pairs: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    from lightning_llm.data import SentencePairDataModule

    backbone = _encoder_dir(tmp_path, arch)
    pl.seed_everything(1)
    task = ClassificationTask(str(backbone), dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"))
    dm = SentencePairDataModule(str(pairs), str(pairs / "tokenizer"), batch_size=8, max_length=32)
    ckpt = _fit(tmp_path, task, dm, steps=3)
    batch = next(iter(dm.val_dataloader()))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        ours = task.model(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                          token_type_ids=inputs["token_type_ids"])

    def check(out: Path, what: str) -> None:
        hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(out)).eval()
        with torch.no_grad():
            err = (hf(**inputs).logits - ours).abs().max().item()
        print(f"{arch} {what}: {hf.config.architectures[0]}, max |logit err| {err:.2e}, labels {hf.config.id2label}")
        assert hf.config.architectures[0].endswith("ForSequenceClassification")
        assert hf.config.id2label == dict(enumerate(LABELS)) and hf.config.label2id == {"different": 0, "same": 1}
        assert err <= 1e-5

    away = _moved(backbone)  # a full fine-tune exports from the checkpoint alone
    assert export_main([str(ckpt), "--to", str(tmp_path / "hf")]) == 0
    check(tmp_path / "hf", "from the checkpoint alone")
    _same_tokenizer(tmp_path / "hf", pairs / "tokenizer")  # the run's --data.tokenizer_dir (a bare vocab.txt)

    # An older checkpoint (no stored config) is rebuilt from its backbone, as before - now with its head.
    shutil.move(str(away), str(backbone))
    old = torch.load(ckpt, weights_only=False)
    old.pop("export")
    torch.save(old, tmp_path / "old.ckpt")
    assert export_main([str(tmp_path / "old.ckpt"), "--to", str(tmp_path / "hf-old")]) == 0
    check(tmp_path / "hf-old", "older checkpoint via the backbone")
    # An architecture without the head is refused rather than written without the trained classifier.
    base_arch = "MegatronBertModel" if arch.startswith("Megatron") else "BertModel"
    assert export_main([str(ckpt), "--to", str(tmp_path / "no-head"), "--architecture", base_arch]) == 2
    assert not (tmp_path / "no-head").exists()


# ---------------------------------------------------------------------------------------------------- LoRA, tied


def _lora_run(llama: Path, root: Path, lora: LoraArgs) -> tuple[Path, CausalLMTask, list[dict[str, torch.Tensor]]]:
    from lightning_llm.data import TextDataModule

    pl.seed_everything(0)
    task = CausalLMTask(str(llama), dropout=0.0, lora=lora, adapter_dir=str(root / "adapter-at-fit-end"),
                        optim=OptimConfig(lr=2e-2, scheduler="constant"))
    dm = TextDataModule(tokenizer_dir=str(llama), block_size=32, batch_size=4, generated_docs=60, val_fraction=0.1,
                        cache_dir=str(root / "cache"))
    ckpt = _fit(root, task, dm, steps=8)
    return ckpt, task, list(dm.val_dataloader())


@torch.no_grad()
def _val_loss(logits_of: Any, batches: list[dict[str, torch.Tensor]]) -> float:
    total, n = 0.0, 0
    for b in batches:
        logits = logits_of(b["input_ids"]).float()
        total += F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum").item()
        n += int((b["labels"] != -100).sum())
    return total / n


def _hf_loss(directory: Path, batches: list[dict[str, torch.Tensor]]) -> float:
    from transformers import AutoModelForCausalLM

    hf = _quiet(AutoModelForCausalLM.from_pretrained, str(directory)).eval()
    return _val_loss(lambda x: hf(input_ids=x).logits, batches)


TIED_LORA = {
    "modules_to_save": LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"],
                                modules_to_save=["embed_tokens", "lm_head"]),
    "lora_on_lm_head": LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"]),
}


@pytest.fixture(scope="module", params=list(TIED_LORA))
def tied_run(request: pytest.FixtureRequest, llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, *_lora_run(llama, root, TIED_LORA[request.param]))


def test_tied_lora_merge_keeps_trained_loss(tied_run: Any, llama: Path, tmp_path: Path) -> None:
    name, ckpt, task, batches = tied_run
    trained = _val_loss(task.model, batches)
    base = _hf_loss(llama, batches)
    outs = {
        "merge --ckpt": (merge_main, ["--base", str(llama), "--ckpt", str(ckpt), "--output", str(tmp_path / "m1")]),
        "merge --adapter": (merge_main, ["--base", str(llama), "--adapter", str(ckpt.parent / "adapter-at-fit-end"),
                                         "--output", str(tmp_path / "m2")]),
        "export --merge-lora": (export_main, [str(ckpt), "--to", str(tmp_path / "m3"), "--merge-lora"]),
    }
    for what, (fn, argv) in outs.items():
        assert fn(argv) == 0
        out = Path(argv[argv.index("--output") + 1] if "--output" in argv else argv[argv.index("--to") + 1])
        got = _hf_loss(out, batches)
        print(f"{name} {what}: val loss {got:.4f} vs trained {trained:.4f} (base {base:.4f})")
        assert abs(got - trained) <= 1e-4 and abs(base - trained) > 0.1
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
        _same_tokenizer(out, llama)
        assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 17


def test_adapter_only_export_with_modules_to_save_loads_in_peft(tied_run: Any, llama: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name, ckpt, task, batches = tied_run
    out = tmp_path / "adapter"
    assert export_main([str(ckpt), "--to", str(out), "--adapter-only"]) == 0
    hf = _quiet(PeftModel.from_pretrained, _quiet(AutoModelForCausalLM.from_pretrained, str(out / "base")), str(out))
    x = batches[0]["input_ids"]
    with torch.no_grad():
        err = (hf.eval()(input_ids=x).logits - task.model(x)).abs().max().item()
    print(f"{name} --adapter-only via PeftModel: max |logit err| {err:.2e}")
    assert err <= 1e-5
    _same_tokenizer(out, llama)  # beside the adapter (where PeftModel users look) and in base/
    _same_tokenizer(out / "base", llama)


# ---------------------------------------------------------------------------------------------------- full fine-tune


def test_decoder_full_finetune_exports_without_backbone(llama: Path, tmp_path: Path) -> None:
    from lightning_llm.data import TextDataModule

    backbone = tmp_path / "backbone"
    shutil.copytree(llama, backbone)
    pl.seed_everything(0)
    task = CausalLMTask(str(backbone), dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"))
    dm = TextDataModule(tokenizer_dir=str(backbone), block_size=32, batch_size=4, generated_docs=60,
                        cache_dir=str(tmp_path / "cache"))
    ckpt = _fit(tmp_path, task, dm, steps=2)
    batches = list(dm.val_dataloader())
    away = _moved(backbone)
    assert export_main([str(ckpt), "--to", str(tmp_path / "hf"), "--tokenizer", str(away)]) == 0
    got, trained = _hf_loss(tmp_path / "hf", batches), _val_loss(task.model, batches)
    print(f"full fine-tune without backbone: val loss {got:.5f} vs trained {trained:.5f}")
    assert abs(got - trained) <= 1e-4
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["max_new_tokens"] == 17
    _same_tokenizer(tmp_path / "hf", away)
    # The run's tokenizer lived in the moved backbone: without --tokenizer the export says so instead of guessing.
    assert export_main([str(ckpt), "--to", str(tmp_path / "hf2")]) == 0
    assert not (tmp_path / "hf2" / "tokenizer.json").exists() and (tmp_path / "hf2" / "model.safetensors").is_file()

    # A checkpoint whose tied embedding and LM head differ (each pipeline stage kept its own copy) is untied on
    # export, both tensors written, instead of one silently replacing the other.
    from safetensors.torch import load_file

    apart = torch.load(ckpt, weights_only=False)
    sd = apart["state_dict"]
    sd["model.lm_head.weight"] = sd["model.embed_tokens.weight"].clone() + 0.01
    torch.save(apart, tmp_path / "apart.ckpt")
    assert export_main([str(tmp_path / "apart.ckpt"), "--to", str(tmp_path / "hf3"), "--no-tokenizer"]) == 0
    written = load_file(str(tmp_path / "hf3" / "model.safetensors"))
    assert json.loads((tmp_path / "hf3" / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(written["lm_head.weight"], sd["model.lm_head.weight"])
    assert torch.equal(written["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])


# ---------------------------------------------------------------------------------------------------- atomic output


def test_failed_export_leaves_nothing(tied_run: Any, llama: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import lightning_llm.export.files as files

    _, ckpt, _, _ = tied_run
    def fail(*_: Any, **__: Any) -> None:
        raise ValueError("disk full (injected)")

    def leftovers() -> list[str]:
        return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))

    monkeypatch.setattr(files, "write_tokenizer", fail)  # after the weights (and the adapter) were written
    target = tmp_path / "deep" / "out"
    assert export_main([str(ckpt), "--to", str(target)]) == 2
    assert export_main([str(ckpt), "--to", str(target), "--adapter-only"]) == 2
    assert merge_main(["--base", str(llama), "--ckpt", str(ckpt), "--output", str(target)]) == 2
    assert not (tmp_path / "deep").exists() and leftovers() == []
    assert capsys.readouterr().out.count("disk full (injected)") == 3

    # A previous export under the target survives a failed one whole; a directory that is no model is refused.
    monkeypatch.undo()
    prev = tmp_path / "prev"
    assert export_main([str(ckpt), "--to", str(prev)]) == 0
    before = sorted(p.name for p in prev.iterdir())
    monkeypatch.setattr(files, "write_tokenizer", fail)
    assert export_main([str(ckpt), "--to", str(prev), "--adapter-only"]) == 2
    assert sorted(p.name for p in prev.iterdir()) == before and leftovers() == []
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    assert export_main([str(ckpt), "--to", str(other)]) == 2
    assert "holds no model" in capsys.readouterr().out and (other / "todo.txt").read_text() == "mine"
