"""Readers of the checkpoint formats our strategies wrote before the engine's layout-free format
(:mod:`lightning_llm.strategies.engine.hybrid_checkpoint`), kept so that ``lightning_llm export`` reads such directories
(:func:`lightning_llm.export.checkpoint.read_checkpoint`); the writers are kept to make such directories in tests.

* ``strategy=tp`` / native ZeRO-3 (Lightning's ``ModelParallelStrategy`` layout)::

      <dir>/.metadata, <dir>/__<rank>_0.distcp   DCP files: {"state_dict": model, "optimizer_0": ..., ...}
      <dir>/meta.pt                              everything else Lightning puts in a checkpoint (loops, callbacks, ...)

* ``strategy=pp``: a directory with one file per pipeline rank (:data:`CHECKPOINT_FILE`), each holding that rank's
  shard of the weights (global parameter names), its optimizer state and the loop state; :func:`consolidate_checkpoint`
  merges the shards into one single-device checkpoint (weights only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_llm.checkpoint import load_file
from lightning_llm.strategies.engine.hybrid_checkpoint import dcp_contents

__all__ = ["CHECKPOINT_FILE", "METADATA_FILENAME", "consolidate_checkpoint", "is_pipeline_checkpoint",
           "is_sharded_checkpoint", "read_sharded", "save_sharded", "stage_checkpoint_file"]

METADATA_FILENAME = "meta.pt"
"""Non-tensor checkpoint contents, written by rank 0 next to the DCP files (Lightning's name)."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A directory in the ``tp`` / ZeRO-3 layout."""
    p = Path(path)
    return p.is_dir() and (p / METADATA_FILENAME).is_file()


def save_sharded(
    path: str | Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a directory in the ``tp`` / ZeRO-3 layout (each rank its own shards, rank 0 the metadata), as older runs
    did."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"state_dict": dict(model_state)}
    state.update({f"optimizer_{i}": dict(s) for i, s in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=p)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        torch.save(dict(metadata or {}), p / METADATA_FILENAME)
    return p


def read_sharded(path: Path, *, name: str | None = None) -> dict[str, Any]:
    """A directory in the ``tp`` / ZeRO-3 layout as one checkpoint dict (every tensor loaded whole on this process, no
    process group; optimizer states dropped)."""
    meta = load_file(path / METADATA_FILENAME, name=f"{name or path}: {METADATA_FILENAME}")
    return {**meta, "state_dict": dict(dcp_contents(path, name=name).get("state_dict", {})), "optimizer_states": []}


CHECKPOINT_FILE = "pp-stage-rank-{:02d}.ckpt"


def stage_checkpoint_file(path: str | Path, pp_rank: int, *, must_exist: bool = False) -> Path:
    """The file of pipeline rank ``pp_rank`` in checkpoint directory ``path``."""
    file = Path(path) / CHECKPOINT_FILE.format(pp_rank)
    if must_exist and not file.is_file():
        raise FileNotFoundError(f"--ckpt_path={path}: not a strategy=pp checkpoint directory "
                                f"(missing {file.name}); pipeline checkpoints hold one file per pipeline rank")
    return file


def consolidate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Merge a ``strategy=pp`` checkpoint directory into one single-device checkpoint dict (weights only; the
    optimizer states stay per stage). Load it with ``Trainer(..., ckpt_path=...)`` after ``torch.save``."""
    files = sorted(Path(path).glob(CHECKPOINT_FILE.replace("{:02d}", "*")))
    if not files:
        raise FileNotFoundError(f"{path}: no {CHECKPOINT_FILE.format(0)}-style files")
    shards = [load_file(f, name=f"{path}: {f.name}") for f in files]
    merged = {k: v for k, v in shards[0].items() if k not in ("state_dict", "optimizer_states", "pipeline_layout")}
    merged["state_dict"] = {k: v for s in shards for k, v in s["state_dict"].items()}
    merged["optimizer_states"] = []
    return merged


def is_pipeline_checkpoint(path: Path) -> bool:
    """A ``strategy=pp`` directory (one file per pipeline rank)."""
    return any(path.glob(CHECKPOINT_FILE.replace("{:02d}", "*")))
