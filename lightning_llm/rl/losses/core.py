"""PPO and GRPO math on padded per-token tensors, as pure functions (no model, no Lightning).

Every tensor is ``[B, N]`` over response tokens (B rollouts, N = longest response) with a boolean/0-1 ``mask``
marking real tokens (a response's tokens up to and including its EOS). Formulas follow trl's ``PPOTrainer``
(``masked_whiten``, GAE, clipped policy/value losses, k1/k3 KL estimators) and J. Schulman's note
"Approximating KL divergence" (k1, k2, k3).

Distributed use: the functions that reduce over the batch take ``all_reduce`` (a function returning the SUM of a
tensor over data-parallel ranks) so statistics are global, and the losses take ``token_count`` (the global number
of masked tokens divided by the world size) so that DDP's gradient average of the per-rank losses equals the
single-device masked mean over the union of the ranks' tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "GRPO_LOSS_TYPES", "IMPORTANCE_SAMPLING_LEVELS", "KLEstimator", "entropy_from_logits", "gae", "group_advantages",
    "grpo_loss", "importance_log_weights", "kl_penalty", "logprobs_from_logits", "masked_mean", "masked_var", "masked_whiten", "per_token_rewards", "policy_loss", "value_loss",
]

AllReduce = Callable[[Tensor], Tensor]
KLEstimator = Literal["k1", "k2", "k3"]


def _sum(x: Tensor, all_reduce: AllReduce | None) -> Tensor:
    return all_reduce(x) if all_reduce is not None else x


def masked_mean(values: Tensor, mask: Tensor, *, all_reduce: AllReduce | None = None) -> Tensor:
    """Mean of ``values`` where ``mask`` is set (over all ranks with ``all_reduce``). Scalar."""
    mask = mask.to(values.dtype)
    total = torch.stack([(values * mask).sum(), mask.sum()])
    total = _sum(total, all_reduce)
    return total[0] / total[1]


def masked_var(values: Tensor, mask: Tensor, *, unbiased: bool = True, all_reduce: AllReduce | None = None) -> Tensor:
    """Variance where ``mask`` is set (two-pass; Bessel-corrected like trl's ``masked_var`` when ``unbiased``)."""
    mean = masked_mean(values, mask, all_reduce=all_reduce)
    m = mask.to(values.dtype)
    total = _sum(torch.stack([((values - mean) ** 2 * m).sum(), m.sum()]), all_reduce)
    var = total[0] / total[1]
    if unbiased:
        if float(total[1]) < 2:
            raise ValueError("masked_var: need at least two masked values for an unbiased variance")
        var = var * total[1] / (total[1] - 1)
    return var


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
                  all_reduce: AllReduce | None = None) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` with masked statistics; ``shift_mean=False`` adds the mean back
    (trl's reward whitening). Positions outside the mask are transformed too; callers zero them."""
    mean = masked_mean(values, mask, all_reduce=all_reduce)
    var = masked_var(values, mask, all_reduce=all_reduce)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) under ``softmax(logits)``: logits [B, N, V], tokens [B, N] -> [B, N] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` per position: [B, N, V] -> [B, N] (``logsumexp - sum p * logits``)."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k1") -> Tensor:
    """Per-token estimate of KL(policy || ref) from log-probs of tokens SAMPLED FROM THE POLICY.

    With ``log r = ref - policy``: k1 = ``-log r`` (unbiased, can be negative), k2 = ``(log r)^2 / 2`` (low
    variance, biased), k3 = ``(r - 1) - log r`` (unbiased and >= 0; trl's ``kl_estimator="k3"``).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


def per_token_rewards(kl: Tensor, scores: Tensor, mask: Tensor, *, kl_coef: float) -> tuple[Tensor, Tensor]:
    """``rewards = -kl_coef * kl`` on every response token, plus the sequence ``scores`` [B] on each row's LAST
    masked token. Returns (rewards [B, N], non_score_rewards [B, N]), zero outside the mask."""
    m = mask.to(kl.dtype)
    non_score = -kl_coef * kl * m
    last = (m.cumsum(-1) * m).argmax(-1)  # index of each row's last real token  [B]
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.to(rewards.dtype)
    return rewards, non_score


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over response tokens (Schulman et al. 2016), as trl computes it.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}`` with ``V`` and ``r``
    zero past each row's end (so the value after the last token is 0: the episode ends there).
    Returns (advantages [B, N], returns = advantages + values [B, N]), zero outside the mask.

    A mask with gaps (a multi-turn episode: the environment's tokens between the policy's turns are not actions)
    chains the masked tokens in order: ``t + 1`` is the row's next masked token (the masked tokens are moved to the
    front of each row, a stable sort, and moved back after; a gap-free mask is left as it is).
    """
    order = torch.sort((~mask.bool()).int(), dim=1, stable=True).indices  # [B, N] masked tokens first, in order
    mask, values, rewards = mask.gather(1, order), values.gather(1, order), rewards.gather(1, order)
    m = mask.to(values.dtype)
    values, rewards = values * m, rewards * m
    n = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    out = [torch.zeros_like(last)] * n
    for t in reversed(range(n)):
        next_value = values[:, t + 1] if t + 1 < n else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        out[t] = last
    advantages = torch.stack(out, dim=1) * m
    back = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=order.device).expand_as(order))
    return advantages.gather(1, back), ((advantages + values) * m).gather(1, back)


