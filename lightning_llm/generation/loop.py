"""Batched autoregressive generation for our decoders: left padding, KV cache, greedy / sampling / beam search.

The model protocol is the one :class:`~lightning_llm.models.DecoderLM` implements (and what the SFT and PPO tasks
pass in; :mod:`lightning_llm.models.decoding`)::

    model(input_ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache, logits_to_keep=1)
        -> logits [B, 1, V]

where ``T`` = cached + new tokens. Prompts are LEFT-padded (``attention_mask`` 0 on the left), so every row's last
prompt token sits in the last column and new tokens are appended in lock-step; positions are counted over real
tokens only (``cumsum(mask) - 1``), so a padded row produces exactly what it produces alone.

Two caches (``GenerationConfig.cache_implementation``): ``dynamic`` (this eager loop: the KV cache and the ids/mask
buffers preallocated for the whole generation and written in place, the head on the last position only) and
``static`` (:mod:`.static`: buffers per batch size and length bucket, each step one compiled graph with
``compile``). Either way whether every row ended (EOS) stays on the device and is read every
:data:`~.sampling.STOP_CHECK_EVERY` steps: a generation reads the host at most ``N / 8 + 3`` times (none per token).

Shape legend: B batch, S prompt length, N new tokens, V vocabulary, K beams.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from .beam import beam_search
from .config import GenerationConfig
from .sampling import STOP_CHECK_EVERY, choose_tokens, ended_width
from .static import all_ended, generate_static, log_once, plan_static
from .stepper import Stepper

log = logging.getLogger(__name__)

__all__ = ["TokenChooser", "generate"]


class TokenChooser:
    """Picks each step's tokens of some rows from their next-token logits: greedy, sampled with one
    ``generator`` (``torch.multinomial`` draws the rows in sequence), or by the inverse CDF of per-row ``uniforms``
    [B, max_new_tokens]; rows that ended (EOS) get ``pad_token_id``.

    :attr:`rowwise`: a row's tokens depend on its own logits and draws only, not on which rows share its call, so
    rows may be decoded in groups (a pipeline's micro-batches) and still equal the whole batch decoded at once."""

    def __init__(self, cfg: GenerationConfig, *, device: torch.device, generator: torch.Generator | None = None,
                 uniforms: Tensor | None = None) -> None:
        self.cfg, self.generator, self.uniforms = cfg, generator, uniforms
        self.eos = torch.tensor(cfg.eos_ids, dtype=torch.long, device=device)
        self.rowwise = not cfg.do_sample or uniforms is not None

    def __call__(self, logits: Tensor, seqs: Tensor, finished: Tensor, step: int,
                 rows: slice = slice(None)) -> tuple[Tensor, Tensor]:
        """``(tokens [R], finished [R])`` of step ``step`` for ``rows`` of the batch, from their logits [R, V] fp32,
        tokens so far ``seqs`` [R, T] and which of them had ended."""
        uniform = self.uniforms[rows, step] if self.uniforms is not None and self.cfg.do_sample else None
        return choose_tokens(logits, seqs, finished, self.cfg, self.eos, uniform=uniform, generator=self.generator)

    def all_ended(self, finished: Tensor) -> bool:
        """Whether every row ended (a host read; none without EOS ids)."""
        return bool(self.eos.numel()) and bool(finished.all())

    def generate_rows(self, model: Any, input_ids: Tensor, attention_mask: Tensor, rows: slice) -> Tensor:
        """New tokens [R, N'] of ``rows`` of the batch decoded by :func:`generate` on ``model`` with these settings
        and those rows' own draws (a row-wise chooser: what a layout decoding a share of the rows calls)."""
        uniforms = self.uniforms[rows] if self.uniforms is not None else None
        return generate(model, input_ids[rows], attention_mask[rows], config=self.cfg, uniforms=uniforms,
                        generator=None if self.rowwise else self.generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> Tensor:
    """Continue left-padded prompts ``input_ids`` [B, S]; returns the new tokens [B, N] (N <= max_new_tokens).

    Rows that ended (EOS) are filled with ``pad_token_id`` afterwards; the EOS itself is kept. Generation stops
    early once every row has ended. The model's training mode is left unchanged (call ``eval()`` first).

    ``uniforms`` [B, max_new_tokens] (sampling only, instead of ``generator``): pre-drawn U(0, 1) numbers; row b's
    token at step t is the inverse CDF of its sampling distribution at ``uniforms[b, t]``. A row's sample then
    depends on its own draws only, not on which other rows share the batch (``torch.multinomial`` with one
    generator draws the rows in sequence).

    A model with a ``generate_rows(input_ids, attention_mask, *, max_new_tokens, choose)`` method (a pipeline's
    decoder: micro-batches in flight through its stages) decodes greedy and per-row-sampled batches with the KV cache
    itself, ``choose`` being the :class:`TokenChooser`; it returns what this loop would. A model with an
    ``all_ended(ended: bool) -> bool`` method decides when the batch has ended (ranks whose every decoding step runs
    collectives stop together).
    """
    cfg = config or GenerationConfig()
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate() needs LEFT-padded prompts: some rows end with padding")
    if cfg.num_beams > 1:
        if cfg.cache_implementation == "static":
            log_once("beam search decodes with the dynamic cache, eagerly (cache_implementation=static and compile "
                     "apply to greedy and sampled decoding)")
        return beam_search(model, input_ids, attention_mask, cfg)
    if uniforms is not None and uniforms.shape != (input_ids.shape[0], cfg.max_new_tokens):
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must be [batch, max_new_tokens] = "
                         f"{(input_ids.shape[0], cfg.max_new_tokens)}")
    choose = TokenChooser(cfg, device=input_ids.device, generator=generator, uniforms=uniforms)
    rowwise_loop = getattr(model, "generate_rows", None)
    if callable(rowwise_loop) and choose.rowwise and cfg.use_cache:
        return rowwise_loop(input_ids, attention_mask, max_new_tokens=cfg.max_new_tokens, choose=choose)
    agree = getattr(model, "all_ended", None) if cfg.eos_ids else None  # ranks that must stop together
    plan = plan_static(model, input_ids, cfg) if cfg.cache_implementation == "static" else None
    if plan is not None:
        return generate_static(model, input_ids, attention_mask, cfg, plan, generator=generator, uniforms=uniforms,
                               agree=agree)
    return _eager(Stepper(model, input_ids, attention_mask, max_new=cfg.max_new_tokens, use_cache=cfg.use_cache),
                  choose, agree)


def _eager(stepper: Stepper, choose: TokenChooser, agree: Any) -> Tensor:
    """The dynamic cache's loop: one forward per token; whether every row ended is read every
    :data:`~.sampling.STOP_CHECK_EVERY` tokens and the output cut where the last row ended."""
    n = choose.cfg.max_new_tokens
    logits = stepper.first()
    finished = torch.zeros(stepper.seqs.shape[0], dtype=torch.bool, device=stepper.seqs.device)
    for step in range(n):
        token, finished = choose(logits, stepper.seqs, finished, step)
        if step == n - 1 or (choose.eos.numel() and (step + 1) % STOP_CHECK_EVERY == 0
                             and all_ended(finished, agree)):
            stepper.rows.append(token)
            break
        logits = stepper.next(token)  # appends the token
    generated = stepper.rows.generated
    if choose.eos.numel():
        generated = generated[:, :int(ended_width(generated, choose.eos))]
    return generated.clone()

