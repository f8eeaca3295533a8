"""DPO: the losses against trl's formulas written out in float64, the preference data (layout, masking, errors), the
task against one device under every layout (one torchrun launch), precomputed vs on-the-fly reference, resume, and
learning held-out preferences from the shared CSL titles."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import SHARED_DATA
from lightning_llm.data import DataError, PreferenceDataModule
from lightning_llm.rl.losses.dpo import DPOConfig, dpo_loss
from lightning_llm.tasks import DPOTask
from lightning_llm.testing import (
    LoggedLoss,
    gradient_summary,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
    two_rank_layout,
)

STEPS = 5
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero1", "zero2", "zero3", "deepspeed_zero2", "3d", "ddp/on_the_fly", "pp/on_the_fly",
           "zero3/on_the_fly"]
CSL = SHARED_DATA / "csl_title"


# ------------------------------------------------------------------------------------------------ formulas
def _trl_reference(pc: list[float], pr: list[float], rc: list[float], rr: list[float], *, beta: float, kind: str,
                   ls: float = 0.0) -> float:
    """trl's DPOTrainer.dpo_loss per pair, in Python floats (float64), averaged."""
    def logsigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))

    losses = []
    for a, b, c, d in zip(pc, pr, rc, rr):
        logits = (a - b) - (c - d)  # pi_logratios - ref_logratios
        if kind == "sigmoid":
            losses.append(-logsigmoid(beta * logits) * (1 - ls) - logsigmoid(-beta * logits) * ls)
        else:  # ipo
            losses.append((logits - 1 / (2 * beta)) ** 2)
    return sum(losses) / len(losses)


@pytest.mark.parametrize(("kind", "beta", "ls"), [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.3, 0.0)])
def test_losses_match_trl_formulas_in_float64(kind: str, beta: float, ls: float) -> None:
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-30 * torch.rand(16, generator=g, dtype=torch.float64) for _ in range(4))
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=kind, label_smoothing=ls)  # type: ignore[arg-type]
    ref = _trl_reference(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta=beta, kind=kind, ls=ls)
    print(f"{kind} beta={beta} ls={ls}: |ours - trl formula| = {abs(float(loss) - ref):.1e}")
    assert abs(float(loss) - ref) <= 1e-12
    assert torch.allclose(stats.chosen_rewards, beta * (pc - rc), atol=0, rtol=0)
    acc = float(stats.means()["rewards/accuracies"])
    assert acc == sum(float(beta * (a - c)) > float(beta * (b - d)) for a, b, c, d in zip(pc, pr, rc, rr)) / 16


