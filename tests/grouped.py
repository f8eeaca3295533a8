"""Several ``lightning_llm`` commands on N processes in one launch: the ranks run them one after another, each by the
CLI's ``main`` in its own folder, with the environment the rank started with and a process group of its own
(``main`` destroys its group when done, and a new group on the old port would read the old one's addresses from the
store: each command gets a rendezvous port of its own). One fork and one set of lazy imports for all of them instead
of one launch each; what the commands compute is what ``lightning_llm ARGS`` on N processes computes."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
from pathlib import Path

from lightning_llm import testing
from lightning_llm.cli import main
from lightning_llm.reliability import leave_process


def run_commands(commands: list[tuple[list[str], Path]], *, nproc: int, plan: Path, timeout: float = 900) -> str:
    """Run every ``(args after lightning_llm, folder)`` of ``commands`` on ``nproc`` processes, in order, in one
    launch; the plan is written to ``plan``. Returns the ranks' output; ``RuntimeError`` with its tail naming the
    first command that failed (the others are not run)."""
    plan.write_text(json.dumps([{"args": args, "cwd": str(cwd), "port": testing.free_port()} for args, cwd in commands]))
    return testing.wait(testing.launch(__file__, nproc, str(plan)), timeout=timeout)


def _worker(plan: Path) -> None:
    for command in json.loads(plan.read_text()):
        env = dict(os.environ)
        os.environ["MASTER_PORT"] = str(command["port"])
        with contextlib.chdir(command["cwd"]):
            rc = main(command["args"])
        os.environ.clear()
        os.environ.update(env)
        if rc != 0:
            print(f"lightning_llm {shlex.join(command['args'])} failed with exit code {rc} (in {command['cwd']})",
                  file=sys.stderr, flush=True)
            leave_process(1)  # the launcher stops the other ranks


if __name__ == "__main__":
    # Run as a script, its folder (tests/) leads sys.path, and its folders peft/, data/, models/ would stand for the
    # packages of those names.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    testing.run_worker(_worker, Path(sys.argv[1]))
