"""The preference losses beyond sigmoid DPO and IPO: trl's other DPO loss types, SimPO and ORPO, each against its
formula written out here in Python floats (float64); the task's losses from logits (length averages over the response
tokens, EOS included; ORPO's NLL a token mean over the batch's chosen responses, exact over any split of the pairs);
SimPO and ORPO building, precomputing and running no reference at all (full fine-tune and LoRA, training and
validation). The layouts: tests/tasks/test_preference_layouts.py."""

from __future__ import annotations

import math
from pathlib import Path

import mpmath
import pytest
import torch

from lightning_llm.data import PreferenceDataModule
from lightning_llm.rl.losses.dpo import DPOConfig, dpo_loss, log1mexp, orpo_loss, simpo_loss
from lightning_llm.tasks import DPOTask


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return math.exp(logsigmoid(x))


def reference_loss(kind: str, pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """One pair's loss as trl's DPOTrainer defines it (loss types with a reference)."""
    uc, ur = pc - rc, pr - rr
    h = uc - ur
    return {
        "sigmoid": lambda: -(1 - eps) * logsigmoid(beta * h) - eps * logsigmoid(-beta * h),
        "hinge": lambda: max(0.0, 1 - beta * h),
        "robust": lambda: (-(1 - eps) * logsigmoid(beta * h) + eps * logsigmoid(-beta * h)) / (1 - 2 * eps),
        "bco_pair": lambda: -logsigmoid(beta * uc) - logsigmoid(-beta * ur),
        "apo_zero": lambda: (1 - sigmoid(beta * uc)) + sigmoid(beta * ur),
        "apo_down": lambda: sigmoid(beta * uc) + (1 - sigmoid(beta * (uc - ur))),
        "sppo_hard": lambda: (uc - 0.5 / beta) ** 2 + (ur + 0.5 / beta) ** 2,
        "nca_pair": lambda: -logsigmoid(beta * uc) - 0.5 * logsigmoid(-beta * uc) - 0.5 * logsigmoid(-beta * ur),
    }[kind]()


def _random(n: int, seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-scale * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(4)]


@pytest.mark.parametrize(("kind", "eps"), [("hinge", 0.0), ("robust", 0.2), ("bco_pair", 0.0), ("apo_zero", 0.0),
                                           ("apo_down", 0.0), ("sppo_hard", 0.0), ("nca_pair", 0.0),
                                           ("sigmoid", 0.1)])
def test_reference_losses_match_trl_formulas_in_float64(kind: str, eps: float) -> None:
    pc, pr, rc, rr = _random(16, 0, 8.0)
    beta = 0.3
    loss, stats = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=kind, label_smoothing=eps)  # type: ignore[arg-type]
    expected = sum(reference_loss(kind, *map(float, v), beta, eps) for v in zip(pc, pr, rc, rr)) / 16
    print(f"{kind}: |ours - formula| = {abs(float(loss) - expected):.1e}")
    assert abs(float(loss) - expected) <= 1e-12
    assert torch.equal(stats.rejected_rewards, beta * (pr - rr))


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (0.1, 1.4, 0.2)])
def test_simpo_matches_trl_cpo_formula(beta: float, gamma: float, eps: float) -> None:
    """trl's CPOTrainer with loss_type=simpo, cpo_alpha=0: logits = (ac - ar) - gamma / beta, then the smoothed
    sigmoid loss of beta * logits; rewards beta * ac, beta * ar."""
    ac, ar, _, _ = _random(16, 1, 3.0)
    loss, stats = simpo_loss(ac, ar, beta=beta, gamma=gamma, label_smoothing=eps)
    per = [-(1 - eps) * logsigmoid(beta * ((a - r) - gamma / beta)) - eps * logsigmoid(-beta * ((a - r) - gamma / beta))
           for a, r in zip(ac.tolist(), ar.tolist())]
    assert abs(float(loss) - sum(per) / 16) <= 1e-12
    assert torch.equal(stats.chosen_rewards, beta * ac) and torch.equal(stats.chosen_logps, ac)
    assert float(stats.means()["rewards/accuracies"]) == sum(a > r for a, r in zip(ac.tolist(), ar.tolist())) / 16


