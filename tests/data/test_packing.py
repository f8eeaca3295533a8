"""Packing without contamination, on one device (the layouts: ``tests/data/test_packing_layouts.py``).

* :func:`pack_examples`: every example exactly once, whole, in one segment with positions 0..n-1; best-fit decreasing
  packs denser than filling rows in order; bad rows refused by index.
* A packed batch against an independent reference, transformers' own model run on each example alone (LLaMA, Qwen2
  with a sliding window on one layer, Mistral with a window on every layer, GPT-2's learned positions): each example's
  loss and each example's own gradient (``d loss_k / d params``, mapped to HF names by ``save_hf``) within 1e-5, fp32;
  the fused loss and the logits path both.
* The old contaminating behaviour fails it: without ``segment_ids`` another example's tokens change a loss.
* SFT with ``--data.packing=true`` trains exactly as without it (whole dataset per step: same examples, same loss).
* Prompt-learning wrappers refuse packed rows, and so does a task whose ``model_inputs`` drops the segments.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.data import InstructionDataModule, pack_examples
from lightning_llm.models import build_model, load_hf, save_hf

transformers = pytest.importorskip("transformers")

TOL = 1e-5
VOCAB = 96


def _examples(lengths: list[int], *, seed: int = 0, vocab: int = VOCAB) -> list[dict[str, list[int]]]:
    """Examples of the given lengths: random tokens, pre-shifted labels, the first two targets masked (a prompt)."""
    rng = random.Random(seed)
    out = []
    for n in lengths:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        labels = ids[1:] + [-100]
        labels[: min(2, n - 1)] = [-100] * min(2, n - 1)
        out.append({"input_ids": ids, "labels": labels})
    return out


def _segments(row: dict[str, list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input_ids, labels) of each segment of a packed row, checking its positions restart at 0."""
    found = []
    for seg in sorted(set(row["segment_ids"])):
        at = [i for i, s in enumerate(row["segment_ids"]) if s == seg]
        assert at == list(range(at[0], at[0] + len(at)))  # contiguous
        assert [row["position_ids"][i] for i in at] == list(range(len(at)))
        found.append((tuple(row["input_ids"][i] for i in at), tuple(row["labels"][i] for i in at)))
    assert sorted(set(row["segment_ids"])) == list(range(1, len(found) + 1))
    return found


# ------------------------------------------------------------------------------------------------ pack_examples


def test_pack_examples_keeps_every_example_whole_once() -> None:
    rng = random.Random(1)
    rows = _examples([rng.randint(1, 40) for _ in range(300)], seed=2)
    packed = pack_examples(rows, 64)
    assert packed == pack_examples(rows, 64)  # deterministic
    assert all(len(p["input_ids"]) <= 64 for p in packed)
    assert all(len(p[k]) == len(p["input_ids"]) for p in packed for k in ("labels", "position_ids", "segment_ids"))
    found = [seg for p in packed for seg in _segments(p)]
    assert sorted(found) == sorted((tuple(r["input_ids"]), tuple(r["labels"])) for r in rows)
    tokens = sum(len(r["input_ids"]) for r in rows)
    assert len(packed) <= tokens // 64 + 2  # near-optimal: at most 2 rows above the lower bound here


def test_best_fit_decreasing_packs_denser_than_in_order_and_keeps_input_order() -> None:
    rows = _examples([6, 5, 5, 4])
    packed = pack_examples(rows, 10)  # in order: [6] [5, 5] [4] = 3 rows; best fit decreasing: [6, 4] [5, 5]
    assert [p["segment_ids"] for p in packed] == [[1] * 6 + [2] * 4, [1] * 5 + [2] * 5]
    assert packed[0]["input_ids"] == rows[0]["input_ids"] + rows[3]["input_ids"]  # input order within a row


def test_pack_examples_refuses_bad_rows() -> None:
    with pytest.raises(ValueError, match=r"row 1 has 11 tokens, more than max_len=10"):
        pack_examples(_examples([3, 11]), 10)
    with pytest.raises(ValueError, match=r"row 0 has 3 input_ids but 2 labels"):
        pack_examples([{"input_ids": [1, 2, 3], "labels": [1, 2]}], 10)
    with pytest.raises(ValueError, match=r"row 0 is empty"):
        pack_examples([{"input_ids": [], "labels": []}], 10)


# ------------------------------------------------------------------------------------------------ model


def _perturbed(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _hf_cfg(cls: Any, **kw: Any) -> Any:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64, attn_implementation="eager")
    return cls(**{**base, **kw})


