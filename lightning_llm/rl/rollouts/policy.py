"""Actor-critic module and rollout tensors for PPO on our decoders.

Layout of one rollout batch (B rows)::

    query_responses  [B, P + N]   left-padded prompts (P columns) followed by the sampled responses (N columns)
    attention_mask   [B, P + N]   1 on prompt tokens and on response tokens up to and including the first EOS
    response_mask    [B, N]       True on response tokens up to and including the first EOS

Token ``t`` of a response is predicted by the logits at column ``P - 1 + t``, and its value (the state before the
token, as in trl) is read at the same column. Positions are counted over real tokens (``cumsum(mask) - 1``),
exactly as :func:`lightning_llm.generation.generate` counts them, so the log-probs of a forward pass equal the
sampling distribution's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm.kernels.loss.head_loss import TokenScores
from lightning_llm.rl.losses.core import entropy_from_logits, logprobs_from_logits

log = logging.getLogger(__name__)

__all__ = ["ActorCritic", "Packed", "Rollout", "adapters_disabled", "has_adapters", "pack_responses",
           "response_logits", "response_logprobs"]


def _lm_head(policy: nn.Module) -> nn.Module:
    base = getattr(policy, "base", policy)  # PromptTuningLM wraps the decoder in .base
    head = getattr(base, "lm_head", None)
    if head is None:
        raise ValueError("the policy has no lm_head: a value head on the policy trunk needs a full decoder")
    return head


class ActorCritic(nn.Module):
    """``policy`` (a decoder, possibly with PEFT adapters) plus a scalar value head, either on the policy's last
    hidden state (``critic=None``: one trunk) or on a separate ``critic`` trunk (a decoder whose ``lm_head`` is
    None, so it returns hidden states). A ``critic`` that is a sequence classifier (a reward model: a ``score`` head
    with one output, as OpenRLHF and trl start their value model) is its own value head: its per-position score is
    the value (no ``value_head``).

    ``forward`` returns (logits [B, S, V], values [B, S] fp32); with ``labels`` (a policy that
    ``computes_loss``) it returns (:class:`~lightning_llm.kernels.loss.head_loss.TokenScores`, values) instead, the
    per-token log-probs and entropies computed from the hidden states in chunks, never the logits.
    """

    def __init__(self, policy: nn.Module, *, hidden_size: int, critic: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        self.value_head: nn.Linear | None = None
        if getattr(critic, "score", None) is None:
            self.value_head = nn.Linear(hidden_size, 1)
            # Zero init: values start at 0, so the first advantages are the (whitened) rewards-to-go.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def pipeline_last_modules(self) -> tuple[str, ...] | None:
        """The pipeline split's contract (:mod:`lightning_llm.strategies.pipeline.split`): the value head joins the
        policy's last stage, reading its last hidden state; a separate critic trunk cannot be split (None)."""
        return ("value_head",) if self.critic is None else None

    @property
    def computes_loss(self) -> bool:
        """The policy's own flag: ``forward(..., labels=)`` gives token scores instead of logits."""
        return bool(getattr(self.policy, "computes_loss", False))

    def forward(self, input_ids: Tensor, *, attention_mask: Tensor, position_ids: Tensor, values: bool = True,
                **scoring: Any) -> tuple[Any, Tensor] | Any:
        """``scoring``: ``labels=``, ``temperature=``, ``token_scores=True`` for the policy's token scores.
        ``values=False``: the policy's output alone (how a pipeline runs the policy, e.g. as the reference)."""
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids}
        if not values or (self.value_head is None and self.critic is None):  # a pipeline stage before the last
            return self.policy(input_ids, **scoring, **kwargs)
        if scoring:
            if not scoring.get("token_scores"):
                raise ValueError("ActorCritic with labels needs token_scores=True (its value head reads the hidden "
                                 "states the scores carry)")
            scores = self.policy(input_ids, **scoring, **kwargs)
            hidden = scores.hidden if self.critic is None else self.critic(input_ids, **kwargs)
            return scores, self._values(hidden)
        if self.critic is None:
            captured: list[Tensor] = []
            # The lm_head's input is the trunk's final (normed) hidden state [B, S', H].
            handle = _lm_head(self.policy).register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
            try:
                logits = self.policy(input_ids, **kwargs)
            finally:
                handle.remove()
            hidden = captured[-1]
            if isinstance(hidden, DTensor):  # a tensor-parallel head's input, made a DTensor by its input hook
                hidden = hidden.full_tensor()
            hidden = hidden[:, -logits.shape[1]:]  # prompt tuning prepends virtual positions
        else:
            logits = self.policy(input_ids, **kwargs)
            hidden = self.critic(input_ids, **kwargs)
        return logits, self._values(hidden)

    def _values(self, hidden: Tensor) -> Tensor:
        """Values [B, S] fp32 from the trunk's output: the value head on hidden states [B, S, H], or a scoring
        critic's own scores [B, S, 1]."""
        if isinstance(hidden, DTensor):  # sequence parallelism: the trunk's output sharded over the sequence
            hidden = hidden.full_tensor()
        if self.value_head is None:
            return hidden[..., 0].float()
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


