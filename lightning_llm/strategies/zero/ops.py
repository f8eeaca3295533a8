"""DeepSpeed's C++ ops built by torch on first use (``async_io`` for ``deepspeed_zero3_nvme``, ``cpu_adam`` for
``optimizer=cpu_adam``): a build killed mid-way leaves its lock behind, and every later load waits on it with no
word (torch's ``FileBaton`` has no timeout). Checked here before the op is loaded."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch.utils.cpp_extension

__all__ = ["STALE_BUILD_LOCK_S", "check_build_lock"]

STALE_BUILD_LOCK_S = 3600
"""An op's build lock older than this is left by a build that was killed (a build takes minutes)."""


def check_build_lock(name: str, *, stale_s: float = STALE_BUILD_LOCK_S) -> None:
    """Raise ``ValueError`` (one line) when torch's JIT build of the op ``name`` would wait forever: a build killed
    mid-way leaves its ``lock`` file behind, and every later load waits for that file to go (torch's ``FileBaton``
    has no timeout), so the run hangs at set-up with no word."""
    build_dir = Path(torch.utils.cpp_extension._get_build_directory(name, verbose=False))
    lock = build_dir / "lock"
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - lock.stat().st_mtime
        if age > stale_s:
            raise ValueError(f"{lock}: DeepSpeed's {name} op build lock is {age / 3600:.1f} h old, left by a build "
                             "that was killed; torch would wait for it forever. Remove it (no build of the op is "
                             "running) and start again")