HF_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: transformers.LlamaForCausalLM(_hf_cfg(transformers.LlamaConfig)),
    # window 4 on layer 1 only (max_window_layers=1), tied head
    "qwen2_sliding": lambda: transformers.Qwen2ForCausalLM(_hf_cfg(
        transformers.Qwen2Config, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(_hf_cfg(transformers.MistralConfig, sliding_window=4)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager")),
}


def _collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded packed rows (positions and segments padded with 0), as the SFT collate pads them."""
    longest = max(len(r["input_ids"]) for r in rows)
    pads = {"input_ids": 0, "labels": -100, "position_ids": 0, "segment_ids": 0}
    batch = {k: torch.tensor([r[k] + [v] * (longest - len(r[k])) for r in rows]) for k, v in pads.items()}
    batch["attention_mask"] = (batch["segment_ids"] > 0).long()
    return batch


def _example_losses(token_losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Mean labelled-token loss of each example (row by row, segment by segment) from per-token losses [B, S]."""
    out = []
    for b in range(token_losses.shape[0]):
        for seg in batch["segment_ids"][b].unique().tolist():
            if seg == 0:
                continue
            at = (batch["segment_ids"][b] == seg) & (batch["labels"][b] != -100)
            out.append(token_losses[b][at].sum() / at.sum())
    return out


def _grads_as_hf(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """``model``'s gradients under the HF checkpoint's names: a copy holding them as weights, written by
    ``save_hf`` (every mapping is linear: transposes, concatenations)."""
    holder = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, q) in zip(holder.named_parameters(), model.named_parameters(), strict=True):
            p.copy_(q.grad)
    save_hf(holder, directory)
    from safetensors.torch import load_file

    return {k: v for f in directory.glob("*.safetensors") for k, v in load_file(str(f)).items()}


def _hf_example(ref: nn.Module, example: dict[str, list[int]]) -> torch.Tensor:
    """The example alone through transformers: its mean labelled-token cross-entropy."""
    ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"])
    logits = ref(input_ids=ids).logits[0]
    return F.cross_entropy(logits, labels, ignore_index=-100)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_packed_losses_and_gradients_equal_each_example_alone_in_transformers(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _perturbed(HF_FAMILIES[family](), seed=3)
        ref.save_pretrained(tmp_path / "src")
    ours, _ = load_hf(tmp_path / "src")
    examples = _examples([7, 12, 5, 9, 3, 10], seed=4)  # longer than the window (4); 3 rows of <= 20
    packed = pack_examples(examples, 20)
    assert len(packed) == 3 and all(len(set(p["segment_ids"])) == 2 for p in packed)  # 2 examples in every row
    batch = _collate(packed)
    order = [ex for p in packed for ex in _segments(p)]  # the examples in the order _example_losses visits them
    index = [next(i for i, e in enumerate(examples) if (tuple(e["input_ids"]), tuple(e["labels"])) == o)
             for o in order]
    kw = {k: batch[k] for k in ("attention_mask", "position_ids", "segment_ids")}

    fused = _example_losses(ours(batch["input_ids"], labels=batch["labels"], reduction="none", **kw), batch)
    logits = ours(batch["input_ids"], **kw)
    eager = _example_losses(F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none"), batch)
    want = [_hf_example(ref, examples[i]) for i in index]
    loss_err = max(max(abs(a.item() - w.item()), abs(b.item() - w.item())) for a, b, w in zip(fused, eager, want))

    grad_err = 0.0
    for k, (loss, w) in enumerate(zip(fused, want)):  # each example's own gradient: packed vs alone
        ours.zero_grad()
        ref.zero_grad()
        loss.backward(retain_graph=True)
        w.backward()
        got = _grads_as_hf(ours, tmp_path / f"g{k}")
        hf = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert set(hf) <= set(got)
        grad_err = max(grad_err, max((got[n] - g).abs().max().item() for n, g in hf.items()))
    print(f"{family}: {len(examples)} examples in {len(packed)} rows; max |loss - transformers alone| "
          f"{loss_err:.2e}, max |d loss_k - transformers alone| {grad_err:.2e}")
    assert loss_err <= TOL and grad_err <= TOL


def test_changing_one_example_leaves_the_others_in_its_row_unchanged() -> None:
    """Would fail under the old packing (one causal mask over the row, positions running on): shown below."""
    torch.manual_seed(0)
    model = build_model("debug", family="decoder", dropout=0.0).eval()
    examples = _examples([9, 7, 8], vocab=256)
    edited = copy.deepcopy(examples)
    edited[0]["input_ids"] = [(t + 17) % 250 + 3 for t in edited[0]["input_ids"]]
    losses = {}
    for name, exs in (("original", examples), ("edited", edited)):
        batch = _collate(pack_examples(exs, 64))
        assert batch["segment_ids"].tolist() == [[1] * 9 + [2] * 7 + [3] * 8]
        with torch.no_grad():
            kw = {k: batch[k] for k in ("attention_mask", "position_ids", "segment_ids")}
            losses[name] = _example_losses(model(batch["input_ids"], labels=batch["labels"], reduction="none", **kw),
                                           batch)
            old = model(batch["input_ids"], labels=batch["labels"], reduction="none")  # no segments: contaminated
            losses[name + "/old"] = _example_losses(old, batch)
    assert abs(float(losses["original"][0] - losses["edited"][0])) > 1e-2  # the edit matters to its own example
    for k in (1, 2):
        assert float(losses["original"][k]) == float(losses["edited"][k])
        assert abs(float(losses["original/old"][k] - losses["edited/old"][k])) > 1e-3


def test_padding_segment_is_finite_and_positions_follow_segments() -> None:
    from lightning_llm.models.layers.masks import segment_positions

    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 3, 3, 3]])
    assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 0, 1, 2, 0, 1, 2]]
    model = build_model("debug-mistral", family="decoder", dropout=0.0, sliding_window=2).eval()
    ids = torch.randint(3, 256, seg.shape)
    with torch.no_grad():
        derived = model(ids, segment_ids=seg)  # positions derived from the segments
        given = model(ids, segment_ids=seg, position_ids=segment_positions(seg))
    assert torch.isfinite(derived).all() and torch.equal(derived, given)
    with pytest.raises(ValueError, match="segment_ids"):
        model(ids, segment_ids=seg, attention_mask=torch.ones(2, 1, 7, 7, dtype=torch.bool))


