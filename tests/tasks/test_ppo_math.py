"""PPO math on fixed tensors: hand-computed values and trl's formulas (written out here independently, as float64
loops over Python numbers, since trl is not installed) must equal lightning_llm.rl.losses.core within 1e-6."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_llm.rl import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    gae,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from lightning_llm.rl.rollouts.policy import pack_responses

TOL = 1e-6


def _fixed(seed: int = 0, b: int = 3, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1])[:b]
    mask = torch.arange(n)[None, :] < lengths[:, None]
    return {
        "mask": mask,
        "rewards": torch.randn(b, n, generator=g, dtype=torch.float64),
        "values": torch.randn(b, n, generator=g, dtype=torch.float64),
        "logprobs": -torch.rand(b, n, generator=g, dtype=torch.float64) * 3,
        "ref_logprobs": -torch.rand(b, n, generator=g, dtype=torch.float64) * 3,
        "advantages": torch.randn(b, n, generator=g, dtype=torch.float64),
        "returns": torch.randn(b, n, generator=g, dtype=torch.float64),
    }


# ------------------------------------------------------------------------------------------ trl, written out as loops
def _trl_gae(rewards, values, mask, gamma, lam):
    """trl PPOTrainer: values/rewards are zero past each row's end, then the backward recursion over the width."""
    out_a, out_r = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        r = [x if m else 0.0 for x, m in zip(r_row, m_row)]
        v = [x if m else 0.0 for x, m in zip(v_row, m_row)]
        n = len(r)
        adv = [0.0] * n
        last = 0.0
        for t in reversed(range(n)):
            nextv = v[t + 1] if t < n - 1 else 0.0
            delta = r[t] + gamma * nextv - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        out_a.append([a if m else 0.0 for a, m in zip(adv, m_row)])
        out_r.append([(a + vv) if m else 0.0 for a, vv, m in zip(adv, v, m_row)])
    return out_a, out_r


def _trl_whiten(values, mask, shift_mean=True):
    xs = [x for row, mrow in zip(values, mask) for x, m in zip(row, mrow) if m]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs) * len(xs) / (len(xs) - 1)  # masked_var(unbiased=True)
    out = [[(x - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean) for x in row] for row in values]
    return out, mean, var


def _rows(t: torch.Tensor) -> list[list]:
    return t.tolist()


def _close(ours: torch.Tensor, ref: list | float, mask: torch.Tensor | None = None) -> float:
    ref_t = torch.tensor(ref, dtype=torch.float64)
    diff = (ours.double() - ref_t).abs()
    if mask is not None:
        diff = diff * mask
    return float(diff.max())


# ------------------------------------------------------------------------------------------ tests
def test_gae_matches_hand_computed_and_trl_loop() -> None:
    # Hand example: one row of 3 tokens, gamma=0.9, lam=0.8.
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.2, 0.1]], dtype=torch.float64)
    m = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.1
    d1 = 0.0 + 0.9 * 0.1 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2, a1 = d2, d1 + 0.72 * d2
    a0 = d0 + 0.72 * a1
    hand = [[a0, a1, a2]]
    err_hand = _close(adv, hand)
    assert err_hand < TOL and _close(ret, [[a0 + 0.5, a1 + 0.2, a2 + 0.1]]) < TOL

    f = _fixed()
    errs = []
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
        adv, ret = gae(f["rewards"], f["values"], f["mask"], gamma=gamma, lam=lam)
        ref_a, ref_r = _trl_gae(_rows(f["rewards"]), _rows(f["values"]), _rows(f["mask"]), gamma, lam)
        errs += [_close(adv, ref_a), _close(ret, ref_r)]
    print(f"GAE: hand max err {err_hand:.2e}; vs trl loop max err {max(errs):.2e}")
    assert max(errs) < TOL
    # lam=1, gamma=1 and zero values: advantage = reward-to-go
    adv, _ = gae(f["rewards"], torch.zeros_like(f["values"]), f["mask"], gamma=1.0, lam=1.0)
    togo = (f["rewards"] * f["mask"]).flip(1).cumsum(1).flip(1) * f["mask"]
    assert _close(adv, _rows(togo)) < TOL


