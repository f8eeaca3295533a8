"""Mixtures of corpora in fixed shares (Megatron's ``data_path: [w1, p1, w2, p2]``).

An epoch holds as many samples as the corpora hold training blocks together; corpus ``c`` gets ``w_c`` of them
(largest-remainder rounding, so the counts are exact). Its ``n_c`` samples are its blocks in order, repeated as
often as ``n_c`` covers them whole, then ``n_c mod B_c`` blocks spread evenly over the corpus (a corpus of weight
below its size's share is subsampled evenly). The training sampler then shuffles the epoch by seed
(``LLMDataModule.make_loader``), so batches mix the corpora at their weights, every data-parallel layout sees the
same global batches, and a mid-epoch resume skips exactly the samples consumed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset


def parse_data_path(data_path: str | Sequence[Any] | None, *, param: str = "--data.data_path"
                    ) -> list[tuple[float, tuple[str, ...]]]:
    """``[(weight, paths)]`` of each corpus: one corpus of weight 1 for a path or a list of paths, one per pair for
    ``[w1, p1, w2, p2, ...]`` (weights normalized to sum 1); ``[]`` for ``None`` (the generated corpus)."""
    if data_path is None:
        return []
    if isinstance(data_path, str):
        return [(1.0, (data_path,))]
    items = list(data_path)
    if not items:
        raise ValueError(f"{param}: an empty list (give a path, a list of paths or [weight, path, weight, path, ...])")
    if all(isinstance(x, str) and not _is_number(x) for x in items):
        return [(1.0, tuple(items))]
    if len(items) % 2 or not all(_is_number(w) for w in items[::2]) or any(_is_number(p) for p in items[1::2]):
        raise ValueError(f"{param}={items}: a mixture is [weight, path, weight, path, ...] (numbers at even "
                         "positions, paths after each)")
    weights = [float(w) for w in items[::2]]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"{param}={items}: mixture weights must be positive numbers")
    total = sum(weights)
    return [(w / total, (str(p),)) for w, p in zip(weights, items[1::2], strict=True)]


def _is_number(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float)):
        return True
    try:
        float(x)
    except (TypeError, ValueError):
        return False
    return True


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """``round(w * total)`` per weight, summing exactly to ``total`` (largest remainders get the leftover)."""
    raw = [w * total for w in weights]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDataset(Dataset):
    """``parts`` (map-style datasets) drawn in shares ``weights`` over an epoch of ``total`` samples (default: all
    parts' samples together); see the module docstring for which samples."""

    def __init__(self, parts: Sequence[Dataset], weights: Sequence[float], total: int | None = None) -> None:
        self.parts = list(parts)
        sizes = [len(p) for p in self.parts]
        self.total = sum(sizes) if total is None else total
        self.counts = mixture_counts(weights, self.total)
        for c, (n, size) in enumerate(zip(self.counts, sizes, strict=True)):
            if n and not size:
                raise ValueError(f"mixture corpus {c + 1} has no samples to draw {n} from")
        self.offsets = [0]
        for n in self.counts:
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self) -> int:
        return self.total

    def locate(self, k: int) -> tuple[int, int]:
        """``(corpus, index in that corpus)`` of sample ``k``."""
        if not 0 <= k < self.total:
            raise IndexError(k)
        c = bisect.bisect_right(self.offsets, k) - 1
        t, n, size = k - self.offsets[c], self.counts[c], len(self.parts[c])
        whole = n // size * size  # samples covering the corpus whole, in order
        return c, (t % size if t < whole else (t - whole) * size // (n - whole))

    def __getitem__(self, k: int) -> Any:
        c, i = self.locate(k)
        return self.parts[c][i]
