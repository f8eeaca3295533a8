"""Tiny checkpoints and tokenizers built once per test run and shared by the run's tests (and by both pytest-xdist
workers of ``make test``): a folder per key under the run's temporary root, built under a file lock into a staging
folder and renamed into place whole, then only read. A test that changes such a folder would change what later tests
load: the folders' files are recorded when built and checked unchanged when the session ends."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock


def shared_root(basetemp: Path) -> Path:
    """The folder both workers of one run see: pytest-xdist gives each worker ``<run root>/popen-gwN`` as its basetemp;
    a run without workers has the root itself."""
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


class BuiltOnce:
    """``built(key, build)``: the folder ``build(folder)`` wrote, built by the first test of the run that asks for
    ``key`` (which names everything the build depends on)."""

    def __init__(self, root: Path) -> None:
        self.root = root / "built-once"
        self.root.mkdir(parents=True, exist_ok=True)
        self.used: dict[Path, dict[str, tuple[int, int]]] = {}

    def __call__(self, key: str, build: Callable[[Path], Any]) -> Path:
        folder = self.root / key
        with FileLock(str(folder) + ".lock"):
            if not folder.is_dir():
                staging = folder.with_name(f".{key}.building")
                shutil.rmtree(staging, ignore_errors=True)
                build(staging)
                staging.rename(folder)
        self.used.setdefault(folder, _files(folder))
        return folder

    def changed(self) -> list[str]:
        """The shared folders whose files differ from what was built: a test wrote into one."""
        return [str(folder) for folder, files in self.used.items() if _files(folder) != files]