def test_orpo_matches_trl_formula_and_log1mexp_is_stable() -> None:
    """ORPO: nll - beta * mean(log sigmoid(log odds)), log odds = (ac - ar) - (log(1 - e^ac) - log(1 - e^ar))."""
    ac, ar, nll, _ = _random(16, 2, 4.0)
    ac[0], ar[1] = -1e-9, -60.0  # where log(1 - e^x) cancels, and where e^x underflows nothing
    beta = 0.25
    loss, stats = orpo_loss(ac, ar, -nll, beta=beta)
    odds = [(a - r) - (math.log(-math.expm1(a)) - math.log(-math.expm1(r))) for a, r in zip(ac.tolist(), ar.tolist())]
    expected = sum(-n - beta * logsigmoid(o) for n, o in zip(nll.tolist(), odds)) / 16
    print(f"orpo: |ours - formula| = {abs(float(loss) - expected):.1e}")
    assert abs(float(loss) - expected) <= 1e-12
    assert max(abs(a - b) for a, b in zip(stats.extra["log_odds_chosen"].tolist(), odds)) <= 1e-9
    x = torch.tensor([-1e-12, -1e-4, -0.5, -0.7, -1.0, -30.0], dtype=torch.float64, requires_grad=True)
    got = log1mexp(x)
    with mpmath.workdps(50):  # log(1 - e^x) in 50 digits
        exact = [float(mpmath.log(1 - mpmath.exp(mpmath.mpf(v)))) for v in x.tolist()]
    assert all(abs(g - e) <= 1e-14 * abs(e) for g, e in zip(got.tolist(), exact)), (got.tolist(), exact)
    got.sum().backward()
    assert torch.isfinite(x.grad).all()  # neither branch of the where leaks a NaN gradient


