"""The pre-engine checkpoints of ``strategy=pp``: a directory with one file per pipeline rank, kept so that
``lightning_llm export`` reads them (every native layout now writes :mod:`.hybrid_checkpoint`'s format).

Each file holds that rank's shard of the weights (global parameter names), its optimizer state and the loop state;
:func:`consolidate_checkpoint` merges the shards into one single-device checkpoint (weights only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_FILE", "stage_checkpoint_file", "consolidate_checkpoint"]

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
    shards = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    merged = {k: v for k, v in shards[0].items() if k not in ("state_dict", "optimizer_states", "pipeline_layout")}
    merged["state_dict"] = {k: v for s in shards for k, v in s["state_dict"].items()}
    merged["optimizer_states"] = []
    return merged
