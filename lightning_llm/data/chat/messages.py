"""Conversations in the formats users bring, read into one form: a list of OpenAI-style messages.

Formats (per record; ``--data.columns.format=auto`` tells them apart by their columns):

* ``openai``: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., "tool_calls": ...}]}``
  (trl, OpenAI fine-tuning files);
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"observation"|"function_call"|"system", "value": ...}],
  "system": ..., "tools": ...}`` (LLaMA-Factory); a ``function_call`` value (JSON ``{"name", "arguments"}`` or a list
  of them) becomes an assistant message with ``tool_calls``; ``tools`` (a list, or a JSON string of one) is kept;
* ``alpaca``: ``{"instruction", "input", "output", "system", "history": [[query, answer], ...]}``; the user message
  is ``instruction`` + newline + ``input`` (LLaMA-Factory's join) and keeps ``instruction``/``input`` as fields, so
  the ``alpaca`` and ``plain`` templates render them in their own sections.

A message's ``content`` may be a string or a list of OpenAI content parts (``[{"type": "text", "text": ...}]``, as
the OpenAI API, trl and LLaMA-Factory take them): its text parts are kept as parts, in order (:func:`message_text` is
the message's text), and a template gets them as transformers hands them over where it renders parts itself, joined
by :data:`PART_SEPARATOR` where it takes strings (:func:`for_template`); a part of another type (an image, audio) is
refused, naming the file, line and the part's type.

Column, tag and role names are configurable (:class:`ChatColumns`, as LLaMA-Factory's ``dataset_info.json``). Every
problem raises :class:`~lightning_llm.files.DataError` naming the file and line: an unknown role, a system message
after the start, turns that do not alternate between the user side (``user``, ``tool``) and the assistant, a
conversation that does not end where the task needs it to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_llm.files import DataError

__all__ = ["PART_SEPARATOR", "ChatColumns", "Conversation", "check_turns", "cut_text", "for_template",
           "load_conversation", "make_conversations", "marked", "message_text", "preference_conversation",
           "prompt_conversation", "read_conversation", "response_conversation", "text_pieces"]

PART_SEPARATOR = "\n"
"""Between the text parts of a message for a template that takes strings: vLLM's join for such templates (its
``string`` chat-template content format), so a model is trained on the prompt a server gives it."""

ROLES = ("system", "user", "assistant", "tool")
_DEFAULT_TAGS = {"openai": ("messages", "role", "content"), "sharegpt": ("conversations", "from", "value")}
_DEFAULT_ROLES = {
    "openai": {r: r for r in ROLES},
    "sharegpt": {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "observation": "tool", "tool": "tool", "function_call": "function_call"},
}


@dataclass
class ChatColumns:
    """Where a record keeps its conversation (LLaMA-Factory's ``dataset_info.json`` ``columns`` and ``tags``). Names
    left ``None`` take the format's own."""

    format: Literal["auto", "openai", "sharegpt", "alpaca"] = "auto"
    """``auto``: per record, a ``messages`` column is openai, ``conversations`` sharegpt, ``instruction`` alpaca (a
    set ``messages`` column: openai or sharegpt by the tags of its first message)."""
    messages: str | None = None
    """Column of the message list (openai ``messages``, sharegpt ``conversations``)."""
    role_tag: str | None = None
    """Key of a message's role (openai ``role``, sharegpt ``from``)."""
    content_tag: str | None = None
    """Key of a message's text (openai ``content``, sharegpt ``value``)."""
    roles: dict[str, str] = field(default_factory=dict)
    """Extra role names: source name -> ``system``, ``user``, ``assistant``, ``tool`` or ``function_call`` (over the
    format's own map; sharegpt: ``human`` -> user, ``gpt`` -> assistant, ``observation`` -> tool)."""
    system: str = "system"
    """Column of the system prompt (sharegpt, alpaca)."""
    tools: str = "tools"
    """Column of the tool descriptions (sharegpt, openai): a list, or a JSON string of one."""
    instruction: str = "instruction"
    """alpaca: the instruction column."""
    input: str = "input"
    """alpaca: the input column (joined to the instruction with a newline)."""
    output: str = "output"
    """alpaca: the response column."""
    history: str = "history"
    """alpaca: earlier turns, ``[[query, answer], ...]``."""

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.roles.items() if v not in (*ROLES, "function_call")}
        if bad:
            raise ValueError(f"--data.columns.roles: {bad} maps to no known role (use {', '.join(ROLES)}, "
                             "function_call)")


