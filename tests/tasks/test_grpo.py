"""GRPO task: the loss and group advantages against the formulas written out here in float64, learning the
programmatic digits reward with a bounded KL, the LoRA reference (adapters off, no copy), per-prompt seeded
sampling, configuration errors, and every setting of the loss family under ddp, tp, pp, zero3 and 3d against one
device, with a stop-and-resume under pp, in one launch of 2 processes (the 4-process layouts:
test_rl_replica_layouts.py; the loss family against trl: test_grpo_losses.py)."""

from __future__ import annotations

import copy
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import PromptDataModule
from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.generation.sampling import inverse_cdf
from lightning_llm.peft import LoraArgs
from lightning_llm.rl import GRPOConfig, RewardConfig, group_advantages, grpo_loss
from lightning_llm.rl.losses.core import logprobs_from_logits
from lightning_llm.rl.rollouts.policy import Rollout, pack_responses, response_logits
from lightning_llm.rl.rollouts.seeding import prompt_uniforms
from lightning_llm.tasks import GRPOTask, OptimConfig
from lightning_llm.testing import MetricRows, run_worker, write_json_on_rank0
from lightning_llm.testing.rl import GRPO_SPECS, compare_fits, held_bytes, layout_runs, rl_fit

DIGITS = RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", kwargs={"chars": "digits"})
KEYS = ("objective/scores", "objective/kl", "reward_std", "frac_reward_zero_std", "response_length", "episode",
        "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "policy/kl_avg", "loss/policy_avg",
        "val/ratio", "policy/skipped_minibatches")




def _task(**kwargs: Any) -> GRPOTask:
    defaults: dict[str, Any] = {
        "model_overrides": {"num_layers": 2}, "generation": GenerationConfig(max_new_tokens=12, do_sample=True),
        "grpo": GRPOConfig(num_generations=8, epochs=2, num_mini_batches=2, beta=0.1), "reward": DIGITS,
        "optim": OptimConfig(lr=3e-3, warmup_steps=0, scheduler="constant", weight_decay=0.0)}
    return GRPOTask("debug", **{**defaults, **kwargs})


def _fit(task: GRPOTask, rollouts: int, *, batch_size: int = 4) -> list[dict[str, float]]:
    pl.seed_everything(0)
    rec = MetricRows()
    dm = PromptDataModule(batch_size=batch_size, generated_prompts=256, max_prompt_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", max_steps=rollouts * task.grpo.updates_per_rollout, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                   limit_val_batches=0, num_sanity_val_steps=0).fit(task, dm)
    return rec.rows


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


# ------------------------------------------------------------------------------------------------ formulas
def _advantages_by_hand(scores: list[float], g: int, *, scale: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(scores), g):
        group = scores[start:start + g]
        mean = sum(group) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (g - 1))  # unbiased
        out += [(x - mean) / (std + eps) if scale else x - mean for x in group]
    return out