def test_masked_whiten_mean_var_match_trl() -> None:
    f = _fixed(1)
    x, m = f["advantages"], f["mask"]
    for shift in (True, False):
        ours = masked_whiten(x, m, shift_mean=shift)
        ref, mean, var = _trl_whiten(_rows(x), _rows(m), shift_mean=shift)
        err = _close(ours, ref, m)
        print(f"whiten(shift_mean={shift}) max err {err:.2e}")
        assert err < TOL
    assert abs(float(masked_mean(x, m)) - mean) < TOL and abs(float(masked_var(x, m)) - var) < TOL
    w = masked_whiten(x, m)
    assert abs(float(masked_mean(w, m))) < TOL and abs(float(masked_var(w, m)) - 1) < 1e-6
    # Two "ranks" (threads) whitening their halves with an all-reduce (barrier + sum) equal whitening the union.
    parts = [(x[:2], m[:2]), (x[2:], m[2:])]
    out = _two_rank_run(lambda xs, ms, ar: masked_whiten(xs, ms, all_reduce=ar), parts)
    err = max(_close(out[0], _rows(w[:2]), m[:2]), _close(out[1], _rows(w[2:]), m[2:]))
    print(f"whiten split over 2 ranks vs union: max err {err:.2e}")
    assert err < TOL


def _two_rank_run(fn, parts):
    """Run ``fn(x, m, all_reduce)`` on two threads whose ``all_reduce`` sums their tensors (like gloo's SUM)."""
    import threading

    barrier = threading.Barrier(2)
    slots: list = [None, None]
    results: list = [None, None]

    def make_all_reduce(rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return all_reduce

    def run(rank: int) -> None:
        results[rank] = fn(parts[rank][0], parts[rank][1], make_all_reduce(rank))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_kl_estimators_match_definitions_and_trl() -> None:
    f = _fixed(2)
    lp, ref = f["logprobs"], f["ref_logprobs"]
    for est in ("k1", "k2", "k3"):
        ours = kl_penalty(lp, ref, est)
        expected = []
        for row_p, row_q in zip(_rows(lp), _rows(ref)):
            e = []
            for p, q in zip(row_p, row_q):
                logr = q - p  # trl: logr = ref_logprobs - logprobs
                e.append({"k1": -logr, "k2": 0.5 * logr * logr, "k3": (math.exp(logr) - 1) - logr}[est])
            expected.append(e)
        err = _close(ours, expected)
        print(f"KL {est}: max err {err:.2e}")
        assert err < TOL
    assert float(kl_penalty(lp, ref, "k3").min()) >= 0
    # Monte-Carlo sanity: on samples from p, k1 and k3 average to KL(p||q) of two categoricals.
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    for est in ("k1", "k3"):
        mc = float(kl_penalty(p.log()[x], q.log()[x], est).mean())
        assert abs(mc - exact) < 0.01, (est, mc, exact)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]


def test_per_token_rewards_put_score_on_last_token() -> None:
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    kl = torch.arange(12, dtype=torch.float64).view(3, 4) / 10
    scores = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    rewards, non_score = per_token_rewards(kl, scores, m, kl_coef=0.1)
    expected = -0.1 * kl * m
    expected[0, 2] += 1.0
    expected[1, 0] += -2.0
    expected[2, 3] += 0.5
    assert _close(rewards, _rows(expected)) < TOL and _close(non_score, _rows(-0.1 * kl * m)) < TOL


