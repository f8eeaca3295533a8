"""What a decoding step does with the next-token logits: the penalties and filters of the settings, the token picked
(argmax, a generator's draw or the inverse CDF of a pre-drawn uniform), and where a batch's generation ended.

Pure tensor functions of the eager loop (:mod:`.loop`) and of the compiled static-cache step (:mod:`.static`): no
host value is read, so they trace into one graph.

Shape legend: R rows, V vocabulary, T tokens so far, N new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .config import GenerationConfig

__all__ = ["STOP_CHECK_EVERY", "choose_tokens", "ended_width", "inverse_cdf", "last_logits", "pick", "process_logits",
           "strip_after_eos"]

STOP_CHECK_EVERY = 8
"""Decoding steps between two reads of whether every row has ended (the stop condition stays on the device; the
steps in between give rows that ended padding, and the output is cut where the last row ended)."""


def strip_after_eos(tokens: Tensor, eos_ids: Sequence[int]) -> list[list[int]]:
    """Generated tokens [B, N] -> per-row lists cut before the first EOS (EOS itself removed)."""
    out = []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:cut])
    return out


def process_logits(logits: Tensor, seqs: Tensor, cfg: GenerationConfig) -> Tensor:
    """Repetition penalty, then temperature / top-k / top-p for sampling. logits [R, V] fp32, seqs [R, T]."""
    if cfg.repetition_penalty != 1.0:
        prev = logits.gather(1, seqs)
        prev = torch.where(prev < 0, prev * cfg.repetition_penalty, prev / cfg.repetition_penalty)
        logits = logits.scatter(1, seqs, prev)
    if not cfg.do_sample:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= cfg.top_p  # tokens entirely beyond the nucleus (top-1 always kept)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def last_logits(out: Tensor) -> Tensor:
    """Logits of the last position as a plain fp32 tensor [R, V]. Under tensor parallelism the model returns
    vocab-sharded DTensor logits (the loss never gathers them); decoding needs the whole row, so gather it."""
    out = out[:, -1]
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return out.float()


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token [R] whose CDF interval holds ``u`` [R] (in [0, 1)), per row of ``probs`` [R, V]. fp64 cumulative
    sums: the last bucket's edge stays within ~1e-16 of the total. Zero-probability tokens have empty intervals."""
    cdf = probs.double().cumsum(-1)  # [R, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [R, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def pick(scores: Tensor, cfg: GenerationConfig, *, uniform: Tensor | None = None,
         generator: torch.Generator | None = None) -> Tensor:
    """The tokens [R] of processed ``scores`` [R, V]: the argmax, the inverse CDF at ``uniform`` [R], or a draw of
    ``torch.multinomial`` from ``generator`` (rows in sequence)."""
    if cfg.do_sample and uniform is not None:
        return inverse_cdf(scores.softmax(-1), uniform)
    if cfg.do_sample:
        return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
    return scores.argmax(-1)


def choose_tokens(logits: Tensor, seqs: Tensor, finished: Tensor, cfg: GenerationConfig, eos: Tensor, *,
                  uniform: Tensor | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """One step's ``(tokens [R], finished [R])`` from the logits [R, V] fp32, the tokens so far ``seqs`` [R, T] and
    which rows had ended (they get ``pad_token_id``); a row ends at a token of ``eos`` [E]."""
    token = pick(process_logits(logits, seqs, cfg), cfg, uniform=uniform, generator=generator)
    token = torch.where(finished, torch.full_like(token, cfg.pad_token_id), token)
    if eos.numel():
        finished = finished | torch.isin(token, eos)
    return token, finished


def ended_width(generated: Tensor, eos: Tensor) -> Tensor:
    """Columns of ``generated`` [R, N] up to and including the step at which every row had ended (its first EOS),
    or all N where some row did not end: what a loop that stopped at that step returns (0-dim long)."""
    is_eos = torch.isin(generated, eos)  # [R, N]
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), generated.shape[1] - 1)  # [R]
    return torch.where(is_eos.any(-1).all(), first.max() + 1, generated.shape[1])
