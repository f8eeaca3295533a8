"""Summarization SFT: instruction data (masking, truncation, packing), generation (KV cache, left padding, beam vs HF),
overfit to ROUGE-L >= 90, predictions file, DDP."""

from __future__ import annotations

import csv
import json
import random
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import ByteTokenizer, InstructionDataModule, pack_examples
from lightning_llm.data.instruction import infer_seqlen
from lightning_llm.data.base import left_pad
from lightning_llm.generation import GenerationConfig, generate, strip_after_eos
from lightning_llm.models import build_model, save_hf
from lightning_llm.tasks import OptimConfig, SFTTask
from lightning_llm.testing import run_cli

EOS = ByteTokenizer.eos_token_id
POOL = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你"


def _records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Short Chinese 'abstracts' whose 'title' is their first five characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        inp = "".join(rng.choice(POOL) for _ in range(10))
        out.append({"instruction": "标题:", "input": inp, "output": inp[:5]})
    return out


@pytest.fixture()
def sft_file(tmp_path: Path) -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(_records(32), ensure_ascii=False), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ data


def test_prompt_tokens_are_masked_and_labels_shifted(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"instruction": "Sum:", "input": "abc", "output": "xy"}) + "\n")
    dm = InstructionDataModule(str(path), template="{instruction}{input}=", val_path=str(path), batch_size=1)
    dm.setup("fit")
    row = dm.datasets["fit"][0]
    prompt, response = list(b"Sum:abc="), [*b"xy", EOS]
    assert row["input_ids"] == prompt + response
    # label[t] = next token when it is a response token: the last prompt position predicts "x".
    assert row["labels"] == [-100] * (len(prompt) - 1) + response + [-100]
    batch = dm.collate([dm.datasets["validate"][0], dm.datasets["validate"][0]])
    assert batch["gen_input_ids"][0].tolist() == prompt and batch["label"] == ["xy", "xy"]


def test_default_alpaca_template_without_input(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"instruction": "Say hi", "output": "hi"}]))
    dm = InstructionDataModule(str(path), batch_size=1)
    dm.setup("fit")
    text = bytes(t for t in dm.datasets["fit"][0]["input_ids"] if t < 256).decode()
    assert "### Instruction:\nSay hi\n\n### Response:\nhi" in text and "### Input" not in text


def test_cutoff_len_truncates_source_but_keeps_template_tail(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"instruction": "T:", "input": "a" * 50, "output": "xyz"}) + "\n")
    dm = InstructionDataModule(str(path), template="{instruction}{input}\nA:", cutoff_len=20, batch_size=1)
    dm.setup("fit")
    row = dm.datasets["fit"][0]
    assert len(row["input_ids"]) == 20
    assert row["input_ids"][-7:] == [*b"\nA:xyz", EOS]  # template tail kept, full response kept
    assert infer_seqlen(100, 4, 20) == (16, 4) and infer_seqlen(4, 100, 20) == (4, 16)
    assert infer_seqlen(30, 30, 20) == (10, 10)


def test_packing_keeps_each_row_whole_in_its_own_segment(sft_file: Path) -> None:
    plain = InstructionDataModule(str(sft_file), template="{instruction}{input}\n", cutoff_len=128)
    packed = InstructionDataModule(str(sft_file), template="{instruction}{input}\n", cutoff_len=128, packing=True)
    plain.setup("fit")
    packed.setup("fit")
    rows, packs = plain.datasets["fit"].examples, packed.datasets["fit"].examples
    assert len(packs) < len(rows) and all(len(p["input_ids"]) <= 128 for p in packs)
    # every packed row splits, by segment, into whole training rows with positions 0..n-1: each row exactly once
    found = []
    for p in packs:
        for seg in sorted(set(p["segment_ids"])):
            at = [i for i, s in enumerate(p["segment_ids"]) if s == seg]
            assert [p["position_ids"][i] for i in at] == list(range(len(at)))
            found.append((tuple(p["input_ids"][i] for i in at), tuple(p["labels"][i] for i in at)))
    assert sorted(found) == sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)
    shortest = pack_examples(rows[:1], 128)[0]  # one example: shorter than the full rows
    batch = packed.collate([packs[0], shortest])  # the collate pads positions and segments with 0
    pad = batch["attention_mask"][1] == 0
    assert pad.any() and (batch["segment_ids"][1][pad] == 0).all() and (batch["position_ids"][1][pad] == 0).all()
    assert batch["segment_ids"][1][~pad].tolist() == shortest["segment_ids"]


# ------------------------------------------------------------------------------------------------ generation