def _denominator(mask: Tensor, token_count: Tensor | float | None) -> Tensor | float:
    return mask.sum() if token_count is None else token_count


def policy_loss(new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_range: float,
                token_count: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate: mean over masked tokens of ``max(-A * ratio, -A * clip(ratio, 1 +- eps))``.

    Returns (loss, stats) with ``clipfrac`` (share of tokens where the clipped branch is larger), ``approxkl``
    (``0.5 * mean(log ratio^2)``) and ``ratio`` (mean ratio); stats are local (not all-reduced) sums/means over
    this mini-batch's masked tokens, divided by ``token_count`` when given.
    """
    m = mask.to(new_logprobs.dtype)
    denom = _denominator(m, token_count)
    log_ratio = (new_logprobs - old_logprobs) * m
    ratio = torch.exp(log_ratio)
    losses = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = (torch.maximum(losses, clipped) * m).sum() / denom
    with torch.no_grad():
        stats = {
            "clipfrac": ((clipped > losses).to(m.dtype) * m).sum() / denom,
            "approxkl": 0.5 * (log_ratio**2 * m).sum() / denom,
            "ratio": (ratio * m).sum() / denom,
        }
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_range_value: float,
               token_count: Tensor | float | None = None) -> tuple[Tensor, Tensor]:
    """Clipped value loss ``0.5 * mean(max((V - R)^2, (clip(V, V_old +- eps) - R)^2))`` over masked tokens.
    Returns (loss, clipfrac)."""
    m = mask.to(values.dtype)
    denom = _denominator(m, token_count)
    clipped = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
    losses1 = (values - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(losses1, losses2) * m).sum() / denom
    with torch.no_grad():
        clipfrac = ((losses2 > losses1).to(m.dtype) * m).sum() / denom
    return loss, clipfrac


# ---------------------------------------------------------------------------------------------------- GRPO


def group_advantages(scores: Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4
                     ) -> tuple[Tensor, Tensor]:
    """GRPO's group-relative advantages of ``scores`` [B * G] (the G responses of a prompt adjacent):
    ``A = (r - mean_group) / (std_group + eps)`` with the unbiased (Bessel) group std, as trl; ``scale=False``
    only centres. Returns (advantages [B * G], group std [B])."""
    grouped = scores.view(-1, group_size)  # [B, G]
    std = grouped.std(dim=1)  # [B]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = centred / (std[:, None] + eps) if scale else centred
    return advantages.reshape(-1), std


GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "cispo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def importance_log_weights(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Log importance weights of the masked per-token log-ratios [B, N]: ``token``: themselves [B, N]; ``sequence``
    (GSPO, Zheng et al. 2025): each response's mean log-ratio over its tokens [B, 1] (0 for an empty response)."""
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    raise ValueError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, got {level!r}")


def grpo_loss(new_logprobs: Tensor, old_logprobs: Tensor, ref_logprobs: Tensor | None, advantages: Tensor,
              mask: Tensor, *, clip_range: float, beta: float, kl_estimator: KLEstimator = "k3",
              loss_type: str = "grpo", clip_range_high: float | None = None, delta: float | None = None,
              importance_sampling_level: str = "token", max_new_tokens: int | None = None,
              seq_count: Tensor | float | None = None, token_count: Tensor | float | None = None
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO-family loss of a mini-batch; every tensor ``[B, N]`` over response tokens (``advantages`` broadcast
    over each response's tokens). With ``w`` the importance weight (``importance_sampling_level``: per token
    ``exp(new - old)``, or per response ``exp(mean_t(new - old))``, GSPO), ``eps_lo = clip_range``, ``eps_hi =
    clip_range_high`` (default ``clip_range``; DAPO's clip-higher)::

        grpo, dapo, dr_grpo:  l_t = -min(min(w, delta) * A, clip(w, 1 - eps_lo, 1 + eps_hi) * A)   (delta: INTELLECT-2)
        cispo (MiniMax-M1):   l_t = -sg(min(w, 1 + eps_hi)) * A * new_t
        every type:           l_t += beta * KL_t,   KL_t = kl_penalty(new, ref)  (k3: exp(ref - new) - (ref - new) - 1)

    reduced over the masked tokens: ``grpo`` the mean over responses of each response's token mean (``seq_count``
    responses, default B); ``dapo`` and ``cispo`` the token mean (``token_count``, default their number); ``dr_grpo``
    the token sum over ``seq_count * max_new_tokens`` (a constant, Liu et al. 2025). Under data parallelism pass the
    GLOBAL counts divided by the world size, so DDP's gradient mean is the global mini-batch's loss gradient.

    Stats (local shares of global token means, divided by ``token_count``): ``ratio`` (the importance weight),
    ``clipfrac`` (tokens whose weight the clip bounded: the clipped branch taken; cispo: ``w > 1 + eps_hi``),
    ``approxkl`` (``0.5 * log ratio^2``), ``kl`` (KL_t to the reference; only with ``beta > 0``) and ``policy``.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}")
    m = mask.to(new_logprobs.dtype)
    tokens = m.sum().clamp(min=1) if token_count is None else token_count  # no token: a loss of 0, not 0/0
    seqs = m.shape[0] if seq_count is None else seq_count
    high = clip_range if clip_range_high is None else clip_range_high
    log_ratio = (new_logprobs - old_logprobs) * m
    weight = torch.exp(importance_log_weights(log_ratio, m, importance_sampling_level))  # [B, N] or [B, 1]
    # sequence level: a response's advantage [B, 1] (its tokens all carry it)
    a = advantages if importance_sampling_level == "token" else \
        ((advantages * m).sum(-1) / m.sum(-1).clamp(min=1))[:, None]
    if loss_type == "cispo":
        bounded = torch.clamp(weight, max=1.0 + high)
        per_token = -bounded.detach() * a * new_logprobs
        clipped_mask = weight > 1.0 + high
    else:
        unclipped = -a * (weight if delta is None else torch.clamp(weight, max=delta))
        clipped = -a * torch.clamp(weight, 1.0 - clip_range, 1.0 + high)
        per_token = torch.maximum(unclipped, clipped)  # = -min(w A, clip(w) A)
        clipped_mask = clipped > unclipped
    kl = None
    if beta != 0:
        if ref_logprobs is None:
            raise ValueError("grpo_loss: beta > 0 needs the reference log-probs")
        kl = kl_penalty(new_logprobs, ref_logprobs, kl_estimator) * m
        per_token = per_token + beta * kl
    per_token = per_token.expand_as(m) if per_token.shape != m.shape else per_token  # sequence level: [B, 1]
    if loss_type == "grpo":
        loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / seqs
    elif loss_type == "dr_grpo":
        if max_new_tokens is None:
            raise ValueError("grpo_loss: loss_type='dr_grpo' divides by responses x max_new_tokens: pass max_new_tokens")
        loss = (per_token * m).sum() / (seqs * max_new_tokens)
    else:
        loss = (per_token * m).sum() / tokens
    with torch.no_grad():
        stats = {
            "ratio": (weight.expand_as(m) * m).sum() / tokens,
            "clipfrac": (clipped_mask.expand_as(m).to(m.dtype) * m).sum() / tokens,
            "approxkl": 0.5 * (log_ratio**2 * m).sum() / tokens,
            "policy": loss.detach(),
        }
        if kl is not None:
            stats["kl"] = kl.sum() / tokens
    return loss, stats
