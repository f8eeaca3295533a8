"""Decoding with a static KV cache (``cache_implementation="static"``), its one-token step compiled (``compile``).

Per (model, batch size B, capacity C) the buffers of one generation are allocated once and reused
(:class:`StaticState`): the KV cache [B, K, C, D] per layer (:class:`~lightning_llm.models.decoding.StaticKVCache`),
the tokens and mask [B, C], the next positions [B, 1], which rows ended [B], the step and the pre-drawn uniforms
[B, C]. ``C`` is the length bucket of prompt + new tokens (:func:`capacity_bucket`), so prompts and lengths to generate
within one bucket share every buffer and every compiled graph.

One generation: the prompt is prefilled by the eager path (the dynamic cache's own code, into the static buffers), the
first token chosen eagerly, then each step (:func:`_step`: the forward of the last token at the device-side column,
the token choice, the writes of the token, its mask column, position, and whether its row ended) has the same shapes
and reads no host value, so ``torch.compile`` traces it into one graph per (B, C) and settings: with
``mode="reduce-overhead"`` on CUDA one CUDA graph replay per token. Sampling from one generator (``torch.multinomial``
draws the rows in sequence) keeps the draw outside the graph: the compiled part is the forward. Whether every row
ended is read every :data:`~.sampling.STOP_CHECK_EVERY` steps; the output is cut where the last row ended, so the
tokens are those of the eager loop.

Shape legend: B batch, S prompt columns, C capacity, N new tokens, V vocabulary.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_llm.models.decoding import StaticKVCache, positions

from .config import GenerationConfig
from .sampling import STOP_CHECK_EVERY, choose_tokens, ended_width, last_logits

log = logging.getLogger(__name__)

__all__ = ["BUCKET_MIN", "STATES", "StaticPlan", "StaticState", "capacity_bucket", "decoder_module", "generate_static",
           "log_once", "plan_static"]

BUCKET_MIN = 32
"""The smallest capacity; the buckets are 32, 48, 64, 96, 128, 192, ... (powers of two and 1.5x them)."""
STATES_PER_MODEL = 2
"""Static states (caches of one batch size and bucket) kept per model for reuse, the most recently used."""
RECOMPILE_LIMIT = 64
"""dynamo's recompile limit while a compiled step runs (one graph per batch size, bucket and settings; torch's
default of 8 would fall back to eager after a few batch sizes)."""

_logged: set[str] = set()


def log_once(reason: str) -> None:
    """Log why a generation decodes otherwise than asked, once per reason and process."""
    if reason not in _logged:
        _logged.add(reason)
        log.warning("generation: %s", reason)


def capacity_bucket(columns: int) -> int:
    """The capacity of a static cache for ``columns`` = prompt + new tokens: the next of 32, 48, 64, 96, 128, ..."""
    c = BUCKET_MIN
    while c < columns:
        c = c * 3 // 2 if c & (c - 1) == 0 else c * 4 // 3  # 2^k -> 1.5 * 2^k -> 2^(k+1)
    return c


def decoder_module(model: Any) -> nn.Module | None:
    """The module a decoding model calls: ``model`` itself, or what a layout's wrapper (not a module) holds as
    ``.model`` (whole copies' row shares, ZeRO-3's stop-together wrapper); None for anything else (a pipeline's
    stages)."""
    while not isinstance(model, nn.Module) and hasattr(model, "model"):
        model = model.model
    return model if isinstance(model, nn.Module) else None


def _sharded(module: nn.Module) -> str | None:
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return "ZeRO-3 units (FSDP2)"
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return "sharded parameters (DTensor)"
    return None


@dataclass(frozen=True)
class StaticPlan:
    """How one generation decodes with the static cache: its capacity and whether the step is compiled."""

    capacity: int
    compiled: bool


def plan_static(model: Any, input_ids: Tensor, cfg: GenerationConfig) -> StaticPlan | None:
    """The static-cache plan of a generation asking for it, or None (logged once per reason) where it decodes with
    the dynamic cache instead: a model that does not take a :class:`StaticKVCache` (``static_kv_cache`` unset: prompt
    learning's wrappers), sharded parameters with ``compile``, or prompt + new tokens past the model's
    ``max_position_embeddings`` (the largest bucket)."""
    module = decoder_module(model)
    if module is None or not getattr(module, "static_kv_cache", False):
        log_once(f"cache_implementation=static: {type(module or model).__name__} takes no static KV cache; decoding "
                 "with the dynamic cache")
        return None
    if cfg.compile and (why := _sharded(module)) is not None:
        log_once(f"compile=true: the decoder holds {why} here, which a compiled step does not trace; decoding "
                 "eagerly with the dynamic cache")
        return None
    columns = input_ids.shape[1] + cfg.max_new_tokens
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    capacity = capacity_bucket(columns)
    if limit is not None and columns > limit:
        log_once(f"cache_implementation=static: a prompt of {input_ids.shape[1]} columns + {cfg.max_new_tokens} new "
                 f"tokens passes the largest bucket (max_position_embeddings={limit}); decoding with the dynamic cache")
        return None
    return StaticPlan(capacity=min(capacity, limit) if limit is not None else capacity, compiled=cfg.compile)


class StaticState:
    """The buffers of generations of ``batch`` rows in a cache of ``capacity`` columns, reused by every generation
    of that shape (their addresses stay: CUDA graphs replay on them)."""

    def __init__(self, batch: int, capacity: int, device: torch.device) -> None:
        self.cache = StaticKVCache(capacity)
        self.ids = torch.zeros(batch, capacity, dtype=torch.long, device=device)  # prompt, then new tokens
        self.mask = torch.zeros(batch, capacity, dtype=torch.bool, device=device)  # attended columns
        self.next_pos = torch.zeros(batch, 1, dtype=torch.long, device=device)  # position of the token to feed
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # the step being decoded
        self.uniforms = torch.zeros(batch, capacity, dtype=torch.float64, device=device)  # per-row draws
        self.eos = torch.zeros(0, dtype=torch.long, device=device)
        self.eos_ids: list[int] = []  # what ``eos`` holds, on the host
        for t in (self.ids, self.mask, self.next_pos, self.finished, self.step, self.uniforms):
            torch._dynamo.mark_static_address(t, guard=False)

    def start(self, input_ids: Tensor, attention_mask: Tensor, cfg: GenerationConfig,
              uniforms: Tensor | None) -> None:
        """Load a generation's prompts [B, S] (and uniforms [B, N]); the cache starts empty."""
        s = input_ids.shape[1]
        self.ids[:, :s] = input_ids
        self.mask[:, :s] = attention_mask.bool()
        self.mask[:, s:] = False
        self.next_pos.copy_(self.mask[:, :s].sum(-1, keepdim=True))  # the first new token's position
        self.finished.zero_()
        self.step.zero_()
        if uniforms is not None:
            self.uniforms[:, :uniforms.shape[1]] = uniforms
        if self.eos_ids != cfg.eos_ids:
            self.eos_ids = cfg.eos_ids
            self.eos = torch.tensor(cfg.eos_ids, dtype=torch.long, device=self.ids.device)
            torch._dynamo.mark_static_address(self.eos, guard=False)
        self.cache.reset()


class _States:
    """The :class:`StaticState` of each model, batch size and capacity (the last :data:`STATES_PER_MODEL` per model;
    a model that is garbage-collected takes its states with it)."""

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[Any, ...], StaticState]] = \
            weakref.WeakKeyDictionary()

    def get(self, model: Any, batch: int, capacity: int, device: torch.device) -> StaticState:
        states = self._by_model.setdefault(model, OrderedDict())
        key = (batch, capacity, device)
        if key not in states:
            states[key] = StaticState(batch, capacity, device)
            while len(states) > STATES_PER_MODEL:
                states.popitem(last=False)
        states.move_to_end(key)
        return states[key]

    def clear(self) -> None:
        self._by_model = weakref.WeakKeyDictionary()


