"""What a multi-turn rollout appends between two turns, as the chat template renders it (:class:`TurnRenderer`), and
the environments of a rollout's episodes, run on one rank of each replica (:class:`EpisodeEnvs`).

**Appended tokens.** The policy's own tokens are kept as it generated them (never decoded and encoded again); what
follows its turn is rendered by the template: the messages an environment or a tool appends, then the generation
prompt of the next assistant turn. The text is the template's rendering of ``[user, assistant, *new messages]`` (a
fixed stand-in conversation) after the assistant turn's end-of-turn token: what a template writes after a turn does
not depend on its text, and templates that rewrite earlier turns (Qwen3 drops past reasoning) do so inside them. A
template that drops an appended message's text (a role it does not know) is refused, naming the role.

**Where environments run.** Under tensor and pipeline parallelism the ranks of a replica decode the same episodes and
must append the same messages: each replica's environments are built and stepped on its first rank only, and what
they return is broadcast to the replica's other ranks (``dist.broadcast_object_list``), so an environment need not be
deterministic (a sandbox, a clock, a random draw) and runs once per episode. Data-parallel replicas run their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from lightning_llm.data.chat.encode import ChatEncoder
from lightning_llm.rl.multiturn.env import EnvConfig, StepResult, call_all, check_messages, step_result
from lightning_llm.rl.multiturn.tools import ToolEnv

log = logging.getLogger(__name__)

__all__ = ["EpisodeEnvs", "TurnRenderer", "replica_group"]

_QUESTION, _REPLY = "Stand-in question.", "Stand-in reply \u2063."


class TurnRenderer:
    """Token ids of conversations as the chat template renders them: an episode's opening (with the tools' schemas
    and the generation prompt) and what follows an assistant turn (see the module docstring)."""

    def __init__(self, chat: ChatEncoder, tools: list[dict[str, Any]] | None) -> None:
        self.chat, self.tools = chat, tools or None
        self.end_of_turn_id = chat.end_of_turn_id
        self._eot = chat.tokenizer.convert_ids_to_tokens(chat.end_of_turn_id)

    def _counts(self, lengths: list[int]) -> list[int]:
        """Token lengths of the renderings of a growing prefix -> each message's tokens (the last is the whole)."""
        out, last = [], 0
        for n in lengths:
            out.append(max(n - last, 0))
            last = max(last, n)
        return out

    def opening(self, messages: list[dict[str, Any]], *, where: str) -> tuple[list[int], list[int]]:
        """``(ids, tokens per message)`` of an episode's opening conversation with the generation prompt."""
        ids = self.chat.ids(messages, self.tools, generation_prompt=True, where=where)
        lengths = [len(self.chat.ids(messages[:k], self.tools, where=where)) for k in range(1, len(messages))]
        return ids, self._counts([*lengths, len(ids)])

    def _after_turn(self, new: list[dict[str, Any]], *, generation_prompt: bool, where: str) -> str:
        base = [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _REPLY}]
        text = self.chat.render(base + new, self.tools, generation_prompt=generation_prompt, where=where)
        at = text.find(_REPLY)
        end = text.find(self._eot, at + len(_REPLY)) if at >= 0 else -1
        if end < 0:
            raise ValueError(f"{where}: the chat template ({self.chat.template.name}) does not end an assistant turn "
                             f"with its end-of-turn token {self._eot!r}: the messages that follow a turn cannot be "
                             "placed")
        return text[end + len(self._eot):]

    def appended(self, messages: list[dict[str, Any]], *, where: str) -> tuple[list[int], list[int]]:
        """``(ids, tokens per message)`` of what follows an assistant turn's end-of-turn token when ``messages`` are
        appended: their rendering, then the next turn's generation prompt (counted with the last message). Refused:
        a template that renders a message shorter than its text (it drops the role or the text; a template may
        escape the text, e.g. Llama 3.1's ``tojson`` of a tool result, which only lengthens it)."""
        plain = [self._after_turn(messages[:k], generation_prompt=False, where=where) for k in range(len(messages) + 1)]
        for k, m in enumerate(messages, start=1):
            if len(plain[k]) - len(plain[k - 1]) < len(m["content"]):
                raise ValueError(f"{where}: the chat template ({self.chat.template.name}) drops a {m['role']!r} "
                                 "message of the environment (its rendering is shorter than its text): it does not "
                                 "support that role")
        ids = self.chat.tokenize(self._after_turn(messages, generation_prompt=True, where=where))
        return ids, self._counts([len(self.chat.tokenize(t)) for t in plain[1:-1]] + [len(ids)])


