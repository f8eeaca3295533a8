"""Preemption (issue 66): a scheduler's SIGTERM stops a fit after the step it came in, with a complete checkpoint of
that step, and the process exits with 128 + the signal's number; ``--ckpt_path=last`` continues on the uninterrupted
curve, at the same layout or another, and starts from scratch when there is no checkpoint yet.

One launch of 2 CPU ranks runs, each against its own uninterrupted curve (``ModelCheckpoint`` every 4 steps, so the
newest scheduled checkpoint holds step 4): ddp x2 and zero3 x2 with SIGTERM sent to every rank at the start of step 5
(saved: step 6), zero3's save resumed under zero3 and under tp x2, deepspeed_zero2 x2 (DeepSpeed's own checkpoint); zero3 with ``async_save`` where SIGTERM reaches
rank 1 alone while the step-4 background write is in flight (slowed), which the preemption save finishes first, and
a second SIGTERM comes during the preemption save. The pytest process meanwhile does the same on one device. In
process: the store agreement, ``--ckpt_path=last``'s choice, Lightning's internals this relies on, SLURM's requeue
signal through Lightning's own requeue. Through the command line (``configs/pretrain_debug.yaml``, as the issue's
user ran it): exit status 143, the log line, and the same command line resuming in the run's next logger version.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from typing_extensions import override

from lightning_llm.reliability import parse_fault, shutdown_process_group
from lightning_llm.testing import (
    checkpointed_fit,
    cli_process,
    gathered,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    write_json_on_rank0,
)

STEPS, EVERY, SIGNAL_AT = 10, 4, 5
SAVED = SIGNAL_AT + 1
"""SIGTERM at the start of step 5 (0-based) is noted before that step's check: the run stops after it, 6 steps done."""
TOL, TOL_RESHARDED = 1e-6, 1e-5
SLOW_WRITE_S = 1.5
REPO = Path(__file__).resolve().parents[2]


class _Lines(logging.Handler):
    """The preemption's log lines of one fit."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _SecondSignal(pl.Callback):
    """Sends this process SIGTERM again while the preemption save of step ``SAVED`` runs."""

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        if trainer.global_step == SAVED:
            os.kill(os.getpid(), signal.SIGTERM)


class _HandlerProbe(pl.Callback):
    """Calls the process's SIGTERM handler (what a signal would run) at the end of set-up, before Lightning registers
    its handlers, and at the start of training, after Lightning's registration and before the loop notes signals;
    records the collectives that ran inside it and what it raised."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def _probe(self, moment: str) -> None:
        from lightning_llm import preemption
        from lightning_llm.testing import CollectiveCounter

        handler, raised = signal.getsignal(signal.SIGTERM), None
        if not callable(handler):
            self.seen[moment] = {"handler": str(handler)}
            return
        with CollectiveCounter().counting() as calls:
            try:
                handler(signal.SIGTERM, None)
            except preemption.StoppedEarly as e:
                raised = str(e)
        preemption._state.stopping = False  # as if no signal came: the run goes on
        self.seen[moment] = {"collectives": [name for name, _, _ in calls], "raised": raised}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe("set-up")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe("train start")


class SignalDuring(pl.Callback):
    """Sends this process SIGTERM in its own ``setup`` hook (``moment="setup"``) or at the first reference forward of
    a preference task's precompute (``precompute``): the command line tests' signal before the loop."""

    def __init__(self, moment: str = "setup") -> None:
        self.moment = moment

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.moment == "setup":
            os.kill(os.getpid(), signal.SIGTERM)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.moment != "precompute":
            return
        passes = pl_module.no_grad_logps

        def signalled(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGTERM)
            return passes(*args, **kwargs)

        pl_module.no_grad_logps = signalled


def _run(out: Path, strategy: Any, *, devices: int, batch: int, fault: str | None = None,
         ckpt_path: str | None = None, callbacks: tuple[pl.Callback, ...] = ()) -> dict[str, Any]:
    lines = _Lines()
    logger = logging.getLogger("lightning_llm.preemption")
    logger.addHandler(lines)
    try:
        row = checkpointed_fit(out, strategy=strategy, devices=devices, steps=STEPS, batch=batch, fault=fault,
                               ckpt_path=ckpt_path, save_every=EVERY, callbacks=callbacks)
    finally:
        logger.removeHandler(lines)
    return {**row, "log": lines.lines}


