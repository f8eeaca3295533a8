"""Sampled, scored responses of a rollout (:class:`Samples`), their groups (a prompt and its responses: the unit
dynamic sampling keeps or drops and moves between replicas), and DAPO's dynamic-sampling selection.

Layout (:mod:`lightning_llm.rl.rollouts.policy`): rows ``i*G .. i*G+G-1`` are prompt i's G responses; a prompt's
``position`` is its place in the global prompt order of the rollout (the order one device holds them in: the
data-parallel sampler gives replica r of R the prompts ``r, r + R, r + 2R, ...`` of the global batch, so local prompt
j of replica r is global prompt ``j * R + r``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llm.data.base import left_pad
from lightning_llm.rl.multiturn.episodes import Episode, pack_episodes
from lightning_llm.rl.rollouts.policy import Packed

__all__ = ["Group", "Samples", "select_groups"]


@dataclass
class Samples(Packed):
    """Sampled responses of one rollout batch on this replica (``[B]`` rows unless noted), decoded and scored."""

    texts: list[str]
    scores: Tensor  # [B] fp32: the weighted sum of the reward sources
    temperature: float  # of the sampling distribution (1 when greedy)
    prompts: list[str] = dataclasses.field(default_factory=list)  # [B] each row's prompt text
    columns: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # [B] each row's record columns
    source_scores: Tensor | None = None  # [S, B] fp32 per reward source (NaN: the source returned None)
    positions: list[int] = dataclasses.field(default_factory=list)  # [B / G] global position of each prompt
    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [B / G] each prompt's unpadded ids
    conversations: list[Any] | None = None  # [B / G] the prompt conversations (chat data)
    index: list[int] = dataclasses.field(default_factory=list)  # [B / G] each prompt's record index
    episodes: list[Episode] | None = None  # [B] multi-turn rollouts: each row's episode (rl.multiturn.episodes)

    def groups(self, size: int, *, draw: int, informative: list[bool]) -> list[Group]:
        """The prompts of these samples as groups of ``size`` responses (CPU copies), from sampling round ``draw``;
        ``informative``: per group, whether its rewards differ (a learning signal)."""
        assert self.source_scores is not None
        out, responses, scores, source_scores = [], self.responses.cpu(), self.scores.cpu(), self.source_scores.cpu()
        for k, position in enumerate(self.positions):
            rows = slice(k * size, (k + 1) * size)
            out.append(Group(key=(draw, position), index=self.index[k], prompt=self.prompts[k * size],
                             prompt_ids=self.prompt_ids[k], columns=self.columns[k * size],
                             conversation=None if self.conversations is None else self.conversations[k],
                             responses=responses[rows], texts=self.texts[rows],
                             scores=scores[rows], source_scores=source_scores[:, rows],
                             informative=informative[k],
                             episodes=None if self.episodes is None else self.episodes[rows]))
        return out

    @classmethod
    def of_groups(cls, groups: list[Group], *, pad_id: int, eos_ids: list[int], temperature: float,
                  device: torch.device) -> Samples:
        """Samples holding ``groups`` in their order (prompts left-padded, responses right-padded with ``pad_id``; the
        masks recomputed: the same tokens give the same masks; episodes packed again)."""
        size = groups[0].responses.shape[0]
        episodes = None if groups[0].episodes is None else [e for g in groups for e in g.episodes or []]
        if episodes is not None:
            packed = pack_episodes(episodes, pad_id=pad_id, device=device)
        else:
            width = max(g.responses.shape[1] for g in groups)
            prompt_ids, prompt_mask = left_pad([g.prompt_ids for g in groups for _ in range(size)], pad_id)
            responses = torch.full((len(groups) * size, width), pad_id, dtype=torch.long)
            for k, g in enumerate(groups):
                responses[k * size:(k + 1) * size, :g.responses.shape[1]] = g.responses
            packed = Packed.of_responses(prompt_ids.to(device), prompt_mask.to(device), responses.to(device), eos_ids)
        conversations = [g.conversation for g in groups]
        return cls(**packed.packed(), episodes=episodes,
                   texts=[t for g in groups for t in g.texts], scores=torch.cat([g.scores for g in groups]).to(device),
                   temperature=temperature, prompts=[g.prompt for g in groups for _ in range(size)],
                   columns=[g.columns for g in groups for _ in range(size)],
                   source_scores=torch.cat([g.source_scores for g in groups], dim=1).to(device),
                   positions=[g.key[1] for g in groups], prompt_ids=[g.prompt_ids for g in groups],
                   conversations=None if all(c is None for c in conversations) else conversations,
                   index=[g.index for g in groups])


@dataclass
class Group:
    """One prompt and its G sampled, scored responses (CPU tensors), keyed by ``(sampling round, global position)``:
    the order dynamic sampling keeps groups in, the same on every layout."""

    key: tuple[int, int]
    index: int
    prompt: str
    prompt_ids: list[int]
    columns: dict[str, Any]
    conversation: Any
    responses: Tensor  # [G, N]
    texts: list[str]
    scores: Tensor  # [G]
    source_scores: Tensor  # [S, G]
    informative: bool  # its rewards are not all equal: a learning signal (zero std: every advantage 0)
    episodes: list[Episode] | None = None  # [G] multi-turn rollouts: the responses' episodes


def select_groups(candidates: list[tuple[tuple[int, int], bool]], target: int) -> list[tuple[int, int]]:
    """DAPO's dynamic sampling, made the same on every layout: of all the candidates sampled (``(key, informative)``
    over every replica and round), the first ``target`` informative ones in key order (round, then global position);
    when fewer were found, topped up with the first uninformative ones (their advantages are 0: they add no policy
    gradient, only their tokens to a token mean and their KL term), so a rollout always trains on ``target`` groups.
    Returns the selected keys in key order."""
    ordered = sorted(candidates)
    keep = [k for k, informative in ordered if informative][:target]
    if len(keep) < target:
        keep += [k for k, informative in ordered if not informative][:target - len(keep)]
    return sorted(keep)
