"""The online RL tasks' side of multi-turn rollouts (``--model.env``, ``--model.tools``): the environment class and
the tools checked when the task is built (before training), set up against the datamodule's chat template at the
start of a fit or validation, and a rollout batch's episodes run (:mod:`lightning_llm.rl.multiturn.episodes`).

What reward sources see of an episode: ``responses`` is its last assistant turn's text, the column ``messages`` its
whole conversation (OpenAI messages, the prompt's included), ``completion_ids`` the policy's tokens of every turn. The
environment's step rewards are one more source, ``env`` (weight 1: their sum per episode, ``None`` where no step gave
one), logged as ``rewards/env/mean`` beside the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_llm.generation import GenerationConfig
from lightning_llm.rl.multiturn.env import EnvConfig, env_class
from lightning_llm.rl.multiturn.episodes import Episode, open_episodes, pack_episodes, run_episodes
from lightning_llm.rl.multiturn.tools import ToolEnv, Tools, template_tool_format
from lightning_llm.rl.multiturn.turns import EpisodeEnvs, TurnRenderer, replica_group
from lightning_llm.rl.rewards.sources import RewardSource
from lightning_llm.rl.rollouts.policy import Packed

log = logging.getLogger(__name__)

__all__ = ["ENV_SOURCE", "MultiTurn", "env_reward"]

ENV_SOURCE = "env"
"""The name of the environment's rewards among the reward sources."""


def env_reward(prompts: list[str], responses: list[str], env_reward: list[float | None]) -> list[float | None]:
    """The ``env`` reward source: each episode's sum of step rewards (a column of the episodes)."""
    return env_reward


class MultiTurn:
    """A task's multi-turn settings (see the module docstring): ``env`` (the class, kwargs and limits) and
    ``tools`` (import paths), both checked here."""

    def __init__(self, env: EnvConfig | None, tools: list[str] | None) -> None:
        self.cfg = env or EnvConfig()
        self.cls = env_class(self.cfg)
        self.tools = Tools(tools) if tools else None
        self.envs: EpisodeEnvs | None = None
        self.renderer: TurnRenderer | None = None

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn (an environment class or tools are given)."""
        return self.cls is not None or self.tools is not None

    def summary_lines(self) -> list[str]:
        """The run summary's line: the environment, the tools and the limits of an episode (none when single-turn)."""
        if not self.enabled:
            return []
        parts = [f"environment {self.cfg.cls}" if self.cls is not None else "no environment"]
        if self.tools is not None:
            parts.append(f"tools {', '.join(self.tools.names)} ({self.cfg.tool_format} calls)")
        budget = f", at most {self.cfg.max_total_tokens} tokens" if self.cfg.max_total_tokens is not None else ""
        return [f"episodes: {'; '.join(parts)}; up to {self.cfg.max_turns} turns{budget}, steps time out after "
                f"{self.cfg.step_timeout:g} s"]

    def reward_source(self) -> RewardSource | None:
        """The ``env`` source of the step rewards (an environment class only: tools give none)."""
        return RewardSource(ENV_SOURCE, env_reward) if self.cls is not None else None

    def ready(self, datamodule: Any, *, dp_rank: int, batch_shared: bool) -> None:
        """Set up against ``datamodule``'s chat template (once; on every rank: under tensor and pipeline parallelism a
        collective of the world creates the replicas' groups)."""
        if self.envs is not None:
            return
        chat = getattr(datamodule, "chat", None)
        what = "--model.env.cls" if self.cls is not None else "--model.tools"
        if chat is None:
            raise ValueError(f"{what}: multi-turn rollouts render conversations with a chat template, and the "
                             "datamodule has none (--data.template: the tokenizer's own, or e.g. chatml)")
        tool_env = None
        if self.tools is not None:
            fmt = self.cfg.tool_format
            if fmt == "auto":
                fmt = template_tool_format(chat.template.source) or ""
                if not fmt:
                    raise ValueError(f"--model.tools: the chat template ({chat.template.name}) writes no tool-call "
                                     "format known here (<tool_call> or Llama 3.1's ipython role): set "
                                     "--model.env.tool_format=hermes or llama3_json")
            tool_env = ToolEnv(self.tools, fmt=fmt, timeout=self.cfg.step_timeout)
            log.info("tools %s, calls parsed as %s", ", ".join(self.tools.names), fmt)
            probe = [{"role": "user", "content": "?"}]
            if chat.render(probe, self.tools.schemas) == chat.render(probe):
                log.warning("--model.tools: the chat template (%s) does not render the tools' schemas: the policy "
                            "knows them only as far as the prompts describe them (e.g. --data.default_system)",
                            chat.template.name)
        group, source = None, 0
        if batch_shared and dist.is_available() and dist.is_initialized():
            group, source = replica_group(dp_rank)
        path = (getattr(datamodule, "paths", None) or {}).get("fit")
        self.renderer = TurnRenderer(chat, self.tools.schemas if self.tools is not None else None)
        self.envs = EpisodeEnvs(self.cfg, self.cls, tool_env, group=group, source=source,
                                acting=group is None or dist.get_rank() == source, where=str(path or ""))

    def rollout(self, decoder: Any, batch: dict[str, Any], *, repeats: int, cfg: GenerationConfig,
                uniforms: Tensor | None, generator: torch.Generator | None, device: torch.device,
                decode: Callable[[list[int], bool], str]) -> tuple[Packed, list[Episode]]:
        """The episodes of a batch's prompts (``repeats`` per prompt, adjacent), rolled out on ``decoder``."""
        assert self.envs is not None and self.renderer is not None, "ready() sets the episodes up"
        columns = batch.get("columns") or [{} for _ in batch["prompt"]]
        indices = batch["index"].tolist() if "index" in batch else range(len(batch["prompt"]))  # one host read
        episodes = []
        for k, (prompt, conv, index) in enumerate(zip(batch["prompt"], batch["conversation"], indices)):
            record = {**columns[k], "prompt": prompt, "messages": [dict(m) for m in conv.messages]}
            episodes += [Episode(key=len(episodes) + j, index=index, record=record) for j in range(repeats)]
        open_episodes(episodes, self.envs, self.renderer)
        run_episodes(decoder, episodes, envs=self.envs, renderer=self.renderer, cfg=cfg, env=self.cfg, decode=decode,
                     uniforms=uniforms, generator=generator, device=device)
        return pack_episodes(episodes, pad_id=cfg.pad_token_id, device=device), episodes
