"""The pre-engine sharded checkpoint layout of ``strategy=tp`` / native ZeRO-3 (Lightning's ``ModelParallelStrategy``
layout), kept so that ``lightning_llm export`` reads such directories (:func:`lightning_llm.export.read_checkpoint`)::

    <dir>/.metadata, <dir>/__<rank>_0.distcp   DCP files: {"state_dict": model, "optimizer_0": ..., ...}
    <dir>/meta.pt                              everything else Lightning puts in a checkpoint (loops, callbacks, ...)

Every native layout now writes the engine's layout-free format instead (:mod:`.hybrid_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["METADATA_FILENAME", "is_sharded_checkpoint", "save_sharded"]

METADATA_FILENAME = "meta.pt"
"""Non-tensor checkpoint contents, written by rank 0 next to the DCP files (Lightning's name)."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A directory in this layout."""
    p = Path(path)
    return p.is_dir() and (p / METADATA_FILENAME).is_file()


def save_sharded(
    path: str | Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a directory in this layout (each rank its own shards, rank 0 the metadata): what older runs saved."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"state_dict": dict(model_state)}
    state.update({f"optimizer_{i}": dict(s) for i, s in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=p)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        torch.save(dict(metadata or {}), p / METADATA_FILENAME)
    return p
