"""Start test processes from a process that imported the package once (a zygote), instead of a fresh interpreter.

A fresh ``python -m lightning_llm`` spends ~8 s of CPU importing (Lightning alone pulls in torchmetrics, scipy,
matplotlib, transformers and torch._dynamo) before its first line of work: each 2-rank torchrun launch of a test paid
it on both ranks plus torchrun's own agent, about half of a multi-process test's time on 2 cores. The zygote imports
everything once per pytest session and serves each launch by ``fork``: a job agent (its own process group, so that
a kill reaches every rank) forks the ranks with the environment torchrun gives them (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``: Lightning takes them as a torchelastic
launch), runs the script or module as ``__main__`` and, like torchrun, stops the other ranks when one fails. The
zygote itself never runs a tensor operation, so no thread pool or process group exists to be forked.

``launch``/``run_cli`` in :mod:`lightning_llm.testing` use it; ``LIGHTNING_LLM_TEST_LAUNCHER=torchrun`` runs every
launch through torchrun again, and what must be run as a user types it (the configs' header commands, torchrun's own
failure summary, several nodes) keeps torchrun.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

_MAX_MESSAGE = 1 << 20


# --------------------------------------------------------------------------------------------------- the zygote
def _serve(path: str) -> NoReturn:
    parent = os.getppid()
    import lightning_llm.cli  # noqa: F401 (the imports every launched process needs, done once)
    import lightning_llm.testing  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # job agents are reaped by the kernel
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect once the imports are done
    srv.listen(64)
    srv.settimeout(2)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session ended without stopping us (killed): never linger
                os._exit(0)
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 2)
        if not msg:
            os._exit(0)
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _agent(conn, json.loads(msg), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _agent(conn: socket.socket, job: dict[str, Any], fds: list[int]) -> NoReturn:
    """One launch: fork ``job["nproc"]`` ranks, wait for them, report the exit code on ``conn``."""
    os.setpgid(0, 0)
    conn.send(json.dumps({"pid": os.getpid()}).encode())
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in set(fds):
        os.close(fd)
    ranks: dict[int, int] = {}
    for rank in range(job["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _rank(job, rank)
        ranks[pid] = rank
    code, kill_at = 0, None  # kill_at: when ranks told to stop (SIGTERM) get SIGKILL
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG if kill_at is not None else 0)
        except ChildProcessError:
            break
        if pid == 0:
            if time.monotonic() > kill_at:
                _signal(ranks, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rc = os.waitstatus_to_exitcode(status)
        rank = ranks.pop(pid)
        if rc != 0 and code == 0:  # as torchrun: the first failure ends the job and names the rank
            code = rc if rc > 0 or not job["distributed"] else 1  # torchrun's 1; a plain process's own code
            if job["distributed"]:  # a plain ``python -m lightning_llm`` run prints nothing of its own
                print(f"zygote launch: rank {rank} (pid {pid}) failed: {exit_line(rc)}; stopping the others",
                      file=sys.stderr, flush=True)
            _signal(ranks, signal.SIGTERM)
            kill_at = time.monotonic() + 10
    conn.send(json.dumps({"returncode": code}).encode())
    os._exit(0)


def exit_line(code: int) -> str:
    """How the agent names a rank's exit: ``exit code 2``, ``exit code -9 (SIGKILL)``."""
    return f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _rank(job: dict[str, Any], rank: int) -> NoReturn:
    """Become rank ``rank``: torchrun's environment, then the script or module as ``__main__``."""
    import torch
    from lightning_utilities.core.rank_zero import rank_zero_only

    n = job["nproc"]
    os.environ.clear()
    os.environ.update(job["env"])
    if n > 1 or job["distributed"]:
        os.environ.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["port"]),
            "TORCHELASTIC_RUN_ID": "zygote", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False"})
    rank_zero_only.rank = rank  # Lightning read it at import, in the zygote
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    if os.environ.get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which a fork skips
        warnings.simplefilter("ignore")
    os.chdir(job["cwd"])
    sys.argv = [job["target"], *job["args"]]
    code: Any = 0
    try:
        if job["module"]:
            runpy.run_module(job["target"], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(job["target"]).parent)
            runpy.run_path(job["target"], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    with contextlib.suppress(Exception):
        from lightning_llm.reliability import leave_process

        leave_process(code)
    os._exit(code)


# --------------------------------------------------------------------------------------------------- the client
IMPORT_TIME_ENV = ("PYTHONPATH", "PYTHONHASHSEED", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE",
                   "TRANSFORMERS_OFFLINE", "TORCHDYNAMO_DISABLE")
"""Variables read at interpreter start or while the package imports: a zygote keeps the values it imported with, so
each set of values a launch asks for gets its own zygote (never a fork that silently keeps other values)."""
_MAX_ZYGOTES = 3
_zygotes: dict[tuple[str | None, ...], tuple[subprocess.Popen, str]] = {}
"""Running zygotes by their :data:`IMPORT_TIME_ENV` values, least recently used first."""


def enabled() -> bool:
    """Launches go through a zygote (``LIGHTNING_LLM_TEST_LAUNCHER`` unset or ``zygote``) on a system with fork."""
    return os.environ.get("LIGHTNING_LLM_TEST_LAUNCHER", "zygote") == "zygote" and hasattr(os, "fork")


def _address(env: dict[str, str]) -> str:
    """The socket of the zygote that imported with ``env``'s :data:`IMPORT_TIME_ENV` values (started if none)."""
    key = tuple(env.get(k) for k in IMPORT_TIME_ENV)
    running = _zygotes.pop(key, None)
    if running is not None and running[0].poll() is None:
        _zygotes[key] = running
        return running[1]
    while len(_zygotes) >= _MAX_ZYGOTES:  # a rarely used set of values (a test's own PYTHONPATH) gives way
        _shutdown(*_zygotes.pop(next(iter(_zygotes))))
    path = os.path.join(tempfile.mkdtemp(prefix="lightning_llm-zygote-"), "socket")
    log = Path(path).with_name("zygote.log")  # its own output (not the session's: no pipe of the caller held open)
    own = {k: v for k, v in os.environ.items() if k not in IMPORT_TIME_ENV}  # this session's, as a zygote's start
    own.update({k: v for k, v in zip(IMPORT_TIME_ENV, key, strict=True) if v is not None})
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", f"from {__name__} import _serve; _serve({path!r})"],
                                env={**own, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL, stdout=f,
                                stderr=subprocess.STDOUT)
    _zygotes[key] = (proc, path)
    atexit.register(_shutdown, proc, path)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            text = log.read_text(errors="replace")[-4000:]
            _shutdown(*_zygotes.pop(key))  # a zygote that never served is not kept for the next launch
            raise RuntimeError(f"the test launcher's zygote did not start (exit code {proc.poll()}):\n{text}")
        time.sleep(0.05)
    return path


def _shutdown(proc: subprocess.Popen, path: str) -> None:
    """Stop a zygote and remove the folder ``mkdtemp`` made for it alone (its socket ``path`` and log)."""
    with contextlib.suppress(Exception):
        proc.kill()
        proc.wait(5)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


class Job:
    """A launch in flight, used as the ``subprocess.Popen`` it stands for (``communicate``, ``poll``, ``wait``,
    ``kill``, ``returncode``, ``args``). ``stderr=True``: stderr apart from stdout (else merged into it)."""

    def __init__(self, target: str, args: list[str], *, nproc: int, env: dict[str, str], cwd: str | None = None,
                 module: bool = False, stderr: bool = False, port: int = 0, distributed: bool = True) -> None:
        self.args = ["<zygote>", f"--nproc_per_node={nproc}", *(["-m"] if module else []), target, *args]
        self.returncode: int | None = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr else (None, None)
        self._pipes = {out_r: [], **({err_r: []} if err_r is not None else {})}
        job = {"nproc": nproc, "env": env, "cwd": cwd or os.getcwd(), "module": module, "target": target,
               "args": list(args), "port": port, "distributed": distributed}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(_address(env))
        socket.send_fds(self._conn, [json.dumps(job).encode()], [out_w] + ([err_w] if err_w is not None else []))
        os.close(out_w)
        if err_w is not None:
            os.close(err_w)
        self.pid = json.loads(self._conn.recv(_MAX_MESSAGE))["pid"]
        self._order = [out_r] + ([err_r] if err_r is not None else [])
        self._open = set(self._order)

    def _pump(self, timeout: float | None) -> None:
        """Read the pipes until every rank closed them and the agent reported; ``TimeoutExpired`` past ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        for fd in self._open:
            sel.register(fd, selectors.EVENT_READ)
        if self.returncode is None:
            sel.register(self._conn, selectors.EVENT_READ)
        try:
            while sel.get_map():
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                events = sel.select(left)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in events:
                    if key.fileobj is self._conn:
                        msg = self._conn.recv(_MAX_MESSAGE)
                        self.returncode = json.loads(msg)["returncode"] if msg else -signal.SIGKILL
                        sel.unregister(self._conn)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._pipes[key.fd].append(chunk)
                    else:
                        sel.unregister(key.fd)
                        self._open.discard(key.fd)
                        os.close(key.fd)
        finally:
            sel.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self._pump(timeout)
        texts = [b"".join(self._pipes[fd]).decode(errors="replace") for fd in self._order]
        return texts[0], (texts[1] if len(texts) > 1 else None)

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._pump(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._pump(timeout)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
