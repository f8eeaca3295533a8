"""Multi-turn rollouts (:func:`run_episodes`): each episode a conversation of the policy with an environment or its
tools, decoded turn by turn with the KV cache kept (:class:`~lightning_llm.generation.turns.TurnDecoder`: a turn
prefills only what was appended since the last), packed as one sequence whose learned tokens are the policy's own.

One turn, for every episode still running (rows of one batch):

1. the policy answers: tokens are sampled up to a stop token (the template's end-of-turn token, EOS), the turn's
   ``max_new_tokens`` or the episode's token budget; a turn without a stop token is cut (truncated) and ends its
   episode;
2. the episode's step (:class:`~lightning_llm.rl.multiturn.turns.EpisodeEnvs`): the tools' results when the turn calls tools,
   else the environment's ``step`` (its reward kept); it ends the episode when it says ``done``, after ``max_turns``
   turns, when it raises or times out, or when its messages would pass the budget;
3. the messages appended are rendered by the template (:class:`~lightning_llm.rl.multiturn.turns.TurnRenderer`: after the
   turn's end-of-turn token; a turn that stopped at EOS or another stop id gets the end-of-turn token as context
   first) and fed with the next turn's first forward.

**The packed rollout** (:func:`pack_episodes`), the layout of :mod:`lightning_llm.rl.rollouts.policy` with a gap-free response
region: ``query_responses`` [B, P + N] = the LEFT-padded prompt, then every token after it (the policy's turns and
the appended context, in order), right-padded; ``attention_mask`` 1 on every real token; ``response_mask`` [B, N]
True on the policy's own tokens only (each turn up to and including its stop token): the tokens the loss, the KL and
the entropy count. The appended messages and the template's markers around them are context only. Old, reference and
current log-probs are computed on the whole sequence in one forward, as single-turn rollouts are.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_llm.data.base import left_pad
from lightning_llm.generation import GenerationConfig
from lightning_llm.generation.turns import TurnDecoder
from lightning_llm.rl.multiturn.env import EnvConfig
from lightning_llm.rl.multiturn.turns import EpisodeEnvs, TurnRenderer
from lightning_llm.rl.rollouts.policy import Packed

log = logging.getLogger(__name__)

__all__ = ["Episode", "pack_episodes", "run_episodes"]


@dataclass
class Episode:
    """One conversation of the policy (a row of a rollout): its prompt, every message with its token count and
    whether the policy wrote it, the tokens after the prompt and the step rewards."""

    key: int  # its row in the rollout (its environment's key)
    index: int  # the prompt's record index
    record: dict[str, Any]  # what the environment's reset gets: the record's columns, its prompt and messages
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    conversation: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # OpenAI messages so far
    counts: list[tuple[int, bool]] = dataclasses.field(default_factory=list)  # per message: (tokens, learned)
    tokens: list[int] = dataclasses.field(default_factory=list)  # every token after the prompt
    learned: list[bool] = dataclasses.field(default_factory=list)  # per token: the policy's own
    pending: list[int] = dataclasses.field(default_factory=list)  # appended tokens the decoder has not fed yet
    rewards: list[float | None] = dataclasses.field(default_factory=list)  # the steps' rewards
    turns: int = 0
    done: bool = False
    stopped: bool = False  # its last turn ended with a stop token (not cut)
    text: str = ""  # its last turn's text, special tokens removed: the ``response`` reward sources score

    @property
    def length(self) -> int:
        """Tokens of the episode so far (the prompt included)."""
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def env_reward(self) -> float | None:
        """The sum of its steps' rewards; None when no step gave one."""
        given = [r for r in self.rewards if r is not None]
        return sum(given) if given else None

    def messages(self) -> list[dict[str, Any]]:
        """Its messages as ``rollouts.jsonl`` holds them: ``role``, ``content``, ``tokens``, ``learned``."""
        return [{"role": m["role"], "content": m["content"], "tokens": n, "learned": learned}
                for m, (n, learned) in zip(self.conversation, self.counts)]

    def add(self, messages: list[dict[str, Any]], ids: list[int], counts: list[int], *, learned: bool) -> None:
        self.conversation += messages
        self.counts += [(n, learned) for n in counts]
        self.tokens += ids
        self.learned += [learned] * len(ids)


def pack_episodes(episodes: list[Episode], *, pad_id: int, device: torch.device) -> Packed:
    """The rollout tensors of ``episodes`` (see the module docstring)."""
    prompt, prompt_mask = left_pad([e.prompt_ids for e in episodes], pad_id)
    n = max(1, max(len(e.tokens) for e in episodes))
    responses = torch.full((len(episodes), n), pad_id, dtype=torch.long)
    real = torch.zeros(len(episodes), n, dtype=torch.bool)
    learned = torch.zeros(len(episodes), n, dtype=torch.bool)
    for i, e in enumerate(episodes):
        k = len(e.tokens)
        responses[i, :k] = torch.tensor(e.tokens, dtype=torch.long)
        real[i, :k] = True
        learned[i, :k] = torch.tensor(e.learned, dtype=torch.bool)
    attention = torch.cat([prompt_mask.bool(), real], dim=1)
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)
    return Packed(query_responses=torch.cat([prompt, responses], 1).to(device), attention_mask=attention.to(device),
                  position_ids=positions.to(device), context_length=prompt.shape[1], responses=responses.to(device),
                  response_mask=learned.to(device),
                  has_eos=torch.tensor([e.stopped for e in episodes], dtype=torch.bool, device=device))


