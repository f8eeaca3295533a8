"""Checkpoints of ``strategy=pp``: a directory with one file per pipeline rank.

Each file holds that rank's shard of the weights (global parameter names), its optimizer state, the loop state and
the ``pipeline_layout`` it was saved with; loading checks the layout matches. :func:`consolidate_checkpoint` merges
the shards into one single-device checkpoint (weights only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_llm.strategies.pipeline_split import StageSpec

__all__ = ["CHECKPOINT_FILE", "pipeline_layout", "stage_checkpoint_file", "check_layout", "consolidate_checkpoint"]

CHECKPOINT_FILE = "pp-stage-rank-{:02d}.ckpt"


def pipeline_layout(
    *, pp_size: int, stages_per_rank: int, placement: str, specs: Sequence[StageSpec]
) -> dict[str, Any]:
    """What a shard depends on: resuming needs the same degrees, placement and this rank's stages/blocks."""
    return {"pipeline_parallel_size": pp_size, "stages_per_rank": stages_per_rank, "schedule_placement": placement,
            "stages": [[s.index, list(s.layers)] for s in specs]}


def stage_checkpoint_file(path: str | Path, pp_rank: int, *, must_exist: bool = False) -> Path:
    """The file of pipeline rank ``pp_rank`` in checkpoint directory ``path``."""
    file = Path(path) / CHECKPOINT_FILE.format(pp_rank)
    if must_exist and not file.is_file():
        raise FileNotFoundError(f"--ckpt_path={path}: not a strategy=pp checkpoint directory "
                                f"(missing {file.name}); pipeline checkpoints hold one file per pipeline rank")
    return file


def check_layout(checkpoint: dict[str, Any], layout: dict[str, Any], path: str | Path) -> None:
    """Raise when a loaded shard was saved with a different pipeline layout than this run's."""
    saved = checkpoint.get("pipeline_layout")
    if saved != layout:
        raise ValueError(f"--ckpt_path={path}: saved with pipeline layout {saved}, but this run uses "
                         f"{layout}; resume with the same pipeline_parallel_size, stages_per_rank and split (or merge "
                         "the shards with consolidate_checkpoint)")


def consolidate_checkpoint(path: str | Path) -> dict[str, Any]:
    """Merge a ``strategy=pp`` checkpoint directory into one single-device checkpoint dict (weights only; the
    optimizer states stay per stage). Load it with ``Trainer(..., ckpt_path=...)`` after ``torch.save``."""
    files = sorted(Path(path).glob(CHECKPOINT_FILE.replace("{:02d}", "*")))
    if not files:
        raise FileNotFoundError(f"{path}: no {CHECKPOINT_FILE.format(0)}-style files")
    shards = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    merged = {k: v for k, v in shards[0].items() if k not in ("state_dict", "optimizer_states", "pipeline_layout")}
    merged["state_dict"] = {k: v for s in shards for k, v in s["state_dict"].items()}
    merged["optimizer_states"] = []
    return merged