def test_prompt_learning_refuses_packed_rows() -> None:
    from lightning_llm.peft.prompt import build_prompt_model

    base = build_model("debug", family="decoder", dropout=0.0)
    batch = _collate(pack_examples(_examples([5, 4], vocab=256), 16))
    for method in ("prompt_tuning", "prefix_tuning"):
        wrapped = build_prompt_model(base, method, 4, options={}, prompt_init="random")
        with pytest.raises(ValueError, match=rf"peft.method={method} cannot train on packed rows .*packing=false"):
            wrapped(batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"])


def test_a_task_whose_model_inputs_drop_the_segments_is_refused() -> None:
    from lightning_llm.tasks import CausalLMTask

    class OwnInputs(CausalLMTask):  # a user task written before packing kept examples apart
        def model_inputs(self, batch: dict[str, Any], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (batch["input_ids"],), {"attention_mask": batch["attention_mask"]}

    task = OwnInputs("debug")
    task.model = build_model("debug", family="decoder")
    batch = _collate(pack_examples(_examples([5, 4], vocab=256), 16))
    with pytest.raises(ValueError, match=r"OwnInputs.model_inputs\(\) drops the batch's segment_ids"):
        task.compute_loss(batch, "train")
    del batch["segment_ids"], batch["position_ids"]  # unpacked rows: as before
    assert torch.isfinite(task.compute_loss(batch, "train")[0])


# ------------------------------------------------------------------------------------------------ SFT


def _sft_file(path: Path, lengths: list[int], seed: int = 0) -> Path:
    """Alpaca records whose byte-tokenized rows ('{instruction}\\n' + output + EOS) have exactly ``lengths`` tokens."""
    rng = random.Random(seed)
    recs = []
    for n in lengths:
        a = n // 2 - 1
        recs.append({"instruction": "".join(rng.choice("abcdefgh") for _ in range(a)),
                     "output": "".join(rng.choice("stuvwxyz") for _ in range(n - a - 2))})
    path.write_text(json.dumps(recs))
    return path


def _sft_losses(data: Path, *, packing: bool, out: Path) -> tuple[list[float], int]:
    from lightning_llm.tasks import OptimConfig, SFTTask
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(5)
    dm = InstructionDataModule(str(data), tokenizer_dir="byte", template="{instruction}\n", cutoff_len=64,
                               packing=packing, batch_size=16)  # every row in one batch: a step sees all examples
    task = SFTTask("debug", dropout=0.0, generate_in=[], optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    rec = LoggedLoss()
    table_trainer(out, strategy="auto", devices=1, max_steps=3, callbacks=[rec]).fit(task, dm)
    return rec.losses, len(dm.datasets["fit"])


def test_sft_with_packing_trains_like_without(tmp_path: Path) -> None:
    data = _sft_file(tmp_path / "train.json", [50, 40, 35, 30, 30, 29, 24, 14])
    plain, n_plain = _sft_losses(data, packing=False, out=tmp_path / "plain")
    packed, n_packed = _sft_losses(data, packing=True, out=tmp_path / "packed")
    err = max(abs(a - b) for a, b in zip(plain, packed, strict=True))
    print(f"SFT: {n_plain} rows unpacked, {n_packed} packed; train_loss {plain} vs {packed}: max err {err:.2e}")
    assert (n_plain, n_packed) == (8, 4) and plain[0] - plain[-1] > 0.05
    assert err <= TOL