@dataclass
class Conversation:
    """Messages (dicts with ``role``/``content``, optionally ``tool_calls`` and alpaca's fields), the tool
    descriptions, and ``where`` the record came from (``file:line``) for errors."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    where: str


def _format(rec: dict[str, Any], cols: ChatColumns, where: str) -> str:
    if cols.format != "auto":
        return cols.format
    if cols.messages is not None and isinstance(rec.get(cols.messages), list):
        first = rec[cols.messages][0] if rec[cols.messages] and isinstance(rec[cols.messages][0], dict) else {}
        return "sharegpt" if (cols.role_tag or "from") in first and "role" not in first else "openai"
    for name, (column, _, _) in _DEFAULT_TAGS.items():
        if column in rec:
            return name
    if cols.instruction in rec:
        return "alpaca"
    raise DataError(f"{where}: no conversation found: expected a 'messages' (openai), 'conversations' (sharegpt) or "
                    f"{cols.instruction!r} (alpaca) field (fields present: {sorted(k for k in rec if k != '_line')}); "
                    "set --data.columns for other names")


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} must be a string, got {type(value).__name__}")
    return value


def _content(value: Any, what: str, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or OpenAI content parts kept as ``{"type": "text", "text"}`` parts (any other
    part refused: a text model cannot learn from an image or a sound)."""
    if not isinstance(value, list):
        return _text(value, what, where)
    parts = []
    for k, part in enumerate(value, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            got = f"has type {kind!r}" if kind not in (None, "text") else "is not {\"type\": \"text\", \"text\": str}"
            raise DataError(f"{where}: {what} part {k} {got}: only text parts can be trained on (a text model takes "
                            "no images or audio)")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content") or ""
    return [p["text"] for p in content] if isinstance(content, list) else [content]


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content, or its text parts joined by :data:`PART_SEPARATOR`."""
    return PART_SEPARATOR.join(_texts(message))


def for_template(messages: list[dict[str, Any]], *, parts: frozenset[str]) -> list[dict[str, Any]]:
    """``messages`` as a template takes them: text parts as they are for the roles whose ``parts`` it renders
    itself, else each message's parts joined into a string (:func:`message_text`)."""
    return [{**m, "content": message_text(m)} if isinstance(m.get("content"), list) and m.get("role") not in parts
            else m for m in messages]


def cut_text(message: dict[str, Any], keep: int) -> dict[str, Any]:
    """``message`` with the first ``keep`` characters of its text (:func:`message_text`); text parts are cut where
    that text is, so a template that takes strings renders exactly ``message_text(message)[:keep]``."""
    content = message["content"]
    if not isinstance(content, list):
        return {**message, "content": content[:keep]}
    kept: list[dict[str, str]] = []
    at = 0  # where the joined text of the parts kept so far ends
    for k, part in enumerate(content):
        if k:
            if at >= keep:
                break
            at += len(PART_SEPARATOR)
        kept.append({**part, "text": part["text"][: max(keep - at, 0)]})
        at += len(part["text"])
    return {**message, "content": kept}


def marked(message: dict[str, Any], mark: str) -> dict[str, Any]:
    """``message`` with ``mark`` after the last non-space character of its text (for parts: of its last part with
    text)."""
    content = message.get("content")
    if isinstance(content, str):
        body = content.rstrip()
        return {**message, "content": body + mark + content[len(body):]}
    if not content:
        return message
    k = max((i for i, p in enumerate(content) if p["text"].strip()), default=len(content) - 1)
    text = content[k]["text"]
    body = text.rstrip()
    return {**message, "content": [*content[:k], {**content[k], "text": body + mark + text[len(body):]},
                                   *content[k + 1:]]}


def _json_field(value: Any, what: str, where: str) -> Any:
    """A field that may be a JSON string of itself (LLaMA-Factory writes ``tools`` and function calls as strings)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: {what} is not valid JSON ({e.msg})") from None
    return value


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """A ShareGPT ``function_call`` value -> OpenAI ``tool_calls``."""
    calls = _json_field(value, "a function_call", where)
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        if not isinstance(call, dict) or "name" not in call:
            raise DataError(f"{where}: a function_call must be {{\"name\", \"arguments\"}} (or a list of them)")
        args = _json_field(call.get("arguments", {}), "function_call arguments", where)
        out.append({"type": "function", "function": {"name": call["name"], "arguments": args}})
    return out


def _list_messages(rec: dict[str, Any], cols: ChatColumns, fmt: str, where: str) -> list[dict[str, Any]]:
    column, role_tag, content_tag = _DEFAULT_TAGS[fmt]
    column, role_tag = cols.messages or column, cols.role_tag or role_tag
    content_tag = cols.content_tag or content_tag
    roles = {**_DEFAULT_ROLES[fmt], **cols.roles}
    raw = rec.get(column)
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: field {column!r} must be a non-empty list of messages")
    out: list[dict[str, Any]] = []
    if fmt == "sharegpt" and rec.get(cols.system):
        out.append({"role": "system", "content": _text(rec[cols.system], f"field {cols.system!r}", where)})
    for i, m in enumerate(raw, start=1):
        if not isinstance(m, dict) or role_tag not in m:
            raise DataError(f"{where}: message {i} must be an object with a {role_tag!r} key")
        role = roles.get(m[role_tag])
        if role is None:
            raise DataError(f"{where}: message {i} has role {m[role_tag]!r}, which is not one of "
                            f"{sorted(roles)} (map it with --data.columns.roles)")
        extra = {k: v for k, v in m.items() if k not in (role_tag, content_tag)} if fmt == "openai" else {}
        if role == "function_call":
            out.append({"role": "assistant", "content": "", "tool_calls": _tool_calls(m.get(content_tag), where)})
            continue
        content = m.get(content_tag)
        if content is None and extra.get("tool_calls"):
            content = ""
        out.append({**extra, "role": role, "content": _content(content, f"message {i} {content_tag!r}", where)})
    return out


def _alpaca_messages(rec: dict[str, Any], cols: ChatColumns, where: str, *, with_answer: bool
                     ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if rec.get(cols.system):
        out.append({"role": "system", "content": _text(rec[cols.system], f"field {cols.system!r}", where)})
    history = rec.get(cols.history) or []
    if not isinstance(history, list):
        raise DataError(f"{where}: field {cols.history!r} must be a list of [query, answer] pairs")
    for i, pair in enumerate(history, start=1):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise DataError(f"{where}: {cols.history!r} entry {i} must be a [query, answer] pair of strings")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    instruction = _text(rec.get(cols.instruction), f"field {cols.instruction!r}", where)
    inp = _text(rec.get(cols.input) or "", f"field {cols.input!r}", where)
    out.append({"role": "user", "content": "\n".join(t for t in (instruction, inp) if t), "instruction": instruction,
                "input": inp})
    output = rec.get(cols.output)
    if with_answer or output:  # predict records may come without a reference (or an empty one)
        out.append({"role": "assistant", "content": _text(output or "", f"field {cols.output!r}", where)})
    return out


def read_conversation(rec: dict[str, Any], cols: ChatColumns, where: str, *, with_answer: bool = True
                      ) -> Conversation:
    """The conversation of one record. ``with_answer``: an alpaca record's ``output`` is required (training)."""
    fmt = _format(rec, cols, where)
    if fmt == "alpaca":
        if with_answer and cols.output not in rec:
            raise DataError(f"{where}: missing field {cols.output!r}")
        messages = _alpaca_messages(rec, cols, where, with_answer=with_answer)
    else:
        messages = _list_messages(rec, cols, fmt, where)
    tools = rec.get(cols.tools)
    if tools:
        tools = _json_field(tools, f"field {cols.tools!r}", where)
        if not isinstance(tools, list):
            raise DataError(f"{where}: field {cols.tools!r} must be a list of tool descriptions")
    return Conversation(messages=messages, tools=tools or None, where=where)


def check_turns(conv: Conversation, *, ends_with: Literal["assistant", "user", "any"]) -> None:
    """Refuse a conversation whose turns do not alternate: after an optional leading system message, the user side
    (``user``, ``tool``) and the assistant take turns, starting with a user message; ``ends_with`` the side the task
    needs (``user``: a prompt to answer)."""
    msgs = conv.messages
    body = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
    for i, m in enumerate(body):
        if m["role"] == "system":
            raise DataError(f"{conv.where}: a system message is only allowed first (message {msgs.index(m) + 1})")
        want_user = i % 2 == 0
        if (m["role"] in ("user", "tool")) != want_user or (i == 0 and m["role"] != "user"):
            got = " -> ".join(x["role"] for x in msgs)
            raise DataError(f"{conv.where}: turns must alternate user/assistant starting with the user (tool results "
                            f"on the user side), got {got}")
    if not body:
        raise DataError(f"{conv.where}: the conversation has no user message")
    last = body[-1]["role"]
    if ends_with == "assistant" and last != "assistant":
        raise DataError(f"{conv.where}: the conversation must end with an assistant message (the answer to learn), "
                        f"it ends with {last!r}")
    if ends_with == "user" and last == "assistant":
        raise DataError(f"{conv.where}: the conversation must end with a user message (the prompt to answer)")


def text_pieces(message: dict[str, Any], *, reasoning: bool = True) -> list[str]:
    """The texts of a message a rendering must contain, in order (its fields for alpaca-style user messages, the
    function names of tool calls). ``reasoning=False``: without the part of the text up to its last ``</think>`` (a
    reply's reasoning, which reasoning models' templates drop from some or all replies)."""
    if "instruction" in message:
        pieces = [message["instruction"], message.get("input") or ""]
    else:
        pieces = _texts(message)
        at = max((k for k, t in enumerate(pieces) if "</think>" in t), default=None)
        if not reasoning and at is not None:
            pieces = [pieces[at].rpartition("</think>")[2], *pieces[at + 1:]]
    pieces += [c.get("function", {}).get("name", "") for c in message.get("tool_calls") or []]
    return [p.strip() for p in pieces if p and p.strip()]


def load_conversation(rec: dict[str, Any], cols: ChatColumns, where: str, *,
                      ends_with: Literal["assistant", "user", "any"], with_answer: bool = True,
                      default_system: str | None = None) -> Conversation:
    """:func:`read_conversation`, with ``default_system`` as its system message when it has none, checked by
    :func:`check_turns`."""
    conv = _with_system(read_conversation(rec, cols, where, with_answer=with_answer), default_system)
    check_turns(conv, ends_with=ends_with)
    return conv


def _messages_of(value: Any, cols: ChatColumns, where: str, what: str) -> list[dict[str, Any]]:
    """A message, or a list of messages, in openai or sharegpt form (told apart by the first message's keys)."""
    items = value if isinstance(value, list) else [value]
    first = items[0] if items and isinstance(items[0], dict) else {}
    fmt = "sharegpt" if "from" in first and "role" not in first else "openai"
    column = _DEFAULT_TAGS[fmt][0]
    try:
        return _list_messages({column: items}, ChatColumns(roles=cols.roles), fmt, where)
    except DataError as e:
        raise DataError(str(e).replace(f"field {column!r}", what)) from None


def _with_system(conv: Conversation, default_system: str | None) -> Conversation:
    if default_system and conv.messages and conv.messages[0]["role"] != "system":
        conv.messages.insert(0, {"role": "system", "content": default_system})
    return conv


def prompt_conversation(rec: dict[str, Any], cols: ChatColumns, where: str, *, field: str = "prompt",
                        default_system: str | None = None) -> Conversation:
    """A prompt to answer (PPO, GRPO): ``rec[field]`` (a string: one user message; or a list of messages), else the
    record's conversation (``cols``) without its trailing reply (a reference answer)."""
    if field in rec:
        value = rec[field]
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else \
            _messages_of(value, cols, where, f"field {field!r}")
        conv = Conversation(messages, None, where)
    else:
        conv = read_conversation(rec, cols, where, with_answer=False)
        while conv.messages and conv.messages[-1]["role"] == "assistant":
            conv.messages.pop()
    check_turns(_with_system(conv, default_system), ends_with="user")
    return conv


def preference_conversation(rec: dict[str, Any], cols: ChatColumns, where: str, *,
                            default_system: str | None = None
                            ) -> tuple[Conversation, dict[str, Any], dict[str, Any]]:
    """``(prompt, chosen reply, rejected reply)`` of a DPO record: ``prompt`` (a string or messages) or the record's
    conversation (``cols``: openai ``messages``, sharegpt ``conversations``), and ``chosen``/``rejected`` as a
    string, one message, or messages; when they are whole conversations with a shared beginning and no prompt is
    given, that beginning is the prompt (trl's implicit prompt)."""
    chosen, rejected = (_reply_messages(rec, key, cols, where) for key in ("chosen", "rejected"))
    if "prompt" in rec or any(c in rec for c in (cols.messages, "messages", "conversations", cols.instruction)):
        conv = prompt_conversation(rec, cols, where, default_system=default_system)
        if len(chosen) > 1 or len(rejected) > 1:  # whole conversations: their beginning must be the prompt
            raise DataError(f"{where}: with a prompt, 'chosen' and 'rejected' must each be one reply")
    else:
        if chosen[:-1] != rejected[:-1] or len(chosen) < 2:
            raise DataError(f"{where}: without a 'prompt' field, 'chosen' and 'rejected' must be whole "
                            "conversations that differ only in their last (assistant) message")
        conv = Conversation(chosen[:-1], None, where)
        check_turns(_with_system(conv, default_system), ends_with="user")
        chosen, rejected = chosen[-1:], rejected[-1:]
    for key, reply in (("chosen", chosen[-1]), ("rejected", rejected[-1])):
        if reply["role"] != "assistant":
            raise DataError(f"{where}: the {key} reply must be an assistant message, got role {reply['role']!r}")
    return conv, chosen[-1], rejected[-1]


def _reply_messages(rec: dict[str, Any], key: str, cols: ChatColumns, where: str) -> list[dict[str, Any]]:
    """``rec[key]``: a string (one assistant message), a message or messages."""
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r} (fields present: {sorted(k for k in rec if k != '_line')})")
    value = rec[key]
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else \
        _messages_of(value, cols, where, f"field {key!r}")