def _batch(pairs: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    dm = PreferenceDataModule(generated_pairs=pairs, generated_val_pairs=0, cutoff_len=28, max_prompt_len=12)
    dm.setup("fit")
    batch = dm.collate([dm.split_dataset("fit")[i] for i in range(pairs)])
    g = torch.Generator().manual_seed(3)
    return batch, torch.randn(*batch["input_ids"].shape, 259, dtype=torch.float64, generator=g)


def _response_logps(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Per row: the summed log-probs of its labelled (response) tokens and their number, by hand."""
    logp = torch.log_softmax(logits, -1)
    sums, counts = [], []
    for row in range(logits.shape[0]):
        keep = [t for t in range(logits.shape[1]) if batch["labels"][row, t] != -100]
        sums.append(sum(float(logp[row, t, batch["labels"][row, t]]) for t in keep))
        counts.append(len(keep))
    return sums, counts


@pytest.mark.parametrize("kind", ["simpo", "orpo"])
def test_task_losses_from_logits_average_response_tokens(kind: str) -> None:
    beta = 0.4
    task = DPOTask("debug", dpo=DPOConfig(beta=beta, loss_type=kind))
    batch, logits = _batch(4)
    if kind == "orpo":
        batch = task._prepared(batch, "validate")  # this batch's own chosen tokens (no trainer: one replica)
    loss, outputs = task.loss_from_output(logits, batch, "train")
    sums, counts = _response_logps(batch, logits)
    avg = [s / k for s, k in zip(sums, counts)]
    if kind == "simpo":
        expected = sum(-logsigmoid(beta * (c - r) - 0.5) for c, r in zip(avg[0::2], avg[1::2])) / 4
    else:  # the chosen responses' NLL as one token mean over the batch, minus beta x the mean log sigmoid(log odds)
        nll = -sum(sums[0::2]) / sum(counts[0::2])
        odds = [(c - r) - (math.log(-math.expm1(c)) - math.log(-math.expm1(r))) for c, r in zip(avg[0::2], avg[1::2])]
        expected = nll - beta * sum(logsigmoid(o) for o in odds) / 4
        assert abs(float(outputs["nll_loss"].mean()) - nll) <= 1e-6 * abs(nll)
    print(f"{kind} from logits: |ours - formula| = {abs(float(loss) - expected):.1e}")
    assert abs(float(loss) - expected) <= 1e-6 * max(1.0, abs(expected))  # the task's log-softmax runs in fp32
    assert torch.allclose(outputs["chosen_logps"], torch.tensor(avg[0::2]).float(), atol=1e-5)


def test_orpo_is_exact_over_any_split_of_the_pairs() -> None:
    """Micro-batches (or replicas) of pairs, each handed the global batch's scale and weighed by its pairs, give the
    whole batch's loss, though their chosen responses hold different numbers of tokens."""
    task = DPOTask("debug", dpo=DPOConfig(beta=0.3, loss_type="orpo"))
    batch, logits = _batch(6)
    batch = task._prepared(batch, "validate")
    whole, _ = task.loss_from_output(logits, batch, "train")
    parts = []
    for rows in (slice(0, 2), slice(2, 8), slice(8, 12)):
        part = {k: v[rows] for k, v in batch.items()}
        parts.append((task.loss_from_output(logits[rows], part, "train")[0], task.loss_weight(part)))
    split = sum(loss * w for loss, w in parts) / sum(w for _, w in parts)
    assert len({int((batch["labels"][rows][0::2] != -100).sum()) for rows in (slice(0, 2), slice(2, 8))}) == 2
    print(f"orpo split 1+3+2 pairs vs whole: {abs(float(split - whole)):.1e}")
    assert abs(float(split - whole)) <= 1e-6


def test_config_refuses_what_a_loss_does_not_use() -> None:
    with pytest.raises(ValueError, match="simpo_gamma applies to loss_type=simpo only"):
        DPOConfig(simpo_gamma=1.0)
    with pytest.raises(ValueError, match="loss_type=orpo uses no reference model"):
        DPOConfig(loss_type="orpo", reference="on_the_fly")
    with pytest.raises(ValueError, match="label_smoothing applies to loss_type sigmoid, robust, simpo only"):
        DPOConfig(loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        DPOConfig(loss_type="kto")  # type: ignore[arg-type]
    assert DPOConfig(loss_type="simpo").gamma == 0.5 and not DPOConfig(loss_type="simpo").needs_reference


@pytest.mark.parametrize(("kind", "lora"), [("simpo", True), ("orpo", False)])
def test_reference_free_losses_build_and_run_no_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          kind: str, lora: bool) -> None:
    """No reference policy is built (not even the adapters-off one of LoRA), no table precomputed and no reference
    pass run, in training and validation; the validation metrics come out by trl's names."""
    import csv

    import lightning.pytorch as pl

    from lightning_llm.peft import LoraArgs
    from lightning_llm.rl.rollouts.reference import ReferencePolicy
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.tasks.preference.base import PreferenceTask

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a reference was built or run")

    monkeypatch.setattr(ReferencePolicy, "for_policy", refuse)
    monkeypatch.setattr(PreferenceTask, "no_grad_logps", refuse)
    monkeypatch.setattr(PreferenceTask, "precompute_reference", refuse)
    pl.seed_everything(0)
    task = DPOTask("debug", model_overrides={"num_layers": 1}, dpo=DPOConfig(loss_type=kind),
                   lora=LoraArgs(r=4, alpha=8, dropout=0.0) if lora else None, optim=OptimConfig(lr=1e-3))
    dm = PreferenceDataModule(generated_pairs=16, generated_val_pairs=8, cutoff_len=24, max_prompt_len=12,
                              batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, val_check_interval=2, num_sanity_val_steps=0,
                         log_every_n_steps=1,
                         logger=pl.loggers.CSVLogger(str(tmp_path)), enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(task, dm)
    assert task.reference is None and task.frozen_models() == {} and task.reference_table == {}
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    logged = {k for r in rows for k, v in r.items() if v}
    expected = {"val_rewards/accuracies", "val_rewards/margins", "val_logps/chosen", "rewards/margins"}
    if kind == "orpo":
        expected |= {"nll_loss", "log_odds_ratio", "log_odds_chosen", "val_nll_loss"}
    assert expected <= logged, sorted(logged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_log_odds_stay_finite_at_mean_log_prob_zero(dtype: torch.dtype) -> None:
    """A response the model gives probability 1 to its precision has mean log-prob exactly 0, where
    log(1 - e^0) = -inf (trl's log odds: inf, or NaN when both are 0): it counts as -eps of the dtype, so the loss
    and its gradients stay finite, and values below -eps are the formula's unchanged."""
    eps = torch.finfo(dtype).eps
    ac = torch.tensor([0.0, 0.0, -1.0, -0.3], dtype=dtype, requires_grad=True)
    ar = torch.tensor([0.0, -1.0, 0.0, -2.0], dtype=dtype, requires_grad=True)
    loss, stats = orpo_loss(ac, ar, torch.zeros(4, dtype=dtype), beta=0.5)
    loss.backward()
    odds = stats.extra["log_odds_chosen"]
    assert torch.isfinite(loss) and torch.isfinite(odds).all() and torch.isfinite(ac.grad).all()
    assert torch.isfinite(ar.grad).all()

    def formula(a: float, r: float) -> float:
        return (a - r) - (math.log(-math.expm1(a)) - math.log(-math.expm1(r)))

    expected = [formula(min(a, -eps), min(r, -eps)) for a, r in zip(ac.tolist(), ar.tolist())]
    print(f"{dtype}: log odds at (0, 0), (0, -1), (-1, 0), (-0.3, -2): {odds.tolist()}")
    assert odds[0] == 0 and odds[1] > 0 > odds[2]
    assert max(abs(g - e) for g, e in zip(odds.tolist(), expected)) <= 1e-5 * max(abs(e) for e in expected)
    assert float(odds[3]) == pytest.approx(formula(-0.3, -2.0), rel=1e-6)  # away from 0: the formula, unclamped


def test_trl_sigmoid_ignores_label_smoothing_as_the_docs_say() -> None:
    """docs/post-training.md and rl/losses/dpo.py say that ``sigmoid`` with ``label_smoothing`` is conservative DPO here and
    that trl 1.16's ``sigmoid`` ignores the option: its DPOTrainer's sigmoid branch, read here, has no
    ``label_smoothing`` (this fails when trl changes it, and the docs need updating)."""
    import inspect

    import trl
    from trl import DPOTrainer

    source = inspect.getsource(DPOTrainer)
    branch = source.split('if loss_type == "sigmoid":', 1)[1].split("elif loss_type", 1)[0]
    print(f"trl {trl.__version__} DPOTrainer sigmoid branch:{branch.rstrip()}")
    assert "per_sequence_loss = -F.logsigmoid(self.beta * delta_score)" in branch
    assert "label_smoothing" not in branch
    robust = source.split('elif loss_type == "robust":', 1)[1].split("elif loss_type", 1)[0]
    assert "self.label_smoothing" in robust  # where trl does read it
