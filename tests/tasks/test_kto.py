"""KTO: the loss against trl's KTOTrainer formula written out in Python floats, the task's loss from logits and its KL
reference point against log-probs computed here from the model's logits, the unpaired data (KL rows' partners,
pairs unpaired, chat records, errors naming file and line), and configs/kto.yaml learning on generated data by
itself. The layouts: tests/tasks/test_preference_layouts.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.data import DataError, UnpairedPreferenceDataModule
from lightning_llm.rl.losses.kto import KTOConfig, kto_loss
from lightning_llm.tasks import KTOTask

REPO = Path(__file__).resolve().parents[2]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def trl_kto(policy: list[float], ref: list[float], good: list[bool], kl: float, *, beta: float, wd: float, wu: float,
            kind: str = "kto") -> float:
    """trl's KTOTrainer: the desirable losses and the undesirable losses, each weighted, concatenated, averaged."""
    chosen = [p - r for p, r, g in zip(policy, ref, good) if g]
    rejected = [p - r for p, r, g in zip(policy, ref, good) if not g]
    if kind == "kto":
        losses = [wd * (1 - sigmoid(beta * (u - kl))) for u in chosen] + \
                 [wu * (1 - sigmoid(beta * (kl - u))) for u in rejected]
    else:
        losses = [wd * (1 - sigmoid(beta * u)) for u in chosen] + [wu * sigmoid(beta * u) for u in rejected]
    return sum(losses) / len(losses)


@pytest.mark.parametrize(("kind", "kl"), [("kto", 0.7), ("kto", 0.0), ("apo_zero_unpaired", 0.7)])
def test_loss_matches_trl_formula_in_float64(kind: str, kl: float) -> None:
    g = torch.Generator().manual_seed(0)
    policy, ref = (-40 * torch.rand(12, generator=g, dtype=torch.float64) for _ in range(2))
    good = torch.rand(12, generator=g) < 0.4
    loss, rewards = kto_loss(policy, ref, good, kl, beta=0.2, desirable_weight=1.3, undesirable_weight=0.8,
                             loss_type=kind)  # type: ignore[arg-type]
    expected = trl_kto(policy.tolist(), ref.tolist(), good.tolist(), kl, beta=0.2, wd=1.3, wu=0.8, kind=kind)
    print(f"{kind} kl={kl}: |ours - trl formula| = {abs(float(loss) - expected):.1e}")
    assert abs(float(loss) - expected) <= 1e-12
    assert torch.equal(rewards, 0.2 * (policy - ref))


def _data(**kwargs: Any) -> UnpairedPreferenceDataModule:
    dm = UnpairedPreferenceDataModule(**{"generated_examples": 12, "generated_val_examples": 4, "cutoff_len": 28,
                                         "max_prompt_len": 12, **kwargs})
    dm.setup("fit")
    return dm


def _response(ids: list[int], labels: list[int]) -> list[int]:
    return [t for t in labels if t != -100]


def test_kl_rows_borrow_another_examples_completion() -> None:
    """Each example's KL row is its own prompt with the completion of one other example of its split; every
    completion is lent exactly once (a rotation of a seeded shuffle), the same for any batch."""
    dm = _data()
    rows = dm.split_dataset("fit")
    own = [_response(*row["chosen"]) for row in rows]
    lent = [_response(*row["rejected"]) for row in rows]
    partners = [own.index(r) for r in lent]
    assert sorted(partners) == list(range(len(rows))) and all(p != i for i, p in enumerate(partners))
    for row in rows:  # the prompt is the example's own: the tokens up to the first labelled position's
        (ids, labels), (kl_ids, kl_labels) = row["chosen"], row["rejected"]
        start, kl_start = (next(t for t, x in enumerate(lab) if x != -100) for lab in (labels, kl_labels))
        assert ids[:start + 1] == kl_ids[:kl_start + 1]
    batch = dm.collate([rows[i] for i in range(4)])
    assert batch["input_ids"].shape[0] == batch["kl_input_ids"].shape[0] == 4
    assert batch["desirable"].tolist() == [True, False, True, False] and batch["example_index"].tolist() == [0, 1, 2, 3]
    assert batch["attention_mask"][:, -1].any() and batch["kl_attention_mask"][:, -1].any()  # each padded to its own