def _loss_by_hand(new: list[list[float]], old: list[list[float]], ref: list[list[float]], adv: list[float],
                  lengths: list[int], *, eps: float, beta: float, loss_type: str) -> tuple[float, list[list[float]], int]:
    """(loss, d loss / d new per token, number of clipped tokens), one token at a time."""
    seq_losses, grads, clipped, total, tokens = [], [], 0, 0.0, sum(lengths)
    for i, n in enumerate(lengths):
        a, row_loss, row_grad = adv[i], 0.0, []
        for t in range(n):
            ratio = math.exp(new[i][t] - old[i][t])
            unclipped, clip = ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a
            d = ref[i][t] - new[i][t]
            kl = math.exp(d) - d - 1  # k3
            surrogate = min(unclipped, clip)
            clipped += clip < unclipped
            token_loss = -surrogate + beta * kl
            # d/dnew: the unclipped branch is ratio * a (d/dnew = ratio * a); the clipped one is constant outside
            # the range; the KL term gives beta * (1 - exp(ref - new)).
            g = (-ratio * a if unclipped <= clip else 0.0) + beta * (1 - math.exp(d))
            row_loss += token_loss
            row_grad.append(g)
        seq_losses.append(row_loss / n)
        total += row_loss
        grads.append(row_grad)
    if loss_type == "grpo":
        b = len(lengths)
        return sum(seq_losses) / b, [[g / (n * b) for g in row] for row, n in zip(grads, lengths)], clipped
    return total / tokens, [[g / tokens for g in row] for row in grads], clipped


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_and_advantages_match_the_formulas_in_float64(loss_type: str) -> None:
    g, b, n, eps, beta = 4, 3, 6, 0.2, 0.04
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(b * g, generator=gen, dtype=torch.float64)
    scores[g:2 * g] = 0.5  # a group of equal rewards: zero advantages, not 0/0
    adv, std = group_advantages(scores, g, scale=True, eps=1e-4)
    by_hand = _advantages_by_hand(scores.tolist(), g, scale=True, eps=1e-4)
    err_adv = max(abs(x - y) for x, y in zip(adv.tolist(), by_hand))
    centred, _ = group_advantages(scores, g, scale=False)
    err_centred = max(abs(x - y) for x, y in zip(centred.tolist(), _advantages_by_hand(scores.tolist(), g, scale=False,
                                                                                         eps=0.0)))
    assert adv[g:2 * g].abs().max() == 0 and float(std[1]) == 0

    rows = b * g
    lengths = [int(x) for x in torch.randint(1, n + 1, (rows,), generator=gen)]
    mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]  # [rows, n]
    old = -torch.rand(rows, n, generator=gen, dtype=torch.float64) * 4
    new = (old + torch.randn(rows, n, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(True)  # ratios off 1
    ref = old + torch.randn(rows, n, generator=gen, dtype=torch.float64) * 0.5
    a = torch.randn(rows, generator=gen, dtype=torch.float64)
    loss, stats = grpo_loss(new * mask, old * mask, ref * mask, a[:, None] * mask, mask, clip_range=eps, beta=beta,
                            loss_type=loss_type)
    loss.backward()
    want, want_grad, n_clipped = _loss_by_hand(new.tolist(), old.tolist(), ref.tolist(), a.tolist(), lengths, eps=eps,
                                               beta=beta, loss_type=loss_type)
    err_loss = abs(float(loss.detach()) - want)
    err_grad = max(abs(float(new.grad[i, t]) - want_grad[i][t]) for i in range(rows) for t in range(lengths[i]))
    assert float(new.grad[~mask].abs().max()) == 0  # padding gets no gradient
    # Data parallel: two halves with the global counts / 2 and averaged (DDP's gradient mean) = the whole batch.
    halves = []
    for part in (slice(0, rows // 2), slice(rows // 2, rows)):
        m = mask[part]
        halves.append(grpo_loss(new[part] * m, old[part] * m, ref[part] * m, a[part, None] * m, m, clip_range=eps,
                                beta=beta, loss_type=loss_type, seq_count=rows / 2, token_count=mask.sum() / 2)[0])
    err_split = abs(float(sum(halves).detach() / 2) - want)
    print(f"{loss_type}: |adv - formula| {err_adv:.1e} (centred {err_centred:.1e}); |loss - formula| {err_loss:.1e}; "
          f"|grad - formula| {err_grad:.1e}; 2-way split {err_split:.1e}; clipped tokens {n_clipped}/{sum(lengths)} "
          f"(clipfrac {float(stats['clipfrac']):.3f})")
    assert 0 < n_clipped < sum(lengths) and abs(float(stats["clipfrac"]) - n_clipped / sum(lengths)) < 1e-12
    assert max(err_adv, err_centred, err_loss, err_grad, err_split) <= 1e-12


def test_task_advantages_and_minibatch_loss_follow_the_formulas() -> None:
    """The task wires the formulas: advantages broadcast over each response's tokens (fp64 scores), and the loss of
    its own forward of the policy (fp32 log-probs, the same as the forward here; the formula evaluated in fp64)."""
    g, b, p, n = 4, 2, 5, 6
    task = _task(grpo=GRPOConfig(num_generations=g, beta=0.04, missing_eos_penalty=0.25))
    task.configure_model()
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 250, (b * g, p), generator=gen)
    responses = torch.randint(3, 250, (b * g, n), generator=gen)
    responses[0, 2] = 2  # an EOS (ByteTokenizer's id 2 is passed below): row 0 ends after 3 tokens
    qr, am, pos, rmask, has_eos = pack_responses(prompts, torch.ones_like(prompts), responses, [2])
    policy = task.model.eval()
    m = rmask.double()
    r = Rollout(query_responses=qr, attention_mask=am, position_ids=pos, context_length=p, responses=responses,
                response_mask=rmask, has_eos=has_eos, logprobs=m, ref_logprobs=m, values=torch.zeros_like(m),
                scores=torch.zeros(b * g))
    with torch.no_grad():  # the task's own forward: token log-probs from the model's fused loss (the default)
        cur = r.forward_logprobs(policy, temperature=1.0, fused=task.uses_fused_loss())
        eager = logprobs_from_logits(response_logits(policy(qr, attention_mask=am, position_ids=pos), p), responses)
    assert float(((cur - eager) * rmask).abs().max()) < 1e-5
    old = (cur.double() + torch.randn(b * g, n, generator=gen, dtype=torch.float64) * 0.3) * m
    ref = (cur.double() + torch.randn(b * g, n, generator=gen, dtype=torch.float64) * 0.3) * m
    scores = torch.rand(b * g, generator=gen, dtype=torch.float64)
    r.logprobs, r.ref_logprobs, r.scores = old, ref, scores.clone()
    stats = task.compute_advantages(r)
    penalised = [s - 0.25 * (not e) for s, e in zip(scores.tolist(), has_eos.tolist())]
    want = _advantages_by_hand(penalised, g, scale=True, eps=1e-4)
    err_adv = max(abs(float(r.advantages[i, t]) - want[i] * bool(rmask[i, t])) for i in range(b * g) for t in range(n))
    assert abs(stats["objective/scores"] - sum(penalised) / len(penalised)) < 1e-6
    loss, mb_stats = task.minibatch_loss(r)
    lengths = rmask.sum(-1).tolist()
    want_loss, _, n_clipped = _loss_by_hand([row[:k] for row, k in zip(cur.double().tolist(), lengths)], old.tolist(),
                                            ref.tolist(), want, lengths, eps=0.2, beta=0.04, loss_type="grpo")
    err_loss = abs(float(loss) - want_loss)
    print(f"task: |advantages - formula| {err_adv:.1e}; |loss - formula| {err_loss:.1e}; clipped tokens "
          f"{n_clipped}/{sum(lengths)}; stats {sorted(mb_stats)}")
    assert err_adv <= 1e-12 and err_loss <= 1e-12 and n_clipped > 0
    assert {"ratio", "clipfrac", "approxkl", "kl", "entropy", "policy"} <= set(mb_stats)


# ------------------------------------------------------------------------------------------------ sampling
def test_per_prompt_sampling_does_not_depend_on_the_batch() -> None:
    """Inverse-CDF sampling from pre-drawn uniforms: the right distribution, and a row samples the same tokens alone
    as beside other rows (what makes 2 ranks x B prompts sample what 1 device x 2B prompts samples)."""
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(200_000, 4)
    tokens = inverse_cdf(probs, torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    assert freq[1] == 0 and float((freq - probs[0].double()).abs().max()) < 0.005
    task = _task()
    task.configure_model()
    model = task.model.eval()
    cfg = GenerationConfig(max_new_tokens=10, do_sample=True, eos_token_id=2)
    ids = torch.randint(3, 250, (3, 7), generator=torch.Generator().manual_seed(2)).repeat_interleave(2, 0)
    mask = torch.ones_like(ids)
    mask[2:4, :3] = 0  # prompt 9 is shorter: left-padded in the batch, unpadded alone
    u = prompt_uniforms(torch.tensor([5, 9, 11]), 2, 10, seed=7, rollout=3)  # 3 prompts x 2 responses
    both = generate(model, ids, mask, config=cfg, uniforms=u)
    alone = generate(model, ids[2:4, 3:], mask[2:4, 3:], config=cfg, uniforms=u[2:4])
    assert torch.equal(both[2:4, :alone.shape[1]], alone)
    again = prompt_uniforms(torch.tensor([9]), 2, 10, seed=7, rollout=3)
    assert torch.equal(again, u[2:4]) and not torch.equal(u[0:2], u[2:4])


# ------------------------------------------------------------------------------------------------ learning
def test_grpo_raises_programmatic_reward_with_bounded_kl() -> None:
    """Reward = share of digits in the response (random-init policy starts near 10/259); 4 prompts x 8 responses
    per rollout. A run whose KL term hardly counts (beta=1e-4; at beta=0 no reference exists to measure the KL to)
    drifts further from the reference: the term binds."""
    rows = _fit(_task(), 30)
    first, last = _mean(rows[:5], "objective/scores"), _mean(rows[-5:], "objective/scores")
    kls = [r["objective/kl"] for r in rows]
    free = _fit(_task(grpo=GRPOConfig(num_generations=8, epochs=2, num_mini_batches=2, beta=1e-4)), 30)
    free_kl = max(r["objective/kl"] for r in free)
    print(f"beta=0.1: scores first5={first:.3f} last5={last:.3f} gain={last - first:.3f}; per-token kl step0="
          f"{kls[0]:.1e} max={max(kls):.2f} last5={_mean(rows[-5:], 'objective/kl'):.2f}; reward_std last5="
          f"{_mean(rows[-5:], 'reward_std'):.3f}; clipfrac={_mean(rows, 'policy/clipfrac_avg'):.3f} "
          f"ratio={_mean(rows, 'val/ratio'):.4f} | beta=1e-4: scores last5={_mean(free[-5:], 'objective/scores'):.3f} "
          f"kl max={free_kl:.2f}")
    assert set(KEYS) <= set(rows[0]) and rows[-1]["episode"] == 30 * 4 * 8
    assert abs(kls[0]) < 1e-6  # reference == initial policy
    assert last - first >= 0.5
    # Per-token KL to the near-uniform initial policy (259 tokens): spreading over the 10 digits costs
    # log(259/10) = 3.25 nats, a deterministic policy ~4.6 (k3 of one token); with beta=0.1 the KL settles below the
    # former and its peak stays well below the latter (over seeds 0-3 and both loss paths: last-5 mean 1.8-2.7,
    # peak 2.0-3.25; the trajectories are chaotic: a 1e-7 change in a log-prob moves later samples).
    assert _mean(rows[-5:], "objective/kl") < math.log(259 / 10) and max(kls) < 4.0
    assert free_kl > max(kls) + 0.5


def test_lora_policy_reference_is_the_base_model_without_a_copy(tmp_path: Path) -> None:
    lora = LoraArgs(r=8, alpha=16, dropout=0.0,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    overrides = {"num_layers": 2, "vocab_size": 264}  # built before fit: give it the byte tokenizer's vocabulary
    full = _task(model_overrides=overrides)
    task = _task(model_overrides=overrides, lora=lora, adapter_dir=str(tmp_path / "adapter"),
                 optim=OptimConfig(lr=1e-2, warmup_steps=0, scheduler="constant", weight_decay=0.0))
    full.configure_model()
    task.configure_model()
    rep_full, rep_lora = full.parameter_report(), task.parameter_report()
    lora_params = sum(p.numel() for n, p in task.model.named_parameters() if "lora_" in n)
    print(f"parameters: full fine-tune {rep_full}; LoRA {rep_lora}")
    assert task.reference.shares_policy and rep_lora["reference"] == 0
    assert rep_full["reference"] == rep_full["policy"] and rep_full["total"] == 2 * rep_full["policy"]
    assert rep_lora["total"] == rep_full["policy"] + lora_params  # base + adapters, no copy
    rows = _fit(task, 12)
    base = copy.deepcopy(full.model)
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in task.model.state_dict().items()
                          if "lora_" not in k})
    # A rollout's reference log-probs vs the base decoder's, after the adapter has trained.
    dm = PromptDataModule(generated_prompts=8)
    dm.setup("fit")
    batch = dm.collate([dm.datasets["fit"][i] for i in range(4)])
    out = generate(task.model.eval(), batch["input_ids"], batch["attention_mask"],
                   config=GenerationConfig(max_new_tokens=8, do_sample=True), generator=torch.Generator().manual_seed(0))
    qr, am, pos, rmask, has_eos = pack_responses(batch["input_ids"], batch["attention_mask"], out, [dm.eos_token_id])
    zeros = torch.zeros(out.shape)
    r = Rollout(query_responses=qr, attention_mask=am, position_ids=pos, context_length=batch["input_ids"].shape[1],
                responses=out, response_mask=rmask, has_eos=has_eos, logprobs=zeros, ref_logprobs=zeros, values=zeros,
                scores=torch.zeros(4))
    ref = task.reference_logprobs(r, 1.0)
    with torch.no_grad():
        want = r.forward_logprobs(base.eval(), temperature=1.0)
        policy = r.forward_logprobs(task.model, temperature=1.0)
    err, moved = float((ref - want).abs().max()), float((policy - want).abs().max())
    print(f"LoRA: |reference - base model| log-probs {err:.1e}; policy moved {moved:.2f}; scores first3="
          f"{_mean(rows[:3], 'objective/scores'):.3f} last3={_mean(rows[-3:], 'objective/scores'):.3f} "
          f"kl last={rows[-1]['objective/kl']:.3f}")
    assert err < 1e-5 and moved > 0.1 and rows[-1]["objective/kl"] > 1e-3
    assert all(p.requires_grad == ("lora_" in name) for name, p in task.model.named_parameters())
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------------------ errors
def test_configuration_errors_name_the_parameter(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, name in [({"num_generations": 1}, "num_generations=1"), ({"loss_type": "bnpo"}, "loss_type='bnpo'"),
                      ({"beta": -0.1}, "beta=-0.1"), ({"eps": 0.0}, "eps=0.0"), ({"clip_range": 0.0}, "clip_range"),
                      ({"epochs": 0}, "epochs=0"), ({"kl_estimator": "k4"}, "kl_estimator")]:
        with pytest.raises(ValueError, match=f"--model.grpo.{name}"):
            GRPOConfig(**bad)
    with pytest.raises(ValueError, match="exactly one of reward.fn"):
        GRPOTask("debug")
    with pytest.raises(ValueError, match="--model.generation.do_sample=false"):
        _task(generation=GenerationConfig(do_sample=False))
    with pytest.raises(ValueError, match="num_mini_batches"):
        _fit(_task(grpo=GRPOConfig(num_generations=2, num_mini_batches=4)), 1, batch_size=1)
    assert main(["fit", "--model=lightning_llm.tasks.GRPOTask", "--model.reward.fn=x:y",
                 "--model.grpo.num_generations=1", "--data=lightning_llm.data.PromptDataModule"]) == 2
    assert "--model.grpo.num_generations=1 is out of range (>= 2" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ layouts
LAYOUTS = ["ddp", "tp", "pp", "zero3", "3d"]
RUNS = [(spec, layout) for spec in GRPO_SPECS for layout in LAYOUTS]
ROLLOUTS = {"dapo": 4, "rlvr": 2, "gspo_dr": 2, "cispo": 2}
"""Rollouts per fit (x 2 epochs = optimizer steps): today's settings 4, each new one 2."""


def _layout_fit(spec: str, layout: str, out: Path, *, under: str = "", **kwargs: Any) -> dict[str, Any]:
    return rl_fit("grpo", GRPO_SPECS[spec], out / under / f"{spec}-{layout}", prompts=out / "prompts.jsonl",
                  layout=layout, steps=2 * ROLLOUTS[spec], **kwargs)


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        for spec in GRPO_SPECS:
            _layout_fit(spec, "1", out)
        return
    for spec, layout in RUNS:
        _layout_fit(spec, layout, out)
    # pp x2 stopped by an error before its third rollout (optimizer step 4), then resumed from last.ckpt
    stopped = _layout_fit("dapo", "pp", out, under="resume", fault="raise:step=4")
    resumed = _layout_fit("dapo", "pp", out, under="resume", resume=str(out / "resume" / "dapo-pp" / "ckpt" / "last.ckpt"))
    write_json_on_rank0(out / "resume.json", {"stopped": stopped, "resumed": resumed})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout of every spec in one launch of 2 processes; the one-device runs computed before it."""
    out = tmp_path_factory.mktemp("grpo_layouts")
    return layout_runs(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("spec", "layout"), RUNS)
def test_layout_matches_one_device(runs: Path, spec: str, layout: str) -> None:
    """Rollouts seeded per prompt (not per rank), groups kept on one replica, losses divided by the global counts:
    2 ranks reproduce one device x 8 prompts per rollout, every setting of the loss family included: the same rollout
    tokens, every logged statistic (rewards/<source>/mean|std too) within 1e-5, the parameters within 1e-4, the
    same rollouts.jsonl; the reward (testing.rl.PairedDigits) checks every prompt arrived with its own record's
    columns. Tensor and pipeline parallel: a replica's ranks hold its prompts and draw the same tokens; ``3d`` adds
    sequence parallelism; under ZeRO-3 a rollout gathers the parameters once (no all-gather while sampling). The
    frozen reference is placed like the policy (tp, pp, zero3, 3d: at most 0.55x of its bytes per rank) and, at
    beta 0 (``rlvr``), not built at all."""
    one, other = runs / f"{spec}-1", runs / f"{spec}-{layout}"
    errs = compare_fits(one, other)
    rows = json.loads((other / "rows.json").read_text())
    frozen, whole = held_bytes(other, "frozen"), held_bytes(one, "frozen")[0]
    gathers = json.loads((other / "rollouts.json").read_text())["gathers"]
    print(f"{spec} under {layout}: max |stat - one device| {errs['stats']:.1e}, params {errs['params']:.1e}, "
          f"rollouts.jsonl {errs['rollouts']:.1e}; scores {[round(r['objective/scores'], 4) for r in rows]}; reference "
          f"bytes per rank {frozen} (one device {whole}); all-gathers while sampling {gathers}; "
          + ", ".join(f"{k} {rows[-1][k]:.3f}" for k in sorted(rows[-1]) if k.startswith(("rewards/", "sampling"))))
    assert errs["stats"] < 1e-5 and errs["params"] < 1e-4 and errs["rollouts"] < 1e-5
    assert len(rows) == ROLLOUTS[spec] and all(r["reward_std"] > 0 for r in rows)  # real sampling
    assert rows[-1]["episode"] == ROLLOUTS[spec] * 8 * 4  # rollouts x global prompts x G
    beta = GRPO_SPECS[spec]["grpo"]["beta"]
    assert ("objective/kl" in rows[0]) == ("policy/kl_avg" in rows[0]) == (beta != 0)
    if beta == 0:
        assert whole == 0 and max(frozen) == 0  # no reference anywhere
    else:
        assert whole > 0 and max(frozen) <= (whole if layout == "ddp" else 0.55 * whole)
    if layout == "zero3":
        assert all(count == 0 for rank in gathers for count in rank)
    lines = [json.loads(x) for x in (other / "rollouts.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [k // 32 for k in range(len(rows) * 32)]
    assert all(x["columns"]["number"] == int(x["prompt"][4:6]) for x in lines)


@pytest.mark.multiprocess
def test_rlvr_settings_take_effect(runs: Path) -> None:
    """The settings of ``rlvr`` did something in the runs compared above: dynamic sampling refilled (more than one
    sampling round; of the groups sampled, some had equal rewards), truncated responses left the loss (rollouts.jsonl:
    0 response tokens exactly where truncated), both sources were logged."""
    rows = json.loads((runs / "rlvr-1" / "rows.json").read_text())
    lines = [json.loads(x) for x in (runs / "rlvr-1" / "rollouts.jsonl").read_text().splitlines()]
    print("rlvr one device:", [{k: round(r[k], 3) for k in ("sampling_rounds", "frac_reward_zero_std",
                                                              "rewards/PairedDigits/mean", "rewards/format/mean")}
                               for r in rows], f"truncated {sum(x['truncated'] for x in lines)}/{len(lines)}")
    assert max(r["sampling_rounds"] for r in rows) > 1 and max(r["frac_reward_zero_std"] for r in rows) > 0
    assert all((x["response_tokens"] == 0) == x["truncated"] for x in lines)
    assert 0 < sum(x["truncated"] for x in lines) < len(lines)
    assert {"PairedDigits", "format"} <= set(lines[0]) and "rewards/format/std" in rows[0]


@pytest.mark.multiprocess
def test_pipeline_stopped_and_resumed_gives_the_uninterrupted_run(runs: Path) -> None:
    """GRPO under pp x2, stopped by an error before its third rollout (optimizer step 4) and resumed from last.ckpt:
    the resumed rollouts (sampling seeds, reference, optimizer state and data order restored) log what the
    uninterrupted one-device run logs, and end with its parameters."""
    got = json.loads((runs / "resume.json").read_text())
    assert "injected fault" in got["stopped"]["error"]
    one = json.loads((runs / "dapo-1" / "rows.json").read_text())
    resumed = got["resumed"]["rows"]
    assert len(one) == 4 and len(resumed) == 2
    err = max(abs(a[k] - b[k]) for a, b in zip(one[2:], resumed) for k in a if k not in ("lr",))
    p1 = torch.load(runs / "dapo-1" / "steps.json.pt")
    p2 = torch.load(runs / "resume" / "dapo-pp" / "steps.json.pt")
    perr = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
    print(f"pp x2 stopped at step 4 and resumed: rollouts 3-4 max abs err {err:.2e}; final params {perr:.2e}")
    assert resumed[-1]["episode"] == one[-1]["episode"] and err < 1e-4 and perr < 1e-4


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
