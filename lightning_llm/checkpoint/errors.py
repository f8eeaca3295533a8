"""One-line errors for checkpoints that cannot be loaded: :class:`CheckpointError` names the path and what is wrong
(a cut file, a missing shard, objects that would run code), instead of a traceback from deep inside ``torch.load``,
DCP or DeepSpeed that never names the file."""

from __future__ import annotations

import logging
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "UnsafeCheckpointError", "check_torch_file", "first_line", "is_zip_file", "loading",
           "refusal"]

ZIP_MAGIC = b"PK\x03\x04"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the path and what is missing or corrupt."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that holds pickled objects other than tensors and plain data: loading it could run code
    (:mod:`lightning_llm.checkpoint.safe_load`)."""


TRUST_HINT = "LIGHTNING_LLM_TRUST_CHECKPOINT=1"


def refusal(name: str, what: str | None) -> str:
    """The one line for a refused file; ``what``: the global it would import (``posix.system``), if known."""
    found = f" ({what})" if what else ""
    return (f"{name}: refused: it holds objects other than tensors and plain data{found}, and loading them could run "
            f"code. Load checkpoints only from sources you trust; {TRUST_HINT} loads it anyway")


def _weights_only_global(e: BaseException) -> str | None:
    """The global torch's restricted unpickler refused (``GLOBAL posix.system`` in its message), if it says."""
    m = re.search(r"GLOBAL ([\w.]+)", str(e))
    return m.group(1) if m else None


def first_line(e: BaseException) -> str:
    """``"<type>: <first sentence of the message>"``: low-level messages run to many lines of advice that does not
    apply here (e.g. torch's "re-run with weights_only=False" for a corrupted shard)."""
    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", line)  # torch's C++ location prefix
    return f"{type(e).__name__}: {line.split('. ')[0]}" if line else type(e).__name__


def is_zip_file(path: Path) -> bool:
    """Whether ``path`` starts like a zip archive (what ``torch.save`` writes; the legacy format does not)."""
    with path.open("rb") as f:
        return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC


def check_torch_file(path: str | Path, *, name: str) -> None:
    """Raise :class:`CheckpointError` if a ``torch.save`` file is empty or cut short. ``name`` starts the message
    (e.g. ``--ckpt_path=<path>``).

    ``torch.save`` writes a zip archive whose directory is at the very end, so any truncation removes it; reading the
    directory costs a few kilobytes. Files in the pre-zip legacy format are left to the loader."""
    p = Path(path)
    size = p.stat().st_size
    if size == 0:
        raise CheckpointError(f"{name}: empty file (0 bytes), not a loadable checkpoint")
    if not is_zip_file(p):
        return
    try:
        with zipfile.ZipFile(p) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{name}: truncated or corrupt file ({size} bytes, its zip directory is missing or "
                              "damaged), not a loadable checkpoint") from e


@contextmanager
def loading(name: str) -> Iterator[None]:
    """Re-raise what ``torch.load`` raises for an unreadable file as one :class:`CheckpointError` starting with
    ``name``. Wrap the load call only: errors of the caller's own code must keep their type."""
    try:
        yield
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise UnsafeCheckpointError(refusal(name, _weights_only_global(e))) from e
        raise CheckpointError(f"{name}: not a loadable checkpoint ({first_line(e)})") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: not a loadable checkpoint ({first_line(e)})") from e