STATES = _States()
"""Every model's static states (``STATES.clear()`` frees them)."""


# ---------------------------------------------------------------------------------------------------- one step
def _forward(model: Any, st: StaticState) -> Tensor:
    """Logits [B, V] fp32 of the token at the cache's write column (which the forward advances by one)."""
    ids = st.ids.index_select(1, st.cache.position.view(1))  # type: ignore[union-attr]  # [B, 1]
    out = model(ids, attention_mask=st.mask, position_ids=st.next_pos, kv_cache=st.cache, logits_to_keep=1)
    return last_logits(out)


def _seqs(st: StaticState, cfg: GenerationConfig) -> Tensor:
    """Every token so far [B, C] for the repetition penalty: the columns not yet written repeat column 0's token
    (already in the row, so penalised once either way)."""
    if cfg.repetition_penalty == 1.0:
        return st.ids  # unused
    cols = torch.arange(st.ids.shape[1], device=st.ids.device)
    return torch.where(cols < st.cache.position, st.ids, st.ids[:, :1])


def _commit(st: StaticState, token: Tensor, finished: Tensor) -> None:
    """Write the chosen token [B] into the next column (attended from now on) and advance the step."""
    column = st.cache.position.view(1)  # type: ignore[union-attr]
    st.ids.index_copy_(1, column, token[:, None])
    st.mask.index_fill_(1, column, True)
    st.next_pos.add_(1)
    st.finished.copy_(finished)
    st.step.add_(1)