@pytest.mark.parametrize("moved", ["reference", "policy"])
def test_task_loss_and_kl_against_logits_computed_here(moved: str) -> None:
    """``_prepared`` (reference and KL rows, on the fly) and ``loss_from_output`` after the reference (KL estimate >
    0) or the policy (< 0: clamped at 0) was moved by noise, against log-probs taken here from the policy's and the
    frozen reference's logits in float64."""
    torch.manual_seed(0)
    beta = 0.5
    task = KTOTask("debug", model_overrides={"num_layers": 1, "vocab_size": 264},
                   kto=KTOConfig(beta=beta, reference="on_the_fly"))
    task.configure_model()
    with torch.no_grad():  # noise makes a near-uniform model's log-probs of these rows lower
        for p in (task.reference.frozen if moved == "reference" else task.model).parameters():
            p.add_(0.05 * torch.randn_like(p))
    dm = _data()
    batch = dm.collate([dm.split_dataset("fit")[i] for i in range(6)])

    def logps(model: torch.nn.Module, prefix: str) -> list[float]:
        with torch.no_grad():
            logits = model(batch[prefix + "input_ids"], attention_mask=batch[prefix + "attention_mask"]).double()
        logp, labels = torch.log_softmax(logits, -1), batch[prefix + "labels"]
        return [sum(float(logp[r, t, labels[r, t]]) for t in range(labels.shape[1]) if labels[r, t] != -100)
                for r in range(labels.shape[0])]

    pol, ref = logps(task.model, ""), logps(task.reference.frozen, "")
    pol_kl, ref_kl = logps(task.model, "kl_"), logps(task.reference.frozen, "kl_")
    raw = sum(p - r for p, r in zip(pol_kl, ref_kl)) / 6
    prepared = task._prepared(batch, "fit")
    print(f"KL estimate {float(prepared['kl'][0]):.6f}, from logits here max(0, {raw:.6f})")
    assert abs(float(prepared["kl"][0]) - max(raw, 0.0)) <= 1e-4 and (raw > 0.05 if moved == "reference" else raw < 0)
    assert max(abs(a - b) for a, b in zip(prepared["ref_logps"].tolist(), ref)) <= 1e-4
    loss, outputs = task.loss_from_output(task.model(*task.model_inputs(prepared, "train")[0],
                                                     **task.model_inputs(prepared, "train")[1]), prepared, "train")
    expected = trl_kto(pol, ref, batch["desirable"].tolist(), max(raw, 0.0), beta=beta, wd=1.0, wu=1.0)
    print(f"KTO from the model: |ours - trl formula on logits here| = {abs(loss.item() - expected):.1e}")
    assert abs(loss.item() - expected) <= 1e-5
    assert max(abs(a - b) for a, b in zip(outputs["logps"].tolist(), pol)) <= 1e-4


def test_pairs_unpaired_and_chat_records(tmp_path: Path) -> None:
    path = tmp_path / "feedback.jsonl"
    recs = [{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}],
             "label": True},
            {"prompt": "3+3?", "completion": "seven", "label": False},
            {"prompt": "1+1?", "chosen": "2", "rejected": "eleven"}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    dm = _data(train_path=str(path), tokenizer_dir="byte", template="chatml", max_prompt_len=40, cutoff_len=64)
    rows = dm.split_dataset("fit")
    assert [row["label"] for row in rows] == [True, False, True, False] and dm.label_counts() == (2, 2)
    end_of_turn = dm.stop_token_ids[0]  # ChatML's <|im_end|>
    assert all(_response(*row["chosen"])[-1] == end_of_turn for row in rows)  # scored up to the end of the turn


@pytest.mark.parametrize(("lines", "error"), [
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "a", "completion": "c", "label": "false"}],
     r":2: field 'label' must be a JSON boolean \(true: desirable, false: undesirable\), got 'false'"),
    ([{"prompt": "a", "completion": "b", "label": 1}],
     r":1: field 'label' must be a JSON boolean"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "label": False}],
     r":2: missing field 'completion'"),
    ([{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": True}],
     r"feedback.jsonl: every training example is desirable \(label true\): KTO needs both"),
    ([{"prompt": "a", "completion": ["b"], "label": True}],
     r":1: field 'completion' must be a string without a chat template"),
])
def test_bad_feedback_files_name_file_and_line(tmp_path: Path, lines: list[dict[str, Any]], error: str) -> None:
    path = tmp_path / "feedback.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    with pytest.raises(DataError, match=rf"{path}{error}" if error.startswith(":") else error):
        UnpairedPreferenceDataModule(str(path)).setup("fit")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="desirable_weight .* must be > 0"):
        KTOConfig(desirable_weight=0.0)
    with pytest.raises(ValueError, match="loss_type must be kto or apo_zero_unpaired"):
        KTOConfig(loss_type="sigmoid")  # type: ignore[arg-type]


