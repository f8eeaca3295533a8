"""Reading checkpoints without running code from them.

Unpickling an object calls whatever its pickle names, so a crafted checkpoint (a colleague's run, a download) could
run a shell command the moment it is loaded. Every read of a checkpoint, its metadata or a shard goes through here:

* ``torch.save`` files (``.ckpt``, the engine's ``meta.pt``, legacy ``model.pt`` / pipeline-stage files, DeepSpeed's
  ``*_states.pt``): ``torch.load(weights_only=True)``, torch's restricted unpickler (tensors, containers, numbers,
  strings, and the classes registered with ``torch.serialization.add_safe_globals``: the project's config
  dataclasses; DeepSpeed's few plain classes for its files only, :data:`DEEPSPEED_GLOBALS`);
* DCP's ``.metadata``, which torch reads with plain ``pickle.load``: :class:`SafeFileSystemReader` admits only
  ``torch.distributed.checkpoint``'s metadata classes and the torch values they hold (:class:`_MetadataUnpickler`);
* objects DCP stores inside its shards (which its planner loads with ``weights_only=False``): :class:`SafeLoadPlanner`
  and :class:`SafeEmptyLoadPlanner` check each with the restricted unpickler first.

:func:`verify_checkpoint` runs the checks of a whole checkpoint (a file, any of our directory layouts, a DeepSpeed
directory) before anything is loaded or written: the CLI calls it on ``--ckpt_path`` before it builds anything,
``export``/``merge`` before they read, the strategies' ``load_checkpoint`` before they load. A refused file raises
:class:`~lightning_llm.checkpoint.errors.UnsafeCheckpointError` naming it (one line, exit code 2 in the CLI).

Opt-in: ``LIGHTNING_LLM_TRUST_CHECKPOINT=1`` (:data:`TRUST_ENV`) loads such a file anyway, with a warning naming the
file and what it would import (and admits those names for the rest of the process, so Lightning's own
``weights_only`` loads of it pass too). Never the default.
"""

from __future__ import annotations

import collections
import functools
import importlib
import io
import logging
import os
import pickle
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner

from lightning_llm.checkpoint.errors import (
    UnsafeCheckpointError,
    check_torch_file,
    is_zip_file,
    loading,
    refusal,
)

log = logging.getLogger(__name__)

__all__ = ["DEEPSPEED_GLOBALS", "TRUST_ENV", "SafeEmptyLoadPlanner", "SafeFileSystemReader", "SafeLoadPlanner",
           "dcp_refusals", "load_file", "read_dcp_metadata", "trusted", "verify_checkpoint", "verify_file"]

TRUST_ENV = "LIGHTNING_LLM_TRUST_CHECKPOINT"
"""Set to 1 to load checkpoints that hold arbitrary pickled objects (only from a source you trust)."""

DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""Plain classes DeepSpeed pickles into its optimizer files (a loss scaler's fields, an int enum, a named tuple):
admitted for DeepSpeed checkpoint files only, by name, so DeepSpeed is imported only when one is read."""

def trusted() -> bool:
    """Whether the user opted in to loading arbitrary pickled objects (:data:`TRUST_ENV`)."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def _resolve(names: Iterable[str]) -> list[Any]:
    """``"pkg.mod.Name"`` -> the object (importing ``pkg.mod``)."""
    out = []
    for qualified in names:
        module, _, attr = qualified.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def _trust(path: Path, name: str) -> None:
    """Opted in: warn, naming what the file imports, and admit those names for this process's later
    ``weights_only`` loads (Lightning's own reads of a ``--ckpt_path`` file among them)."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if is_zip_file(path) else []
    if unsafe:
        log.warning("%s: loading objects other than tensors and plain data (%s) because %s=1: this runs code from "
                    "the file", name, ", ".join(unsafe), TRUST_ENV)
        torch.serialization.add_safe_globals(_resolve(unsafe))


def load_file(path: str | Path | io.BytesIO, *, name: str, mmap: bool = False, allowed: Iterable[str] = ()) -> Any:
    """``torch.load`` of a checkpoint file that never runs code from it: torch's restricted unpickler, plus the
    classes named in ``allowed`` (``"module.Name"``). A refused file raises
    :class:`~lightning_llm.checkpoint.errors.UnsafeCheckpointError` starting with ``name``; other unreadable files
    :class:`~lightning_llm.checkpoint.errors.CheckpointError`. ``mmap`` maps the tensors instead of reading them
    (zip-format files only; others are read)."""
    if isinstance(path, (str, Path)):
        path = Path(path)
        check_torch_file(path, name=name)  # an empty or cut file: said as such, not as an unpickling failure
        mmap = mmap and is_zip_file(path)
        if trusted():
            _trust(path, name)
            with loading(name):
                return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    with loading(name), torch.serialization.safe_globals(_resolve(allowed)):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def verify_file(path: str | Path, *, name: str, allowed: Iterable[str] = ()) -> None:
    """Raise if ``path`` holds objects the restricted unpickler refuses (tensors are mapped, not read)."""
    load_file(path, name=name, mmap=True, allowed=allowed)


# ------------------------------------------------------------------------------------------------------ DCP
@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a DCP ``.metadata`` pickle may name: the metadata module's classes, the storage-info record, and the torch
    values inside them (dtypes, ``Size``, layouts by name, the checkpoint id as a path)."""
    allowed: dict[tuple[str, str], Any] = {}
    for attr, value in vars(dcp_metadata).items():
        if isinstance(value, type) and value.__module__ == dcp_metadata.__name__:
            allowed[(dcp_metadata.__name__, attr)] = value
    storage_info = dcp.filesystem._StorageInfo
    allowed[(storage_info.__module__, storage_info.__name__)] = storage_info
    for attr, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", attr)] = value
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for cls in (Path, PurePosixPath, PureWindowsPath, type(Path())):
        allowed[(cls.__module__, cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`_metadata_globals` (Python's "restricting globals" recipe)."""

    def __init__(self, file: Any, *, name: str) -> None:
        super().__init__(file)
        self.name = name

    def find_class(self, module: str, name: str) -> Any:
        value = _metadata_globals().get((module, name))
        if value is None:
            raise UnsafeCheckpointError(refusal(self.name, f"{module}.{name}"))
        return value


def read_dcp_metadata(path: str | Path, *, name: str) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of directory ``path``, read with :class:`_MetadataUnpickler`; a refused global raises
    :class:`~lightning_llm.checkpoint.errors.UnsafeCheckpointError` starting with ``name``, any other failure is
    unpickling's own."""
    with (Path(path) / ".metadata").open("rb") as f:
        if trusted():
            return pickle.load(f)
        return _MetadataUnpickler(f, name=name).load()


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader whose ``.metadata`` goes through :func:`read_dcp_metadata`."""

    def __init__(self, path: str | Path, *, name: str | None = None) -> None:
        super().__init__(str(path))
        self.name = name or str(path)

    def read_metadata(self) -> dcp_metadata.Metadata:  # type: ignore[override]
        # No ``**kwargs``: DCP then does not fall back to per-rank metadata files (a layout we never write) when the
        # global index fails, e.g. is refused.
        metadata = read_dcp_metadata(self.path, name=f"{self.name}: .metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _CheckedBytes:
    """Planner mix-in: an object stored in a DCP shard is checked with the restricted unpickler before the planner
    loads it (DCP's own ``load_bytes`` unpickles with ``weights_only=False``)."""

    checkpoint_name = "checkpoint"

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if not trusted():
            load_file(value, name=f"{self.checkpoint_name}: the object {read_item.dest_index.fqn!r} in a shard")
            value.seek(0)
        super().load_bytes(read_item, value)  # type: ignore[misc]


@contextmanager
def dcp_refusals() -> Iterator[None]:
    """DCP gathers each rank's exception into one ``CheckpointException``: a refusal among them is raised as itself
    (one line naming the checkpoint), on every rank alike."""
    try:
        yield
    except CheckpointException as e:
        for exc, _ in e.failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
        raise


class SafeLoadPlanner(_CheckedBytes, DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose stored objects are checked first (:class:`_CheckedBytes`)."""

    def __init__(self, *args: Any, name: str = "checkpoint", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_name = name


class SafeEmptyLoadPlanner(_CheckedBytes, _EmptyStateDictLoadPlanner):
    """The planner that loads a whole DCP directory offline, with stored objects checked first."""

    def __init__(self, *args: Any, name: str = "checkpoint", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_name = name


# ------------------------------------------------------------------------------------------------ whole checkpoints
def _deepspeed_files(path: Path) -> Iterator[Path]:
    """The ``.pt`` files of a DeepSpeed checkpoint directory's tag directories (``latest`` names the one loaded; a
    universal checkpoint nests one directory per parameter)."""
    for tag_dir in sorted(d for d in path.iterdir() if d.is_dir()):
        yield from sorted(tag_dir.rglob("*.pt"))


def verify_checkpoint(path: str | Path, *, name: str) -> None:
    """Check every file of a checkpoint that unpickles before anything reads it: a ``torch.save`` file, or in a
    directory DCP's ``.metadata``, every ``*.pt``/``*.ckpt`` beside it (``meta.pt``, ``model.pt``, pipeline-stage
    files) and DeepSpeed's tag directories. Objects inside DCP shards are checked as they are read (the safe
    planners). Raises :class:`~lightning_llm.checkpoint.errors.UnsafeCheckpointError` naming the file."""
    p = Path(path)
    if p.is_file():
        verify_file(p, name=name)
        return
    if not p.is_dir():
        return
    if (p / ".metadata").is_file():
        read_dcp_metadata(p, name=f"{name}: .metadata")
    for f in sorted([*p.glob("*.pt"), *p.glob("*.ckpt")]):
        if f.is_file():
            verify_file(f, name=f"{name}: {f.name}")
    if (p / "latest").is_file() or any(p.glob("*/*_model_states.pt")):
        for f in _deepspeed_files(p):
            verify_file(f, name=f"{name}: {f.relative_to(p)}", allowed=DEEPSPEED_GLOBALS)