def _cut_and_resume(out: Path, strategy: Any, *, devices: int, batch: int, fault: str,
                    resume: dict[str, Any] | None = None, callbacks: tuple[pl.Callback, ...] = ()) -> dict[str, Any]:
    cut = _run(out, strategy, devices=devices, batch=batch, fault=fault, callbacks=callbacks)
    path = cut.get("preempted", {}).get("path")
    runs = {"cut": cut}
    for name, (other, other_batch) in {"resumed": (strategy, batch), **(resume or {})}.items():
        runs[name] = _run(out / name, other, devices=devices, batch=other_batch, ckpt_path=path)
    return runs


def _slow_first_background_write() -> Any:
    """The first background write of the fit sleeps ``SLOW_WRITE_S`` first: still in flight at the next steps."""
    from lightning_llm.strategies.engine import checkpoint as engine_checkpoint

    real, calls = engine_checkpoint.hckpt.write_hybrid, []

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(SLOW_WRITE_S)
        return real(*args, **kwargs)

    engine_checkpoint.hckpt.write_hybrid = slow
    return lambda: setattr(engine_checkpoint.hckpt, "write_hybrid", real)


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.strategies import TensorParallelStrategy, ZeroStrategy

    every_rank = f"term:step={SIGNAL_AT}"
    if mode == "reference":
        runs = {"full": _run(out / "one-full", "auto", devices=1, batch=8),
                **_cut_and_resume(out / "one", "auto", devices=1, batch=8, fault=every_rank)}
        shutdown_process_group()
        (out / "reference.json").write_text(json.dumps(runs))
        return
    zero3 = lambda: ZeroStrategy(stage=3)  # noqa: E731 - built while the fault is set
    tp2 = lambda: TensorParallelStrategy(tensor_parallel_size=2)  # noqa: E731
    probes = {"ddp": _HandlerProbe(), "zero3": _HandlerProbe()}
    runs = {"ddp_full": _run(out / "ddp-full", "ddp", devices=2, batch=4, callbacks=(probes["ddp"],)),
            "ddp": _cut_and_resume(out / "ddp", "ddp", devices=2, batch=4, fault=every_rank),
            "zero3_full": _run(out / "zero3-full", zero3, devices=2, batch=4, callbacks=(probes["zero3"],)),
            "zero3": _cut_and_resume(out / "zero3", zero3, devices=2, batch=4, fault=every_rank,
                                     resume={"resumed_tp2": (tp2, 8)}),
            "deepspeed": _cut_and_resume(out / "deepspeed", "deepspeed_zero2", devices=2, batch=4, fault=every_rank)}
    restore = _slow_first_background_write()
    try:
        runs["async"] = _cut_and_resume(out / "async", lambda: ZeroStrategy(stage=3, async_save=True), devices=2,
                                        batch=4, fault=f"term:step={SIGNAL_AT}:rank=1", callbacks=(_SecondSignal(),))
    finally:
        restore()
    runs["probes"] = {layout: probe.seen for layout, probe in probes.items()}
    write_json_on_rank0(out / "layouts.json", gathered(runs))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("preemption")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@functools.cache
def _saved_step(path: str) -> int:
    from lightning_llm.export import read_checkpoint

    return int(read_checkpoint(path)["global_step"])


def _check(name: str, runs: dict[str, Any], full: list[float], *, tol: float = TOL, exact: float = TOL) -> None:
    """The cut run stopped after step ``SAVED`` with status 143 and said so; its checkpoint holds that step, whole;
    every resumed run continues on ``full``."""
    cut = runs["cut"]
    assert "error" not in cut, cut
    stop = cut["preempted"]
    assert stop["status"] == 128 + signal.SIGTERM == 143 and stop["step"] == SAVED, stop
    path = Path(stop["path"])
    assert path.name == "last.ckpt" and _saved_step(str(path)) == SAVED
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(".")]  # no staging left behind
    assert max_abs_err(cut["losses"], full[:SAVED]) <= exact
    line = next(ln for ln in cut["log"] if ln.startswith("saved step"))
    took = float(re.search(rf"saved step {SAVED} to {re.escape(str(path))} in ([0-9.]+) s", line).group(1))
    assert line.endswith("exiting with status 143 (128 + SIGTERM)"), line
    for key, resumed in runs.items():
        if not key.startswith("resumed"):
            continue
        assert "error" not in resumed and "preempted" not in resumed, resumed
        assert resumed["start"] == SAVED and len(resumed["losses"]) == STEPS - SAVED, resumed
        err = max_abs_err(resumed["losses"], full[SAVED:])
        print(f"{name}: SIGTERM at step {SIGNAL_AT}, saved step {SAVED} in {took:.2f} s, exit 143; {key} steps "
              f"{SAVED}-{STEPS - 1}: max |loss - uninterrupted| {err:.2e}")
        assert err <= (tol if key != "resumed" else exact)