def test_kv_cache_and_left_padding_do_not_change_tokens() -> None:
    torch.manual_seed(0)
    model = build_model("debug", family="decoder").eval()
    prompts = [[5, 9, 17, 3, 44, 2], [7, 8], [100, 101, 102]]
    ids, mask = left_pad(prompts, 0)
    for beams in (1, 3):
        cfg = GenerationConfig(max_new_tokens=8, num_beams=beams)
        cached = generate(model, ids, mask, config=cfg)
        full = generate(model, ids, mask, config=GenerationConfig(max_new_tokens=8, num_beams=beams, use_cache=False))
        alone = [generate(model, torch.tensor([p]), config=cfg)[0].tolist() for p in prompts]
        assert torch.equal(cached, full)
        assert cached.tolist() == alone
    # Sampling draws from the generator given: the same seed reproduces the tokens, another gives other tokens
    # (the global RNG, reseeded between the calls, changes nothing); top_k=1 is greedy.
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    sample = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(7)
    first = generate(model, ids, mask, config=sample, generator=g(1))
    torch.manual_seed(8)
    assert torch.equal(first, generate(model, ids, mask, config=sample, generator=g(1)))
    torch.manual_seed(7)
    other = generate(model, ids, mask, config=sample, generator=g(2))
    assert first.shape == other.shape == (3, 6) and (first != other).float().mean() > 0.5, (first, other)
    top1 = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1)
    assert torch.equal(generate(model, ids, mask, config=top1, generator=g(2)),
                       generate(model, ids, mask, config=GenerationConfig(max_new_tokens=6)))
    assert strip_after_eos(torch.tensor([[4, 5, 9, 0], [9, 1, 1, 1]]), [9]) == [[4, 5], []]
    with pytest.raises(ValueError, match="LEFT-padded"):
        generate(model, torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]]))


@pytest.mark.parametrize("eos", [None, 39, 252])
def test_greedy_and_beam_search_match_transformers_generate(eos: int | None, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = build_model("debug", family="decoder").eval()
    save_hf(model, tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids, mask = left_pad([[5, 9, 17, 3, 44, 2], [7, 8], [100, 101, 102]], 0)
    for beams in (1, 3):
        ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams, do_sample=False,
                          pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:]
        ours = generate(model, ids, mask, config=GenerationConfig(max_new_tokens=10, num_beams=beams, eos_token_id=eos))
        cut = [eos] if eos is not None else []
        ref_rows = [r + ([eos] if eos in full else []) for r, full in zip(strip_after_eos(ref, cut), ref.tolist())]
        our_rows = [r + ([eos] if eos in full else []) for r, full in zip(strip_after_eos(ours, cut), ours.tolist())]
        print(f"eos={eos} beams={beams}: ours={our_rows} hf={ref_rows}")
        assert our_rows == ref_rows


# ------------------------------------------------------------------------------------------------ training


def test_val_loss_is_the_token_mean_of_the_split_at_any_batch_size(tmp_path: Path) -> None:
    """Replies of 1-9 tokens: val_loss is the mean over every labelled token of the split (perplexity's definition),
    the same at eval batch sizes 1, 3 and 32 (a mean of batch means weighted by rows differs with the batching)."""
    rng = random.Random(1)
    recs = [dict(r, output=r["input"][:rng.randint(1, 9)]) for r in _records(13)]
    path = tmp_path / "val.json"
    path.write_text(json.dumps(recs, ensure_ascii=False), encoding="utf-8")
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(0)
    task = CausalLMTask("debug", dropout=0.0).eval()
    got = {}
    for bs in (1, 3, 32):
        dm = InstructionDataModule(str(path), val_path=str(path), template="{instruction}{input}\n", cutoff_len=64,
                                   batch_size=bs)
        trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        got[bs] = trainer.validate(task, dm, verbose=False)[0]["val_loss"]
    total = count = 0.0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            logits = task.model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten(),
                                                       reduction="sum").item()
            count += int((batch["labels"] != -100).sum())
    print(f"val_loss at eval batch 1 / 3 / 32: {got}; token mean over the split {total / count:.6f}")
    assert all(abs(v - total / count) <= 1e-5 for v in got.values())


