"""Fault tolerance: exact resume state (RNG per rank), atomic checkpoint files and output directories
(:func:`staged_directory`), fault injection for tests.

Data order on resume is handled by :class:`lightning_llm.data.base.LLMDataModule` (its state_dict records how
many batches of the current epoch were consumed); optimizer, LR-schedule and loop state are Lightning's own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_llm.files import atomic_open, fresh_sibling
from lightning_llm.logs import PER_RANK

log = logging.getLogger(__name__)

FAULT_ENV = "LIGHTNING_LLM_FAULT"
"""Fault injection for tests: ``kill:step=K[:rank=R]`` SIGKILLs rank R (default all) before training step K;
``kill:save=N[:rank=R][:at=MOMENT]`` SIGKILLs it during its N-th checkpoint save (1-based) at one of
:data:`SAVE_MOMENTS`: ``begin`` (nothing written yet), ``shards`` (default: a file half-written, or a sharded
directory with this rank's shards written but not yet published; with ``rank=R`` the other ranks go on writing),
``published`` (the new checkpoint in place, the save not yet returned);
``raise:...`` raises RuntimeError there instead (every rank at once: a crash that tests can survive in-process);
``term:...`` sends this process SIGTERM there (``sig=USR1``: another signal) and goes on, as a scheduler's signal
arrives. ``attempt=A``: only in attempt A of a job that ``torchrun --max-restarts`` restarts in place
(``TORCHELASTIC_RESTART_COUNT``, 0 first)."""

SAVE_MOMENTS = ("begin", "shards", "published")


def parse_fault(spec: str | None) -> dict[str, Any] | None:
    """``"kill:step=3:rank=1"`` -> ``{"action": "kill", "step": 3, "rank": 1}``; None/empty -> None."""
    if not spec:
        return None
    action, *fields = spec.split(":")
    if action not in ("kill", "raise", "term"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: action must be 'kill', 'raise' or 'term'")
    out: dict[str, Any] = {"action": action}
    for f in fields:
        key, _, value = f.partition("=")
        if (key == "at" and value in SAVE_MOMENTS) or (key == "sig" and action == "term" and value.isalnum()):
            out[key] = value
            continue
        if key not in ("step", "save", "rank", "attempt") or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}={spec!r}: expected step=K, save=N, rank=R, attempt=A, "
                             f"at={'|'.join(SAVE_MOMENTS)} or (term) sig=NAME, got {f!r}")
        out[key] = int(value)
    if "step" not in out and "save" not in out:
        raise ValueError(f"{FAULT_ENV}={spec!r}: needs step=K or save=N")
    return out


def _fault_hits(fault: dict[str, Any] | None, key: str, value: int, rank: int) -> bool:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return (bool(fault) and fault.get(key) == value and fault.get("rank", rank) == rank
            and fault.get("attempt", attempt) == attempt)


def _trigger(fault: dict[str, Any], where: str) -> None:
    log.error("fault injection (%s): %s at %s", FAULT_ENV, fault["action"], where)
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["action"] == "term":
        os.kill(os.getpid(), signal.Signals[f"SIG{fault.get('sig', 'TERM')}"])
        return
    raise RuntimeError(f"injected fault at {where}")


def shutdown_process_group() -> bool:
    """Barrier, then destroy every process group; True if there was one. Call on all ranks once the work is done.

    Left to interpreter exit, gloo's communication threads can be torn down on one rank while a peer still talks
    to them, which aborts the peer ("terminate called without an active exception", SIGABRT) after all work is
    done; a process that built several Trainers, device meshes or DeepSpeed engines hits this most often.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def leave_process(code: int) -> NoReturn:
    """Exit a distributed worker once its work is done and its process groups are destroyed: run the ``atexit``
    handlers (loggers, progress bars), flush, then ``os._exit`` so that no C++ static destructor runs.

    Even after :func:`shutdown_process_group`, a worker that built DeepSpeed or gloo state occasionally aborted in
    interpreter finalization ("terminate called without an active exception", seen once in CI after a DeepSpeed
    ZeRO-3 predict had written its output), turning a finished run into a failed one.
    """
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _global_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


class FaultInjector(pl.Callback):
    """Kills or fails this process before a given training step (see :data:`FAULT_ENV`)."""

    def __init__(self, spec: str | None = None) -> None:
        self.fault = parse_fault(spec if spec is not None else os.environ.get(FAULT_ENV))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if _fault_hits(self.fault, "step", trainer.global_step, trainer.global_rank):
            _trigger(self.fault, f"step {trainer.global_step} on rank {trainer.global_rank}")


class RNGState(pl.Callback):
    """Saves every rank's Python/NumPy/torch RNG state in checkpoints and restores this rank's on resume, so
    dropout and sampling continue exactly as in an uninterrupted run."""

    @staticmethod
    def _capture() -> dict[str, Any]:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        # Plain types and tensors only, so `torch.load(weights_only=True)` (LightningCLI's --ckpt_path) reads it.
        numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
        return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}

    @override
    def state_dict(self) -> dict[str, Any]:
        states = [self._capture()]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            states = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, self._capture())
        return {"per_rank": states}

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("per_rank") or []
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank >= len(states):
            log.warning("checkpoint holds RNG states for %d ranks; rank %d keeps its own", len(states), rank,
                        extra=PER_RANK)
            return
        self._pending = states[rank]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # Applied at the first batch, not at load time: between loading and here the resumed run re-creates its
        # DataLoader iterator, which draws from the global RNG (the uninterrupted run drew that before saving).
        if self._pending is None:
            return
        s, self._pending = self._pending, None
        random.setstate(s["python"])
        name, keys, pos, has_gauss, gauss = s["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(s["torch"])


class SaveFault:
    """``kill:save=N[:rank=R][:at=MOMENT]`` (see :data:`FAULT_ENV`): a save calls :meth:`begin`, then
    :meth:`shards_written` and :meth:`published` as it gets there; the fault fires at this process's N-th save, at
    its moment. A save finished in the background passes the number :meth:`begin` returned (later saves may have
    begun meanwhile)."""

    def __init__(self) -> None:
        self.fault = parse_fault(os.environ.get(FAULT_ENV))
        self.saves = 0

    def hits(self, moment: str, save: int | None = None) -> bool:
        n = self.saves if save is None else save
        return _fault_hits(self.fault, "save", n, _global_rank()) and self.fault.get("at", "shards") == moment

    def _at(self, moment: str, path: str | os.PathLike, what: str, save: int | None) -> None:
        if self.hits(moment, save):
            _trigger(self.fault, f"checkpoint save #{self.saves if save is None else save} ({Path(path).name}), {what}")

    def begin(self, path: str | os.PathLike) -> int:
        self.saves += 1
        self._at("begin", path, "nothing written yet", None)
        return self.saves

    def shards_written(self, path: str | os.PathLike, save: int | None = None) -> None:
        self._at("shards", path, "this rank's shards written, not published", save)

    def published(self, path: str | os.PathLike, save: int | None = None) -> None:
        self._at("published", path, "published, the save not yet returned", save)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temp file beside the target, fsync, then rename: a crash mid-write leaves the previous
    checkpoint intact and never a truncated file under the final name."""

    def __init__(self) -> None:
        super().__init__()
        self.fault = SaveFault()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        self.fault.begin(path)
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)
            if self.fault.hits("shards"):
                if self.fault.fault["action"] != "term":  # a signal arrives; a crash leaves it half-written
                    f.flush()
                    f.truncate(max(1, f.tell() // 2))
                self.fault.shards_written(path)
        self.fault.published(path)


def staging_path(path: str | os.PathLike) -> Path:
    """Where a checkpoint directory is written before :func:`publish` moves it to ``path`` (the same on every rank)."""
    p = Path(path)
    return p.with_name(f".{p.name}.partial")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where that is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def remove_path(p: Path) -> None:
    """Remove a file, link or directory tree if it exists."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _fsync_dir(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staged: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move a complete checkpoint (file or directory) from ``staged`` to ``path`` atomically: readers see the old
    checkpoint or the new one, whole, at every moment; the old one is deleted only after the swap. Call it once
    (rank 0) after every rank finished writing into ``staged``."""
    staged, path = Path(staged), Path(path)
    if not (path.exists() or path.is_symlink()):
        os.replace(staged, path)
    elif _exchange(staged, path):  # ``path`` is now the new checkpoint, ``staged`` the old one
        remove_path(staged)
    else:  # no atomic swap here: the old one is moved aside for the instant between the two renames
        old = path.with_name(f".{path.name}.old")
        remove_path(old)
        os.replace(path, old)
        os.replace(staged, path)
        remove_path(old)
    _fsync_dir(path.parent)


def _is_model_directory(p: Path) -> bool:
    return (p / "config.json").is_file() or (p / "adapter_config.json").is_file()


@contextlib.contextmanager
def staged_directory(target: str | os.PathLike[str], *, flag: str) -> Iterator[Path]:
    """Yield an empty staging directory; on a clean exit it replaces ``target`` atomically, on an error it is removed
    (with any parent directories this call created). An existing ``target`` is replaced only if it is empty or a
    model directory (a previous export), never another directory: ``flag`` names the option in that error."""
    target = Path(target).absolute()
    if target.exists() or target.is_symlink():
        if not target.is_dir() or target.is_symlink():
            raise ValueError(f"{flag}={target}: exists and is not a directory")
        if any(target.iterdir()) and not _is_model_directory(target):
            raise ValueError(f"{flag}={target}: an existing directory that holds no model (no config.json or "
                             "adapter_config.json): it would be replaced as a whole; choose a new path")
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = fresh_sibling(target, directory=True)  # as readable as a mkdir's (mkdtemp would make it 0700)
    except OSError as e:
        _remove_created(created)
        raise ValueError(f"{flag}={target}: cannot create the output directory ({e.strerror or e})") from e
    try:
        yield tmp
        publish(tmp, target)
    except BaseException:
        remove_path(tmp)
        _remove_created(created)
        raise


def _remove_created(created: list[Path]) -> None:
    for p in created:  # deepest first; only directories that stayed empty
        with contextlib.suppress(OSError):
            p.rmdir()
