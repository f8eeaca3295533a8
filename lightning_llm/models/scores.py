"""A sequence classifier's scores (``DecoderLM`` with ``config.num_labels > 0``, a reward model): which token of a row
scores it, by transformers' rule for ``...ForSequenceClassification``, and the row's scores read there.

Shape legend: B batch, S sequence, L labels.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["score_mask", "score_positions", "sequence_scores"]


def score_positions(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """[B] the column of each row's last token that is not padding, by transformers' rule for
    ``...ForSequenceClassification``: the rightmost token whose id is not ``pad_token_id`` (0 for a row of padding), so
    left- and right-padded rows score the same token. A row ending in tokens equal to the pad id (a tokenizer whose
    pad token is its EOS) is scored before them, as transformers scores it."""
    columns = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    return (columns * (input_ids != pad_token_id).to(torch.int32)).argmax(-1)


def score_mask(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """[B, S] bool, True at each row's :func:`score_positions` column."""
    columns = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return columns == score_positions(input_ids, pad_token_id).unsqueeze(-1)


def sequence_scores(scores: Tensor, input_ids: Tensor, pad_token_id: int) -> Tensor:
    """A sequence classifier's scores [B, L] from its per-position scores [B, S, L]: each row's at
    :func:`score_positions`."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    return scores[rows, score_positions(input_ids, pad_token_id).to(scores.device)]
