"""Preemption: a signal from the scheduler (SIGTERM from SLURM, Kubernetes, a spot instance's shutdown; SLURM's
``--signal``) stops a fit at a step boundary with a complete checkpoint of that step, and the process exits with
``128 + the signal's number`` (143 for SIGTERM), so that a pipeline or job array sees an unfinished run.

What happens, on every rank:

1. The handler (installed once Lightning has registered its own, at the start of the sanity check or of training)
   only notes the signal on the host; nothing else runs inside it. A second signal is counted, nothing more: a save in
   progress goes on (the saves are atomic, so a SIGKILL at any moment leaves the previous checkpoint whole).
2. The ranks agree on the step to stop after without waiting for the device or for each other
   (:class:`StoreAgreement`): at the start of each optimizer step every rank adds its note to a key of the process
   group's store; at the end of that step it reads the key, which every rank has written by then (a rank finishing a
   step has exchanged that step's collectives with every other rank, which had posted before starting it). So every
   rank reads the same notes for the same step and stops after it. A signal noted before a step's start stops the run
   after that step; one that comes during a step, after the next. On one process no store is involved: the run stops
   after the step the signal came in. Two store operations per step, no tensor: no host read, no collective.
3. The step's checkpoint is written where ``--ckpt_path=last`` finds it (:func:`last_checkpoint`): the run's
   ``last.ckpt`` (the first ``ModelCheckpoint``'s directory), through the strategy's own save (native engine,
   DeepSpeed, Lightning's own), after a background save still in flight is finished (``async_save``). Under SLURM
   with Lightning's auto-requeue, the requeue signal (SIGUSR1 by default) runs Lightning's own handler at the step
   boundary instead (its ``hpc_ckpt_N.ckpt`` and ``scontrol requeue``), not inside the signal handler.
4. The log names the signal, the step saved, the path and how long the save took; then :class:`Preempted` (a
   ``SystemExit`` with the status) ends the fit and the process.

Lightning 2.6 itself checks for SIGTERM by broadcasting a flag from rank 0 and reading it on the host at the start of
every training batch of a multi-rank run (a device sync per step on GPUs) and by a handler that broadcasts from inside
the signal handler; both are replaced for the fit (:func:`_take_over_lightning_sigterm`, the one place that touches
Lightning's internals for this).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_llm.strategies.engine.async_save import BackgroundSaveError
from lightning_llm.strategies.engine.checkpoint import LayoutFreeCheckpointing

log = logging.getLogger(__name__)

__all__ = ["Preempted", "Preemption", "StoreAgreement", "exit_status", "last_checkpoint"]


def exit_status(signum: int) -> int:
    """The status a run stopped by signal ``signum`` exits with: ``128 + signum``, the shell's convention (143 for
    SIGTERM, 138 for SIGUSR1)."""
    return 128 + int(signum)


class Preempted(SIGTERMException):
    """A fit stopped by a signal after saving its step: ``SystemExit`` with :func:`exit_status` (a subclass of
    Lightning's ``SIGTERMException``, so code catching that still does)."""

    def __init__(self, signum: int, *, step: int, path: Path | None) -> None:
        super().__init__(exit_status(signum))
        self.signum, self.step, self.path = int(signum), step, path


# ------------------------------------------------------------------------------------------- agreement over ranks
class StoreAgreement:
    """Which step the ranks stop after, agreed through the process group's store without a collective.

    Each optimizer step ``s`` has a counter ``<prefix>/<s>``: every rank adds ``1 + (world + 1)`` when it noted a
    signal before starting step ``s``, else ``1`` (:meth:`post`); at the end of step ``s`` each rank reads it
    (:meth:`read`): ``total % (world + 1)`` ranks posted, ``total // (world + 1)`` of them signalled. Every rank has
    posted by then whenever the step exchanged collectives over all ranks (a rank cannot finish such a step before
    every other rank started it); otherwise the read polls until they have (host only, no deadlock: a rank that has
    not posted is behind and needs nothing more from this one to catch up). The first signal number posted is kept
    under ``<prefix>/signal``."""

    def __init__(self, store: dist.Store, *, prefix: str, world: int, rank: int, timeout: float = 1800.0) -> None:
        self.store, self.prefix, self.world, self.rank, self.timeout = store, prefix, world, rank, timeout
        self._last_read: int | None = None

    def _key(self, step: int) -> str:
        return f"{self.prefix}/{step}"

    def post(self, step: int, signum: int | None) -> None:
        """This rank's note for step ``step``, before it starts."""
        if signum:
            self.store.compare_set(f"{self.prefix}/signal", "", str(int(signum)))
        self.store.add(self._key(step), 1 + (self.world + 1 if signum else 0))

    def read(self, step: int) -> int:
        """After step ``step``: the signal number the ranks stop for (0: none), the same on every rank."""
        key, base = self._key(step), self.world + 1
        total, start, pause = self.store.add(key, 0), time.monotonic(), 1e-4
        while total % base < self.world:
            if time.monotonic() - start > self.timeout:
                raise RuntimeError(f"preemption check of step {step}: only {total % base} of {self.world} ranks "
                                   f"reached it within {self.timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            total = self.store.add(key, 0)
        if self.rank == 0 and self._last_read is not None:  # every rank read it before it posted this step
            self.store.delete_key(self._key(self._last_read))
        self._last_read = step
        return int(self.store.get(f"{self.prefix}/signal")) if total // base else 0


def _default_store() -> dist.Store:
    """The default process group's store (TCPStore or torchrun's agent store behind a prefix). torch has no public
    accessor; ``_get_default_store`` is what torch's own elastic and checkpoint code use."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# ------------------------------------------------------------------------------------------- Lightning's own check
def _take_over_lightning_sigterm(trainer: pl.Trainer) -> bool:
    """Switch off Lightning 2.6's own SIGTERM check for this fit; returns whether Lightning's handler already noted a
    SIGTERM (between its registration and ours), which this callback then takes over.

    Lightning's ``_TrainingEpochLoop.advance`` calls ``_broadcast_sigterm_tensor()`` at the start of every batch of a
    multi-rank run: a broadcast of a device tensor and ``.item()`` on it, a device sync per step. An instance
    attribute of the same name shadows the method for this trainer's loop (no supported hook exists; removed again
    by :func:`_restore_lightning_sigterm`). Lightning's flag ``received_sigterm`` would raise ``SIGTERMException``
    (exit status 0) at the end of a batch on the ranks that got the signal only: it is cleared here, and this
    callback's handler replaces Lightning's, so it stays cleared. ``tests/checkpoints/test_preemption.py`` fails if
    Lightning renames either."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        raise RuntimeError("lightning_llm.preemption: this Lightning version has no "
                           "_TrainingEpochLoop._broadcast_sigterm_tensor; update _take_over_lightning_sigterm")
    loop._broadcast_sigterm_tensor = _no_lightning_check  # type: ignore[method-assign]
    connector = trainer._signal_connector
    noted = bool(connector.received_sigterm)
    connector.received_sigterm = False
    return noted