def open_episodes(episodes: list[Episode], envs: EpisodeEnvs, renderer: TurnRenderer) -> None:
    """Every episode's opening conversation (its environment's ``reset``, else the record's prompt conversation)
    rendered: its prompt ids and its first messages."""
    openings = envs.reset([e.key for e in episodes], [e.record for e in episodes], [e.index for e in episodes])
    for e, opening in zip(episodes, openings):
        messages = opening if opening is not None else e.record["messages"]
        e.prompt_ids, counts = renderer.opening(messages, where=envs.record_where(e.record, e.index))
        e.conversation, e.counts = [dict(m) for m in messages], [(n, False) for n in counts]


def run_episodes(decoder: Any, episodes: list[Episode], *, envs: EpisodeEnvs, renderer: TurnRenderer,
                 cfg: GenerationConfig, env: EnvConfig, decode: Callable[[list[int], bool], str],
                 uniforms: Tensor | None = None, generator: torch.Generator | None = None,
                 device: torch.device) -> TurnDecoder:
    """Roll out ``episodes`` (opened: :func:`open_episodes`) to their end on ``decoder`` (what ``generate`` would be
    given), filling them in; ``uniforms`` [B, max_turns x max_new_tokens] (per-row draws: turn t reads columns
    ``t * N ..``) or ``generator``; ``decode(ids, keep_special)``: the tokenizer's text. Returns the decoder (its
    forward counts)."""
    n = cfg.max_new_tokens
    stops = set(cfg.eos_ids)
    width = max(len(e.prompt_ids) for e in episodes)
    dec = TurnDecoder(decoder, len(episodes), device=device, capacity=width + env.max_turns * (n + 64))
    rows = list(range(len(episodes)))  # decoder row -> episode
    for turn in range(env.max_turns):
        live = [not episodes[r].done for r in rows]
        if (dec.agree(not any(live)) if dec.lockstep else not rows):
            break
        act = [episodes[r] for r in rows]
        block, mask = left_pad([(e.prompt_ids if turn == 0 else e.pending) if on else [] for e, on in zip(act, live)]
                               or [[]], cfg.pad_token_id)
        if block.shape[1] == 0:  # nothing appended anywhere (lock-step rows of ended episodes)
            block, mask = torch.full((len(rows), 1), cfg.pad_token_id), torch.zeros(len(rows), 1, dtype=torch.long)
        caps = [n if env.max_total_tokens is None else env.max_total_tokens - e.length for e in act]
        out = dec.turn(block.to(device), mask.to(device), cfg,
                       uniforms=None if uniforms is None else uniforms[rows, turn * n:(turn + 1) * n],
                       generator=generator,
                       limits=None if env.max_total_tokens is None else torch.tensor(caps, device=device),
                       active=torch.tensor(live, device=device) if dec.lockstep else None).tolist()
        stepping = []
        for e, on, toks, cap in zip(act, live, out, caps):
            if on:
                e.pending = []
                if _add_turn(e, toks[:max(cap, 0)], stops, decode):
                    stepping.append(e)
        _step(stepping, envs=envs, renderer=renderer, env=env, end_of_turn=renderer.end_of_turn_id)
        if not dec.lockstep:
            keep = [i for i, r in enumerate(rows) if not episodes[r].done]
            if len(keep) < len(rows) and keep:
                dec.keep(torch.tensor(keep, device=device))
            rows = [rows[i] for i in keep]
    for e in episodes:
        e.done, e.pending = True, []
    return dec


def _add_turn(e: Episode, toks: list[int], stops: set[int], decode: Callable[[list[int], bool], str]) -> bool:
    """Append the policy's turn ``toks`` (cut after its first stop token) to ``e``; whether it stopped (else the
    episode ends, truncated)."""
    end = next((i for i, t in enumerate(toks) if t in stops), None)
    ids = toks if end is None else toks[:end + 1]
    body = ids if end is None else ids[:-1]
    e.add([{"role": "assistant", "content": decode(body, True)}], ids, [len(ids)], learned=True)
    e.turns += 1
    e.stopped, e.text = end is not None, decode(body, False)
    if end is None:
        e.done = True
    return end is not None


def _step(stepping: list[Episode], *, envs: EpisodeEnvs, renderer: TurnRenderer, env: EnvConfig,
          end_of_turn: int) -> None:
    """The steps of the episodes whose turn just stopped; the messages of those that go on rendered as their
    pending tokens."""
    wheres = [envs.record_where(e.record, e.index) for e in stepping]
    results = envs.step([e.key for e in stepping], [e.conversation for e in stepping], wheres,
                        [e.turns >= env.max_turns for e in stepping])
    for e, res, where in zip(stepping, results, wheres):
        e.rewards.append(res.reward)
        if res.error is not None or res.done or e.turns >= env.max_turns or not res.messages:
            e.done = True
            continue
        ids, counts = renderer.appended(res.messages, where=where)
        if e.tokens[-1] != end_of_turn:  # stopped at EOS or another stop id: the turn is closed as the template does
            ids, counts = [end_of_turn, *ids], [counts[0] + 1, *counts[1:]]
        if env.max_total_tokens is not None and e.length + len(ids) + 1 > env.max_total_tokens:
            e.done = True  # its messages and a token of the next turn do not fit the budget
            continue
        e.add(res.messages, ids, counts, learned=False)
        e.pending = ids
