"""Conversations -> token ids and the assistant tokens to learn, with one chat template.

**Which tokens are labelled.** A conversation is rendered and tokenized whole, exactly as
``tokenizer.apply_chat_template(messages, tokenize=True)`` does, and every reply is learned as that whole rendering
has it: from after its assistant header up to and including the template's end-of-turn token (the one generation
stops at; what follows it, e.g. ChatML's newline, is not learned), with whatever the template writes into the turn
(Qwen3's empty think block). Everything else (system, user and tool messages, the headers, the template's own
markers) is not. Where the template is prefix-stable at reply ``i`` (the tokens of ``messages[:i]`` rendered with the
generation prompt, and of ``messages[:i + 1]``, are prefixes of the whole conversation's tokens), the reply is the
tokens in between: the prompt it is trained on is the prompt it is served. Where it is not (a template that rewrites
earlier turns: Qwen3, DeepSeek-R1), the reply is located in the whole rendering (:mod:`.spans`). Refused with
the record's file and line: a reply that neither way can locate, a tokenization that merges across the start of a
reply, a reply that holds the end-of-turn token in its text, a template that drops a message, a field, a reply's
answer (its reasoning, up to ``</think>``, may be dropped) or the tools (a role it does not know), and the
template's own errors (e.g. roles that do not alternate).

**The end-of-turn token** is found once, from a probe conversation: the first special token after the reply in an
assistant turn (``<|im_end|>``, ``<|eot_id|>``, EOS). Generation stops at it and at EOS
(:attr:`ChatEncoder.stop_token_ids`). A template whose replies end without a special token is refused: the model
could not learn to stop.

**Too long.** A row longer than ``cutoff_len`` keeps the whole replies that fit; when not even the first fits, history
turns are dropped from the front, then the prompt and the reply share ``cutoff_len`` as LLaMA-Factory's
``infer_seqlen`` splits it: the last user message's text is shortened (its end removed; the template's markers and
the generation prompt stay) and the reply cut. Generation prompts are fitted to ``max_prompt_len`` the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lightning_llm.data.chat.messages import (
    PART_SEPARATOR,
    Conversation,
    cut_text,
    for_template,
    message_text,
    text_pieces,
)
from lightning_llm.data.chat.spans import TurnLocator, common_prefix, generation_spans, has_generation_blocks
from lightning_llm.data.chat.template import ChatTemplate, chat_tokenizer
from lightning_llm.files import DataError

log = logging.getLogger(__name__)

__all__ = ["ChatEncoder", "Encoded", "infer_seqlen", "labels_for"]

_PROBE_USER, _PROBE_REPLY = "Probe question?", "Probe reply."


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of ``cutoff_len`` between source (prompt) and target (response) tokens."""
    if target_len * 2 < cutoff_len:  # short target: truncate the source only
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:  # short source: truncate the target only
        max_target_len = cutoff_len - source_len
    else:  # both long: proportional
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


@dataclass
class Encoded:
    """Token ids of a conversation and the ``[start, end)`` token spans of its learned replies."""

    ids: list[int]
    spans: list[tuple[int, int]]