def test_task_loss_pairs_interleaved_rows_and_masks_the_prompt() -> None:
    """loss_from_output on random logits vs the loss assembled by hand from per-token log-softmax (float64)."""
    task = DPOTask("debug", dpo=DPOConfig(beta=0.2, loss_type="ipo"))
    dm = PreferenceDataModule(generated_pairs=4, generated_val_pairs=0, cutoff_len=24, max_prompt_len=12)
    dm.setup("fit")
    batch = dm.collate([dm.split_dataset("fit")[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 6 and batch["pair_index"].tolist() == [0, 0, 1, 1, 2, 2]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch["input_ids"].shape, 259, dtype=torch.float64, generator=g)
    batch["ref_logps"] = -5 * torch.rand(6, dtype=torch.float64, generator=g)
    loss, _ = task.loss_from_output(logits, batch, "train")
    logp = torch.log_softmax(logits, -1)
    seq, n = [], []
    for row in range(6):
        lab = batch["labels"][row]
        keep = (lab != -100).nonzero().flatten().tolist()
        assert keep and batch["attention_mask"][row, keep[0]] == 1  # only response positions are scored
        seq.append(sum(float(logp[row, t, lab[t]]) for t in keep))
        n.append(len(keep))
    avg = [s / k for s, k in zip(seq, n)]
    ref = [float(r) / k for r, k in zip(batch["ref_logps"], n)]
    expected = _trl_reference(avg[0::2], avg[1::2], ref[0::2], ref[1::2], beta=0.2, kind="ipo")
    assert abs(float(loss) - expected) <= 1e-6 * max(1.0, abs(expected))  # the task's log-softmax runs in fp32


def test_reference_rows_place_the_table_on_the_batches_device_once() -> None:
    """The precomputed table (kept on the host, as the checkpoint holds it) is copied to the batches' device once per
    table, not every step; a new table (a precompute, a checkpoint read) is copied anew. ("meta" stands in for the
    accelerator.)"""
    task = DPOTask("debug", model_overrides={"num_layers": 1})
    task.reference_table["fit"] = torch.arange(8.0).view(4, 2)
    index = torch.tensor([3, 1], device="meta")
    moved = []
    to = torch.Tensor.to

    def counting_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        moved.append(self.shape)
        return to(self, *args, **kwargs)

    torch.Tensor.to = counting_to  # type: ignore[method-assign]
    try:
        rows = [task.reference_rows("fit", index) for _ in range(3)]
        task.reference_table["fit"] = torch.zeros(5, 2)
        rows.append(task.reference_rows("fit", index))
    finally:
        torch.Tensor.to = to  # type: ignore[method-assign]
    assert moved == [torch.Size([4, 2]), torch.Size([5, 2])]
    assert all(r.device.type == "meta" and r.shape == (2, 2) for r in rows)
    assert torch.equal(task.reference_rows("fit", torch.tensor([4, 0])), torch.zeros(2, 2))  # same device: no copy


def test_preference_file_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n"
                   + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:2: missing field 'rejected'"):
        PreferenceDataModule(str(bad)).setup("fit")
    bad.write_text(json.dumps({"prompt": "", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:1: empty prompt"):
        PreferenceDataModule(str(bad)).setup("fit")
    with pytest.raises(ValueError, match="--model.dpo.beta must be > 0"):
        DPOConfig(beta=0)
    with pytest.raises(ValueError, match="cutoff_len"):
        PreferenceDataModule(cutoff_len=8, max_prompt_len=8)


# ------------------------------------------------------------------------------------------------ layouts
class Logged(LoggedLoss):
    """Also the logged reward margin and accuracy per step (named, the first step's gradients too: the harness
    compares them with the one-device run named ``reference``)."""

    def __init__(self, grads: str | None = None, reference: str | None = None) -> None:
        super().__init__(grads, reference)
        self.margins: list[float] = []
        self.frozen_bytes = 0  # of the task's frozen models (a full fine-tune's on_the_fly reference) on this rank

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        super().on_train_start(trainer, pl_module)
        self.frozen_bytes = sum(model_state_bytes(m, [])["params"] for m in pl_module.frozen_models().values())

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        self.margins.append(float(trainer.callback_metrics.get("rewards/margins", float("nan"))))


def counted_reference_rows(task: Any) -> list[int]:
    """The rows of each batch this rank runs through the reference precompute of ``task``, appended as it runs."""
    rows: list[int] = []
    logps = task._reference_logps
    task._reference_logps = lambda batch, both: rows.append(batch["input_ids"].shape[0]) or logps(batch, both)
    return rows


def check_reference_table(name: str, layout: str, row: dict[str, Any], ref: dict[str, Any]) -> None:
    """A layout's precomputed table (``row["table"]``, 64 training and 8 validation items, two rows each) is one
    device's, each data-parallel replica of 2 running half of its rows (tp, pp, 3d: one replica, every row)."""
    table_err = max_abs_err(sum(row["table"], []), sum(ref["table"], []))
    replicas = 1 if layout in ("tp", "pp", "3d") else 2
    print(f"{name}: max |reference table - one device's| {table_err:.2e}; rows run by this rank "
          f"{row['precomputed_rows']} (one device {ref['precomputed_rows']})")
    assert table_err <= TOL and ref["precomputed_rows"] == 2 * (64 + 8)
    assert row["precomputed_rows"] == ref["precomputed_rows"] // replicas


def _fit(layout: str, devices: int, out: Path, *, reference: str = "precomputed", resume: str | None = None,
         steps: int = STEPS) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(5)
    task = DPOTask("debug", model_overrides={"num_layers": 2}, dpo=DPOConfig(beta=0.5, reference=reference),
                   optim=OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0))
    dm = PreferenceDataModule(generated_pairs=64, generated_val_pairs=8, cutoff_len=32, max_prompt_len=16,
                              batch_size=batch)
    rows = counted_reference_rows(task)
    # a fit from scratch records its first step's gradients, named by its run (one device: by its reference kind)
    run = reference if devices == 1 else f"{out.name}/{reference}"
    rec = Logged(grads=None if resume else run, reference=reference)
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=[rec],
                            save_every_step=True)
    trainer.fit(task, dm, ckpt_path=resume)
    table = task.reference_table.get("fit")
    return {"losses": rec.losses, "margins": rec.margins, "ckpt": str(out / "ckpt" / "last.ckpt"),
            "frozen_bytes": rec.frozen_bytes, "table": table.tolist() if table is not None else None,
            "precomputed_rows": sum(rows)}


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({"precomputed": _fit("1", 1, out / "ref"),
                                                        "on_the_fly": _fit("1", 1, out / "ref-fly",
                                                                           reference="on_the_fly")}))
        return
    results = {}
    for layout in LAYOUTS:
        name, _, reference = layout.partition("/")
        results[layout] = gathered(_fit(name, 2, out / layout.replace("/", "-"), reference=reference or "precomputed"))
    # Resume at another layout: 3 steps under zero3, then to STEPS under pp (the precomputed table comes along).
    _fit("zero3", 2, out / "resume", steps=3)
    results["zero3->pp resume"] = gathered(_fit("pp", 2, out / "resume", resume=str(out / "resume" / "ckpt" /
                                                                                     "last.ckpt")))
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dpo")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS, "zero3->pp resume"])
def test_layout_matches_one_device(runs: Path, layout: str) -> None:
    ref_all = json.loads((runs / "reference.json").read_text())
    ref = ref_all["on_the_fly" if layout.endswith("on_the_fly") else "precomputed"]
    assert max_abs_err(ref_all["on_the_fly"]["losses"], ref_all["precomputed"]["losses"]) <= TOL
    assert ref["margins"][-1] > ref["margins"][0] + 0.1  # it learns: the implicit reward margin grows
    for row in json.loads((runs / "layouts.json").read_text())[layout]:
        losses = row["losses"]
        if layout.endswith("resume"):  # from the checkpoint's table: no reference row run again
            assert len(losses) == STEPS - 3 and row["precomputed_rows"] == 0
            err = max_abs_err(losses, ref["losses"][3:])
        else:
            err = max(max_abs_err(losses, ref["losses"]), max_abs_err(row["margins"], ref["margins"]))
        grads = "" if layout.endswith("resume") else "; " + gradient_summary(runs, "{}/{}".format(
            layout.replace("/", "-"), "on_the_fly" if layout.endswith("on_the_fly") else "precomputed"))
        print(f"{layout}: max |train_loss, rewards/margins - one device| over {len(losses)} steps = {err:.2e}; "
              f"frozen reference bytes {row['frozen_bytes']:,} (one device: {ref['frozen_bytes']:,}){grads}")
        assert err <= TOL, (losses, ref["losses"])
        if row["table"] is not None and not layout.endswith("resume"):
            check_reference_table(layout, layout, row, ref)
        if layout.endswith("on_the_fly"):  # a full fine-tune's reference copy, placed like the policy
            assert ref["frozen_bytes"] > 0
            assert row["frozen_bytes"] <= (ref["frozen_bytes"] if layout.startswith("ddp") else
                                           0.55 * ref["frozen_bytes"]), (layout, row["frozen_bytes"])


def test_resume_refuses_a_reference_table_of_other_pairs(tmp_path: Path) -> None:
    """Precomputed reference log-probs are looked up by pair index: resuming on other pairs of the same count would
    pair every example with another's reference, so it is refused where the checkpoint's table is read, in one line
    naming the checkpoint, the data file's line of the first pair that differs, and nothing recomputed."""
    import lightning.pytorch as pl

    from lightning_llm.data.preference import make_preference_pairs

    pairs = tmp_path / "pairs.jsonl"
    records = make_preference_pairs(16, seed=1)
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    precomputed: list[str] = []

    def fit(resume: str | None, steps: int) -> None:
        pl.seed_everything(5)
        task = DPOTask("debug", model_overrides={"num_layers": 1})
        passes = task.precompute_reference
        task.precompute_reference = lambda split: precomputed.append(split) or passes(split)  # type: ignore[method-assign]
        dm = PreferenceDataModule(str(pairs), val_fraction=0.25, cutoff_len=24, max_prompt_len=12, batch_size=4)
        table_trainer(tmp_path, strategy="auto", devices=1, max_steps=steps, callbacks=[],
                      save_every_step=True).fit(task, dm, ckpt_path=resume)

    fit(None, 1)
    assert precomputed == ["fit", "validate"]
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    fit(ckpt, 2)  # the same pairs: resumes, the table from the checkpoint
    assert precomputed == ["fit", "validate"]
    held_out = PreferenceDataModule(str(pairs), val_fraction=0.25)
    held_out.setup("fit")
    line = int(held_out.record_name("fit", 2).rsplit(":", 1)[1])  # the file line of training pair 2
    records[line - 1] = {**records[line - 1], "chosen": records[line - 1]["chosen"] + "!"}
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError) as error:
        fit(ckpt, 3)
    print(error.value)
    assert str(error.value).startswith(f"--ckpt_path={ckpt}: its precomputed reference log-probs were computed on "
                                       "other fit pairs than the datamodule holds")
    assert f"the first that differs is pair 2 ({pairs}:{line})" in str(error.value) and "\n" not in str(error.value)
    assert precomputed == ["fit", "validate"]  # nothing recomputed on resume


# ------------------------------------------------------------------------------------------------ real data
@pytest.mark.recipe
@pytest.mark.skipif(not (CSL / "dev.json").is_file(), reason="needs ../shared/data/csl_title")
def test_csl_pairs_held_out_accuracy_from_ties_to_above_0_9(tmp_path: Path) -> None:
    """Real CSL titles as chosen, corrupted titles as rejected; held-out pairs (test.json) scored in validation."""
    import csv

    from lightning_llm.cli import main
    from lightning_llm.data.preference import main as make_pairs

    assert make_pairs(["--csl", str(CSL), "--out", str(tmp_path / "pairs")]) == 0
    config = Path(__file__).resolve().parents[2] / "configs" / "dpo.yaml"
    vocab = CSL.parent / "tokenizers" / "bert-base-chinese"
    assert main(["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={tmp_path}",
                 "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
                 "--trainer.max_steps=40", "--trainer.val_check_interval=20",
                 f"--data.train_path={tmp_path / 'pairs' / 'train.jsonl'}",
                 f"--data.val_path={tmp_path / 'pairs' / 'val.jsonl'}", f"--data.tokenizer_dir={vocab}",
                 "--data.limit_examples=320", "--data.max_prompt_len=16", "--data.cutoff_len=48",
                 "--data.batch_size=16", "--data.eval_batch_size=64", "--model.optim.lr=0.002"]) == 0
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    first = next(float(r["rewards/accuracies"]) for r in rows if r.get("rewards/accuracies"))
    val = [float(r["val_rewards/accuracies"]) for r in rows if r.get("val_rewards/accuracies")]
    print(f"CSL pairs: rewards/accuracies {first:.3f} at step 0 (policy = reference: every pair a tie) -> held-out "
          f"val_rewards/accuracies {val[-1]:.3f} after 40 steps")
    assert first == 0.0 and val[-1] >= 0.9


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
