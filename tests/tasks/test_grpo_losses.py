"""The GRPO loss family (``loss_type`` grpo / dapo / dr_grpo / cispo, ``importance_sampling_level`` token /
sequence (GSPO), ``clip_range_high``, ``delta``, ``beta`` 0 or not, ``mask_truncated_completions``) against trl 1.16's
own ``GRPOTrainer._compute_loss`` run here on the same log-probs, advantages and masks (loss and gradient), both as
the pure function and as the task computes it on its own forward; DAPO's dynamic-sampling selection and its refill
against the rule written out here."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_llm.generation import GenerationConfig
from lightning_llm.rl import GRPOConfig, RewardConfig, grpo_loss
from lightning_llm.rl.rollouts.policy import Rollout, pack_responses
from lightning_llm.rl.rollouts.samples import select_groups
from lightning_llm.tasks import GRPOTask

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

VARIANTS = [  # (loss_type, level, clip_range_high, delta, beta)
    *itertools.product(["grpo", "dapo", "dr_grpo", "cispo"], ["token", "sequence"], [None, 0.28], [None], [0.0, 0.04]),
    ("grpo", "token", 0.28, 1.5, 0.04), ("dapo", "token", None, 1.3, 0.0), ("dapo", "sequence", None, 1.06, 0.0),
]


def trl_loss(new: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, *,
             loss_type: str, level: str, eps: float, eps_high: float | None, delta: float | None, beta: float,
             max_new_tokens: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """trl 1.16's ``GRPOTrainer._compute_loss`` on these tensors: one process, no gradient accumulation, the model's
    forward replaced by ``new`` (log-probs [B, N]). trl's ``epsilon_high`` for cispo is the weight's bound itself."""
    high = eps if eps_high is None else eps_high
    b, n = new.shape
    stub = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        loss_type=loss_type, epsilon_low=eps, epsilon_high=1 + high if loss_type == "cispo" else high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1), use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_new_tokens, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t),
        _get_per_token_logps_and_entropies=lambda *a, **k: (new, torch.zeros_like(new), None))
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, n, dtype=torch.long), "completion_mask": mask.long(),
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum()}
    return trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["train"]


def _tensors(seed: int, b: int = 8, n: int = 7, spread: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, n + 1, (b,), generator=g)
    lengths[0] = n  # one response as long as the longest allowed
    mask = torch.arange(n)[None, :] < lengths[:, None]
    old = -torch.rand(b, n, generator=g, dtype=torch.float64) * 4
    return {"mask": mask, "old": old, "new": old + torch.randn(b, n, generator=g, dtype=torch.float64) * spread,
            "ref": old + torch.randn(b, n, generator=g, dtype=torch.float64) * 0.5,
            "adv": torch.randn(b, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize(("loss_type", "level", "high", "delta", "beta"), VARIANTS)
def test_loss_and_gradient_equal_trl(loss_type: str, level: str, high: float | None, delta: float | None,
                                     beta: float) -> None:
    """Ratios far enough from 1 that both clip bounds and ``delta`` bind (counted); loss and d loss / d new."""
    t = _tensors(0, spread=0.3 if level == "token" and delta is None else 0.6)
    eps = 0.2 if level == "token" else 0.04  # sequence ratios are near 1: GSPO's ranges are small
    m, n = t["mask"], t["mask"].shape[1]
    ours_new = t["new"].clone().requires_grad_(True)
    theirs_new = t["new"].clone().requires_grad_(True)
    loss, stats = grpo_loss(ours_new * m, t["old"] * m, t["ref"] * m, t["adv"][:, None] * m, m, clip_range=eps,
                            clip_range_high=high, delta=delta, importance_sampling_level=level, beta=beta,
                            loss_type=loss_type, max_new_tokens=n)
    want, metrics = trl_loss(theirs_new, t["old"], t["ref"], t["adv"], m, loss_type=loss_type, level=level, eps=eps,
                             eps_high=high, delta=delta, beta=beta, max_new_tokens=n)
    loss.backward()
    want.backward()
    err = abs(float(loss.detach()) - float(want.detach()))
    gerr = float((ours_new.grad - theirs_new.grad).abs().max())
    print(f"{loss_type}/{level} high={high} delta={delta} beta={beta}: |loss - trl| {err:.1e}, |grad - trl| {gerr:.1e}; "
          f"clipfrac {float(stats['clipfrac']):.3f}; kl {'kl' in stats} (trl {'kl' in metrics})")
    assert err <= 1e-12 and gerr <= 1e-12 and float(theirs_new.grad.abs().max()) > 0
    assert ("kl" in stats) == (beta != 0) == ("kl" in metrics)
    if beta:
        assert abs(float(stats["kl"]) - metrics["kl"][0]) <= 1e-12
    if loss_type != "cispo":  # the clip binds somewhere: the comparison covers it
        assert 0 < float(stats["clipfrac"]) < 1
    elif level == "token":
        assert float(stats["clipfrac"]) > 0
    if delta is not None:  # and delta binds: without it the loss differs
        free = grpo_loss(t["new"] * m, t["old"] * m, t["ref"] * m, t["adv"][:, None] * m, m, clip_range=eps,
                         clip_range_high=high, importance_sampling_level=level, beta=beta, loss_type=loss_type)[0]
        assert abs(float(free) - float(loss.detach())) > 1e-6


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_data_parallel_halves_add_up_to_the_whole(loss_type: str) -> None:
    """Two replicas, each dividing by the global counts / 2, average (DDP) to the one-device loss."""
    t = _tensors(1)
    m, n = t["mask"], t["mask"].shape[1]
    kw = {"clip_range": 0.2, "clip_range_high": 0.28, "beta": 0.04, "loss_type": loss_type, "max_new_tokens": n}
    whole = grpo_loss(t["new"] * m, t["old"] * m, t["ref"] * m, t["adv"][:, None] * m, m, **kw)[0]
    halves = [grpo_loss(t["new"][p] * m[p], t["old"][p] * m[p], t["ref"][p] * m[p], t["adv"][p, None] * m[p], m[p],
                        seq_count=m.shape[0] / 2, token_count=m.sum() / 2, **kw)[0] for p in (slice(0, 4), slice(4, 8))]
    assert abs(float(sum(halves) / 2) - float(whole)) <= 1e-12


def _task(grpo: GRPOConfig) -> GRPOTask:
    return GRPOTask("debug", model_overrides={"num_layers": 2}, grpo=grpo,
                    generation=GenerationConfig(max_new_tokens=6, do_sample=True),
                    reward=RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward"))


@pytest.mark.parametrize("setting", ["dapo+clip_high+mask_truncated", "cispo", "dr_grpo", "gspo", "delta"])
def test_task_loss_equals_trl_on_its_own_forward(setting: str) -> None:
    """The task wires every setting: its mini-batch loss on its own forward equals trl's loss on the same log-probs
    (the fused path's fp32 log-probs given to both), with trl's truncation rule (the last completion token is neither
    EOS nor padding: the response never ended) for ``mask_truncated_completions``."""
    g, b, p, n, eos = 4, 2, 5, 6, 2
    cfg = {"dapo+clip_high+mask_truncated": dict(loss_type="dapo", clip_range_high=0.28,
                                                 mask_truncated_completions=True),
           "cispo": dict(loss_type="cispo", clip_range_high=0.5), "dr_grpo": dict(loss_type="dr_grpo"),
           "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", clip_range=3e-3),
           "delta": dict(loss_type="grpo", delta=1.25, beta=0.0)}[setting]
    task = _task(GRPOConfig(num_generations=g, **{"beta": 0.04, **cfg}))
    task.configure_model()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 250, (b * g, p), generator=gen)
    responses = torch.randint(3, 250, (b * g, n), generator=gen)
    responses[0, 2] = responses[3, 5] = responses[5, 1] = eos
    qr, am, pos, rmask, has_eos = pack_responses(prompts, torch.ones_like(prompts), responses, [eos])
    m = rmask.float()
    r = Rollout(query_responses=qr, attention_mask=am, position_ids=pos, context_length=p, responses=responses,
                response_mask=rmask, has_eos=has_eos, logprobs=m, ref_logprobs=m, values=torch.zeros_like(m),
                scores=torch.zeros(b * g))
    with torch.no_grad():
        cur = r.forward_logprobs(task.model.eval(), temperature=1.0, fused=task.uses_fused_loss()) * m
    old = (cur + torch.randn(b * g, n, generator=gen) * 0.3) * m
    ref = (cur + torch.randn(b * g, n, generator=gen) * 0.3) * m
    r.logprobs, r.ref_logprobs = old, (ref if task.grpo.beta else None)
    r.scores = torch.rand(b * g, generator=gen)
    if task.grpo.mask_truncated_completions:
        r.loss_mask = rmask & has_eos[:, None]
    task.compute_advantages(r)
    loss, _ = task.minibatch_loss(r)
    # trl's mask: completion_mask, zeroed where the completion was truncated (grpo_trainer.py, ~line 2488)
    completion_ids = [row[mk].tolist() for row, mk in zip(responses, rmask)]
    truncated = torch.tensor([ids[-1] not in (eos, 256) for ids in completion_ids])
    trl_mask = rmask & ~truncated[:, None] if task.grpo.mask_truncated_completions else rmask
    adv = (r.advantages * m).sum(-1) / m.sum(-1)
    want, _ = trl_loss(cur, old, ref, adv, trl_mask, loss_type=task.grpo.loss_type, eps=task.grpo.clip_range,
                       level=task.grpo.importance_sampling_level, eps_high=task.grpo.clip_range_high,
                       delta=task.grpo.delta, beta=task.grpo.beta, max_new_tokens=n)
    err = abs(float(loss.detach()) - float(want))
    print(f"{setting}: task loss {float(loss):.6f}, trl {float(want):.6f}, |diff| {err:.1e}; truncated rows "
          f"{int(truncated.sum())}/{b * g}")
    assert err <= 1e-6 and bool(truncated.any()) and bool((~truncated).any())


def test_beta_zero_needs_no_reference() -> None:
    t = _tensors(2)
    m = t["mask"]
    loss, stats = grpo_loss(t["new"] * m, t["old"] * m, None, t["adv"][:, None] * m, m, clip_range=0.2, beta=0.0)
    assert "kl" not in stats and torch.isfinite(loss)
    with pytest.raises(ValueError, match="beta > 0 needs the reference"):
        grpo_loss(t["new"] * m, t["old"] * m, None, t["adv"][:, None] * m, m, clip_range=0.2, beta=0.1)
    with pytest.raises(ValueError, match="loss_type must be one of grpo, dapo, dr_grpo, cispo"):
        grpo_loss(t["new"], t["old"], None, t["adv"][:, None], m, clip_range=0.2, beta=0.0, loss_type="bnpo")


# ------------------------------------------------------------------------------------------------ dynamic sampling
def _dapo_rule(candidates: list[tuple[tuple[int, int], bool]], target: int) -> list[tuple[int, int]]:
    """DAPO's filter, written out: keep groups with a signal in sampling order until the batch is full; then (our
    documented top-up when the rounds ran out) the first groups without one."""
    kept, spare = [], []
    for key, informative in sorted(candidates):
        (kept if informative else spare).append(key)
    kept = kept[:target]
    return sorted(kept + spare[:target - len(kept)])


def test_dynamic_sampling_selection_follows_the_rule() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        rounds, per_round, target = 1 + trial % 4, 8, 8
        candidates = [((r, p), bool(torch.rand(1, generator=gen) < 0.4)) for r in range(rounds) for p in range(per_round)]
        shuffled = [candidates[i] for i in torch.randperm(len(candidates), generator=gen)]  # the gather's order
        got = select_groups(shuffled, target)
        assert got == _dapo_rule(candidates, target) and len(got) == target
