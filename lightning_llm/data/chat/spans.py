"""Where an assistant turn lies in the whole conversation's rendering, for templates that rewrite earlier turns.

Templates such as Qwen3's (an empty ``<think>`` block only in the replies after the last user query, reasoning
dropped from earlier ones), DeepSeek-R1's (reasoning dropped from every reply, ``<think>\\n`` in the generation
prompt) or templates that move a system message are not prefix-stable: the conversation rendered up to a reply is not
the beginning of the whole rendering. A reply is then located in the whole rendering itself, as it is trained.

**The template's own markers** (:func:`generation_spans`), when it has transformers' ``{% generation %}`` blocks
(what ``return_assistant_tokens_mask`` reads): one block per reply, each learned from its start through the first
end-of-turn token, which must end the block or follow it at once. Otherwise (:class:`TurnLocator`):

1. **Where the user side before it ends.** The user-side messages (user, tool) are rendered with a unique marker
   after the last non-space character of their text (inside any trimming the template does); removing the markers
   must give the whole rendering back exactly (else the template reads the text in ways this cannot follow: refused),
   and the marker's place is where that message's text ends in the whole rendering.
2. **The assistant header.** The conversation up to the reply is rendered (markers included) without and with the
   generation prompt: after the last marker, ``tail`` is what the template writes after that message when it ends
   the conversation and ``prompt_tail`` that plus the generation prompt. The whole rendering must continue with
   ``tail``; the header is the longest part of ``prompt_tail`` it continues with (the whole generation prompt for
   ChatML's ``<|im_start|>assistant\\n``; ``<｜Assistant｜>`` where the generation prompt adds ``<think>\\n`` that
   the rendered turn does not have). Learning starts after it: what the template writes into the turn (an empty think
   block) is learned, the header is not.
3. **The end.** The first end-of-turn token (or EOS) after the header, included.

Character positions become token positions by tokenizing the rendering up to them, which must be a prefix of the
whole conversation's tokens (else tokens merge across the boundary: refused), as the prefix path requires.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from lightning_llm.data.chat.messages import marked, text_pieces
from lightning_llm.files import DataError

__all__ = ["TurnLocator", "common_prefix", "generation_spans", "has_generation_blocks", "token_at"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_MARK = re.compile("\ue000(\\d+)\ue001")  # private-use characters: never a template's own text


def _mark(k: int) -> str:
    return f"\ue000{k}\ue001"


def _with_marks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the user-side ones' text marked after its last non-space character."""
    return [m if m["role"] == "assistant" else marked(m, _mark(k)) for k, m in enumerate(messages)]