def test_overfit_32_examples_reaches_rouge_l_90(sft_file: Path, tmp_path: Path) -> None:
    pl.seed_everything(0)
    dm = InstructionDataModule(str(sft_file), val_path=str(sft_file), template="{instruction}{input}\n",
                               cutoff_len=128, batch_size=32, eval_batch_size=16)
    task = SFTTask("debug", dropout=0.0, generation=GenerationConfig(max_new_tokens=24),
                   optim=OptimConfig(lr=3e-3, warmup_steps=10, weight_decay=0.0),
                   predictions_path=str(tmp_path / "pred_{stage}.jsonl"))
    pl.Trainer(accelerator="cpu", max_steps=150, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0).fit(task, dm)
    evaluator = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    metrics = evaluator.validate(task, dm, verbose=False)[0]
    print({k: round(v, 3) for k, v in metrics.items()})
    assert metrics["val_rouge-l"] >= 90
    rows = [json.loads(x) for x in (tmp_path / "pred_val.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 32 and set(rows[0]) == {"prompt", "label", "prediction"}
    assert [r["label"] for r in rows] == [r["output"] for r in _records(32)]  # record order
    assert not list(tmp_path.glob(".*.tmp"))
    # predict: LLaMA-Factory metric names in <predictions>.metrics.json
    dm.paths["predict"] = str(sft_file)
    evaluator.predict(task, dm, return_predictions=False)
    pm = json.loads((tmp_path / "pred_predict.metrics.json").read_text())
    assert {"predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l",
            "predict_samples_per_second"} <= set(pm)
    assert pm["predict_rouge-l"] == pytest.approx(metrics["val_rouge-l"], abs=1e-3)


def _sft_args(out: Path, data: Path, *, batch: int, extra: list[str]) -> list[str]:
    return [
        "fit", "--seed_everything=1", "--model=lightning_llm.tasks.SFTTask", "--model.backbone=debug",
        "--model.dropout=0", "--model.generation.max_new_tokens=8", "--model.optim.lr=0.003",
        f"--model.predictions_path={out / 'pred_{stage}.jsonl'}",
        "--data=lightning_llm.data.InstructionDataModule", f"--data.train_path={data}", f"--data.val_path={data}",
        "--data.template=plain", "--data.cutoff_len=64", f"--data.batch_size={batch}",
        "--data.eval_batch_size=5", "--data.limit_examples=16",
        "--trainer.accelerator=cpu", "--trainer.max_steps=3", "--trainer.logger=CSVLogger",
        f"--trainer.logger.save_dir={out}", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.num_sanity_val_steps=0", f"--trainer.default_root_dir={out}",
        "--trainer.callbacks+=lightning_llm.testing.StepRecorder", f"--trainer.callbacks.output={out / 'steps.json'}",
        *extra,
    ]


@pytest.fixture(scope="module")
def sft_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The one-device reference run (batch 8) shared by the 2-process cases: (data file, run dir)."""
    root = tmp_path_factory.mktemp("sft_single")
    data = root / "train.json"
    data.write_text(json.dumps(_records(32), ensure_ascii=False), encoding="utf-8")
    assert main(_sft_args(root / "run", data, batch=8, extra=["--trainer.devices=1"])) == 0
    return data, root / "run"


# strategy flags -> per-rank batch (global batch 8: data-parallel ranks split it, tensor-parallel ranks share it)
SFT_STRATEGIES: dict[str, tuple[list[str], int]] = {
    "ddp": (["--trainer.strategy=ddp"], 4),
    "tp": (["--trainer.strategy=tp"], 8),
    "tp_sp": (["--trainer.strategy=lightning_llm.strategies.TensorParallelStrategy",
               "--trainer.strategy.sequence_parallel=true"], 8),
    "zero2": (["--trainer.strategy=zero2"], 4),
    "pp": (["--trainer.strategy=pp"], 8),  # generation decodes through the stages token by token
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(SFT_STRATEGIES))
def test_sft_two_processes_match_one_device_and_write_predictions_once(
        name: str, sft_single: tuple[Path, Path], tmp_path: Path) -> None:
    """3 SFT steps plus generation-scored validation on 2 processes: per-step loss of the global batch equals one
    device within 1e-5, the greedy predictions are identical, and they are written once, in record order."""
    data, single = sft_single
    flags, batch = SFT_STRATEGIES[name]
    multi = tmp_path / name
    run_cli(_sft_args(multi, data, batch=batch, extra=["--trainer.devices=2", *flags]), nproc=2)
    ref = json.loads((single / "steps.json").read_text())["losses"][0]
    ranks = json.loads((multi / "steps.json").read_text())["losses"]
    mean = [(a + b) / 2 for a, b in zip(*ranks)]  # data-parallel: each rank's half; tensor-parallel: both the same
    err = max(abs(a - b) for a, b in zip(ref, mean, strict=True))
    one = [json.loads(x) for x in (single / "pred_val.jsonl").read_text(encoding="utf-8").splitlines()]
    two = [json.loads(x) for x in (multi / "pred_val.jsonl").read_text(encoding="utf-8").splitlines()]
    same = sum(a["prediction"] == b["prediction"] for a, b in zip(one, two))
    print(f"{name}: single={ref}\n{name}={mean}\nmax_abs_err={err:.2e}; identical predictions {same}/{len(one)}")
    assert len(ref) == 3 and err <= 1e-5
    # 16 validation records over 2 ranks x batches of 5: padded duplicate rows are dropped, order kept.
    assert len(two) == 16 and [r["label"] for r in two] == [r["output"] for r in _records(16)]
    assert same == len(one) == 16
    rows = [r for r in csv.DictReader(next(multi.rglob("metrics.csv")).open()) if r.get("val_rouge-l")]
    assert rows and all(k in rows[0] for k in ("val_bleu-4", "val_rouge-1", "val_rouge-2", "val_samples_per_s"))
    ref_rows = [r for r in csv.DictReader(next(single.rglob("metrics.csv")).open()) if r.get("val_rouge-l")]
    assert [r["val_rouge-l"] for r in rows] == [r["val_rouge-l"] for r in ref_rows]
    # val_loss: the token mean of the split (each rank's eval batches weighted by their labelled tokens)
    val, ref_val = ([float(r["val_loss"]) for r in csv.DictReader(next(d.rglob("metrics.csv")).open())
                     if r.get("val_loss")] for d in (multi, single))
    print(f"{name}: val_loss {val} vs one device {ref_val}")
    assert val and max(abs(a - b) for a, b in zip(val, ref_val, strict=True)) <= 1e-5


