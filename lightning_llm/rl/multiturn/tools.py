"""Tools the policy calls in a multi-turn rollout (``--model.tools``): Python functions with type hints and a
docstring, their schemas the chat template's ``tools`` (transformers' ``get_json_schema``, the one templates read),
their calls parsed from the policy's turn in its template's format and run on the host with a timeout.

Formats (``--model.env.tool_format``; ``auto`` reads the template):

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Qwen2.5, Qwen3,
  Hermes 2/3: templates that write ``<tool_call>``);
* ``llama3_json``: the whole turn is one JSON object ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` in
  front allowed; Llama 3.1/3.2's JSON tool calling: templates with the ``ipython`` role).

Tools are an environment built in (:class:`ToolEnv`): after a turn with calls, each call's result is appended as a
``tool`` message (``{"role": "tool", "name": ..., "content": ...}``) and the policy answers again; a turn without
calls ends the episode (its final answer), unless a user environment takes over. A call that does not parse, names no
tool, or raises becomes a ``tool`` message with the error text, never a crash; one past the timeout likewise.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_llm.rl.multiturn.env import StepResult, call_all
from lightning_llm.rl.rewards.config import import_path

log = logging.getLogger(__name__)

__all__ = ["TOOL_FORMATS", "ToolCall", "ToolEnv", "Tools", "parse_tool_calls", "template_tool_format"]

TOOL_FORMATS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One call the policy wrote: its tool ``name`` and ``arguments``, or the ``error`` that kept it from parsing."""

    name: str | None
    arguments: dict[str, Any]
    error: str | None = None


class Tools:
    """The run's tools by name (``paths``: ``pkg.module:function`` import paths) and their schemas, checked before
    training: each importable, callable, with type hints and a docstring transformers can read, names unique."""

    def __init__(self, paths: Sequence[str]) -> None:
        from transformers.utils import get_json_schema  # transformers is imported lazily across the package

        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        for i, path in enumerate(paths):
            param = f"--model.tools[{i}]={path}"
            fn = import_path(path, param=f"--model.tools[{i}]", example="my_pkg.tools:calculator")
            if not callable(fn):
                raise ValueError(f"{param} is not a function")
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # noqa: BLE001 - transformers' TypeHint/Docstring parsing exceptions
                raise ValueError(f"{param}: its schema cannot be read ({e}); a tool is a function with a type hint "
                                 "on every argument and a Google-style docstring (Args: one line per argument)") from e
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"{param}: a second tool named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)

    @property
    def names(self) -> list[str]:
        return list(self.functions)


def template_tool_format(source: str) -> str | None:
    """The tool-call format a chat template's Jinja ``source`` writes (``hermes`` / ``llama3_json``), else None."""
    if "<tool_call>" in source:
        return "hermes"
    if "ipython" in source or '"parameters"' in source:
        return "llama3_json"
    return None


def _call_of(obj: Any, *, keys: Sequence[str]) -> ToolCall:
    """A parsed JSON value as a call: ``{"name": str, <one of keys>: dict or JSON string of one}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, {}, 'a tool call is a JSON object {"name": ..., "' + keys[0] + '": {...}}')
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} are not JSON ({e})")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} are not a JSON object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The calls in a turn's ``text`` (its content, special tokens kept) written in format ``fmt``; an empty list
    when it holds none (the final answer). A call that does not parse is a :class:`ToolCall` with its ``error``."""
    if fmt == "hermes":
        calls = []
        for m in _HERMES.finditer(text):
            if not m.group(2):
                calls.append(ToolCall(None, {}, "<tool_call> without its closing </tool_call>"))
                continue
            try:
                calls.append(_call_of(json.loads(m.group(1).strip()), keys=("arguments", "parameters")))
            except json.JSONDecodeError as e:
                calls.append(ToolCall(None, {}, f"the tool call is not JSON ({e})"))
        return calls
    if fmt != "llama3_json":
        raise ValueError(f"tool format {fmt!r}: one of {', '.join(TOOL_FORMATS)}")
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return [ToolCall(None, {}, f"the tool call is not JSON ({e})")]
    return [_call_of(obj, keys=("parameters", "arguments"))]


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class ToolEnv:
    """The built-in environment of ``tools``: each call of the last assistant message run (``timeout`` seconds
    each), its result or error a ``tool`` message; no calls: the episode is done."""

    timeout_per_step: float | None = None  # the calls carry their own timeouts

    def __init__(self, tools: Tools, *, fmt: str, timeout: float) -> None:
        self.tools, self.fmt, self.timeout = tools, fmt, timeout

    def calls(self, messages: list[dict[str, Any]]) -> list[ToolCall]:
        return parse_tool_calls(messages[-1]["content"], self.fmt)

    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        calls = self.calls(messages)
        if not calls:
            return StepResult([], None, True)
        runs = call_all([None if c.error else self._bound(c) for c in calls], self.timeout)
        out = []
        for call, (ok, value) in zip(calls, runs):
            name = call.name or "unknown"
            if call.error is not None:
                text = f"error: {call.error}"
            elif not ok:
                text = f"error: {name} raised {type(value).__name__}: {value}"
            else:
                text = _as_text(value)
            out.append({"role": "tool", "name": name, "content": text})
        return StepResult(out, None, False)

    def _bound(self, call: ToolCall) -> Callable[[], Any]:
        fn = self.tools.functions.get(call.name or "")
        if fn is None:
            known = ", ".join(self.tools.names)

            def unknown() -> Any:
                raise LookupError(f"no tool named {call.name!r} (tools: {known})")
            return unknown
        return lambda: fn(**call.arguments)
