"""``rollouts.jsonl``: every trained response of an online RL run, one JSON line each (``--model.log_rollouts=true``,
trl's ``log_completions``), in the run's log directory beside ``metrics.csv``.

A line's fields: ``step`` (the rollout's index, 0 first), ``prompt``, ``response``, ``reward`` (the score the
advantages were computed from: the weighted sum of the sources, after ``missing_eos_penalty`` / ``score_clip``), one
field per named reward source (its own score; ``null`` where it returned ``None``), ``advantage`` (GRPO: the
response's; PPO: the mean over its tokens), ``response_tokens`` (its tokens in the loss mask), ``truncated`` (it never
emitted EOS) and ``columns`` (the prompt record's other fields); a multi-turn rollout's lines also hold ``messages``
(the episode's conversation, the prompt's messages included, each with ``role``, ``content``, ``tokens``: its token
count, and ``learned``: true for the policy's own turns; ``response`` is its last turn). Rank 0 writes the lines of every data-parallel
replica (gathered), in the global prompt order (:mod:`lightning_llm.rl.rollouts.samples`): the file of a 2-replica run is the
file of one device. A rollout's lines are appended in one write; a resumed run appends to the file.

Later tools read these records (a multi-turn environment's transcripts, distillation's samples): :func:`records`
builds them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["ROLLOUT_FIELDS", "TAKEN_FIELDS", "RolloutLog", "records", "rollout_records"]

ROLLOUT_FIELDS = ("step", "prompt", "response", "reward", "advantage", "response_tokens", "truncated", "columns")
"""The fields of every line (a reward source may not take one of these names, nor ``messages``: a multi-turn line's)."""
TAKEN_FIELDS = (*ROLLOUT_FIELDS, "messages")
"""Names a reward source may not take."""


def records(*, step: int, prompts: list[str], responses: list[str], rewards: list[float],
            sources: dict[str, list[float]], advantages: list[float], response_tokens: list[int],
            truncated: list[bool], columns: list[dict[str, Any]], order: list[int],
            messages: list[list[dict[str, Any]]] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """One ``(global order, line)`` per response (every argument a list over the responses, ``order`` each one's
    place in the global order; ``messages``: multi-turn episodes' conversations)."""
    out = []
    for i, response in enumerate(responses):
        line: dict[str, Any] = {"step": step, "prompt": prompts[i], "response": response, "reward": rewards[i]}
        line.update({name: None if math.isnan(v[i]) else v[i] for name, v in sources.items()})
        line.update(advantage=advantages[i], response_tokens=response_tokens[i], truncated=truncated[i],
                    columns=columns[i])
        if messages is not None:
            line["messages"] = messages[i]
        out.append((order[i], line))
    return out


def rollout_records(r: Any, *, step: int, names: list[str]) -> list[tuple[int, dict[str, Any]]]:
    """The records of a scored rollout ``r`` (:class:`~lightning_llm.rl.rollouts.policy.Rollout` with its advantages and the
    :class:`~lightning_llm.rl.rollouts.samples.Samples` it was made from; ``names``: the reward sources')."""
    s, m = r.samples, r.response_mask
    per_prompt = len(s.texts) // len(s.positions)
    return records(step=step, prompts=s.prompts, responses=s.texts, rewards=r.scores.tolist(),
                   sources=dict(zip(names, s.source_scores.tolist())),
                   advantages=((r.advantages * m).sum(-1) / m.sum(-1).clamp(min=1)).tolist(),
                   response_tokens=r.trained_mask.sum(-1).tolist(), truncated=(~r.has_eos).tolist(),
                   columns=s.columns, order=[p * per_prompt + k for p in s.positions for k in range(per_prompt)],
                   messages=None if s.episodes is None else [e.messages() for e in s.episodes])


class RolloutLog:
    """Appends each rollout's records to ``path`` on global rank 0 (``writer``), gathered from the ``replicas``
    data-parallel replicas of ``group`` (``None``: the default group, as torch reads it). Every rank calls
    :meth:`write` (with several replicas the gather is a collective)."""

    def __init__(self, path: Path, *, replicas: int = 1, group: Any = None, writer: bool = True) -> None:
        self.path, self.replicas, self.group, self.writer = path, replicas, group, writer

    def write(self, rows: list[tuple[int, dict[str, Any]]]) -> None:
        if self.replicas > 1:
            every: list[Any] = [None] * self.replicas
            dist.all_gather_object(every, rows, group=self.group)
            rows = [r for part in every for r in part]
        if not self.writer:
            return
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for _, line in sorted(rows, key=lambda r: r[0]))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
