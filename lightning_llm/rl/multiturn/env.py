"""Environments of multi-turn rollouts: the user's class (``--model.env.cls``), checked before training, and its calls
run on the host with a timeout.

The class's contract (one instance per episode: each of a GRPO prompt's G responses has its own)::

    class MyEnv:
        def __init__(self, **kwargs): ...                           # --model.env.kwargs
        def reset(self, record: dict) -> list[dict] | None: ...      # optional: the opening conversation
        def step(self, messages: list[dict]) -> dict: ...            # after each assistant turn

``reset`` gets the prompt record (its columns, ``prompt`` and ``messages``: the prompt conversation) and returns the
opening conversation (OpenAI messages ending with a user-side message), or ``None`` for the record's own prompt.
``step`` gets the conversation so far (the last message the policy's) and returns ``{"messages": [...], "reward":
float | None, "done": bool}``: messages to append (roles ``user``, ``tool`` or ``system``), a reward (summed over the
episode and added to the reward sources' score) and whether the episode ends. A step that raises or passes
``step_timeout`` ends its episode (one logged line naming the class and the record); a step that returns something
else than that dict is refused (an error naming the class).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_llm.rl.rewards.config import import_path

log = logging.getLogger(__name__)

__all__ = ["ENV_ROLES", "EnvConfig", "StepResult", "call_all", "env_class", "step_result"]

ENV_ROLES = ("user", "tool", "system")
"""Roles an environment's messages may take."""


@dataclass
class EnvConfig:
    """A multi-turn environment (``cls``) and the limits of its episodes; the tools (``--model.tools``) use the same
    loop and limits."""

    cls: str | None = None
    """Import path of the environment class (``pkg.module:Class``): ``reset(record)`` (optional) and
    ``step(messages)``; one instance per episode. None: tools alone (``--model.tools``), or no environment."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class."""
    max_turns: int = 3
    """Most assistant turns of an episode (tool-calling turns included)."""
    max_total_tokens: int | None = None
    """Token budget of an episode (its prompt, every turn and every appended message): a turn stops at it, and
    messages that would pass it end the episode instead. None: ``max_turns`` x ``max_new_tokens`` of turns and what
    the environment appends."""
    step_timeout: float = 30.0
    """Seconds a ``reset``, a ``step`` or one tool call may take (a step past it ends its episode; a tool call past
    it returns an error message to the policy)."""
    tool_format: str = "auto"
    """How the policy writes tool calls: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``:
    Qwen2.5, Qwen3, Hermes), ``llama3_json`` (the turn is one JSON object ``{"name": ..., "parameters": {...}}``:
    Llama 3.1/3.2), or ``auto`` (read from the chat template)."""

    def __post_init__(self) -> None:
        checks = {"max_turns": self.max_turns >= 1, "step_timeout": self.step_timeout > 0,
                  "max_total_tokens": self.max_total_tokens is None or self.max_total_tokens >= 2,
                  "tool_format": self.tool_format in ("auto", "hermes", "llama3_json")}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"--model.env.{bad[0]}={getattr(self, bad[0])!r} is out of range")


# Saved in checkpoints' hyper-parameters; those written while the class lived in ``lightning_llm/rl/env.py`` name it
# there and still load weights_only.
torch.serialization.add_safe_globals([EnvConfig, (EnvConfig, "lightning_llm.rl.env.EnvConfig")])


def env_class(cfg: EnvConfig) -> type | None:
    """The environment class ``cfg.cls`` names, checked before training: importable, a class, with a callable
    ``step`` (``reset`` optional)."""
    if cfg.cls is None:
        return None
    target = import_path(cfg.cls, param="--model.env.cls", example="my_pkg.envs:MyEnv")
    if not isinstance(target, type):
        raise ValueError(f"--model.env.cls={cfg.cls!r} is not a class (it is a {type(target).__name__}): an "
                         "environment is a class with step(messages) (and optionally reset(record))")
    for name in ("step", "reset"):
        method = getattr(target, name, None)
        if (method is None and name == "step") or (method is not None and not callable(method)):
            raise ValueError(f"--model.env.cls={cfg.cls!r}: the class has no method {name}(...) (an environment "
                             "defines step(messages) -> {'messages', 'reward', 'done'} and optionally "
                             "reset(record))")
    return target


@dataclass
class StepResult:
    """What an environment's ``step`` (or the built-in tool environment) returned, checked."""

    messages: list[dict[str, Any]]
    reward: float | None
    done: bool
    error: str | None = None
    """Why the episode ended abnormally (the step raised or timed out), else None."""


def step_result(out: Any, *, where: str) -> StepResult:
    """``out`` of a ``step`` as a :class:`StepResult`; refused, naming ``where`` (the class and the record), unless it
    is ``{"messages": [...], "reward": float | None, "done": bool}`` with messages of the roles an environment
    writes."""
    if not isinstance(out, dict) or not {"messages", "done"} <= set(out):
        raise ValueError(f"{where}: step() returned {type(out).__name__} {str(out)[:80]!r}; it must return "
                         "{'messages': [...], 'reward': float | None, 'done': bool}")
    messages, reward, done = out["messages"] or [], out.get("reward"), out["done"]
    if not isinstance(done, bool):
        raise ValueError(f"{where}: step()['done'] is {done!r}: it must be true or false")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise ValueError(f"{where}: step()['reward'] is {reward!r}: it must be a finite number or None")
    check_messages(messages, roles=ENV_ROLES, where=f"{where}: step()['messages']")
    return StepResult([dict(m) for m in messages], None if reward is None else float(reward), done)


def check_messages(messages: Any, *, roles: Sequence[str], where: str) -> None:
    """Refuse anything but a list of ``{"role": one of roles, "content": str, ...}`` dicts, naming ``where``."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} is a {type(messages).__name__}; it must be a list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}[{i}] is {str(m)[:80]!r}: a message is {{'role': one of {', '.join(roles)}, "
                             "'content': a string}")


def call_all(calls: Sequence[Callable[[], Any] | None], timeout: float | None) -> list[tuple[bool, Any]]:
    """Run ``calls`` concurrently on host threads (a ``None`` is skipped) and wait at most ``timeout`` seconds for
    all of them; ``(True, result)`` per call, or ``(False, why)``: the exception it raised, or a ``TimeoutError``
    (the call keeps running on its daemon thread; nothing waits for it any more)."""
    results: list[tuple[bool, Any] | None] = [None] * len(calls)
    threads = []

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = (True, fn())
        except Exception as e:  # noqa: BLE001 - user code: reported per episode, never a crash of the run
            results[i] = (False, e)

    for i, fn in enumerate(calls):
        if fn is None:
            results[i] = (True, None)
            continue
        t = threading.Thread(target=run, args=(i, fn), daemon=True, name=f"rl-env-{i}")
        t.start()
        threads.append((i, t))
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            results[i] = (False, TimeoutError(f"no answer within {timeout:g} s"))
    return [r if r is not None else (False, TimeoutError("no answer")) for r in results]
