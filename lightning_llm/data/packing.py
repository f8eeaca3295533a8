"""Packing training examples into fixed-length rows without cross-contamination.

A packed row concatenates whole examples; it carries, besides ``input_ids`` and the pre-shifted ``labels``,

* ``segment_ids``: ``1..k`` for the row's k examples (the collate pads with 0: padding), which the model turns into a
  block-diagonal causal attention mask (:func:`lightning_llm.models.layers.masks.causal_padding_mask`): a token attends
  only to earlier tokens of its own example;
* ``position_ids``: restarting at 0 for every example, so rotary / learned positions are those of the example alone.

Each example's labels are its own (pre-shifted: ``labels[t]`` is the token after ``t`` within the example, -100 where
nothing is learned), so no token is trained to predict the first token of the next example. With both, the packed
row's per-example losses and gradients equal the examples run one by one (``tests/data/test_packing.py``).

Examples are assigned to rows by best-fit decreasing (longest first, each into the fullest row it still fits; ties
by creation order): deterministic, O(n log n), with first-fit decreasing's worst case (at most 11/9 of the optimal
number of rows, + 1) where filling rows in input order can need twice the optimum. Both efficiencies are logged.
Examples within a row keep their input order.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["pack_examples", "packing_efficiency"]


def _bins(lengths: Sequence[int], max_len: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of capacity ``max_len`` (best-fit decreasing)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: the fullest bin that fits is found by bisect
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            bins.append([i])
            room, b = max_len - n, len(bins) - 1
        else:
            room, b = free.pop(at)
            bins[b].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, b))
    return [sorted(b) for b in bins]


def _check(rows: Sequence[dict[str, Any]], max_len: int) -> list[int]:
    if max_len < 1:
        raise ValueError(f"pack_examples: max_len must be >= 1, got {max_len}")
    lengths = []
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        if len(row["labels"]) != n:
            raise ValueError(f"pack_examples: row {i} has {n} input_ids but {len(row['labels'])} labels")
        if n == 0:
            raise ValueError(f"pack_examples: row {i} is empty")
        if n > max_len:
            raise ValueError(f"pack_examples: row {i} has {n} tokens, more than max_len={max_len} (rows are never "
                             "split: truncate them first)")
        lengths.append(n)
    return lengths


def pack_examples(rows: Sequence[dict[str, Any]], max_len: int) -> list[dict[str, list[int]]]:
    """Whole examples packed into rows of at most ``max_len`` tokens.

    Args:
        rows: Examples, each with ``input_ids`` and pre-shifted ``labels`` (same length, -100 where not learned);
            other keys are ignored.
        max_len: Most tokens of a packed row.

    Returns:
        Packed rows with ``input_ids``, ``labels``, ``position_ids`` (0.. per example) and ``segment_ids`` (1..k per
        example). The packing efficiency (tokens / (rows x ``max_len``)) is logged.
    """
    lengths = _check(rows, max_len)
    packed = []
    for members in _bins(lengths, max_len):
        out: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": []}
        for seg, i in enumerate(members, start=1):
            n = lengths[i]
            out["input_ids"] += list(rows[i]["input_ids"])
            out["labels"] += list(rows[i]["labels"])
            out["position_ids"] += range(n)
            out["segment_ids"] += [seg] * n
        packed.append(out)
    if packed:
        log.info("packed %d examples into %d rows of <= %d tokens: efficiency %.1f%% (greedy in order: %.1f%%)",
                 len(rows), len(packed), max_len, 100 * packing_efficiency(lengths, len(packed), max_len),
                 100 * packing_efficiency(lengths, _greedy_rows(lengths, max_len), max_len))
    return packed


def packing_efficiency(lengths: Sequence[int], n_rows: int, max_len: int) -> float:
    """Share of the ``n_rows x max_len`` token slots that hold tokens."""
    return sum(lengths) / max(n_rows * max_len, 1)


def _greedy_rows(lengths: Sequence[int], max_len: int) -> int:
    """Rows that filling in input order would need (logged for comparison)."""
    rows, used = 0, max_len
    for n in lengths:
        if used + n > max_len:
            rows, used = rows + 1, 0
        used += n
    return rows
