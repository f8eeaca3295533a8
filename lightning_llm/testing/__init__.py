"""Helpers for parity tests and benchmarks: record per-step losses/parameters, launch N local processes.

Shipped with the package (like ``lightning.pytorch.demos``) so users can check their own strategies/plans
against a single-device run the same way our tests do.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_llm.contract import capabilities_of
from lightning_llm.data import TextDataModule
from lightning_llm.files import atomic_open
from lightning_llm.preemption import Preempted
from lightning_llm.reliability import FAULT_ENV, leave_process, shutdown_process_group
from lightning_llm.strategies import HybridParallelStrategy
from lightning_llm.strategies.zero.native import model_state_bytes
from lightning_llm.tasks import CausalLMTask
from lightning_llm.tasks.base import OptimConfig
from lightning_llm.tools.tiny import write_bpe_tokenizer  # noqa: F401 (the package's API: tests write tokenizers)

from . import zygote
from .counters import COLLECTIVES, CollectiveCounter, HostReadCounter, StepTailCounter  # noqa: F401 (the package's API)
from .gradients import GRADIENTS_ENV, GradientRecorder, check_gradient_records
from .gradients import full_gradients, gradient_summary, recorder_for  # noqa: F401 (the package's API)


class StepRecorder(pl.Callback):
    """Records every rank's training loss per optimizer step, and optionally the final full parameters.

    At the end of ``fit`` rank 0 writes ``{"losses": [[rank0 step losses], [rank1 ...], ...],
    "world_size": N}`` to ``output`` as JSON, and the full (unsharded) parameters to ``output + ".pt"`` when
    ``save_params`` is set. Sharded parameters (DTensor) are gathered with ``full_tensor()``; under pipeline
    parallelism each rank's stages are gathered to rank 0.
    """

    def __init__(self, output: str, save_params: bool = False) -> None:
        """
        Args:
            output: JSON file for the recorded losses.
            save_params: Also save the final parameters (``<output>.pt``).
        """
        self.output = output
        self.save_params = save_params
        self.losses: list[float] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:  # e.g. a pipeline rank without the last stage reports the broadcast loss instead
            loss = trainer.callback_metrics.get("train_loss")
        self.losses.append(float(loss.detach().float()) if loss is not None else float("nan"))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gathered = [self.losses]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, self.losses)
        params = full_parameters(pl_module) if self.save_params else None
        if params is not None and capabilities_of(trainer.strategy).pipelined:
            parts: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, params)
            params = {k: v for part in parts for k, v in part.items()}
        if trainer.global_rank == 0:
            with atomic_open(self.output, "w") as f:
                json.dump({"losses": gathered, "world_size": len(gathered)}, f)
            if params is not None:
                with atomic_open(self.output + ".pt", "wb") as f:
                    torch.save(params, f)


class RolloutRecorder(pl.Callback):
    """The tokens of every training rollout of an on-policy RL task (each response's real tokens: the batch's padding
    left out), by the prompts' record ``index``, the
    all-gathers each rank's sampling ran (``CollectiveCounter``: ZeRO-3 gathers once per rollout, before it
    samples), and the bytes each rank holds of the task's frozen and scoring models (``model_state_bytes``, at fit
    start).

    Rank 0 writes ``{"rollouts": [{index: [[tokens of each response]]}, ...], "gathers": [[per rollout], per rank],
    "frozen_bytes": [per rank], "scoring_bytes": [per rank], "parts_bytes": [{child of task.model: bytes}, per
    rank]}`` to ``output`` as JSON at the end of ``fit``; tensor- and pipeline-parallel peers
    must have drawn the same tokens (checked: their entries are merged and must agree)."""

    def __init__(self, output: str) -> None:
        self.output = output
        self.rollouts: list[dict[int, list[list[int]]]] = []
        self.gathers: list[int] = []
        self.frozen_bytes = self.scoring_bytes = 0
        self.parts_bytes: dict[str, int] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.frozen_bytes = sum(model_state_bytes(m, [])["params"] for m in pl_module.frozen_models().values())
        self.scoring_bytes = sum(model_state_bytes(m, [])["params"] for m in pl_module.scoring_models().values())
        self.parts_bytes = {name: model_state_bytes(m, [])["params"] for name, m in pl_module.model.named_children()}
        sample = pl_module.sample

        def recorded(batch: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            with CollectiveCounter().counting() as calls:
                out = sample(batch, *args, **kwargs)
            if trainer.training:
                self.gathers.append(sum(1 for name, _, _ in calls if name.startswith("all_gather")))
                per = out.responses.shape[0] // len(batch["index"])
                real = out.attention_mask[:, out.context_length:].bool()  # a row's tokens, not the batch's padding
                rows = [r[m].tolist() for r, m in zip(out.responses, real)]
                self.rollouts.append({int(i): rows[k * per:(k + 1) * per] for k, i in enumerate(batch["index"].tolist())})
            return out

        pl_module.sample = recorded  # type: ignore[method-assign]

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = (self.rollouts, self.frozen_bytes, self.gathers, self.scoring_bytes, self.parts_bytes)
        every = gathered(mine) if torch.distributed.is_initialized() else [mine]
        merged: list[dict[int, list[list[int]]]] = [{} for _ in self.rollouts]
        for rollouts, *_ in every:
            for step, rows in zip(merged, rollouts, strict=True):
                for index, tokens in rows.items():
                    if step.setdefault(index, tokens) != tokens:
                        raise AssertionError(f"ranks of one replica drew different tokens for prompt {index}")
        if trainer.global_rank == 0:
            with atomic_open(self.output, "w") as f:
                json.dump({"rollouts": merged, "frozen_bytes": [e[1] for e in every], "gathers": [e[2] for e in every],
                           "scoring_bytes": [e[3] for e in every], "parts_bytes": [e[4] for e in every]}, f)


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of all parameters by name, gathering DTensor shards (a collective: call on every rank)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[name] = t.clone().cpu()
    return out


def run_worker(fn: Callable[..., Any], *args: Any) -> NoReturn:
    """Entry point of a process launched by torchrun for a test or benchmark: run ``fn(*args)``, then leave
    deterministically on every rank (barrier, destroy the process groups, flush, ``os._exit``).

    A process that built several Trainers (each with its device meshes, FSDP or DeepSpeed state) can otherwise abort
    in interpreter shutdown after all its work is done; an exception still exits non-zero with its traceback.
    """
    fn(*args)
    shutdown_process_group()
    leave_process(0)


def launch(script: str | Path, nproc: int, *args: str, extra: list[str] | None = None) -> subprocess.Popen:
    """Start ``python -m torch.distributed.run --nproc_per_node=NPROC SCRIPT ARGS`` on this machine (1 thread per
    process, output captured); pair it with :func:`wait`. The one launcher of the multi-process tests."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if zygote.enabled() and not extra:  # forked from the pre-imported zygote (see lightning_llm.testing.zygote)
        return zygote.Job(str(script), list(args), nproc=nproc, env=env, port=free_port())  # type: ignore[return-value]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *(extra or []), str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait(proc: subprocess.Popen, timeout: float = 600) -> str:
    """The output of a :func:`launch`; raises ``RuntimeError`` with its tail when it fails or times out."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise RuntimeError(f"{' '.join(proc.args)} timed out\n{out[-8000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)} failed\n{out[-8000:]}")
    return out


class LoggedLoss(pl.Callback):
    """The ``train_loss`` this rank logged at each training step (NaN where none was), and the step ``fit`` started
    from (> 0 after a resume). Named (``grads``), it also records the first step's full gradients for the layout
    harness (:class:`~.gradients.GradientRecorder`; only where the harness asks: :data:`GRADIENTS_ENV`), to be
    compared with the one-device run named ``reference`` (default: ``grads``)."""

    def __init__(self, grads: str | None = None, reference: str | None = None) -> None:
        self.losses: list[float] = []
        self.start = -1
        self.gradients = GradientRecorder(grads, reference) if grads and os.environ.get(GRADIENTS_ENV) else None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = trainer.global_step
        if self.gradients is not None:
            self.gradients.on_train_start(trainer, pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.gradients is not None:
            self.gradients.on_before_optimizer_step(trainer, pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics.get("train_loss", float("nan"))))


def table_trainer(out: Path, *, strategy: Any, devices: int, max_steps: int, callbacks: list[pl.Callback],
                  save_every_step: bool = False, save_every: int = 1) -> pl.Trainer:
    """The Trainer of the layout-table tests: CPU, no logger, progress bar or validation; ``save_every_step``:
    ``out/ckpt/last.ckpt`` rewritten after every step (every ``save_every`` steps; no other checkpoint)."""
    if save_every_step:
        callbacks = [*callbacks, pl.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True,
                                                              every_n_train_steps=save_every, save_top_k=0)]
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                      enable_checkpointing=save_every_step, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=str(out))


def checkpointed_fit(out: Path, *, strategy: Any, devices: int, steps: int, batch: int, fault: str | None = None,
                     ckpt_path: str | None = None, save_every: int = 1,
                     callbacks: tuple[pl.Callback, ...] = ()) -> dict[str, Any]:
    """The fit of the checkpoint tests: the ``debug`` decoder (dropout 0, constant LR 3e-3) on the generated corpus,
    ``out/ckpt/last.ckpt`` after every step (every ``save_every``: :func:`table_trainer`), from ``ckpt_path`` if
    given. ``strategy``, or a callable building it, is built while ``LIGHTNING_LLM_FAULT=fault`` is set (strategies
    read it when built); a ``RuntimeError`` of fit is returned as ``error``, a stop by a signal
    (:class:`~lightning_llm.preemption.Preempted`) as ``preempted`` (its exit status, step and path). Returns the
    losses logged and the step fit started from."""
    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        strategy = strategy() if callable(strategy) else strategy
        pl.seed_everything(3)
        task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=3e-3, scheduler="constant"))
        dm = TextDataModule(block_size=32, batch_size=batch, cache_dir=str(out.parent / "cache"), generated_docs=100)
        rec = LoggedLoss()
        trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=[rec, *callbacks],
                                save_every_step=True, save_every=save_every)
        row: dict[str, Any] = {}
        try:
            trainer.fit(task, dm, ckpt_path=ckpt_path)
        except RuntimeError as e:
            row["error"] = str(e)
        except Preempted as e:
            row["preempted"] = {"status": e.code, "step": e.step, "path": str(e.path)}
    finally:
        os.environ.pop(FAULT_ENV, None)
    return {**row, "losses": rec.losses, "start": rec.start}


def gathered(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``all_gather_object`` over the default group)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def write_json_on_rank0(path: Path, obj: Any) -> None:
    """``obj`` as JSON at ``path``, written by global rank 0 only."""
    if int(os.environ.get("RANK", "0")) == 0:
        path.write_text(json.dumps(obj))


def run_layouts_and_reference(script: str | Path, out: Path, reference: Callable[[], Any], *, nproc: int = 2,
                              timeout: float = 1200, then: tuple[tuple[int, str], ...] = (),
                              args: tuple[str, ...] = ()) -> Path:
    """The layout-table pattern: the one-device ``reference`` in this process (1 thread), then ``script layouts OUT
    ARGS`` on ``nproc`` ranks (and ``script MODE OUT ARGS`` on ``n`` ranks for each ``(n, MODE)`` of ``then``: a file
    whose layouts need another number of processes); returns ``out``. Runs that record their first-step gradients
    (``LoggedLoss(grads=...)``, :class:`GradientRecorder`) are compared with the reference's records of the same name,
    per parameter (:func:`~.gradients.check_gradient_records`: a difference past 1e-5 of a tensor's largest entry
    raises, naming the run and the parameter; ``out/gradients/summary.json`` holds every run's figures)."""
    grads = out / "gradients"
    with _environment({GRADIENTS_ENV: str(grads / "reference")}):
        _single_threaded(reference)
    with _environment({GRADIENTS_ENV: str(grads / "layouts")}):
        for n, mode in ((nproc, "layouts"), *then):
            wait(launch(script, n, mode, str(out), *args), timeout)
    if (grads / "layouts").is_dir():
        check_gradient_records(grads)
    return out


@contextlib.contextmanager
def _environment(changes: dict[str, str]) -> Iterator[None]:
    """``changes`` set in ``os.environ`` for the block; every variable added or changed in it (PL_GLOBAL_SEED & co)
    is put back after."""
    env = dict(os.environ)
    os.environ.update(changes)
    try:
        yield
    finally:
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update(env)


def _single_threaded(fn: Callable[[], Any]) -> Any:
    """``fn()`` with one intra-op thread (the test workers share the machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def run_reference_meanwhile(proc: subprocess.Popen, fn: Callable[[], Any], timeout: float = 600) -> str:
    """Run the single-device reference ``fn`` in this process (1 thread) while the launched ranks ``proc`` run;
    returns their output. Environment variables the reference sets (PL_GLOBAL_SEED & co) are removed after."""
    try:
        with _environment({}):
            _single_threaded(fn)
        return wait(proc, timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def resumed_curve_error(path: Path, reference: list[float], *, start: int) -> float:
    """``max |got - ref|`` of the resumed run ``path`` (the JSON ``{"start", "losses"}`` its workers wrote) against the
    uninterrupted ``reference`` curve from step ``start`` on; checks it resumed there and ran to the end."""
    got = json.loads(Path(path).read_text())
    assert got["start"] == start and len(got["losses"]) == len(reference) - start, got
    return max_abs_err(got["losses"], reference[start:])


def saved_tensor_bytes(fn: Callable[[], Any], exclude: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs, those of ``exclude`` (inputs,
    weights) left out: what a forward keeps alive until its backward (the activation memory models are checked
    against it)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def two_rank_layout(layout: str, global_batch: int = 8) -> tuple[Any, int]:
    """(strategy, per-rank batch) of a layout on 2 processes: the model-parallel ones (``tp``, ``pp``, ``cp``; ``3d``
    is tp2 with sequence parallelism) give every rank the whole batch, the data-parallel ones (any other strategy
    name) half of it."""
    if layout == "3d":
        return HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True), \
            global_batch
    return layout, global_batch if layout in ("tp", "pp", "cp") else global_batch // 2


def max_abs_err(got: list[float], ref: list[float]) -> float:
    """``max |got - ref|`` over two equally long curves."""
    return max(abs(x - y) for x, y in zip(got, ref, strict=True))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CLI_ERROR = "lightning_llm: error: "
"""How the command line starts its one error line."""


def torchrun_cli_fails(args: list[str], cwd: str | Path, *, nproc: int = 2, timeout: float = 300) -> str:
    """Run ``lightning_llm ARGS`` on ``nproc`` processes under torchrun; it must fail. Returns the output of every
    rank (stdout + stderr)."""
    env = dict(os.environ)
    env.pop("LIGHTNING_LLM_DEBUG", None)
    proc = cli_process(args, nproc=nproc, cwd=cwd, env=env, timeout=timeout, replace_env=True)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        raise AssertionError(f"expected the run to fail:\n{out[-3000:]}")
    return out


def one_error_line_from_ranks(out: str) -> str:
    """The single error line of a failed torchrun: printed once over all ranks, no worker traceback, and a worker
    left with the CLI's exit code 2 (torchrun's own failure summary follows). Returns the line."""
    lines = [ln for ln in out.splitlines() if CLI_ERROR in ln]
    problems = [] if len(lines) == 1 else [f"{len(lines)} error lines"]
    if [ln for ln in out.splitlines() if ln.startswith("[rank") and "Traceback" in ln]:
        problems.append("a worker traceback")
    if "exitcode  : 2" not in out and zygote.exit_line(2) not in out:  # torchrun's summary, or the zygote's
        problems.append("no worker exited with code 2")
    if problems:
        raise AssertionError(f"{', '.join(problems)}:\n{out[-4000:]}")
    return lines[0]


def cli_process(args: list[str], *, nproc: int = 1, nnodes: int = 1, timeout: float = 600,
                cwd: str | Path | None = None, env: dict[str, str] | None = None,
                replace_env: bool = False) -> subprocess.CompletedProcess:
    """Run ``lightning_llm ARGS`` in fresh processes (one, or ``nproc`` per node as torchrun starts them: forked from
    the :mod:`~lightning_llm.testing.zygote` where it serves) with ``OMP_NUM_THREADS=1`` and ``env`` added to this
    process's environment (``replace_env``: ``env`` alone); stdout and stderr apart, whatever the exit code."""
    full_env = {**({} if replace_env else os.environ), "OMP_NUM_THREADS": "1", **(env or {})}
    cwd = str(cwd or os.getcwd())
    if zygote.enabled() and nnodes == 1:
        job = zygote.Job("lightning_llm", list(args), nproc=nproc, env=full_env, cwd=cwd, module=True, stderr=True,
                         port=free_port(), distributed=nproc > 1)
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            raise
        return subprocess.CompletedProcess(job.args, job.returncode, out, err or "")
    if nproc == 1 and nnodes == 1:
        cmd = [sys.executable, "-m", "lightning_llm", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "lightning_llm", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env, check=False)


def run_cli(args: list[str], *, nproc: int = 1, nnodes: int = 1, timeout: float = 600, cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``lightning_llm ARGS`` in fresh processes (:func:`cli_process`): one process, or ``nproc`` per node.

    Raises ``RuntimeError`` with the captured output when the command fails.
    """
    proc = cli_process(args, nproc=nproc, nnodes=nnodes, timeout=timeout, cwd=cwd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(map(str, proc.args))}\n--- stdout\n"
                           f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


class MetricRows(pl.Callback):
    """Every metric logged so far (``trainer.callback_metrics``), after each training step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def logged_rows(out: Path, *, key: str) -> list[dict[str, float]]:
    """The rows of the ``metrics.csv`` under ``out`` that hold ``key``, as floats."""
    import csv

    path = next(out.rglob("metrics.csv"))
    return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(path.open()) if r.get(key)]