def replica_group(dp_rank: int) -> tuple[Any, int]:
    """``(group, source)``: the process group of the ranks that hold this rank's batch (a replica's tensor- and
    pipeline-parallel ranks: those of equal data-parallel rank ``dp_rank``) and its first global rank. A collective of
    the whole world (every rank's ``dp_rank`` gathered, the groups created), once per run."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_rank)
    replicas = sorted(set(every))
    members = [[r for r, d in enumerate(every) if d == k] for k in replicas]
    group, _ = dist.new_subgroups_by_enumeration(members)
    return group, members[replicas.index(dp_rank)][0]


class EpisodeEnvs:
    """The environments of one rollout's episodes (one per episode, built on the replica's acting rank) and the
    built-in tool environment; results broadcast over ``group`` (the replica's ranks) from ``source``."""

    def __init__(self, cfg: EnvConfig, cls: type | None, tools: ToolEnv | None, *, group: Any = None,
                 source: int = 0, acting: bool = True, where: str = "") -> None:
        self.cfg, self.cls, self.tools = cfg, cls, tools
        self.group, self.source, self.acting = group, source, acting
        self.name = cls.__name__ if cls is not None else "tools"
        self.where = where  # the prompt file, for the lines naming a record
        self._envs: dict[int, Any] = {}  # episode id -> its environment (acting rank only)

    def _shared(self, payload: Any) -> Any:
        """``payload`` of the acting rank, on every rank of the replica."""
        if self.group is None:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=self.source, group=self.group)
        return box[0]

    def record_where(self, record: dict[str, Any], index: int) -> str:
        prompt = str(record.get("prompt", ""))[:60]
        return f"{self.name} on record {index}{f' of {self.where}' if self.where else ''} (prompt {prompt!r})"

    def reset(self, keys: Sequence[int], records: Sequence[dict[str, Any]], indices: Sequence[int]
              ) -> list[list[dict[str, Any]] | None]:
        """One new environment per episode ``keys``; their ``reset(record)`` (None without a class or a reset)."""
        out: Any = None
        if self.acting:
            self._envs = {}
            calls: list[Any] = []
            for key, rec, i in zip(keys, records, indices):
                try:
                    env = self.cls(**self.cfg.kwargs) if self.cls is not None else None
                except Exception as e:  # noqa: BLE001 - user code, reported naming the class and record
                    raise ValueError(f"{self.record_where(rec, i)}: {self.name}(**--model.env.kwargs) raised "
                                     f"{type(e).__name__}: {e}") from e
                self._envs[key] = env
                reset = getattr(env, "reset", None)
                calls.append(None if reset is None else (lambda r=reset, rec=rec: r(dict(rec))))
            out = []
            for (ok, value), rec, i in zip(call_all(calls, self.cfg.step_timeout), records, indices):
                where = self.record_where(rec, i)
                if not ok:
                    raise ValueError(f"{where}: reset() raised {type(value).__name__}: {value}")
                if value is not None:
                    check_messages(value, roles=("system", "user", "assistant", "tool"), where=f"{where}: reset()")
                    if not value or value[-1]["role"] == "assistant":
                        raise ValueError(f"{where}: reset() returned a conversation that does not end with a "
                                         "user-side message: the policy answers it")
                out.append(value)
        return self._shared(out)

    def step(self, keys: Sequence[int], conversations: Sequence[list[dict[str, Any]]], wheres: Sequence[str],
             final: Sequence[bool]) -> list[StepResult]:
        """Each episode's step after its assistant turn: the tools' when the turn calls some (not on its ``final``
        turn), else its environment's (none: the episode is done)."""
        out: Any = None
        if self.acting:
            out = [StepResult([], None, True)] * len(keys)
            env_calls: list[Any] = [None] * len(keys)
            tool_calls: list[Any] = [None] * len(keys)
            for j, (key, conv, last) in enumerate(zip(keys, conversations, final)):
                if self.tools is not None and not last and self.tools.calls(conv):
                    tool_calls[j] = lambda c=conv: self.tools.step(c)  # type: ignore[union-attr]
                elif self._envs.get(key) is not None:
                    env_calls[j] = lambda e=self._envs[key], c=conv: e.step([dict(m) for m in c])
            tools_done = call_all(tool_calls, None)
            for j, (ok, value) in enumerate(call_all(env_calls, self.cfg.step_timeout)):
                if tool_calls[j] is not None:
                    ok, value = tools_done[j]
                elif env_calls[j] is None:
                    continue
                if not ok:
                    why = f"{type(value).__name__}: {value}"
                    log.warning("%s: step() %s; the episode ends here", wheres[j],
                                "timed out" if isinstance(value, TimeoutError) else f"raised {why}")
                    out[j] = StepResult([], None, True, error=why)
                else:
                    out[j] = value if isinstance(value, StepResult) else step_result(value, where=wheres[j])
        return self._shared(out)
