"""A run refused while it sets up (bad data found by the datamodule's ``setup``, a model that cannot be built) leaves
no run directory behind.

Lightning makes the loggers' directories (``runs/NAME/version_N``) before it calls the datamodule's ``setup``, where
the data is read and checked, so a refused run would leave an empty ``version_N`` per attempt. :func:`fresh_run_dirs`
names, before the run, the log directories (and their parents) that do not exist yet; :func:`remove_unused` removes
those of them that hold nothing but what a run writes as it starts: empty files, the saved ``config.yaml`` /
``hparams.yaml``, a TensorBoard event file holding only its header. A run that logged a metric or saved a checkpoint
keeps its directory.
"""

from __future__ import annotations

import logging
import shutil
import struct
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["fresh_run_dirs", "remove_unused"]

START_FILES = ("config.yaml", "hparams.yaml")
"""Files a run writes as it starts (LightningCLI's saved config, the loggers' hyper-parameters)."""


def fresh_run_dirs(trainer: Any) -> list[Path]:
    """The loggers' directories this run would create, and their parents that do not exist yet (deepest first)."""
    out: list[Path] = []
    for logger in trainer.loggers:
        log_dir = getattr(logger, "log_dir", None)
        p = Path(log_dir).absolute() if log_dir else None
        while p is not None and not p.exists() and p not in out and p != p.parent:
            out.append(p)
            p = p.parent
    return out


def _header_only_events(p: Path) -> bool:
    """A TensorBoard event file holding one record (the file-version header every writer starts with): TFRecord
    framing, ``uint64 length | uint32 crc | data | uint32 crc``."""
    data = p.read_bytes()
    if len(data) < 12:
        return False
    (length,) = struct.unpack("<Q", data[:8])
    return len(data) == 8 + 4 + length + 4


def _unused(p: Path) -> bool:
    if p.is_symlink():
        return False
    if p.is_dir():
        return all(_unused(c) for c in p.iterdir())
    if p.name.startswith("events.out.tfevents."):
        return _header_only_events(p)
    return p.stat().st_size == 0 or p.name in START_FILES


def remove_unused(dirs: list[Path]) -> None:
    """Remove each of ``dirs`` (deepest first) that exists and holds nothing of a run (see the module docstring)."""
    for d in dirs:
        try:
            if d.is_dir() and _unused(d):
                shutil.rmtree(d)
                log.debug("removed %s: the run was refused before it wrote anything there", d)
        except OSError as e:  # another process's files, a race with a peer: leave it
            log.debug("kept %s: %s", d, e)