def test_clipped_policy_and_value_losses_match_trl() -> None:
    f = _fixed(3)
    g = torch.Generator().manual_seed(7)
    new = f["logprobs"] + 0.3 * torch.randn(f["logprobs"].shape, generator=g, dtype=torch.float64)
    m = f["mask"]
    loss, stats = policy_loss(new, f["logprobs"], f["advantages"], m, clip_range=0.2)
    # trl: pg_losses = -A * ratio; pg_losses2 = -A * clamp(ratio, 1-eps, 1+eps); masked_mean(max(...))
    tot = cnt = clip = kl = ratio_sum = 0.0
    for rn, ro, ra, rm in zip(_rows(new), _rows(f["logprobs"]), _rows(f["advantages"]), _rows(m)):
        for a_new, a_old, adv, mm in zip(rn, ro, ra, rm):
            if not mm:
                continue
            ratio = math.exp(a_new - a_old)
            l1, l2 = -adv * ratio, -adv * min(max(ratio, 0.8), 1.2)
            tot += max(l1, l2)
            clip += float(l2 > l1)
            kl += 0.5 * (a_new - a_old) ** 2
            ratio_sum += ratio
            cnt += 1
    errs = [abs(float(loss) - tot / cnt), abs(float(stats["clipfrac"]) - clip / cnt),
            abs(float(stats["approxkl"]) - kl / cnt), abs(float(stats["ratio"]) - ratio_sum / cnt)]
    assert 0 < clip < cnt  # the example exercises both branches
    # value loss: trl vf_loss = 0.5 * masked_mean(max((v - R)^2, (clamp(v, v_old +- eps) - R)^2))
    vpred = f["values"] + 0.4 * torch.randn(f["values"].shape, generator=g, dtype=torch.float64)
    vloss, vclip = value_loss(vpred, f["values"], f["returns"], m, clip_range_value=0.2)
    vt = vc = 0.0
    for rv, ro, rr, rm in zip(_rows(vpred), _rows(f["values"]), _rows(f["returns"]), _rows(m)):
        for v, vo, ret, mm in zip(rv, ro, rr, rm):
            if mm:
                vcl = min(max(v, vo - 0.2), vo + 0.2)
                vt += max((v - ret) ** 2, (vcl - ret) ** 2)
                vc += float((vcl - ret) ** 2 > (v - ret) ** 2)
    errs += [abs(float(vloss) - 0.5 * vt / cnt), abs(float(vclip) - vc / cnt)]
    print(f"clipped losses: max err {max(errs):.2e} (policy clipfrac {clip / cnt:.2f}, value clipfrac {vc / cnt:.2f})")
    assert max(errs) < TOL
    # token_count rescales (the DDP normalization): twice the count halves the loss
    half, _ = policy_loss(new, f["logprobs"], f["advantages"], m, clip_range=0.2, token_count=2 * m.sum())
    assert abs(float(half) - float(loss) / 2) < TOL
    # ratio == 1 (first update): loss = -mean(A), nothing clipped
    l0, s0 = policy_loss(f["logprobs"], f["logprobs"], f["advantages"], m, clip_range=0.2)
    assert abs(float(l0) + float(masked_mean(f["advantages"], m))) < TOL and float(s0["clipfrac"]) == 0
    # gradient flows through the unclipped branch only
    new_g = new.clone().requires_grad_(True)
    policy_loss(new_g, f["logprobs"], f["advantages"], m, clip_range=0.2)[0].backward()
    assert float(new_g.grad[~m].abs().sum()) == 0


def test_entropy_and_kl_controllers() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [10.0, -10.0, -10.0, -10.0]]])
    ent = entropy_from_logits(logits)
    assert abs(float(ent[0, 0]) - math.log(4)) < TOL and float(ent[0, 1]) < 1e-6
    fixed = make_kl_controller(0.1, adaptive=False, target=None, horizon=100)
    fixed.update(50.0, 16)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.1
    ctl = make_kl_controller(0.1, adaptive=True, target=6.0, horizon=1000)
    assert isinstance(ctl, AdaptiveKLController)
    value = 0.1
    for kl, n in ((12.0, 64), (6.6, 64), (1.0, 32)):  # clipped +20%, +10%, clipped -20%
        ctl.update(kl, n)
        value *= 1 + max(min(kl / 6.0 - 1, 0.2), -0.2) * n / 1000
        assert abs(ctl.value - value) < 1e-12
    restored = AdaptiveKLController(0.5, target=6.0, horizon=1000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="kl_target"):
        make_kl_controller(0.1, adaptive=True, target=None, horizon=10)


def test_pack_responses_masks_after_first_eos() -> None:
    eos = 9
    prompts = torch.tensor([[0, 5, 6], [7, 8, 4]])
    pmask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses = torch.tensor([[1, 9, 0, 0], [2, 3, 4, 5]])
    qr, am, pos, rmask, has_eos = pack_responses(prompts, pmask, responses, [eos])
    assert rmask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert has_eos.tolist() == [True, False]
    assert am.tolist() == [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
    assert pos[0, 1:5].tolist() == [0, 1, 2, 3] and pos[1].tolist() == list(range(7))
    assert torch.equal(qr[:, 3:], responses)