def labels_for(ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Pre-shifted labels: ``labels[t] = ids[t + 1]`` where token ``t + 1`` is in a span, else -100."""
    labels = [-100] * len(ids)
    for start, end in spans:
        for t in range(max(start, 1), min(end, len(ids))):
            labels[t - 1] = ids[t]
    return labels


def _cut_user_text(message: dict[str, Any], keep: int) -> dict[str, Any]:
    """``message`` with only the first ``keep`` characters of its text (alpaca fields: of instruction + input)."""
    if "instruction" not in message:
        return cut_text(message, keep)
    instruction = message["instruction"][:keep]
    inp = (message.get("input") or "")[: max(0, keep - len(message["instruction"]))]
    return {**message, "instruction": instruction, "input": inp,
            "content": "\n".join(t for t in (instruction, inp) if t)}


def _user_text_len(message: dict[str, Any]) -> int:
    if "instruction" in message:
        return len(message["instruction"]) + len(message.get("input") or "")
    return len(message_text(message))


class ChatEncoder:
    """Renders conversations with ``template`` (transformers' ``apply_chat_template``), tokenizes them and finds their
    replies (see the module docstring). ``tokenizer`` is the datamodule's; :attr:`tokenizer` is the one to use from
    then on (the byte tokenizer gains the template's control tokens). Template problems found by the probe raise
    ``ValueError`` naming ``param``."""

    def __init__(self, tokenizer: Any, template: ChatTemplate, *, eos_token_id: int,
                 param: str = "--data.template") -> None:
        self.tokenizer = chat_tokenizer(tokenizer, template, param=param)
        self.template, self.param = template, param
        self.eos_token_id = eos_token_id
        self._memo: dict[str, tuple[int, ...]] = {}
        # BERT-style vocabularies have no EOS token: their replies end with [SEP] (eos_and_pad_ids' choice).
        self._kwargs = {} if getattr(self.tokenizer, "eos_token", None) else {
            "eos_token": self.tokenizer.convert_ids_to_tokens(eos_token_id)}
        self.takes_parts = self._roles_rendering_parts()
        """The roles whose text parts the template renders itself (passed as parts); other roles' messages get their
        parts joined into a string."""
        self.end_of_turn_id, self._stops_per_turn = self._probe()
        self.stop_token_ids = list(dict.fromkeys([self.end_of_turn_id, eos_token_id]))

    # ------------------------------------------------------------------------------------------ rendering
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
               generation_prompt: bool = False, where: str = "") -> str:
        """The text of ``messages`` (``where``: the record, for the error when the template refuses them)."""
        return self._render(for_template(messages, parts=self.takes_parts), tools, generation_prompt=generation_prompt,
                            where=where)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
                generation_prompt: bool = False, where: str = "") -> str:
        from jinja2.exceptions import TemplateError

        try:
            # The tokenizer's own template goes by its name (None): a tokenizer with several picks its tool-use one.
            template = None if self.template.own else self.template.source
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                                      add_generation_prompt=generation_prompt, tokenize=False,
                                                      **self._kwargs)
        except (TemplateError, TypeError) as e:
            if isinstance(e, TypeError) and not _raised_in_template(e):
                raise  # a TypeError of our own call, not of the template's operations on the record's values
            raise DataError(f"{where or self.param}: the chat template ({self.template.name}) cannot render this "
                            f"conversation: {e}") from None

    def tokenize(self, text: str) -> list[int]:
        """``text``'s ids (no special tokens added: the template writes its own). The last few are memoized: a reply
        re-encoded after its prompt was shortened tokenizes that prompt again."""
        ids = self._memo.get(text)
        if ids is None:
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._memo[text] = ids
            if len(self._memo) > 64:
                del self._memo[next(iter(self._memo))]
        return list(ids)

    def ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *,
            generation_prompt: bool = False, where: str = "") -> list[int]:
        return self.tokenize(self.render(messages, tools, generation_prompt=generation_prompt, where=where))

    def _roles_rendering_parts(self) -> frozenset[str]:
        """The roles (system, user, assistant) whose text parts the template renders itself, as multimodal models'
        templates do: a message of that role with two text parts renders without error, both texts in order, and
        nothing of the parts' structure (a template that takes strings prints the list, drops it, or fails). Probed
        per role: a template may loop over the user's parts and concatenate the assistant's content as a string."""
        first, second = "Probe part one.", "Probe part two."
        parts = [{"type": "text", "text": first}, {"type": "text", "text": second}]
        flat_text = first + PART_SEPARATOR + second
        user = {"role": "user", "content": _PROBE_USER}

        def probe(role: str, content: Any) -> list[dict[str, Any]]:  # a conversation with one message of ``role``
            mine = {"role": role, "content": content}
            return {"system": [mine, user], "user": [mine], "assistant": [user, mine]}[role]

        roles = set()
        for role in ("system", "user", "assistant"):
            try:
                text, flat = self._render(probe(role, parts)), self._render(probe(role, flat_text))
            except DataError:
                continue
            if 0 <= text.find(first) < text.find(second) and text.count("type") == flat.count("type"):
                roles.add(role)
        return frozenset(roles)

    def _probe(self) -> tuple[int, int]:
        """(end-of-turn id, stop ids per assistant turn) from a one-turn probe conversation."""
        user = [{"role": "user", "content": _PROBE_USER}]
        reply = {"role": "assistant", "content": _PROBE_REPLY}
        prompt, whole = self.render(user, generation_prompt=True), self.render([*user, reply])
        name = f"{self.param}={self.template.name}"
        # The header: the generation prompt as far as the rendered turn has it (DeepSeek-R1's turn lacks the
        # "<think>\n" its generation prompt adds; see spans.py).
        header = common_prefix(prompt, whole)
        if header < len(self.render(user)):
            raise ValueError(f"{name}: the template is not prefix-stable: a conversation rendered with the generation "
                             f"prompt ({prompt!r}) does not begin as the same conversation with the reply "
                             f"({whole!r}), so the reply's tokens cannot be located")
        turn = whole[header:]
        at = turn.find(_PROBE_REPLY)
        if at < 0:
            raise ValueError(f"{name}: the template does not render an assistant reply as given ({turn!r})")
        after = turn[at + len(_PROBE_REPLY):]
        # Added tokens that are words, not whitespace (some tokenizers add "\n" tokens; templates write them as text).
        specials = {t: i for t, i in self.tokenizer.added_tokens_encoder.items() if t.strip()}
        if "eos_token" in self._kwargs:
            specials[self._kwargs["eos_token"]] = self.eos_token_id
        found = sorted((after.find(tok), -len(tok), tok) for tok in specials if tok in after)  # first, then longest
        if not found:
            raise ValueError(f"{name}: an assistant reply is followed by {after!r}, which holds no special token (EOS "
                             "or an end-of-turn token): the model could not learn where a reply ends and generation "
                             "would not stop; use a template whose replies end with one")
        end_of_turn = specials[found[0][2]]
        p_ids, w_ids = self.tokenize(whole[:header]), self.tokenize(whole)
        stops = {end_of_turn, self.eos_token_id}
        return end_of_turn, sum(t in stops for t in w_ids[len(p_ids):])

    def check_rendered(self, conv: Conversation, text: str, *, learned: list[int]) -> None:
        """Refuse a rendering that drops a message's text (a role or field the template ignores) or the tools. Replies
        that are not learned (history under ``assistant_turns=last``) may be rendered shortened: a template may
        rewrite past replies (e.g. drop their reasoning), and the model sees them so at inference too; learned ones
        may lose their reasoning (up to the last ``</think>``: reasoning templates drop it), not their answer."""
        pos = 0
        for i, message in enumerate(conv.messages):
            if message["role"] == "assistant" and i not in learned:
                continue
            for piece in text_pieces(message, reasoning=message["role"] != "assistant"):
                found = text.find(piece, pos)
                if found < 0:
                    raise DataError(f"{conv.where}: the chat template ({self.template.name}) drops the "
                                    f"{message['role']} message {i + 1} (its text is not in the rendered "
                                    "conversation): it does not support that role or field")
                pos = found + len(piece)
        if conv.tools and self.render(conv.messages, None, where=conv.where) == text:
            raise DataError(f"{conv.where}: the chat template ({self.template.name}) ignores the record's tools")

    # ------------------------------------------------------------------------------------------ replies
    def encode(self, conv: Conversation, *, turns: Literal["all", "last"] = "all") -> Encoded:
        """The conversation's token ids and the spans of its replies (every assistant message, or the last): by
        prefixes where the template is prefix-stable at a reply, else located in the whole rendering
        (:class:`~lightning_llm.data.chat.spans.TurnLocator`)."""
        msgs, tools, where = conv.messages, conv.tools, conv.where
        text = self.render(msgs, tools, where=where)
        ids = self.tokenize(text)
        replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        learned = replies[-1:] if turns == "last" else replies
        spans: list[tuple[int, int]] = []
        located: dict[str, Any] = {}  # what locating computes once per conversation
        for i in learned:
            span = self._prefix_span(conv, i, text, ids)
            spans.append(span if span is not None else self._located_span(conv, i, text, ids, located))
        self.check_rendered(conv, text, learned=learned)
        return Encoded(ids, spans)

    def _stop_texts(self) -> list[str]:
        return [self.tokenizer.convert_ids_to_tokens(t) for t in self.stop_token_ids]

    def _located_span(self, conv: Conversation, i: int, text: str, ids: list[int], cache: dict[str, Any]
                      ) -> tuple[int, int]:
        """Reply ``i``'s span in the whole rendering where the template is not prefix-stable at it: from the
        template's ``{% generation %}`` blocks, else located by :class:`~lightning_llm.data.chat.spans.TurnLocator`."""
        if "blocks" not in cache:
            cache["blocks"] = self._generation_spans(conv, text, ids)
        if cache["blocks"] is not None:
            return cache["blocks"][i]
        if "locator" not in cache:
            cache["locator"] = TurnLocator(
                conv.messages, text, ids, render=lambda m, **kw: self.render(m, conv.tools, where=conv.where, **kw),
                tokenize=self.tokenize, stop_texts=self._stop_texts(), template=self.template.name, where=conv.where)
        return cache["locator"].span(i)

    def _generation_spans(self, conv: Conversation, text: str, ids: list[int]) -> dict[int, tuple[int, int]] | None:
        """The replies' spans from the template's ``{% generation %}`` blocks, rendered by transformers' renderer (the
        one ``return_assistant_tokens_mask`` uses) with the tokenizer's special tokens; ``None`` without blocks, or
        when this rendering is not ``text``."""
        if not has_generation_blocks(self.template.source):
            return None
        from transformers.utils.chat_template_utils import render_jinja_template  # loaded lazily, as tokenizers.py does

        rendered, blocks = render_jinja_template(
            conversations=[for_template(conv.messages, parts=self.takes_parts)], tools=conv.tools,
            chat_template=self.template.source,
            return_assistant_tokens_mask=True, **{**self.tokenizer.special_tokens_map, **self._kwargs})
        if rendered[0] != text:
            return None
        replies = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        return generation_spans(text, ids, blocks[0], replies, tokenize=self.tokenize,
                                stop_ids=self.stop_token_ids, where=conv.where)

    def _prefix_span(self, conv: Conversation, i: int, text: str, ids: list[int]) -> tuple[int, int] | None:
        """Reply ``i``'s span when the conversation up to it, with the generation prompt and with the reply, renders
        as the beginning of the whole ``text``; ``None`` when the template rewrites it there."""
        msgs, tools, where = conv.messages, conv.tools, conv.where
        p_text = self.render(msgs[:i], tools, generation_prompt=True, where=where)
        q_text = self.render(msgs[: i + 1], tools, where=where)
        if not (q_text.startswith(p_text) and text.startswith(q_text)):
            return None
        p, q = self.tokenize(p_text), self.tokenize(q_text)
        if ids[: len(p)] != p or ids[: len(q)] != q:
            raise DataError(f"{where}: tokens merge across the start or end of assistant message {i + 1} (the "
                            "prompt tokenized alone is not the beginning of the whole conversation's tokens), so "
                            "the trained prompt would differ from the generation prompt")
        at = [k for k, t in enumerate(ids[len(p):len(q)]) if t in self.stop_token_ids]
        if len(at) != self._stops_per_turn:
            raise DataError(f"{where}: assistant message {i + 1} holds the end-of-turn token "
                            f"{self.tokenizer.convert_ids_to_tokens(self.end_of_turn_id)!r} (or EOS) in its "
                            "text; the reply would end there")
        return len(p), len(p) + at[0] + 1

    # ------------------------------------------------------------------------------------------ fitting
    def fit_prompt(self, conv: Conversation, limit: int, *, length: int | None = None) -> Conversation:
        """``conv`` (ending with a user-side message) with history turns dropped from the front, then the last user
        message's text shortened, until its rendering with the generation prompt has at most ``limit`` tokens
        (``length``: that rendering's token count when the caller has it)."""
        def tokens(msgs: list[dict[str, Any]]) -> int:
            return len(self.ids(msgs, conv.tools, generation_prompt=True, where=conv.where))

        if (length if length is not None else tokens(conv.messages)) <= limit:
            return conv
        msgs = self._drop_history(conv, lambda m: tokens(m) <= limit)
        last = max(i for i, m in enumerate(msgs) if m["role"] == "user")

        def cut(keep: int) -> list[dict[str, Any]]:
            return [*msgs[:last], _cut_user_text(msgs[last], keep), *msgs[last + 1:]]

        n = _user_text_len(msgs[last])
        keep = _largest_fitting(lambda k: tokens(cut(k)), n, limit,
                                n_length=length if length is not None and msgs == conv.messages else None)
        if keep is None:
            raise DataError(f"{conv.where}: the prompt is longer than {limit} tokens even without the text of its "
                            "last user message (the system message and the template's markers alone): raise the "
                            "length limit")
        return Conversation(cut(keep), conv.tools, conv.where)

    @staticmethod
    def _drop_history(conv: Conversation, fits: Callable[[list[dict[str, Any]]], bool]) -> list[dict[str, Any]]:
        """Drop the oldest user/assistant exchanges (the system message stays) until ``fits`` or one exchange is
        left."""
        msgs = list(conv.messages)
        head = 1 if msgs and msgs[0]["role"] == "system" else 0
        while not fits(msgs):
            starts = [i for i in range(head + 1, len(msgs)) if msgs[i]["role"] == "user"]
            if not starts:
                break
            msgs = msgs[:head] + msgs[starts[0]:]
        return msgs

    def training_row(self, conv: Conversation, *, cutoff_len: int, turns: Literal["all", "last"] = "all"
                     ) -> tuple[Encoded, bool]:
        """``(encoded row of at most cutoff_len tokens, whether it was shortened)`` (see the module docstring)."""
        enc = self.encode(conv, turns=turns)
        if len(enc.ids) <= cutoff_len:
            return enc, False
        whole = [s for s in enc.spans if s[1] <= cutoff_len]
        if whole:
            return Encoded(enc.ids[: whole[-1][1]], whole), True
        first = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
        j = first[-1] if turns == "last" else first[0]
        head = Conversation(conv.messages[: j + 1], conv.tools, conv.where)
        msgs = self._drop_history(head, lambda m: len(self.ids(m, conv.tools, where=conv.where)) <= cutoff_len)
        same = j == len(conv.messages) - 1 and len(msgs) == len(conv.messages)  # enc's last span is that reply
        one = enc if same else self.encode(Conversation(msgs, conv.tools, conv.where), turns="last")
        start, end = one.spans[-1]
        src, tgt = infer_seqlen(start, end - start, cutoff_len)
        if src < start:
            prompt = self.fit_prompt(Conversation(msgs[:-1], conv.tools, conv.where), src, length=start)
            one = self.encode(Conversation([*prompt.messages, msgs[-1]], conv.tools, conv.where), turns="last")
            start, end = one.spans[0]
        end = min(end, start + tgt)
        return Encoded(one.ids[:end], [(start, end)]), True


def _largest_fitting(length: Callable[[int], int], n: int, limit: int, *, n_length: int | None = None) -> int | None:
    """The largest ``k`` in ``[0, n)`` with ``length(k) <= limit`` for a non-decreasing ``length`` with
    ``length(n) > limit`` (``n_length``, when known; ``None`` when not even ``length(0)`` fits). Interpolation steps (token counts grow about
    linearly in the kept characters) alternate with bisection, so it takes a few calls, never more than ~2 log2(n)."""
    lo_len = length(0)
    if lo_len > limit:
        return None
    lo, hi, hi_len = 0, n, n_length if n_length is not None else length(n)
    interpolate = True
    while hi - lo > 1:
        if interpolate and hi_len > lo_len:
            guess = lo + (limit - lo_len) * (hi - lo) // (hi_len - lo_len)
        else:
            guess = (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        value = length(guess)
        width = hi - lo
        if value <= limit:
            lo, lo_len = guess, value
        else:
            hi, hi_len = guess, value
        interpolate = (hi - lo) * 2 <= width  # a step that did not halve the range: bisect next
    return lo


def _raised_in_template(e: BaseException) -> bool:
    """Whether ``e`` was raised while a Jinja template ran (its compiled code's frames are named ``<template>``)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            return True
        tb = tb.tb_next
    return False
