"""Reward sources of the online RL tasks: several named, weighted scorers of (prompts, responses, columns).

A source is a Python callable (``--model.rewards[i].fn``, a class instantiated with its ``kwargs``) or a reward model
(``--model.rewards[i].model``: :class:`~lightning_llm.rl.rewards.RewardModel`). Every source is called once per
rollout on this replica's responses::

    fn(prompts, responses, **columns)            # columns: the prompt records' fields, as keyword lists

* ``prompts``, ``responses``: lists of B texts (a GRPO prompt repeated for its G responses, rows of one prompt
  adjacent);
* ``columns``: each field of the prompt records other than the prompt itself (``answer``, ``tests``, ``level``...:
  :class:`~lightning_llm.data.PromptDataModule`'s ``columns``), a list aligned with ``responses``, values as read from
  the JSON (``None`` where a record lacks the field), and ``completion_ids`` (trl's name: each response's token ids in
  the loss mask, its EOS included). A function gets them when its signature takes ``**kwargs``, or those it names; one
  that takes only ``(prompts, responses)`` gets none. A named parameter without a default that the data has no column
  for is refused before the first rollout, as is a source's ``required_columns`` (``MathAccuracy``'s ``answer``).

A function returns B numbers (a list, or a tensor); ``None`` for a sample leaves it to the other sources: the score of
a sample is the weighted sum of the sources that scored it (trl's rule: ``nansum(weights * scores)``; 0 where none
did). A reward model gets the prompt ``conversations`` (chat data) instead of the columns.

Errors name the source: one that raises (with the first prompt of the batch), or returns the wrong number of scores.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llm.data.prompts import RESERVED_COLUMNS
from lightning_llm.rl.rewards.config import RewardConfig
from lightning_llm.rl.rewards.model import RewardModel

log = logging.getLogger(__name__)

__all__ = ["RewardSource", "RewardSources", "Scored", "columns_by_name", "source_configs"]


def source_configs(reward: RewardConfig | None, rewards: Sequence[RewardConfig] | None, *,
                   optional: bool = False) -> list[tuple[str, RewardConfig]]:
    """(parameter name, config) of every reward source of a run: ``--model.reward`` where it names a function or model
    (today's single source), then each of ``--model.rewards``. Refuses a run without one unless ``optional`` (an
    environment's step rewards score it)."""
    out = [("--model.reward", reward)] if reward is not None and (reward.fn or reward.model) else []
    out += [(f"--model.rewards[{i}]", cfg) for i, cfg in enumerate(rewards or [])]
    if not out and not optional:
        raise ValueError("--model.reward: set exactly one of reward.fn (an import path) and reward.model (a "
                         "reward-model checkpoint or HF directory), or list several sources in --model.rewards")
    for param, cfg in out:
        if (cfg.fn is None) == (cfg.model is None):
            raise ValueError(f"{param}: set exactly one of reward.fn (an import path) and reward.model (a reward-model "
                             "checkpoint or HF directory)")
    return out


def columns_by_name(rows: Sequence[dict[str, Any]], repeats: int = 1) -> dict[str, list[Any]]:
    """Per-prompt column dicts -> one list per column name, each prompt's value repeated ``repeats`` times."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    return {n: [row.get(n) for row in rows for _ in range(repeats)] for n in names}


@dataclass
class Scored:
    """The scores of one batch of responses: ``total`` [B] fp32 (the weighted sum) and ``per_source`` [S, B] fp32
    (NaN where a source returned ``None``), on the caller's device."""

    total: Tensor
    per_source: Tensor


class RewardSource:
    """One named, weighted scorer (see the module docstring): ``fn`` a callable or a :class:`RewardModel`."""

    def __init__(self, name: str, fn: Any, *, weight: float = 1.0) -> None:
        self.name, self.fn, self.weight = name, fn, float(weight)
        self.is_model = isinstance(fn, RewardModel)
        self._takes_all, self._named, self._required = False, frozenset(), list(getattr(fn, "required_columns", ()))
        if not self.is_model:
            self._read_signature(fn)

    def _read_signature(self, fn: Callable[..., Any]) -> None:
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: called with (prompts, responses)
            return
        self._takes_all = any(p.kind is p.VAR_KEYWORD for p in params)
        keywords = [p for p in params[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self._named = frozenset(p.name for p in keywords)
        self._required += [p.name for p in keywords if p.default is p.empty and p.name not in RESERVED_COLUMNS]

    @property
    def required_columns(self) -> list[str]:
        """Columns the source cannot score without (named parameters without a default, ``required_columns``)."""
        return list(dict.fromkeys(self._required))

    def __call__(self, prompts: list[str], responses: list[str], *, columns: dict[str, list[Any]],
                 conversations: list[Any] | None = None) -> Tensor:
        """Scores [B] fp32 on the CPU or the model's device (NaN where the source returned ``None``)."""
        try:
            if self.is_model:
                out = self.fn(prompts, responses, conversations)
            else:
                out = self.fn(prompts, responses, **{k: v for k, v in columns.items()
                                                     if self._takes_all or k in self._named})
        except Exception as e:  # noqa: BLE001 - any error of user code is reported naming the source
            raise ValueError(f"reward {self.name} raised {type(e).__name__}: {e} (the batch's first prompt: "
                             f"{prompts[0]!r})") from e
        scores = out.detach().float() if isinstance(out, Tensor) else torch.tensor(
            [math.nan if v is None else float(v) for v in out], dtype=torch.float32)
        if scores.shape != (len(responses),):
            raise ValueError(f"reward {self.name} returned {tuple(scores.shape)} scores for {len(responses)} responses "
                             "(one number, or None, per response)")
        return scores


class RewardSources:
    """The sources of a run, in order, each with a unique name (``rewards/<name>/mean`` is logged per source)."""

    def __init__(self, sources: Sequence[RewardSource]) -> None:
        names = [s.name for s in sources]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two reward sources are named {dup!r}: give each its own --model.rewards[i].name")
        models = [s for s in sources if s.is_model]
        if len(models) > 1:
            raise ValueError(f"{len(models)} reward models ({', '.join(s.name for s in models)}): a run takes one "
                             "reward model beside any number of reward functions")
        self.sources = list(sources)
        self.weights = torch.tensor([s.weight for s in sources], dtype=torch.float32)
        self.model: RewardModel | None = models[0].fn if models else None
        self._warned_unscored = False

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def check_inputs(self, columns: Sequence[str] | None, *, max_new_tokens: int, where: str) -> None:
        """Refuse, before the first rollout, a source that needs a column the prompt data (``where``) does not have
        (``columns``: ``None`` when the datamodule does not say), or whose length penalty measures another longest
        response than the run's ``max_new_tokens``."""
        for s in self.sources:
            missing = [c for c in s.required_columns if columns is not None and c not in columns]
            if missing:
                raise ValueError(f"reward {s.name} needs the column {missing[0]!r}, which {where} does not have (its "
                                 f"columns: {', '.join(columns or []) or 'none besides the prompt'})")
            limit = getattr(s.fn, "max_new_tokens", None)
            if isinstance(limit, int) and limit != max_new_tokens:
                raise ValueError(f"reward {s.name}: max_new_tokens={limit} but --model.generation.max_new_tokens="
                                 f"{max_new_tokens}: its length penalty is measured against the run's longest response")

    def statistics(self, per_source: Tensor, *, all_sum: Callable[[Tensor], Tensor]) -> dict[str, float]:
        """``rewards/<name>/mean`` and ``rewards/<name>/std`` (unbiased, trl's ``nanstd``) of each source's scores
        ``per_source`` [S, B] over every replica (``all_sum``: the sum over replicas), leaving out the samples a
        source returned ``None`` (NaN) for."""
        per = per_source.double()
        seen = ~per.isnan()
        x = per.nan_to_num(0.0)
        sums = all_sum(torch.stack([x.sum(1), (x * x).sum(1), seen.sum(1).double()], dim=1))  # [S, 3]
        out = {}
        for name, (total, squares, n) in zip(self.names, sums.tolist()):
            mean = total / n if n else math.nan
            var = (squares - n * mean * mean) / (n - 1) if n > 1 else math.nan
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, math.sqrt(max(var, 0.0))
        return out

    def score(self, prompts: list[str], responses: list[str], *, columns: dict[str, list[Any]],
              conversations: list[Any] | None, device: torch.device) -> Scored:
        """Every source on the batch; the weighted sum of those that scored each sample."""
        per = torch.stack([s(prompts, responses, columns=columns, conversations=conversations).to(device)
                           for s in self.sources])  # [S, B]
        total = torch.nansum(per * self.weights.to(device)[:, None], dim=0)
        if not self._warned_unscored and bool(per.isnan().all(0).any()):
            self._warned_unscored = True
            log.warning("every reward source returned None for some responses: they score 0 (logged once)")
        return Scored(total=total, per_source=per)