def _step(model: Any, st: StaticState, cfg: GenerationConfig, with_uniforms: bool) -> None:
    """One whole decoding step on the device (greedy, or sampling from the per-row uniforms)."""
    logits = _forward(model, st)
    uniform = st.uniforms.index_select(1, st.step.view(1)).squeeze(1) if with_uniforms else None
    token, finished = choose_tokens(logits, _seqs(st, cfg), st.finished, cfg, st.eos, uniform=uniform)
    _commit(st, token, finished)


_compiled: dict[tuple[str, str, bool], Any] = {}
_partial: set[str] = set()  # step functions that do not trace as one graph here (compiled in pieces from then on)


def _compile(fn: Any, device: torch.device, *, fullgraph: bool) -> Any:
    """``fn`` compiled for ``device`` (CUDA graphs on CUDA), once per process."""
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    key = (fn.__name__, mode, fullgraph)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, mode=mode, dynamic=False, fullgraph=fullgraph)
    return _compiled[key]


class _Runner:
    """Calls a step function compiled (each call a new CUDA-graph step) or as it is. The step is compiled whole
    (``fullgraph``); where dynamo cannot trace it whole (another torch's dynamo, a model's own code) it is compiled
    in pieces instead, which is logged once with the reason (nothing ran when tracing failed)."""

    def __init__(self, fn: Any, device: torch.device, compiled: bool) -> None:
        self.plain, self.device, self.compiled = fn, device, compiled

    def __call__(self, *args: Any) -> Any:
        if not self.compiled:
            return self.plain(*args)
        if self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        whole = self.plain.__name__ not in _partial
        with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, torch._dynamo.config.recompile_limit)):
            try:
                return _compile(self.plain, self.device, fullgraph=whole)(*args)
            except torch._dynamo.exc.Unsupported as e:
                if not whole:
                    raise
                _partial.add(self.plain.__name__)
                log_once(f"compile=true: the decoding step does not trace as one graph here, so it is compiled in "
                         f"pieces (slower): {str(e).splitlines()[0][:300]}")
                return _compile(self.plain, self.device, fullgraph=False)(*args)


# ---------------------------------------------------------------------------------------------------- generation
def all_ended(finished: Tensor, agree: Any) -> bool:
    """Whether every row ended: the one host read every :data:`~.sampling.STOP_CHECK_EVERY` tokens (``agree``: the
    model's ``all_ended``, for ranks that must stop together)."""
    ended = bool(finished.all())
    return agree(ended) if agree is not None else ended


def generate_static(model: Any, input_ids: Tensor, attention_mask: Tensor, cfg: GenerationConfig, plan: StaticPlan,
                    *, generator: torch.Generator | None, uniforms: Tensor | None, agree: Any) -> Tensor:
    """New tokens [B, N'] of left-padded prompts, as :func:`~.loop.generate` decodes them, with the static cache.
    ``agree``: the model's ``all_ended`` (ranks that must stop together), or None."""
    b, s = input_ids.shape
    n = cfg.max_new_tokens
    st = STATES.get(model, b, plan.capacity, input_ids.device)
    st.start(input_ids, attention_mask, cfg, uniforms)
    mask = st.mask[:, :s]  # the prefill: the eager path, into the static buffers
    logits = last_logits(model(st.ids[:, :s], attention_mask=mask, position_ids=positions(mask), kv_cache=st.cache,
                               logits_to_keep=1))
    rowwise = not cfg.do_sample or uniforms is not None
    token, finished = choose_tokens(logits, st.ids[:, :s], st.finished, cfg, st.eos,
                                    uniform=uniforms[:, 0] if uniforms is not None and cfg.do_sample else None,
                                    generator=None if rowwise else generator)
    st.cache.start_steps()  # the first new token's column: s
    st.ids[:, s] = token
    st.mask[:, s] = True
    st.finished.copy_(finished)
    st.step.fill_(1)
    step = _Runner(_step, input_ids.device, plan.compiled) if rowwise else None
    forward = None if rowwise else _Runner(_forward, input_ids.device, plan.compiled)
    done = 1
    while done < n:
        if st.eos.numel() and done % STOP_CHECK_EVERY == 0 and all_ended(st.finished, agree):
            break
        if step is not None:
            step(model, st, cfg, uniforms is not None and cfg.do_sample)
        else:  # one generator's draws: the forward compiled, the draw eager
            assert forward is not None
            logits = forward(model, st)
            token, finished = choose_tokens(logits, st.ids[:, :s + done], st.finished, cfg, st.eos,
                                            generator=generator)
            _commit(st, token, finished)
        done += 1
    generated = st.ids[:, s:s + done]
    if st.eos.numel():
        generated = generated[:, :int(ended_width(generated, st.eos))]
    return generated.clone()
