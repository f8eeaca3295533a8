"""The weight mapping: for a config and an HF class, the list of entries (HF key <-> our keys, with split and merge
functions) that loading and saving walk, generated from the config by the class's family record
(``Family.entries``), so missing and unexpected keys are reported by name."""

from __future__ import annotations

import re

from torch import Tensor

from ...config import ModelConfig
from ..record.entries import Entry, Fused, Stacked
from .architectures import SUPPORTED_ARCHITECTURES, layout_kind
from .registry import family

__all__ = ["IGNORED", "base_prefix", "entries", "head_keys", "save_entries"]

IGNORED = re.compile(
    r"(^|\.)attn\.(masked_)?bias$|(^|\.)position_ids$|(^|\.)token_type_ids$|(^|\.)rotary_emb\.inv_freq$"
)
"""Checkpoint keys that carry no weights we need (buffers that old versions persisted)."""


def base_prefix(kind: str) -> str:
    """The base model's prefix of a weight layout's keys (``model.layers.0...``)."""
    return family(kind).base_prefix


def head_keys(kind: str) -> re.Pattern[str]:
    """Head weights of other tasks in a layout's checkpoints: dropped with a warning."""
    return family(kind).head_keys


def entries(config: ModelConfig, architecture: str) -> list[Entry | Stacked | Fused]:
    """The mapping of ``architecture``'s keys (without the base prefix, but for ``top`` entries) to ours (a
    multimodal class: its language model's)."""
    return family(layout_kind(architecture)).entries(config, SUPPORTED_ARCHITECTURES[architecture].head)


def save_entries(config: ModelConfig, architecture: str, sd: dict[str, Tensor]) -> list[Entry]:
    """The entries of :func:`entries` with each fused expert tensor written per expert and part (the rows of an
    expert's gate and up projections: half each)."""
    out: list[Entry] = []
    for e in entries(config, architecture):
        if isinstance(e, Fused):
            out.append(e.save_entry())
        elif isinstance(e, Stacked):
            t = sd.get(e.ours)
            if t is None:
                out.append(Entry(e.hf[0][0], (e.ours,)))  # reported missing by the caller
                continue
            out += e.save_entries([t.shape[1] // len(e.hf[0])] * len(e.hf[0]))
        else:
            out.append(e)
    return out