def has_adapters(model: nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[int]:
    """Run ``model`` as its frozen base: every injected PEFT layer (and ``modules_to_save`` copy) is switched off
    with peft's ``enable_adapters(False)`` and back on afterwards. peft toggles ``requires_grad`` as it does so;
    the flags are restored exactly. Yields the number of switched layers."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    layers = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper))]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield len(layers)
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def pack_responses(prompt_ids: Tensor, prompt_mask: Tensor, responses: Tensor, eos_ids: Sequence[int]
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Left-padded prompts [B, P] + generated tokens [B, N] -> (query_responses [B, P+N], attention_mask [B, P+N],
    position_ids [B, P+N], response_mask [B, N] bool, has_eos [B] bool). Tokens after the first EOS are masked."""
    n = responses.shape[1]
    if eos_ids:
        is_eos = torch.isin(responses, torch.tensor(list(eos_ids), device=responses.device))
    else:
        is_eos = torch.zeros_like(responses, dtype=torch.bool)
    has_eos = is_eos.any(-1)
    # first EOS index per row (n when none); tokens up to and including it are real
    first = torch.where(has_eos, is_eos.int().argmax(-1), torch.full_like(has_eos, n, dtype=torch.long))
    response_mask = torch.arange(n, device=responses.device)[None, :] <= first[:, None]
    attention_mask = torch.cat([prompt_mask.bool(), response_mask], dim=1)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.cat([prompt_ids, responses], dim=1), attention_mask, position_ids, response_mask, has_eos


def response_logits(logits: Tensor, context_length: int) -> Tensor:
    """Logits [B, P+N, V] (or any per-position values [B, P+N, ...]) -> those that predict each response token
    [B, N, ...]."""
    return logits[:, context_length - 1:-1]


def response_logprobs(output: Any, r: Rollout, temperature: float) -> tuple[Tensor, Tensor]:
    """(log-probs, entropies) [b, N] of ``r``'s responses from a policy's output: its ``TokenScores`` (the fused
    path, no [b, S, V] logits) or logits [b, P+N, V] (log-softmax of logits / T in fp32)."""
    p = r.context_length
    if isinstance(output, TokenScores):
        return -response_logits(output.loss, p), response_logits(output.entropy, p)
    rl = response_logits(output, p).float() / temperature
    with torch.no_grad():
        entropy = entropy_from_logits(rl)
    return logprobs_from_logits(rl, r.responses), entropy


@dataclass
class Packed:
    """Prompts and their responses as one batch of sequences (the layout in the module docstring): what a rollout's
    samples (:class:`~lightning_llm.rl.rollouts.samples.Samples`) and the rollout itself (:class:`Rollout`) are made
    of, from single-turn responses (:meth:`of_responses`) or multi-turn episodes
    (:func:`~lightning_llm.rl.multiturn.episodes.pack_episodes`)."""

    query_responses: Tensor  # [B, P+N]
    attention_mask: Tensor  # [B, P+N] bool
    position_ids: Tensor  # [B, P+N]
    context_length: int  # P
    responses: Tensor  # [B, N]
    response_mask: Tensor  # [B, N] bool: the policy's own tokens (each turn up to and including its stop token)
    has_eos: Tensor  # [B] bool: the (last) response ended with a stop token

    @classmethod
    def of_responses(cls, prompt_ids: Tensor, prompt_mask: Tensor, responses: Tensor, eos_ids: Sequence[int]
                     ) -> Packed:
        """Left-padded prompts [B, P] and generated tokens [B, N] packed (:func:`pack_responses`)."""
        qr, am, pos, rmask, has_eos = pack_responses(prompt_ids, prompt_mask, responses, eos_ids)
        return cls(query_responses=qr, attention_mask=am, position_ids=pos, context_length=prompt_ids.shape[1],
                   responses=responses, response_mask=rmask, has_eos=has_eos)

    def packed(self) -> dict[str, Any]:
        """These sequences' fields by name (what a :class:`Rollout` or samples made of them take)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Packed)}


@dataclass
class Rollout(Packed):
    """One rollout batch on this rank (see the module docstring for the layout). ``[B, N]`` unless noted."""

    logprobs: Tensor  # old policy log-probs of the sampled tokens (0 outside the mask)
    ref_logprobs: Tensor | None  # None: no reference (GRPO at beta 0)
    values: Tensor
    scores: Tensor  # [B] sequence scores after the missing-EOS penalty
    rewards: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    loss_mask: Tensor | None = None  # [B, N] bool: the tokens the loss counts (default: response_mask)
    samples: Any = None  # the rl.rollouts.samples.Samples the rollout was made from (texts, columns, scores per source)

    @property
    def trained_mask(self) -> Tensor:
        """The tokens the loss counts: ``loss_mask`` (e.g. truncated responses masked out), else ``response_mask``."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    def select(self, index: Tensor) -> Rollout:
        """The rows ``index`` (a mini-batch)."""
        changes = {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)
                   if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, **changes)

    def labels(self) -> Tensor:
        """Next-token labels [B, P+N] for a model that computes its loss: each response token (up to its first EOS)
        at the column whose logits predict it, -100 elsewhere."""
        labels = torch.full_like(self.query_responses, -100)
        labels[:, self.context_length - 1:-1] = self.responses.masked_fill(~self.response_mask, -100)
        return labels

    def forward_logprobs(self, model: nn.Module, *, temperature: float, fused: bool = False) -> Tensor:
        """Log-probs of the responses under a plain decoder ``model`` (e.g. the reference) [B, N]; ``fused``: the
        model computes them from its hidden states (``labels=``), 0 outside the response mask."""
        kwargs = {"attention_mask": self.attention_mask, "position_ids": self.position_ids}
        if fused:
            loss = model(self.query_responses, labels=self.labels(), reduction="none", temperature=temperature,
                         **kwargs)
            return -response_logits(loss, self.context_length)
        logits = model(self.query_responses, **kwargs)
        return logprobs_from_logits(response_logits(logits, self.context_length) / temperature, self.responses)