def test_config_learns_generated_feedback_by_itself(tmp_path: Path) -> None:
    """configs/kto.yaml as a user runs it (shortened): at step 0 the policy is the reference (rewards and kl 0, loss
    0.5); the held-out desirable completions' reward rises above the undesirable ones'."""
    import csv

    from lightning_llm.cli import main

    assert main(["fit", "--config", str(REPO / "configs" / "kto.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}",
                 "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
                 "--trainer.max_steps=12", "--trainer.val_check_interval=12", "--data.generated_examples=96",
                 "--data.generated_val_examples=16", "--model.optim.lr=0.003"]) == 0
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    first = next(r for r in rows if r.get("train_loss"))
    assert float(first["kl"]) == 0.0 and float(first["rewards/margins"]) == 0.0 and float(first["train_loss"]) == 0.5
    val = next(r for r in rows if r.get("val_rewards/margins"))
    print(f"KTO on generated feedback: val_rewards/chosen {float(val['val_rewards/chosen']):.3f}, "
          f"val_rewards/rejected {float(val['val_rewards/rejected']):.3f}, val_kl {float(val['val_kl']):.3f} after 12 "
          "steps")
    assert float(val["val_rewards/margins"]) > 0.5
    assert float(val["val_rewards/chosen"]) > 0 > float(val["val_rewards/rejected"])


@pytest.mark.parametrize("reference", ["precomputed", "on_the_fly"])
def test_apo_zero_unpaired_runs_no_reference_on_the_kl_rows(tmp_path: Path, reference: str) -> None:
    """``apo_zero_unpaired`` reads no KL row: the reference runs on the examples' rows only (counted: one row per
    example, where ``kto`` runs two) and no KL pass runs; the precomputed table holds the examples' reference log-probs
    kto computes (with the KL rows beside them) and marks the KL rows as never computed (NaN)."""
    import lightning.pytorch as pl

    from lightning_llm.testing import LoggedLoss, table_trainer

    def fit(loss_type: str) -> tuple[dict[bool, int], list[float], KTOTask]:
        pl.seed_everything(3)
        task = KTOTask("debug", model_overrides={"num_layers": 1},
                       kto=KTOConfig(beta=0.5, loss_type=loss_type, reference=reference))  # type: ignore[arg-type]
        rows = {True: 0, False: 0}  # reference / policy-without-gradient (KL) rows run
        passes = task.no_grad_logps

        def counted(batch: dict[str, torch.Tensor], *, reference: bool) -> torch.Tensor:
            rows[reference] += batch["input_ids"].shape[0]
            return passes(batch, reference=reference)

        task.no_grad_logps = counted  # type: ignore[method-assign]
        rec = LoggedLoss()
        dm = UnpairedPreferenceDataModule(generated_examples=16, generated_val_examples=4, cutoff_len=28,
                                          max_prompt_len=12, batch_size=4)
        table_trainer(tmp_path / loss_type, strategy="auto", devices=1, max_steps=3, callbacks=[rec]).fit(task, dm)
        return rows, rec.losses, task

    apo_rows, apo_losses, apo = fit("apo_zero_unpaired")
    kto_rows, _, kto = fit("kto")
    examples = 16 + 4 if reference == "precomputed" else 3 * 4  # every example once / each step's
    print(f"reference={reference}: rows through the reference: apo_zero_unpaired {apo_rows[True]}, kto "
          f"{kto_rows[True]}; KL passes {apo_rows[False]} / {kto_rows[False]}")
    assert apo_rows == {True: examples, False: 0}
    assert kto_rows[True] == 2 * examples and kto_rows[False] > 0
    if reference == "precomputed":
        table = apo.reference_table["fit"]
        assert table[:, 1].isnan().all() and table[:, 0].isfinite().all()
        assert (table[:, 0] - kto.reference_table["fit"][:, 0]).abs().max() <= 1e-5
    assert all(math.isfinite(x) for x in apo_losses) and len(apo_losses) == 3


def test_resume_of_apo_zero_unpaired_table_as_kto_is_refused(tmp_path: Path) -> None:
    """A table precomputed for ``apo_zero_unpaired`` holds no KL rows' reference (NaN): resumed with ``kto``, which
    reads them, it is refused in one line where the checkpoint is read, not trained on as NaN (or 0)."""
    import lightning.pytorch as pl

    from lightning_llm.testing import table_trainer

    def fit(loss_type: str, steps: int, resume: str | None) -> None:
        pl.seed_everything(3)
        task = KTOTask("debug", model_overrides={"num_layers": 1}, kto=KTOConfig(loss_type=loss_type))  # type: ignore[arg-type]
        dm = UnpairedPreferenceDataModule(generated_examples=8, generated_val_examples=4, cutoff_len=28,
                                          max_prompt_len=12, batch_size=4)
        table_trainer(tmp_path, strategy="auto", devices=1, max_steps=steps, callbacks=[],
                      save_every_step=True).fit(task, dm, ckpt_path=resume)

    fit("apo_zero_unpaired", 1, None)
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    with pytest.raises(ValueError, match=rf"^--ckpt_path={ckpt}: its precomputed reference log-probs lack the second "
                                         r"row of every example \(KTO's KL rows"):
        fit("kto", 2, ckpt)