def response_conversation(rec: dict[str, Any], cols: ChatColumns, where: str, *, field: str = "response",
                          default_system: str | None = None) -> tuple[Conversation, dict[str, Any]]:
    """``(prompt, reply)`` of a record to score (a reward model's input): the prompt as :func:`prompt_conversation`
    reads it, and ``rec[field]`` as one assistant reply (a string or one message)."""
    reply = _reply_messages(rec, field, cols, where)
    if len(reply) != 1 or reply[0]["role"] != "assistant":
        raise DataError(f"{where}: field {field!r} must be one assistant reply (a string or one message)")
    return prompt_conversation(rec, cols, where, default_system=default_system), reply[0]


_WORDS = {  # English: (French, German)
    "cat": ("chat", "Katze"), "dog": ("chien", "Hund"), "house": ("maison", "Haus"), "water": ("eau", "Wasser"),
    "tree": ("arbre", "Baum"), "book": ("livre", "Buch"), "sun": ("soleil", "Sonne"), "moon": ("lune", "Mond"),
    "bread": ("pain", "Brot"), "apple": ("pomme", "Apfel"), "car": ("voiture", "Auto"), "bird": ("oiseau", "Vogel"),
    "milk": ("lait", "Milch"), "river": ("rivière", "Fluss"), "friend": ("ami", "Freund"), "night": ("nuit", "Nacht"),
}


def make_conversations(n: int, *, seed: int = 0, turns: int = 2) -> list[dict[str, Any]]:
    """``n`` deterministic OpenAI-format records for runs without a file: a system message naming the language
    (French or German), then ``turns`` exchanges in which the user gives an English word and the assistant
    translates it. The reply depends on the system message, so a model that learns them reads it."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lang = rng.randrange(2)
        messages = [{"role": "system", "content": f"Translate each word into {('French', 'German')[lang]}."}]
        for word in rng.sample(sorted(_WORDS), turns):
            messages += [{"role": "user", "content": word}, {"role": "assistant", "content": _WORDS[word][lang]}]
        out.append({"messages": messages})
    return out
