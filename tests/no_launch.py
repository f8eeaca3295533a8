"""``make test-fast`` (``pytest -m "not multiprocess"``) launches no process, and stays so: while a run deselects the
``multiprocess`` tests, starting a process (``subprocess``, ``os.fork``/``forkpty``/``posix_spawn``,
``multiprocessing`` and the test launcher's zygote, which start theirs through these) fails the test that does it,
naming it and the command. A test that must launch one carries ``@pytest.mark.multiprocess``; ``make test`` runs it.

Let through: what libraries run on first use to probe the toolchain (:func:`probe`), milliseconds each, none of
them importing anything. DeepSpeed's process group on the CPU probes every op (``ldconfig -p``, a test program for an op's library)
and loads its shared-memory op through torch's extension builder (``ninja --version``, the compiler's version,
``ninja -v``: up to date once the op is built, which the first run on a machine does); inductor asks its compiler's
``--version`` (the compiles that follow are refused); lm-eval stamps its results with ``git describe``; jsonargparse's
stub reader asks an interpreter for its ``sys.path`` (nothing imported).
``os.system`` is left alone: a checkpoint crafted to run code names it, and pickling it must find the real one."""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

NOT_MULTIPROCESS = re.compile(r"\bnot\s+multiprocess\b")
_PATCHED_OS = ("fork", "forkpty", "posix_spawn", "posix_spawnp")
COMPILERS = frozenset({"cc", "gcc", "g++", "c++", "clang", "clang++"})
PROBE_FILES = frozenset({"test.c", "test.o"})
"""DeepSpeed's ``has_function``: ``test.c`` compiled, ``test.o`` linked, in a temporary folder."""
SEARCH_PATH = ["-c", "import sys, json; print(json.dumps(sys.path))"]
"""typeshed_client (jsonargparse's reader of type stubs) asks the interpreter for its search path."""

refusals: list[str] = []
"""What was refused since the running test started (a test that caught the failure fails all the same)."""


def refused(markexpr: str | None) -> bool:
    """A ``-m`` expression that deselects the multiprocess tests: this run launches nothing."""
    return bool(markexpr and NOT_MULTIPROCESS.search(markexpr))


def _refuse(what: str) -> NoReturn:
    test = os.environ.get("PYTEST_CURRENT_TEST", "a test")
    text = (f"{test} launched a process ({what[:300]}) in a run without the multiprocess tests (-m 'not "
            "multiprocess': make test-fast launches none): mark the test @pytest.mark.multiprocess, or do the work "
            "in this process")
    refusals.append(text)
    pytest.fail(text)


def _os_refusal(name: str) -> Callable[..., NoReturn]:
    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        _refuse(f"os.{name}{args[:2]!r}" if args else f"os.{name}()")
    return refuse


def probe(args: Any) -> bool:
    """A command line that only probes the toolchain or stamps a version (see the module's docstring)."""
    argv = [os.fsdecode(a) for a in ([args] if isinstance(args, str | bytes | os.PathLike) else args)]
    tool, rest = (os.path.basename(argv[0]), argv[1:]) if argv else ("", [])
    return (rest == ["--version"]
            or (tool == "ldconfig" and rest == ["-p"])
            or (tool in COMPILERS and (rest == ["-dumpfullversion", "-dumpversion"]
                                       or any(os.path.basename(a) in PROBE_FILES for a in rest)))
            or (tool == "ninja" and all(a == "-v" or a.startswith("-j") or a.isdigit() for a in rest))
            or (tool == "git" and rest[:1] == ["describe"])
            or rest == SEARCH_PATH)


def _popen_refusal(saved: Callable[..., Any]) -> Callable[..., Any]:
    def execute_child(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> Any:
        if probe(args):
            return saved(self, args, *rest, **kwargs)
        _refuse(f"subprocess {args!r}")
    return execute_child


def _spawn_refusal(args: Any, *rest: Any, **kwargs: Any) -> NoReturn:  # multiprocessing's spawn and forkserver
    _refuse(f"fork_exec {args!r}")


@contextlib.contextmanager
def refusing() -> Iterator[None]:
    """Every way this process starts another fails the running test while inside."""
    saved_os = {name: getattr(os, name) for name in _PATCHED_OS if hasattr(os, name)}
    saved_popen, saved_spawn = subprocess.Popen._execute_child, _posixsubprocess.fork_exec  # type: ignore[attr-defined]
    for name in saved_os:
        setattr(os, name, _os_refusal(name))
    subprocess.Popen._execute_child = _popen_refusal(saved_popen)  # type: ignore[attr-defined,method-assign]
    _posixsubprocess.fork_exec = _spawn_refusal
    try:
        yield
    finally:
        for name, fn in saved_os.items():
            setattr(os, name, fn)
        subprocess.Popen._execute_child = saved_popen  # type: ignore[attr-defined,method-assign]
        _posixsubprocess.fork_exec = saved_spawn
