"""Checkpoints written in the background (``--trainer.strategy.async_save=true``): the loop stands still only while
this rank's state is copied to host memory, and DCP writes the copy while training goes on.

A save in two halves, the same two as ``torch.distributed.checkpoint.async_save``:

1. in the loop (the stand-still): the previous background save is awaited when it is still running (its host
   buffers are reused, and the checkpoints of one run are written in order), then the live tensors
   (:func:`~.hybrid_checkpoint.checkpoint_state`) are copied into host buffers kept from one save to the next:
   torch's ``DefaultStager`` builds them at the first save (pinned on CUDA), later saves copy into them with one
   ``_foreach_copy_`` per device (non-blocking on CUDA, then one synchronize); and ``meta.pt`` is serialized;
2. on one worker thread: :func:`~.hybrid_checkpoint.write_hybrid` writes the copy into ``.<name>.partial`` and
   publishes it, exactly as a synchronous save does, so a checkpoint appears under its name (``last.ckpt``, a
   top-k file, what ``--ckpt_path=last`` finds) only complete, and a crash at any moment leaves the previous one
   whole.

The worker's collectives (DCP's plan exchange, the agreement of every step) run on a gloo process group of their own:
on the default group they could interleave with the loop's collectives in a different order on different ranks.
A second checkpoint of the same state (``ModelCheckpoint``'s top-k file and ``last.ckpt`` of one step, keyed by the
global step and batch) reuses the staged copy and does not wait. Why not ``dcp.async_save`` itself: it starts a
thread per call, so two saves in flight could run their collectives concurrently, and the publish must follow the
shards in the same ordered job.

A failed background write raises :class:`BackgroundSaveError` naming the checkpoint: at the next training step of
the rank that sees it (the others see it at their next step, or stop when its process exits), at the next save, or
at the end of fit, which waits for the last write. Nothing here is a per-step cost but a ``Future.done()`` check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from lightning_llm.checkpoint import first_line

log = logging.getLogger(__name__)

__all__ = ["BackgroundSaveError", "BackgroundSaves"]


class BackgroundSaveError(RuntimeError):
    """A checkpoint's background write failed; the previous checkpoint under that name is intact."""


@dataclass
class _Write:
    path: Path
    future: Future


class BackgroundSaves:
    """The staging buffers, the worker thread and the process group of one fit's background saves. Built on every
    rank at the same point (a collective: the gloo group)."""

    def __init__(self, *, device: torch.device, timeout: timedelta | None = None) -> None:
        self.group: dist.ProcessGroup | None = None
        if dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._cuda = cuda = device.type == "cuda"
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_llm-checkpoint")
        self._writes: list[_Write] = []
        self._buffers: Any = None  # the staged copy, reused by the next save of the same structure
        self._staged: tuple[Hashable, Any] | None = None  # (version, copy) of the last save

    def stage(self, state: Any, *, version: Hashable) -> Any:
        """A copy of ``state`` in host memory that training cannot change. The same copy again for the same
        ``version`` (another checkpoint of the same state); a new one first waits for every pending write, then
        copies into the previous copy's buffers when ``state`` has its structure (one ``_foreach_copy_`` per
        device), else stages it anew with torch's stager (the first save: it walks the state tensor by tensor)."""
        if self._staged is not None and self._staged[0] == version:
            return self._staged[1]
        self.wait()
        pairs = _pairs(self._buffers, state) if self._buffers is not None else None
        if pairs is None:
            self._buffers = None
            self._buffers = self._stager.stage(state)
        else:
            _copy(pairs, non_blocking=self._cuda)
        self._staged = (version, self._buffers)
        return self._buffers

    def submit(self, path: str | Path, write: Callable[[], Any]) -> None:
        """Run ``write`` (it writes ``path``) on the worker, after the writes submitted before it."""
        self._writes.append(_Write(Path(path), self._worker.submit(_no_grad, write)))

    def pending(self, path: str | Path) -> bool:
        return any(w.path == Path(path) and not w.future.done() for w in self._writes)

    def raise_if_failed(self) -> None:
        """Raise the first failed write that has finished, without waiting for any; forget finished ones."""
        for i, w in enumerate(self._writes):
            if not w.future.done():
                break
            if w.future.exception() is not None:
                self._writes = self._writes[i + 1:]
                raise _error(w)
        self._writes = [w for w in self._writes if not w.future.done() or w.future.exception() is not None]

    def wait(self) -> None:
        """Wait for every write; raise the first that failed (the ones after it stay tracked)."""
        while self._writes:
            w = self._writes.pop(0)
            try:
                w.future.result()
            except Exception:  # noqa: BLE001 - reported below, naming the checkpoint
                raise _error(w) from w.future.exception()

    def close(self, *, raise_errors: bool) -> None:
        """Wait for the last writes, release the worker, the buffers and the group; a failure is raised or (while
        another exception is on its way) logged, never dropped."""
        try:
            while True:
                try:
                    self.wait()
                    break
                except BackgroundSaveError as e:
                    if raise_errors:
                        raise
                    log.error("%s", e)
        finally:
            self._worker.shutdown(wait=True)
            self._staged = self._buffers = None
            self._stager.close()
            if self.group is not None and dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _pairs(staged: Any, live: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(staged, live)`` local tensors at the same places of two states of one structure (same keys, tensor types,
    shapes and dtypes); ``None`` where they differ."""
    if isinstance(live, dict):
        if not isinstance(staged, dict) or staged.keys() != live.keys():
            return None
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, value in live.items():
            sub = _pairs(staged[key], value)
            if sub is None:
                return None
            out += sub
        return out
    if isinstance(live, torch.Tensor) and type(staged) is type(live):
        s, t = _local(staged), _local(live)
        if s.shape == t.shape and s.dtype == t.dtype and live.shape == staged.shape:
            return [(s, t)]
    return None


@torch.no_grad()
def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], *, non_blocking: bool) -> None:
    """The live tensors into their staged buffers: one ``_foreach_copy_`` per source device."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in pairs:
        dsts, srcs = by_device.setdefault(src.device, ([], []))
        dsts.append(dst)
        srcs.append(src)
    for dsts, srcs in by_device.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)
    if non_blocking:
        torch.accelerator.synchronize()


def _no_grad(write: Callable[[], Any]) -> Any:
    with torch.no_grad():
        return write()


def _error(w: _Write) -> BackgroundSaveError:
    e = w.future.exception()
    assert e is not None
    return BackgroundSaveError(f"checkpoint {w.path}: its background write failed ({first_line(e)}); the previous "
                               "checkpoint under that name is intact")
