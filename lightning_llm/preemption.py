"""Preemption: a signal from the scheduler (SIGTERM from SLURM, Kubernetes, a spot instance's shutdown; SLURM's
``--signal``) stops a fit at a step boundary with a complete checkpoint of that step, and the process exits with
``128 + the signal's number`` (143 for SIGTERM), so that a pipeline or job array sees an unfinished run.

What happens, on every rank:

1. The handler (:func:`_handle`, in place from the fit's ``setup`` hook on: before Lightning registers its own,
   whose broadcast it never lets run inside a handler) only notes the signal on the host once the loop runs (the
   sanity check or training); nothing else runs inside it. A second signal is counted, nothing more: a save in
   progress goes on (the saves are atomic, so a SIGKILL at any moment leaves the previous checkpoint whole).
   Before that (set-up, loading a checkpoint, the reference precompute of the preference tasks: :func:`phase`) there
   is nothing to save yet: the handler raises :class:`StoppedEarly` (exit status ``128 + signal``), which the command
   line reports in one line naming the phase. The command line installs the same handler when it starts.
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
the signal handler (a signal on some ranks only would pair that broadcast with another collective, or hang); both are
replaced for the run (:func:`_take_over_lightning_sigterm`, :func:`_silence_lightning_notifier`: the places that touch
Lightning's internals for this).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

__all__ = ["Preempted", "Preemption", "StoppedEarly", "StoreAgreement", "exit_status", "install_handler", "last_checkpoint",
           "phase"]


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


class StoppedEarly(SystemExit):
    """A signal before the fit's loop (set-up, the reference precompute, ...) or during validate/test/predict: there
    is nothing to save, the process ends with :func:`exit_status`; ``str()`` is the one line that says so."""

    def __init__(self, signum: int, phase: str) -> None:
        super().__init__(exit_status(signum))
        self.signum, self.phase = int(signum), phase

    def __str__(self) -> str:
        return (f"{signal.Signals(self.signum).name} during {self.phase}: nothing to save (no training step since the "
                f"last checkpoint); exiting with status {self.code}")


# ------------------------------------------------------------------------------------------- the one handler
class _HandlerState:
    """What :func:`_handle` does now: raise :class:`StoppedEarly` naming ``phases[-1]``, or (no phase, a fit's loop
    running) hand the signal to ``receiver`` (:meth:`Preemption._on_signal`), which only notes it."""

    def __init__(self) -> None:
        self.phases: list[str] = ["set-up"]
        self.receiver: Callable[[int, Any], None] | None = None
        self.stopping = False  # StoppedEarly raised: later signals wait for it to unwind


_state = _HandlerState()


def _handle(signum: int, frame: Any) -> None:
    """The project's signal handler (see the module docstring): no collective, no I/O inside it."""
    if _state.stopping:
        return
    if _state.phases or _state.receiver is None:
        _state.stopping = True
        raise StoppedEarly(signum, _state.phases[-1] if _state.phases else "the end of the run")
    _state.receiver(signum, frame)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A stretch of work where a signal ends the process at once (nothing to save yet), named ``name`` in the line
    that says so (e.g. ``the reference precompute``), also inside a fit's loop."""
    depth = len(_state.phases)
    _state.phases.append(name)
    try:
        yield
    finally:
        del _state.phases[depth:]


def install_handler(signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> Callable[[], None]:
    """Install :func:`_handle` for ``signals`` now (the command line, as it starts: a signal during set-up ends the
    process with one line); returns what puts the previous handlers back. Nothing outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _state.phases, _state.receiver, _state.stopping = ["set-up"], None, False
    previous = {sig: signal.signal(sig, _handle) for sig in signals}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


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
def _take_over_lightning_sigterm(trainer: pl.Trainer) -> None:
    """Switch off Lightning 2.6's own per-batch SIGTERM check for this fit.

    Lightning's ``_TrainingEpochLoop.advance`` calls ``_broadcast_sigterm_tensor()`` at the start of every batch of a
    multi-rank run: a broadcast of a device tensor and ``.item()`` on it, a device sync per step. An instance
    attribute of the same name shadows the method for this trainer's loop (no supported hook exists; removed again
    by :func:`_restore_lightning_sigterm`). Lightning's flag ``received_sigterm`` (which would raise
    ``SIGTERMException``, exit status 0, on the ranks that got the signal only) is never set: its notifier is
    silenced (:func:`_silence_lightning_notifier`). ``tests/checkpoints/test_preemption.py`` fails if Lightning
    renames either."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        raise RuntimeError("lightning_llm.preemption: this Lightning version has no "
                           "_TrainingEpochLoop._broadcast_sigterm_tensor; update _take_over_lightning_sigterm")
    loop._broadcast_sigterm_tensor = _no_lightning_check  # type: ignore[method-assign]
    trainer._signal_connector.received_sigterm = False