def _unmark(text: str) -> tuple[str, dict[int, int]]:
    """``text`` without markers, and each marker's position in it (a marker found twice: position -1)."""
    places: dict[int, int] = {}
    pieces, removed, last = [], 0, 0
    for match in _MARK.finditer(text):
        k = int(match.group(1))
        places[k] = -1 if k in places else match.start() - removed
        pieces.append(text[last:match.start()])
        removed += match.end() - match.start()
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces), places


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TurnLocator:
    """The replies of one conversation located in its whole rendering ``text`` (token ids ``ids``) as the module
    docstring describes. ``render(messages, generation_prompt=...)`` renders with the encoder's template and tools;
    ``tokenize`` is the encoder's; ``stop_texts`` are the end-of-turn and EOS tokens as the template writes them."""

    def __init__(self, messages: list[dict[str, Any]], text: str, ids: list[int], *,
                 render: Callable[..., str], tokenize: Callable[[str], list[int]], stop_texts: list[str],
                 template: str, where: str) -> None:
        self.messages, self.text, self.ids = messages, text, ids
        self._render, self._tokenize, self._stops = render, tokenize, stop_texts
        self.template, self.where = template, where
        self._marked = _with_marks(messages)
        unmarked, self._ends = _unmark(render(self._marked, generation_prompt=False))
        self._readable = "\ue000" not in text and unmarked == text

    def _refuse(self, i: int, why: str) -> DataError:
        return DataError(f"{self.where}: the chat template ({self.template}) is not prefix-stable at message {i + 1} "
                         f"(it rewrites earlier turns) and the reply cannot be located in the whole conversation: "
                         f"{why}")

    def span(self, i: int) -> tuple[int, int]:
        """``[start, end)`` token span of assistant message ``i``: after its header, through its end-of-turn token."""
        if not self._readable:
            raise self._refuse(i, "the template does not render a message's text as given (it reads inside it)")
        user_end = self._ends.get(i - 1, -1)
        if i < 1 or user_end < 0:
            raise self._refuse(i, f"message {i} is not rendered once in it")
        before = self._marked[:i]
        mark = _mark(i - 1)
        tail = self._render(before, generation_prompt=False).rpartition(mark)[2]
        prompt_tail = self._render(before, generation_prompt=True).rpartition(mark)[2]
        rest = self.text[user_end:]
        header = common_prefix(prompt_tail, rest)
        # A template may end a conversation otherwise than a turn followed by a reply (Phi-3's writes EOS when no
        # generation prompt follows): the whole generation prompt continuing the rendering places the reply too.
        ends = rest.startswith(tail) and header >= len(tail)
        if not ends and not rest.startswith(prompt_tail):
            raise self._refuse(i, f"the message before it ends differently ({rest[:len(tail)]!r}) than when it ends "
                                  f"the conversation ({tail!r})")
        pieces = text_pieces(self.messages[i], reasoning=False)
        if pieces:  # a reply "<b>..." shares its first characters with a generation prompt ending "<think>\n"
            # (DeepSeek-R1) that its history turn lacks: the common prefix runs into the reply. The header then ends
            # where the reply's text starts, the latest start from which the overrun is the text's own beginning.
            first = pieces[0]
            floor = len(tail) if ends else len(prompt_tail)
            content = rest.rfind(first, max(floor, header - len(first)), header + len(first))
            header = content if content >= 0 else header
        start = user_end + header
        stops = [p for p in (self.text.find(s, start) for s in self._stops) if p >= 0]
        if not stops:
            raise self._refuse(i, "no end-of-turn token follows it")
        stop = min(stops)
        end = stop + next(len(s) for s in self._stops if self.text.startswith(s, stop))
        turn = self.text[start:stop]
        # every string the message holds (reasoning, tool-call arguments too): an end-of-turn text in any of them
        # would end the located turn early, learning a cut reply without a word
        held = [s for s in self._stops if any(s in text for text in _strings(self.messages[i]))]
        if held:
            raise DataError(f"{self.where}: assistant message {i + 1} holds the end-of-turn token {held[0]!r} (or "
                            "EOS) in its text, reasoning or tool calls; the reply would end there")
        for piece in pieces:
            if piece not in turn:
                raise DataError(f"{self.where}: the chat template ({self.template}) drops the assistant message "
                                f"{i + 1} (its text is not in its turn of the rendered conversation): it does not "
                                "support that role or field")
        return (token_at(self.text, self.ids, start, tokenize=self._tokenize, where=self.where, reply=i),
                token_at(self.text, self.ids, end, tokenize=self._tokenize, where=self.where, reply=i))


def _strings(value: Any) -> list[str]:
    """Every string inside a message (nested dicts and lists: tool calls, their arguments)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def token_at(text: str, ids: list[int], char: int, *, tokenize: Callable[[str], list[int]], where: str,
             reply: int) -> int:
    """The number of tokens of ``ids`` (``text``'s) before character ``char``, where a reply starts or ends."""
    head = tokenize(text[:char])
    if ids[: len(head)] != head:
        raise DataError(f"{where}: tokens merge across the start or end of assistant message {reply + 1} (the "
                        "rendering up to it tokenized alone is not the beginning of the whole conversation's "
                        "tokens), so the trained prompt would differ from the generation prompt")
    return len(head)


def has_generation_blocks(source: str) -> bool:
    """Whether a Jinja template marks what replies generate with ``{% generation %}``."""
    return _GENERATION.search(source) is not None


def generation_spans(text: str, ids: list[int], blocks: Sequence[tuple[int, int]], replies: list[int], *,
                     tokenize: Callable[[str], list[int]], stop_ids: Sequence[int], where: str
                     ) -> dict[int, tuple[int, int]] | None:
    """Reply index -> ``[start, end)`` token span from the template's ``{% generation %}`` character ``blocks`` of
    ``text``, one per reply in order, each through its first end-of-turn token (which must end the block or follow it
    at once); ``None`` when the blocks are not that (another method then locates the replies)."""
    if len(blocks) != len(replies):
        return None
    spans = {}
    for i, (a, b) in zip(replies, blocks):
        start = token_at(text, ids, a, tokenize=tokenize, where=where, reply=i)
        end = token_at(text, ids, b, tokenize=tokenize, where=where, reply=i)
        stop = next((t for t in range(start, min(end + 1, len(ids))) if ids[t] in stop_ids), None)
        if stop is None or stop < end - 1:  # no end-of-turn token at the block's end, or one inside the reply
            return None
        spans[i] = (start, stop + 1)
    return spans
