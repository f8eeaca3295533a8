"""Batched autoregressive generation for our decoders: left padding, KV cache, greedy / sampling / beam search.

The model protocol is the one :class:`~lightning_llm.models.DecoderLM` implements (and what the SFT and PPO tasks
pass in; :mod:`lightning_llm.models.decoding`)::

    model(input_ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache: KVCache | None,
          logits_to_keep=1) -> logits [B, 1, V]

where ``T`` = cached + new tokens. Prompts are LEFT-padded (``attention_mask`` 0 on the left), so every row's last
prompt token sits in the last column and new tokens are appended in lock-step; positions are counted over real
tokens only (``cumsum(mask) - 1``), so a padded row produces exactly what it produces alone.

Per token: the KV cache and the ids/mask buffers are preallocated for the whole generation and written in place,
the head runs on the last position only, and the one host synchronisation is the EOS check (none without EOS ids).

Shape legend: B batch, S prompt length, N new tokens, V vocabulary, K beams.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm.models.decoding import DecodeRows, KVCache

log = logging.getLogger(__name__)

__all__ = ["GenerationConfig", "TokenChooser", "for_datamodule", "generate", "last_logits", "strip_after_eos"]


@dataclass
class GenerationConfig:
    """Decoding settings (the names follow ``transformers.GenerationConfig``)."""

    max_new_tokens: int = 64
    """Most tokens generated per prompt (EOS included)."""
    do_sample: bool = False
    """Sample from the (temperature / top-k / top-p filtered) distribution instead of taking the argmax."""
    temperature: float = 1.0
    """Softmax temperature when sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``; 1.0 = off."""
    num_beams: int = 1
    """Beam search width; 1 = greedy or sampling."""
    length_penalty: float = 1.0
    """Beam search: finished hypotheses are ranked by ``sum logprob / generated_len ** length_penalty``."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty on tokens already in the sequence (prompt included); 1.0 = off."""
    eos_token_id: int | list[int] | None = None
    """Token id(s) that end a sequence; ``None`` generates exactly ``max_new_tokens``."""
    pad_token_id: int = 0
    """Id written after a sequence has ended."""
    use_cache: bool = True
    """Reuse keys/values of earlier tokens (``False`` recomputes the whole sequence every step)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise ValueError(f"generation.num_beams must be >= 1, got {self.num_beams}")
        if self.num_beams > 1 and self.do_sample:
            raise ValueError("generation.do_sample=true with generation.num_beams > 1 is not supported")
        if self.temperature <= 0:
            raise ValueError(f"generation.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


torch.serialization.add_safe_globals([GenerationConfig])  # saved in SFT checkpoints' hyper-parameters


def for_datamodule(config: GenerationConfig, datamodule: Any) -> GenerationConfig:
    """``config`` completed from the datamodule's tokenizer: where it names no ``eos_token_id``, the ids a response
    ends at (``datamodule.stop_token_ids``: a chat template's end-of-turn token and EOS; else its
    ``eos_token_id``), and its ``pad_token_id``."""
    changes: dict[str, Any] = {}
    stops = getattr(datamodule, "stop_token_ids", None) or getattr(datamodule, "eos_token_id", None)
    if config.eos_token_id is None and stops is not None:
        changes["eos_token_id"] = list(stops) if isinstance(stops, (list, tuple)) else int(stops)
    if getattr(datamodule, "pad_token_id", None) is not None:
        changes["pad_token_id"] = datamodule.pad_token_id
    return GenerationConfig(**{**config.__dict__, **changes})


def strip_after_eos(tokens: Tensor, eos_ids: Sequence[int]) -> list[list[int]]:
    """Generated tokens [B, N] -> per-row lists cut before the first EOS (EOS itself removed)."""
    out = []
    for row in tokens.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:cut])
    return out


def _process_logits(logits: Tensor, seqs: Tensor, cfg: GenerationConfig) -> Tensor:
    """Repetition penalty, then temperature / top-k / top-p for sampling. logits [R, V] fp32, seqs [R, T]."""
    if cfg.repetition_penalty != 1.0:
        prev = logits.gather(1, seqs)
        prev = torch.where(prev < 0, prev * cfg.repetition_penalty, prev / cfg.repetition_penalty)
        logits = logits.scatter(1, seqs, prev)
    if not cfg.do_sample:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= cfg.top_p  # tokens entirely beyond the nucleus (top-1 always kept)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def last_logits(out: Tensor) -> Tensor:
    """Logits of the last position as a plain fp32 tensor [R, V]. Under tensor parallelism the model returns
    vocab-sharded DTensor logits (the loss never gathers them); decoding needs the whole row, so gather it."""
    out = out[:, -1]
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return out.float()


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
        cfg = self.cfg
        scores = _process_logits(logits, seqs, cfg)
        if cfg.do_sample and self.uniforms is not None:
            token = _inverse_cdf(scores.softmax(-1), self.uniforms[rows, step])  # [R]
        elif cfg.do_sample:
            token = torch.multinomial(scores.softmax(-1), 1, generator=self.generator).squeeze(1)  # [R]
        else:
            token = scores.argmax(-1)  # [R]
        token = torch.where(finished, torch.full_like(token, cfg.pad_token_id), token)
        if self.eos.numel():
            finished = finished | torch.isin(token, self.eos)
        return token, finished

    def all_ended(self, finished: Tensor) -> bool:
        """Whether every row ended (the one host synchronisation of a step; none without EOS ids)."""
        return bool(self.eos.numel()) and bool(finished.all())

    def generate_rows(self, model: Any, input_ids: Tensor, attention_mask: Tensor, rows: slice) -> Tensor:
        """New tokens [R, N'] of ``rows`` of the batch decoded by :func:`generate` on ``model`` with these settings
        and those rows' own draws (a row-wise chooser: what a layout decoding a share of the rows calls)."""
        uniforms = self.uniforms[rows] if self.uniforms is not None else None
        return generate(model, input_ids[rows], attention_mask[rows], config=self.cfg, uniforms=uniforms,
                        generator=None if self.rowwise else self.generator)


class _Stepper:
    """Feeds the model one step at a time, with or without a KV cache. Rows may be reordered (beam search)."""

    def __init__(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, max_new: int,
                 use_cache: bool) -> None:
        self.model = model
        self.rows = DecodeRows(input_ids, attention_mask, max_new)
        self.cache = KVCache(capacity=input_ids.shape[1] + max_new) if use_cache else None

    @property
    def seqs(self) -> Tensor:
        return self.rows.seqs

    def _call(self, ids: Tensor, kwargs: dict[str, Tensor]) -> Tensor:
        return last_logits(self.model(ids, **kwargs, kv_cache=self.cache, logits_to_keep=1))

    def first(self) -> Tensor:
        return self._call(*self.rows.prefill())

    def next(self, tokens: Tensor) -> Tensor:  # tokens [R] -> next-token logits [R, V] fp32
        self.rows.append(tokens)
        return self._call(*(self.rows.step() if self.cache is not None else self.rows.whole()))

    def reorder(self, index: Tensor) -> None:
        self.rows.reorder(index)
        if self.cache is not None:
            self.cache.reorder(index)


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
        return _beam_search(model, input_ids, attention_mask, cfg)
    if uniforms is not None and uniforms.shape != (input_ids.shape[0], cfg.max_new_tokens):
        raise ValueError(f"uniforms {tuple(uniforms.shape)} must be [batch, max_new_tokens] = "
                         f"{(input_ids.shape[0], cfg.max_new_tokens)}")
    choose = TokenChooser(cfg, device=input_ids.device, generator=generator, uniforms=uniforms)
    rowwise_loop = getattr(model, "generate_rows", None)
    if callable(rowwise_loop) and choose.rowwise and cfg.use_cache:
        return rowwise_loop(input_ids, attention_mask, max_new_tokens=cfg.max_new_tokens, choose=choose)
    stepper = _Stepper(model, input_ids, attention_mask, max_new=cfg.max_new_tokens, use_cache=cfg.use_cache)
    agree = getattr(model, "all_ended", None) if cfg.eos_ids else None  # ranks that must stop together
    logits = stepper.first()
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(cfg.max_new_tokens):
        token, finished = choose(logits, stepper.seqs, finished, step)
        ended = choose.all_ended(finished)
        if agree is not None:
            ended = agree(ended)
        if ended or step == cfg.max_new_tokens - 1:
            stepper.rows.append(token)
            break
        logits = stepper.next(token)
    return stepper.rows.generated.clone()


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token [R] whose CDF interval holds ``u`` [R] (in [0, 1)), per row of ``probs`` [R, V]. fp64 cumulative
    sums: the last bucket's edge stays within ~1e-16 of the total. Zero-probability tokens have empty intervals."""
    cdf = probs.double().cumsum(-1)  # [R, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [R, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _beam_search(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, cfg: GenerationConfig) -> Tensor:
    """Beam search with K = num_beams beams per prompt; returns each prompt's best hypothesis [B, N].

    A hypothesis ends when it emits EOS (ranked by ``logprob_sum / len ** length_penalty``); a prompt is done when
    it has K ended hypotheses and no running beam can beat the worst of them (HF's ``early_stopping=False`` rule).
    """
    b, k, device = input_ids.shape[0], cfg.num_beams, input_ids.device
    eos = set(cfg.eos_ids)
    rows = torch.arange(b, device=device).repeat_interleave(k)  # [B*K] beam rows of each prompt
    stepper = _Stepper(model, input_ids[rows], attention_mask[rows], max_new=cfg.max_new_tokens,
                       use_cache=cfg.use_cache)
    agree = getattr(model, "all_ended", None)
    logits = stepper.first()  # [B*K, V]
    beam_scores = torch.zeros(b, k, device=device)
    beam_scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first one at step 0
    history = torch.empty(b * k, 0, dtype=torch.long, device=device)  # [B*K, step]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b
    vocab = logits.shape[-1]
    for step in range(cfg.max_new_tokens):
        logp = F.log_softmax(_process_logits(logits, stepper.seqs, cfg), dim=-1)  # [B*K, V]
        total = (beam_scores.view(-1, 1) + logp).view(b, k * vocab)
        top_scores, top_idx = torch.topk(total, 2 * k, dim=1)  # [B, 2K]: enough to keep K non-EOS beams
        next_beam = torch.zeros(b, k, dtype=torch.long, device=device)
        next_token = torch.full((b, k), cfg.pad_token_id, dtype=torch.long, device=device)
        next_score = torch.full((b, k), float("-inf"), device=device)
        gen_len = step + 1
        for i in range(b):
            if done[i]:
                next_score[i] = 0.0  # keep the row alive with pad tokens; it is ignored
                continue
            kept = 0
            for rank, (score, idx) in enumerate(zip(top_scores[i].tolist(), top_idx[i].tolist())):
                beam, token = divmod(idx, vocab)
                if token in eos:
                    if rank < k:  # an EOS outside the top K would not have survived as a beam
                        hyp = history[i * k + beam].tolist() + [token]
                        finished[i].append((score / gen_len ** cfg.length_penalty, hyp))
                    continue
                next_beam[i, kept], next_token[i, kept], next_score[i, kept] = beam, token, score
                kept += 1
                if kept == k:
                    break
            finished[i] = sorted(finished[i], key=lambda h: -h[0])[:k]
            if len(finished[i]) == k:
                best_running = float(next_score[i].max()) / gen_len ** cfg.length_penalty
                done[i] = best_running <= finished[i][-1][0]
        order = (torch.arange(b, device=device)[:, None] * k + next_beam).view(-1)  # [B*K] source rows
        history = torch.cat([history[order], next_token.view(-1, 1)], dim=1)
        beam_scores = next_score
        ended = all(done)
        if agree is not None:  # ranks whose decoding steps run collectives stop together
            ended = agree(ended)
        if ended or step == cfg.max_new_tokens - 1:
            break
        stepper.reorder(order)
        logits = stepper.next(next_token.view(-1))
    best: list[list[int]] = []
    for i in range(b):
        pool = list(finished[i])
        if not done[i]:  # running beams compete at max length
            for j in range(k):
                score = float(beam_scores[i, j])
                if score > float("-inf"):
                    pool.append((score / history.shape[1] ** cfg.length_penalty, history[i * k + j].tolist()))
        best.append(max(pool, key=lambda h: h[0])[1])
    width = max(len(h) for h in best)
    out = torch.full((b, width), cfg.pad_token_id, dtype=torch.long, device=device)
    for i, h in enumerate(best):
        out[i, :len(h)] = torch.as_tensor(h, dtype=torch.long, device=device)
    return out