def _no_lightning_check() -> None:
    """Lightning's per-batch SIGTERM broadcast, switched off (the agreement is :class:`StoreAgreement`'s)."""


def _silence_lightning_notifier(trainer: pl.Trainer) -> None:
    """Before Lightning registers its signal handlers (at the end of its set-up): its SIGTERM notifier, which runs
    ``dist.broadcast`` inside the signal handler, is shadowed for this trainer by one that does nothing; Lightning
    then composes it with the handler already in place (:func:`_handle`), which it calls. Lightning's SLURM requeue
    handler is not registered either while :func:`_handle` holds its signal (it runs at the step boundary:
    :meth:`Preemption._stop`)."""
    connector = trainer._signal_connector
    if not hasattr(type(connector), "_sigterm_notifier_fn"):
        raise RuntimeError("lightning_llm.preemption: this Lightning version has no "
                           "_SignalConnector._sigterm_notifier_fn; update _silence_lightning_notifier")
    connector._sigterm_notifier_fn = _no_lightning_notice  # type: ignore[method-assign]


def _no_lightning_notice(signum: int, frame: Any) -> None:
    """Lightning's SIGTERM notifier, switched off (the project's :func:`_handle` runs beside it)."""


def _restore_lightning_notifier(trainer: pl.Trainer) -> None:
    vars(trainer._signal_connector).pop("_sigterm_notifier_fn", None)


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


_PHASES = {"fit": "set-up", "validate": "validation", "test": "testing", "predict": "prediction"}
"""What a signal is said to come during before a fit's loop runs, by the run's stage (fit: its set-up)."""


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
        self._previous: dict[int, Any] = {}  # the handlers before this run's set-up, put back at its end
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

    def _hold_signals(self, trainer: pl.Trainer, stage: str) -> None:
        """At set-up, before Lightning registers its handlers: :func:`_handle` holds this run's signals (a signal ends
        the process at once until the loop runs: nothing to save yet) and Lightning's notifier is silenced."""
        signals = self._signals(trainer)
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("preemption: %s runs outside the main thread, where no signal handler can be installed; "
                        "a %s stops the process without a checkpoint", stage, "/".join(s.name for s in signals))
            return
        _silence_lightning_notifier(trainer)
        _state.phases, _state.receiver, _state.stopping = [_PHASES.get(stage, stage)], None, False
        self._previous = {sig: signal.signal(sig, _handle) for sig in signals}
        for sig in signals:
            if sig != signal.SIGTERM and self._is_lightning_requeue(trainer, sig):
                self._lightning_handlers[sig] = trainer._signal_connector._slurm_sigusr_handler_fn

    def _release_signals(self, trainer: pl.Trainer) -> None:
        """At the run's end (or failure): the handlers from before its set-up, also as those Lightning's teardown
        puts back."""
        if self._previous:
            _state.phases, _state.receiver = ["the end of the run"], None
            originals = trainer._signal_connector._original_handlers
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
                if sig in originals:
                    originals[sig] = handler
            self._previous = {}
        _restore_lightning_notifier(trainer)

    def _install(self, trainer: pl.Trainer) -> None:
        """When the fit's loop starts: the agreement over ranks, and signals noted from now on."""
        if self._installed:
            return
        self._installed, self._step = True, trainer.global_step
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            prefix = "lightning_llm/preemption/" + str(trainer.strategy.broadcast(uuid.uuid4().hex))
            self._agreement = StoreAgreement(_default_store(), prefix=prefix, world=trainer.world_size,
                                             rank=trainer.global_rank)
        if self._previous:
            _take_over_lightning_sigterm(trainer)
            _state.phases, _state.receiver, _state.stopping = [], self._on_signal, False

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
        self._hold_signals(trainer, stage)

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
        self._release_signals(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "")

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
