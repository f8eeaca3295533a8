"""Rule-based rewards of RL with verifiable rewards (reasoning RL), each a reward source
(:mod:`lightning_llm.rl.rewards.sources`) given by import path, ``lightning_llm.rl.rewards:<name>``:

* :class:`MathAccuracy`: 1.0 when the response's final answer equals the record's answer column mathematically
  (math-verify: ``\\boxed{}``, LaTeX or a plain number; ``1/2`` equals ``\\boxed{0.5}``), else 0.0;
* :class:`FormatReward`: 1.0 when the whole response matches a regular expression, else 0.0;
* :class:`SoftOverlong`: DAPO's soft length penalty (Yu et al. 2025, eq. 13): 0 up to ``max_new_tokens - buffer``
  response tokens, falling linearly to -1 at ``max_new_tokens`` (trl's ``get_soft_overlong_punishment``).
"""

from __future__ import annotations

import logging
import re
import string
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["CHAR_SETS", "CharShareReward", "FormatReward", "MathAccuracy", "SoftOverlong"]


class MathAccuracy:
    """1.0 when a response's final answer is mathematically equal to the record's ``answer`` column (its name is the
    ``answer`` argument), else 0.0; ``None`` (left to the other sources) for a record whose answer is missing or
    cannot be parsed. Built on math-verify (``parse`` then ``verify``, gold first: its order). A run whose prompt data
    has no such column is refused before the first rollout."""

    def __init__(self, answer: str = "answer", *, float_rounding: int = 6, timeout_seconds: int = 5) -> None:
        """
        Args:
            answer: The column holding each record's reference answer (a number, or a string: ``"42"``, ``"1/2"``,
                ``"\\\\frac{1}{2}"``, ``"\\\\boxed{3}"``).
            float_rounding: Decimal places math-verify rounds floats to before comparing.
            timeout_seconds: math-verify's time limit per parse and comparison.
        """
        import math_verify  # the RL extra: pure Python (sympy, antlr4)

        self._verify = math_verify
        self.answer, self.float_rounding, self.timeout = answer, float_rounding, timeout_seconds
        self.required_columns = [answer]
        self._gold: dict[str, Any] = {}  # parsed answers: a GRPO prompt's answer is compared G times

    def _parse_gold(self, value: Any) -> Any:
        text = str(value)
        if text not in self._gold:
            self._gold[text] = self._verify.parse(text, parsing_timeout=self.timeout)
        return self._gold[text]

    def __call__(self, prompts: list[str], responses: list[str], **columns: Any) -> list[float | None]:
        out: list[float | None] = []
        for response, gold in zip(responses, columns[self.answer], strict=True):
            parsed_gold = self._parse_gold(gold) if gold is not None else None
            if not parsed_gold:
                out.append(None)
                continue
            answer = self._verify.parse(response, parsing_timeout=self.timeout)
            same = self._verify.verify(parsed_gold, answer, float_rounding=self.float_rounding,
                                       timeout_seconds=self.timeout)
            out.append(1.0 if same else 0.0)
        return out


class FormatReward:
    """1.0 when the whole response matches ``pattern`` (``re.fullmatch``; ``.`` also matches newlines), else 0.0.
    The default asks for a reasoning block and then an answer: ``<think>...</think>`` then any text."""

    def __init__(self, pattern: str = r"\s*<think>.*?</think>\s*\S.*") -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"FormatReward: pattern={pattern!r} is not a regular expression ({e})") from None
        self.pattern = pattern

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        return [1.0 if self.regex.fullmatch(r) else 0.0 for r in responses]


class SoftOverlong:
    """DAPO's soft overlong punishment of a response of ``L`` tokens (its tokens in the loss mask, EOS included:
    trl's ``completion_ids``): 0 when ``L <= max_new_tokens - buffer``, ``(max_new_tokens - buffer - L) / buffer``
    up to ``max_new_tokens`` (so -1 there), -1 beyond."""

    def __init__(self, max_new_tokens: int, buffer: int) -> None:
        """
        Args:
            max_new_tokens: L_max, the longest response (the run's ``--model.generation.max_new_tokens``).
            buffer: L_cache, the length over which the penalty grows from 0 to -1.
        """
        if not 0 < buffer <= max_new_tokens:
            raise ValueError(f"SoftOverlong: buffer={buffer} must be in 1..max_new_tokens={max_new_tokens}")
        self.max_new_tokens, self.buffer = max_new_tokens, buffer

    def __call__(self, prompts: list[str], responses: list[str], *, completion_ids: list[list[int]]) -> list[float]:
        free = self.max_new_tokens - self.buffer
        return [0.0 if len(ids) <= free else max(-1.0, (free - len(ids)) / self.buffer) for ids in completion_ids]


CHAR_SETS = {"digits": string.digits, "lowercase": string.ascii_lowercase, "uppercase": string.ascii_uppercase,
             "vowels": "aeiou", "whitespace": string.whitespace}


class CharShareReward:
    """Programmatic reward: the share of a response's characters that belong to ``chars`` (0 for an empty
    response). ``chars`` is a named set (``digits``, ``lowercase``, ``uppercase``, ``vowels``) or the characters
    themselves (in YAML prefer a named set: a quoted ``"0123"`` may still be read as a number). Whitespace counts
    unless ``ignore_whitespace``."""

    def __init__(self, chars: str = "digits", *, ignore_whitespace: bool = False) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"--model.reward.kwargs.chars must be a non-empty string or one of "
                             f"{sorted(CHAR_SETS)}, got {chars!r}")
        self.chars = frozenset(CHAR_SETS.get(chars, chars))
        self.ignore_whitespace = ignore_whitespace

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        out = []
        for text in responses:
            if self.ignore_whitespace:
                text = "".join(text.split())
            out.append(sum(c in self.chars for c in text) / len(text) if text else 0.0)
        return out