@pytest.mark.multiprocess
def test_sigterm_on_one_device_saves_the_step_and_resumes_exactly(runs: Path) -> None:
    ref = json.loads((runs / "reference.json").read_text())
    _check("1 device", ref, ref["full"]["losses"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_sigterm_on_every_rank_saves_the_step_and_resumes_exactly(runs: Path, layout: str) -> None:
    """ddp x2 (Lightning's DDP, one .ckpt file) and zero3 x2 (the engine's sharded directory, also resumed under tp
    x2 through the layout-free format)."""
    for rank, row in enumerate(json.loads((runs / "layouts.json").read_text())):
        _check(f"{layout} x2 rank {rank}", row[layout], row[f"{layout}_full"]["losses"], tol=TOL_RESHARDED)


@pytest.mark.multiprocess
def test_sigterm_under_deepspeed_saves_the_step(runs: Path) -> None:
    """deepspeed_zero2 x2: the same stop, DeepSpeed's own checkpoint directory of step 6 (staged and published whole),
    status 143; the resumed run starts there and ends on ddp's curve (the same data-parallel math)."""
    for rank, row in enumerate(json.loads((runs / "layouts.json").read_text())):
        _check(f"deepspeed_zero2 x2 rank {rank}", row["deepspeed"], row["ddp_full"]["losses"], tol=TOL_RESHARDED,
               exact=TOL_RESHARDED)


@pytest.mark.multiprocess
def test_sigterm_during_a_background_save(runs: Path) -> None:
    """zero3 x2 with ``async_save``: SIGTERM reaches rank 1 alone while the step-4 write (slowed by 1.5 s) is in
    flight. Both ranks agree through the store, the preemption save first finishes that write, then writes step 6;
    a second SIGTERM during it changes nothing: the checkpoint is whole and resumes exactly."""
    for rank, row in enumerate(json.loads((runs / "layouts.json").read_text())):
        runs_ = row["async"]
        _check(f"zero3 async x2 rank {rank}", runs_, row["zero3_full"]["losses"])
        line = next(ln for ln in runs_["cut"]["log"] if ln.startswith("saved step"))
        waited = float(re.search(r", ([0-9.]+) s of it finishing a background save", line).group(1))
        assert waited >= 0.5 and "1 more signal(s) came during the save" in line, line
        said = next(ln for ln in runs_["cut"]["log"] if ln.startswith("SIGTERM"))
        assert said == (f"SIGTERM received during step {SIGNAL_AT}; saving step {SAVED}" if rank == 1 else
                        f"SIGTERM received by another rank; saving step {SAVED}"), said


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_no_collective_runs_inside_a_signal_handler(runs: Path, layout: str) -> None:
    """ddp x2 and zero3 x2 (which Lightning restores after set-up): what a SIGTERM would run at the end of set-up
    (before Lightning registers its handlers) and at the start of training (after it did, before the loop notes
    signals) is the project's handler, which runs no collective (Lightning's broadcast inside its handler, on the
    signalled ranks only, could pair with another collective or hang) and ends the process naming the phase."""
    for rank, row in enumerate(json.loads((runs / "layouts.json").read_text())):
        seen = row["probes"][layout]
        print(f"{layout} rank {rank}: {seen}")
        assert "error" not in row[f"{layout}_full"] and len(row[f"{layout}_full"]["losses"]) == STEPS
        for moment in ("set-up", "train start"):
            assert seen[moment] == {"collectives": [], "raised": "SIGTERM during set-up: nothing to save (no "
                                    "training step since the last checkpoint); exiting with status 143"}, seen


# ------------------------------------------------------------------------------------------------ in process
def test_store_agreement_is_the_same_on_every_rank() -> None:
    """Two ranks on one store: a read waits until both posted, gives the first signal posted to both, and none when
    none was; the previous step's key is dropped; a rank that never posts ends in a timeout naming the step."""
    import torch.distributed as dist

    from lightning_llm.preemption import StoreAgreement

    store = dist.HashStore()
    ranks = [StoreAgreement(store, prefix="p", world=2, rank=r, timeout=5) for r in (0, 1)]
    for r in ranks:
        r.post(0, None)
    assert [r.read(0) for r in ranks] == [0, 0]
    got: list[int] = []
    ranks[0].post(1, signal.SIGUSR1)
    reader = threading.Thread(target=lambda: got.append(ranks[0].read(1)))
    reader.start()
    time.sleep(0.2)
    assert not got  # rank 1 has not posted step 1 yet: the read waits
    ranks[1].post(1, signal.SIGTERM)
    reader.join(5)
    assert got == [signal.SIGUSR1] and ranks[1].read(1) == signal.SIGUSR1  # the first signal posted, on both
    assert not store.check(["p/0"]) and store.check(["p/1"])
    ranks[0].timeout = 0.2
    ranks[0].post(2, None)
    with pytest.raises(RuntimeError, match="preemption check of step 2: only 1 of 2 ranks reached it"):
        ranks[0].read(2)


def test_ckpt_path_last_is_the_newest_checkpoint_of_every_attempt(tmp_path: Path) -> None:
    """``--ckpt_path=last``: none yet -> None (start from scratch); else the newest complete checkpoint over every
    logger version (each attempt of a run gets a new ``version_N``) and Lightning's SLURM requeue saves, never a
    staging directory or temporary file."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_llm.preemption import last_checkpoint

    trainer = pl.Trainer(default_root_dir=str(tmp_path), logger=CSVLogger(str(tmp_path), name="run"),
                         enable_progress_bar=False)
    assert last_checkpoint(trainer) is None

    def make(p: Path, when: int, *, directory: bool = False) -> Path:
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.mkdir() if directory else p.write_text("x"))
        os.utime(p, (when, when))
        return p

    make(tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt", 100)
    newest = make(tmp_path / "run" / "version_1" / "checkpoints" / "epoch=0-step=8.ckpt", 200, directory=True)
    make(tmp_path / "run" / "version_1" / "checkpoints" / ".last.ckpt.partial", 300, directory=True)
    make(tmp_path / "run" / "version_1" / "checkpoints" / ".last.ckpt.tmp-1-ab", 300)
    assert last_checkpoint(trainer) == newest
    hpc = make(tmp_path / "hpc_ckpt_1.ckpt", 400)
    assert last_checkpoint(trainer) == hpc


def test_lightning_internals_it_replaces_are_where_it_expects() -> None:
    """Lightning 2.6 checks SIGTERM with a per-batch broadcast read on the host, and sets ``received_sigterm`` from a
    handler that broadcasts inside the signal handler: ``preemption._take_over_lightning_sigterm`` switches both off
    for a fit. This fails when Lightning moves them (then the replacement needs updating)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    assert ".item()" in inspect.getsource(_TrainingEpochLoop._broadcast_sigterm_tensor)
    notifier = inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    assert "dist.broadcast" in notifier and "self.received_sigterm = True" in notifier
    # preemption._silence_lightning_notifier: Lightning composes its notifier (looked up on the instance) with the
    # handler already in place, and registers its SLURM requeue handler only where none is
    register = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "[self._sigterm_notifier_fn]" in register and "self._original_handlers = self._get_current_signal_handlers()" \
        in register
    assert "sigterm_handlers.append(signal.getsignal(signal.SIGTERM))" in register
    assert "not self._has_already_handler(sigusr)" in register


def test_fault_spec_sends_a_signal() -> None:
    assert parse_fault("term:step=3:sig=USR1:attempt=0") == {"action": "term", "step": 3, "sig": "USR1",
                                                             "attempt": 0}
    with pytest.raises(ValueError, match="sig=NAME"):
        parse_fault("kill:step=3:sig=USR1")


@pytest.mark.multiprocess  # Lightning runs scontrol (a script here)
def test_slurm_requeue_signal_runs_lightnings_requeue_at_the_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SLURM with Lightning's auto-requeue, its requeue signal (SIGUSR1, what ``--signal=USR1@60`` sends) runs
    Lightning's own handler at the step boundary, not inside the signal handler: its ``hpc_ckpt_1.ckpt`` of that step
    and ``scontrol requeue JOBID``; the process status is 128 + 10; ``--ckpt_path=last`` finds that checkpoint."""
    from lightning_llm.preemption import last_checkpoint

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "pretrain",
                       "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                       "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    row = checkpointed_fit(out, strategy="auto", devices=1, steps=6, batch=8, fault="term:step=2:sig=USR1",
                           save_every=4)
    assert row["preempted"]["status"] == 128 + signal.SIGUSR1 == 138 and row["preempted"]["step"] == 3, row
    hpc = out / "hpc_ckpt_1.ckpt"
    assert row["preempted"]["path"] == str(hpc) and _saved_step(str(hpc)) == 3
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    trainer = pl.Trainer(default_root_dir=str(out), logger=False, enable_progress_bar=False)
    assert last_checkpoint(trainer) == hpc


# ------------------------------------------------------------------------------------------------ command line
def test_the_command_line_exits_with_the_signal_status(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` returns a fit's ``Preempted`` status (128 + its signal), and 143 for Lightning's own
    ``SIGTERMException`` (validate/test/predict stopped by SIGTERM), never 0."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lightning_llm.cli import app
    from lightning_llm.preemption import Preempted

    for raised, status in ((Preempted(signal.SIGUSR1, step=3, path=None), 138), (SIGTERMException(), 143)):
        def stopped(*args: Any, error: BaseException = raised, **kwargs: Any) -> None:
            raise error

        monkeypatch.setattr(app, "LLMCLI", stopped)
        assert app.main(["validate", "--config", "x.yaml"]) == status


def _cli(out: Path, *extra: str, env: dict[str, str] | None = None) -> Any:
    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), "--trainer.max_steps=8",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.log_every_n_steps=1",
            "--model.model_overrides={num_layers: 2}", f"--data.cache_dir={out.parent / 'cache'}",
            "--data.generated_docs=60", f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.every_n_train_steps=4",
            "--trainer.callbacks.save_last=true", "--ckpt_path=last", *extra]
    return cli_process(args, cwd=REPO, env=env, timeout=600)


def _first_step(metrics: Path) -> int:
    return int(metrics.read_text().splitlines()[1].split(",")[1])


@pytest.mark.multiprocess
def test_the_same_command_line_serves_every_attempt(tmp_path: Path) -> None:
    """``lightning_llm fit --config configs/pretrain_debug.yaml ... --ckpt_path=last``: the first attempt starts from
    scratch, SIGTERM at step 5 saves step 6 and exits 143 saying where and how long; the same command line again
    resumes that checkpoint (in the logger's next version) and finishes with status 0."""
    out = tmp_path / "runs"
    first = _cli(out, env={"LIGHTNING_LLM_FAULT": "term:step=5"})
    log = first.stdout + first.stderr
    assert first.returncode == 143, log[-3000:]
    assert "--ckpt_path=last: no checkpoint of this run yet; training starts from scratch" in log
    last = out / "pretrain_debug" / "version_0" / "checkpoints" / "last.ckpt"
    assert re.search(rf"saved step 6 to {re.escape(str(last))} in [0-9.]+ s; exiting with status 143", log), log[-3000:]
    assert _saved_step(str(last)) == 6
    second = _cli(out)
    log = second.stdout + second.stderr
    assert second.returncode == 0, log[-3000:]
    assert f"--ckpt_path=last: resuming {last}" in log
    assert _first_step(out / "pretrain_debug" / "version_1" / "metrics.csv") == 6


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))


@pytest.mark.multiprocess
@pytest.mark.parametrize(("moment", "phase"), [("setup", "set-up"), ("precompute", "the reference precompute (fit "
                                                                                  "examples)")])
def test_a_signal_before_the_loop_ends_the_run_in_one_line(tmp_path: Path, moment: str, phase: str) -> None:
    """``lightning_llm fit --config configs/kto.yaml`` (its reference precomputed) with SIGTERM during set-up, or at the
    first reference forward of the precompute: status 143 at once, one line naming the phase, no traceback, no
    checkpoint (nothing was trained)."""
    args = ["fit", "--config", str(REPO / "configs" / "kto.yaml"), "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false", "--data.generated_examples=32", "--data.generated_val_examples=8",
            f"--trainer.logger.init_args.save_dir={tmp_path}", f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=tests.checkpoints.test_preemption.SignalDuring",
            f"--trainer.callbacks.moment={moment}"]
    proc = cli_process(args, cwd=REPO, timeout=600)
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("lightning_llm: SIGTERM")]
    print(lines)
    assert proc.returncode == 143, out[-3000:]
    assert lines == [f"lightning_llm: SIGTERM during {phase}: nothing to save (no training step since the last "
                     "checkpoint); exiting with status 143"], out[-3000:]
    assert "Traceback" not in out and not list(tmp_path.rglob("*.ckpt"))