def _no_lightning_check() -> None:
    """Lightning's per-batch SIGTERM broadcast, switched off (the agreement is :class:`StoreAgreement`'s)."""


def _restore_lightning_sigterm(trainer: pl.Trainer) -> None:
    vars(trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)


def _cluster_environment(trainer: pl.Trainer) -> Any:
    """The cluster environment Lightning registered its signal handlers for (a single-device strategy has none of
    its own: Lightning's accelerator connector keeps it)."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    return env if env is not None else trainer._accelerator_connector.cluster_environment


# ------------------------------------------------------------------------------------------- where checkpoints are
def _checkpoint_dirs(trainer: pl.Trainer, callback: ModelCheckpoint) -> list[Path]:
    """Where ``callback`` writes, or wrote in earlier attempts of this run: its ``dirpath``, or (none given) the
    ``checkpoints`` folder of every version of the first logger (Lightning's default places each attempt in a new
    ``version_N``), or ``default_root_dir/checkpoints`` without a logger."""
    if callback.dirpath:
        return [Path(callback.dirpath)]
    if not trainer.loggers:
        return [Path(trainer.default_root_dir) / "checkpoints"]
    logger = trainer.loggers[0]
    root = getattr(logger, "root_dir", None)
    if root is None:
        save_dir = logger.save_dir or trainer.default_root_dir
        root = os.path.join(save_dir, str(logger.name)) if logger.name else save_dir
    return sorted(p for p in Path(root).glob("*/checkpoints") if p.is_dir())


def _mtime(p: Path) -> int:
    """When a checkpoint was completed: its modification time (a directory: the newest of it and its entries)."""
    times = [p.stat().st_mtime_ns]
    if p.is_dir():
        times += [c.stat().st_mtime_ns for c in p.iterdir()]
    return max(times)


def last_checkpoint(trainer: pl.Trainer) -> Path | None:
    """What ``--ckpt_path=last`` resumes: the newest complete checkpoint (by modification time) that the trainer's
    ``ModelCheckpoint`` callbacks wrote in this or an earlier attempt of the run (any ``*.ckpt`` file or checkpoint
    directory in their directories, every logger version's for a directory taken from the logger), or Lightning's
    SLURM requeue saves (``default_root_dir/hpc_ckpt_*.ckpt``); ``None`` when there is none yet (a first attempt
    starts from scratch). Hidden entries (a save's staging directory, a temporary file) are never complete."""
    found: set[Path] = set(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
    for callback in _model_checkpoints(trainer):
        for d in _checkpoint_dirs(trainer, callback):
            found |= {p for p in d.glob("*.ckpt") if not p.name.startswith(".")}
    found = {p for p in found if p.exists()}
    return max(found, key=lambda p: (_mtime(p), p.name)) if found else None


# ------------------------------------------------------------------------------------------- the callback
def _model_checkpoints(trainer: pl.Trainer) -> list[ModelCheckpoint]:
    return [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]


def _signal_number(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"Preemption(signals=...): {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


class Preemption(pl.Callback):
    """Stop a fit at a step boundary on a scheduler's signal, with a checkpoint of that step, and exit with
    ``128 + signal`` (module docstring). Every task installs one; give your own in ``--trainer.callbacks`` to choose
    the signals."""

    def __init__(self, signals: list[str] | None = None) -> None:
        """
        Args:
            signals: The signals handled, by name. Default: SIGTERM, plus under SLURM its requeue signal (SIGUSR1
                unless ``SLURMEnvironment(requeue_signal=...)`` says otherwise; with Lightning's auto-requeue its own
                requeue save and ``scontrol requeue`` run at the step boundary). ``[]``: none (Lightning's own
                handling stays).
        """
        self.signals = None if signals is None else [_signal_number(s) for s in signals]
        self._received: int | None = None  # the first signal noted on this rank
        self._received_at: int | None = None  # the global step it came in
        self._count = 0
        self._open: int | None = None  # the step started and posted, not yet read
        self._agreement: StoreAgreement | None = None
        self._lightning_handlers: dict[int, Callable[..., Any]] = {}  # Lightning's SLURM requeue handler
        self._installed = False
        self._step = 0  # the global step this rank is in (what the handler records)

    @property
    def signalled(self) -> int | None:
        """The signal this rank noted during the fit (the first one), or ``None``."""
        return self._received

    # ---------------------------------------------------------------------------------------------- handler
    def _on_signal(self, signum: int, frame: Any) -> None:
        """The signal handler: notes the signal, nothing else (logging and saving happen at the step boundary)."""
        self._count += 1
        if self._received is None:
            self._received, self._received_at = signum, self._step

    def _install(self, trainer: pl.Trainer) -> None:
        if self._installed:
            return
        self._installed, self._step = True, trainer.global_step
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            prefix = "lightning_llm/preemption/" + str(trainer.strategy.broadcast(uuid.uuid4().hex))
            self._agreement = StoreAgreement(_default_store(), prefix=prefix, world=trainer.world_size,
                                             rank=trainer.global_rank)
        signals = self._signals(trainer)
        if not signals:
            return
        if _take_over_lightning_sigterm(trainer):
            self._on_signal(signal.SIGTERM, None)
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: fit runs outside the main thread, where no signal handler can be installed; "
                        "a %s stops the process without a checkpoint", "/".join(s.name for s in signals))
            return
        for sig in signals:
            previous = signal.getsignal(sig)
            if sig != signal.SIGTERM and self._is_lightning_requeue(trainer, sig) and callable(previous):
                self._lightning_handlers[sig] = previous
            signal.signal(sig, self._on_signal)  # Lightning's teardown restores the handlers from before fit

    def _signals(self, trainer: pl.Trainer) -> list[signal.Signals]:
        if self.signals is not None:
            return self.signals
        env = _cluster_environment(trainer)
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            return [signal.SIGTERM, signal.Signals(env.requeue_signal)]
        return [signal.SIGTERM]

    @staticmethod
    def _is_lightning_requeue(trainer: pl.Trainer, sig: int) -> bool:
        env = _cluster_environment(trainer)
        return isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == sig

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._installed, self._received, self._received_at, self._count, self._open = False, None, None, 0, None
        self._agreement, self._lightning_handlers, self._step = None, {}, trainer.global_step
        if stage == "fit" and not _model_checkpoints(trainer) and (self.signals is None or self.signals):
            log.warning("preemption: no ModelCheckpoint in this fit (enable_checkpointing=false?): a SIGTERM stops it "
                        "at a step boundary without a checkpoint")

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = trainer.global_step
        if self._open is not None:  # a later micro-batch of the same optimizer step
            return
        self._open = trainer.global_step
        if self._agreement is not None:
            self._agreement.post(self._open, self._received)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step, self._step = self._open, trainer.global_step
        if step is None or trainer.global_step == step:  # accumulating: the optimizer step is not done yet
            return
        self._open = None
        signum = self._agreement.read(step) if self._agreement is not None else (self._received or 0)
        if signum:
            self._stop(trainer, signum)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._installed:
            _restore_lightning_sigterm(trainer)
        self._installed = False

    # ---------------------------------------------------------------------------------------------- the stop
    def _stop(self, trainer: pl.Trainer, signum: int) -> None:
        name = signal.Signals(signum).name
        came = (f"received during step {self._received_at}" if self._received is not None
                else "received by another rank")
        log.warning("%s %s; saving step %d", name, came, trainer.global_step)
        start, before = time.monotonic(), self._count
        requeue = self._lightning_handlers.get(signum)
        if requeue is not None:
            existing = set(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt"))
            requeue(signum, None)  # Lightning's own: hpc_ckpt_N.ckpt, then `scontrol requeue` on rank 0
            new = sorted(set(Path(trainer.default_root_dir).glob("hpc_ckpt_*.ckpt")) - existing)
            path, waited = (new[-1] if new else None), 0.0
        else:
            waited = self._finish_background_saves(trainer)
            path = self._last_path(trainer)
            if path is not None:
                trainer.save_checkpoint(path, weights_only=False)
                waited += self._finish_background_saves(trainer)
        took = time.monotonic() - start
        status = exit_status(signum)
        where = (f"to {path}" if path is not None else "nowhere (no ModelCheckpoint)")
        extra = f", {waited:.2f} s of it finishing a background save" if waited >= 0.005 else ""
        again = f"; {self._count - before} more signal(s) came during the save" if self._count > before else ""
        log.warning("saved step %d %s in %.2f s%s%s; exiting with status %d (128 + %s)",
                    trainer.global_step, where, took, extra, again, status, name)
        raise Preempted(signum, step=trainer.global_step, path=path)

    @staticmethod
    def _finish_background_saves(trainer: pl.Trainer) -> float:
        """Wait for the strategy's background checkpoint writes (``async_save``); seconds waited. A failed one is
        logged (the previous checkpoint under its name is intact) and the preemption save goes on."""
        strategy = trainer.strategy
        if not isinstance(strategy, LayoutFreeCheckpointing):
            return 0.0
        start = time.monotonic()
        try:
            strategy.wait_for_checkpoints()
        except BackgroundSaveError as e:
            log.error("preemption: %s", e)
        return time.monotonic() - start

    @staticmethod
    def _last_path(trainer: pl.Trainer) -> Path | None:
        """Where the preemption save goes: the ``last`` checkpoint of the first ``ModelCheckpoint`` (one that keeps a
        ``last`` if any does), so that ``--ckpt_path=last`` and that callback's next save find it."""
        callbacks = _model_checkpoints(trainer)
        if not callbacks:
            return None
        cb = next((c for c in callbacks if c.save_last), callbacks[0])
        if cb.last_model_path and Path(cb.last_model_path).parent == Path(cb.dirpath or "."):
            path = cb.last_model_path
        else:
            metrics = {**trainer.callback_metrics, "epoch": torch.tensor(trainer.current_epoch),
                       "step": torch.tensor(trainer.global_step)}
            path = cb.format_checkpoint_name(metrics, filename=cb.CHECKPOINT_NAME_LAST)
        cb.last_model_path = str(path)  # part of the saved state: the resumed run's next last save replaces it
        return Path(path)
