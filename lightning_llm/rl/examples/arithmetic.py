"""Arithmetic word problems with a reference ``answer`` column: the prompt file of ``configs/grpo_math.yaml``
(reasoning RL with a verifier, :class:`~lightning_llm.rl.rewards.verifiers.MathAccuracy`, on a tiny model on the CPU).

Each record is ``{"prompt": "Ann has 3 apples and gets 4 more. How many apples does Ann have? Answer:",
"answer": 7, "level": "add"}``: sums and differences of small numbers with one-digit answers (``max_answer``), so
a tiny policy that answers in digits is right by chance often enough for its groups to differ.

    python -m lightning_llm.rl.examples.arithmetic runs/math        # train.jsonl and val.jsonl

For multi-turn rollouts (``configs/grpo_tools.yaml``): :func:`calculator`, a tool (``--model.tools``), and
:class:`RetryEnv`, an environment (``--model.env.cls``) that tells the policy when its answer is wrong and lets it try
again.
"""

from __future__ import annotations

import argparse
import ast
import logging
import operator
import random
import re
from pathlib import Path
from typing import Any

from lightning_llm.files import write_jsonl_atomic

log = logging.getLogger(__name__)

__all__ = ["RetryEnv", "arithmetic_problems", "calculator", "write_arithmetic_prompts"]

_NAMES = ["Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal"]
_THINGS = ["apples", "pens", "cards", "coins", "books", "eggs"]


def arithmetic_problems(n: int, *, max_answer: int = 9, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` word problems (``prompt``, ``answer`` an int in ``0..max_answer``, ``level``: ``add`` or ``sub``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        answer = rng.randint(0, max_answer)
        if rng.random() < 0.5:
            a = rng.randint(0, answer)
            text, level = f"{name} has {a} {thing} and gets {answer - a} more.", "add"
        else:
            b = rng.randint(0, max_answer - answer)
            text, level = f"{name} has {answer + b} {thing} and gives {b} away.", "sub"
        out.append({"prompt": f"{text} How many {thing} does {name} have? Answer:", "answer": answer, "level": level})
    return out


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with +, -, *, / and parentheses, e.g. "3 + 4 * 2".
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class RetryEnv:
    """An arithmetic problem the policy may answer up to ``max_turns`` times: a right answer (the last number of its
    reply equals the record's ``answer``) ends the episode with reward 1; a wrong or missing one gets "Not quite: try
    again." and reward 0; a tool call (``<tool_call>``) is left to the tools."""

    def __init__(self, *, retry: str = "Not quite: try again. Answer:") -> None:
        self.retry, self.answer = retry, None

    def reset(self, record: dict[str, Any]) -> None:
        self.answer = record["answer"]
        return None

    def step(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        numbers = re.findall(r"-?\d+", messages[-1]["content"])
        right = bool(numbers) and int(numbers[-1]) == int(self.answer)
        return {"messages": [] if right else [{"role": "user", "content": self.retry}], "reward": float(right),
                "done": right}


def write_arithmetic_prompts(out_dir: str | Path, *, n_train: int = 512, n_val: int = 64, max_answer: int = 9,
                             seed: int = 0) -> Path:
    """Write ``train.jsonl`` and ``val.jsonl`` of :func:`arithmetic_problems` (other seeds) under ``out_dir``."""
    out = Path(out_dir)
    write_jsonl_atomic(out / "train.jsonl", arithmetic_problems(n_train, max_answer=max_answer, seed=seed))
    write_jsonl_atomic(out / "val.jsonl", arithmetic_problems(n_val, max_answer=max_answer, seed=seed + 1))
    log.info("arithmetic prompts written to %s (%d train / %d val)", out, n_train, n_val)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_llm.rl.examples.arithmetic",
                                     description=write_arithmetic_prompts.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--n_train", type=int, default=512)
    parser.add_argument("--n_val", type=int, default=64)
    parser.add_argument("--max_answer", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    write_arithmetic_prompts(a.out_dir, n_train=a.n_train, n_val=a.n_val, max_answer=a.max_answer, seed=a.seed)
    print(f"arithmetic prompts written to {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
