"""Summarization metrics as LLaMA-Factory reports them: BLEU-4 and ROUGE-1/2/L F1, per sample, averaged, x100.

LLaMA-Factory (``ComputeSimilarity``) scores each (prediction, label) pair with ``rouge_chinese.Rouge`` and
``nltk``'s ``sentence_bleu(..., smoothing_function=SmoothingFunction().method3)`` and averages over samples. This
module re-implements exactly those formulas, dependency-free, so results match those packages to float precision:

* ROUGE-N counts *distinct* n-grams (``rouge_chinese`` uses sets: "exclusive" mode), F = 2PR / (P + R + 1e-8).
* ROUGE-L is the LCS over the whole token sequences, F = 2PR / (P + R + 1e-8).
* BLEU-4: clipped n-gram precisions (n = 1..4, uniform weights), brevity penalty against the reference,
  NIST geometric smoothing (method3) for zero counts, 0 when no unigram matches.
* Either side empty after tokenization -> all ROUGE scores 0 (LLaMA-Factory's guard).

Tokenization: ``char`` (default: every non-whitespace character, the usual choice for Chinese), ``jieba`` (word
segmentation as LLaMA-Factory does for ROUGE; needs the optional ``jieba`` package) or ``whitespace``.

torchmetrics' own ``ROUGEScore`` counts n-grams with multiplicity and ``BLEUScore`` is corpus-level with a different
smoothing, so neither reproduces the reference numbers; :class:`TextSimilarity` is a ``torchmetrics.Metric``
(sums synced across ranks) built on the functions here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import torch
from torchmetrics import Metric

log = logging.getLogger(__name__)

Tokenization = Literal["char", "jieba", "whitespace"]
METRIC_NAMES = ("bleu-4", "rouge-1", "rouge-2", "rouge-l")


def tokenize_text(text: str, tokenization: Tokenization = "char") -> list[str]:
    """Split ``text`` into the units the metrics count."""
    if tokenization == "char":
        return [c for c in text if not c.isspace()]
    if tokenization == "whitespace":
        return text.split()
    if tokenization == "jieba":
        try:
            import jieba
        except ImportError as e:
            raise ImportError("metrics tokenization='jieba' needs the jieba package (pip install jieba)") from e
        return [w for w in jieba.cut(text) if w.strip()]
    raise ValueError(f"unknown metric tokenization {tokenization!r} (choose char, jieba or whitespace)")


def _ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def _f1(overlap: float, hyp_count: int, ref_count: int) -> float:
    precision = overlap / hyp_count if hyp_count else 0.0
    recall = overlap / ref_count if ref_count else 0.0
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_n(hyp: Sequence[str], ref: Sequence[str], n: int) -> float:
    """ROUGE-N F1 (0..1) over distinct n-grams, as ``rouge_chinese`` computes it."""
    h, r = set(_ngrams(hyp, n)), set(_ngrams(ref, n))
    return _f1(len(h & r), len(h), len(r))


def _lcs_len(x: Sequence[str], y: Sequence[str]) -> int:
    prev = [0] * (len(y) + 1)  # one DP row: O(len(y)) memory
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(hyp: Sequence[str], ref: Sequence[str]) -> float:
    """ROUGE-L F1 (0..1): longest common subsequence over the token sequences."""
    if not hyp or not ref:
        return 0.0
    lcs = _lcs_len(ref, hyp)
    precision, recall = lcs / len(hyp), lcs / len(ref)
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def sentence_bleu(hyp: Sequence[str], ref: Sequence[str], max_n: int = 4) -> float:
    """Sentence BLEU (0..1) with uniform weights and NIST geometric smoothing (nltk ``method3``), one reference."""
    numerators, denominators = [], []
    for n in range(1, max_n + 1):
        h = Counter(_ngrams(hyp, n)) if len(hyp) >= n else Counter()
        r = Counter(_ngrams(ref, n)) if len(ref) >= n else Counter()
        numerators.append(sum(min(c, r[g]) for g, c in h.items()))
        denominators.append(max(1, sum(h.values())))
    if numerators[0] == 0:
        return 0.0
    hyp_len, ref_len = len(hyp), len(ref)
    bp = 1.0 if hyp_len > ref_len else (0.0 if hyp_len == 0 else math.exp(1 - ref_len / hyp_len))
    log_sum, k = [], 1
    for num, den in zip(numerators, denominators):
        if num == 0:  # method3: 1 / (2^k * denominator) for the k-th zero precision
            p = 1 / (2 ** k * den)
            k += 1
        else:
            p = num / den
        log_sum.append(math.log(p) / max_n)
    return bp * math.exp(math.fsum(log_sum))


def pair_scores(prediction: str, label: str, tokenization: Tokenization = "char") -> dict[str, float]:
    """All four scores (x100) for one pair, by LLaMA-Factory name without the ``predict_`` prefix."""
    hyp, ref = tokenize_text(prediction, tokenization), tokenize_text(label, tokenization)
    if not hyp or not ref:
        rouge = {"rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    else:
        rouge = {"rouge-1": rouge_n(hyp, ref, 1), "rouge-2": rouge_n(hyp, ref, 2), "rouge-l": rouge_l(hyp, ref)}
    return {"bleu-4": sentence_bleu(hyp, ref) * 100, **{k: v * 100 for k, v in rouge.items()}}


class TextSimilarity(Metric):
    """Mean per-sample BLEU-4 / ROUGE-1 / ROUGE-2 / ROUGE-L (x100) over all updates and ranks.

    ``compute()`` returns ``{prefix + name: tensor}`` with names ``bleu-4``, ``rouge-1``, ``rouge-2``, ``rouge-l``.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, *, tokenization: Tokenization = "char", prefix: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        tokenize_text("", tokenization)  # validate the name now
        self.tokenization: Tokenization = tokenization
        self.prefix = prefix
        self.add_state("sums", default=torch.zeros(len(METRIC_NAMES), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, predictions: Sequence[str], labels: Sequence[str]) -> None:  # type: ignore[override]
        if len(predictions) != len(labels):
            raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
        for pred, label in zip(predictions, labels):
            scores = pair_scores(pred, label, self.tokenization)
            self.sums += torch.tensor([scores[k] for k in METRIC_NAMES], dtype=torch.float64, device=self.sums.device)
            self.count += 1

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        mean = self.sums / self.count.clamp(min=1)
        return {f"{self.prefix}{name}": mean[i] for i, name in enumerate(METRIC_NAMES)}
