"""Causal decoder language model (LLaMA / GPT-2 family).

Module tree (uniform so that parallel plans are data keyed by module path)::

    embed_tokens      nn.Embedding [V, H]              (None on non-first pipeline stages; a ScaledEmbedding, rows
                                                        times sqrt(H), with config.scale_embeddings: Gemma)
    embed_positions   nn.Embedding [P, H] or None      (GPT-2 learned positions)
    layers            nn.ModuleDict {"0": TransformerBlock, ...}   (a pipeline split deletes entries)
    norm              final norm or None
    lm_head           nn.Linear [H -> V], no bias      (None on non-last pipeline stages; tied to embed_tokens;
                                                        a NormHead when config.norm_head: rows L2-normalised)
    score             nn.Linear [H -> L], no bias      (a sequence classifier, ``config.num_labels = L > 0``: in
                                                        place of lm_head; transformers' ``...ForSequenceClassification``)

Variants are config switches of this one module tree (so every family shares one parallel spec): fused ``W_pack``
and ``q_norm``/``k_norm`` in the attention (``block.Attention``), partial rotary (``partial_rotary_factor``), a
sliding window on the layers of ``config.sliding_layers`` (a band in the attention mask), rope types of ``layers/rope.py``,
Multi-head Latent Attention as every layer's ``self_attn`` (``config.mla``: ``mla.LatentAttention``), Gated DeltaNet
as the ``self_attn`` of the layers ``config.linear_layers`` names (``deltanet.GatedDeltaNet``: Qwen3.5, Qwen3-Next,
a recurrent state instead of keys and values), Mixture-of-Experts
feed-forwards (``config.moe``: ``moe.MoEBlock``), norms on each branch's input and/or output (``branch_input_norm``,
``branch_output_norm``: ``attn_out_norm``/``mlp_out_norm``), rotary dims in pairs (``rope_interleave``), layers without
rotary embedding (``nope_layers``), the sliding layers' own rope (``sliding_rope``: OLMo 3, Gemma 3's local base),
LongRoPE's factors chosen per forward (``_longrope``), Gemma's scaled embedding and soft-caps (the scores':
``attention.softcapped_attention``; the logits': in forward and in the fused loss's chunks). Attention takes SDPA over one
mask per forward, or the varlen flash kernel over one layout per forward (``layers/attention.py``: ``config.attention``).

Shape legend: B batch, S sequence, H hidden, V vocab, D head dim.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn

from lightning_llm.kernels.loss.head_loss import TokenScores, head_cross_entropy, head_token_scores

from .config import ModelConfig
from .init import InitPlan, WeightsSource, draw_init_seed, full_index, init_whole, materialize, plan_for_modules
from .layers.attention import AttentionMask, TokenMask, contiguous_sequences, uses_varlen, varlen_layout
from .layers.block import KVCache, NormHead, ScaledEmbedding, TransformerBlock, build_norm, use_fused_kernel
from .layers.deltanet import GatedDeltaNet, recurrent_rows
from .layers.masks import additive_mask, causal_mask, causal_padding_mask, segment_positions
from .layers.mla import LatentAttention
from .layers.moe import MoEBlock, RoutingInput
from .layers.rope import longrope_original, precompute_rope, rope_from_positions, rope_inv_freq, rope_type
from .layers.routing import RoutingStats

log = logging.getLogger(__name__)

__all__ = ["DecoderLM", "HeadLoss"]


class HeadLoss(Protocol):
    """A loss of the LM head other than the token cross-entropy (distillation's divergence from a teacher), which
    ``DecoderLM.forward(..., labels=, head_loss=)`` returns instead: called with the final hidden states [B, S, H] (what
    the head reads), the head, the labels and the logits' soft-cap, inside the forward (where ZeRO-3 holds the head
    whole). A pipeline splits its tensors with the rows when it is a pytree (:mod:`torch.utils._pytree`)."""

    def __call__(self, hidden: Tensor, head: nn.Module, labels: Tensor, *, softcap: float | None) -> Any: ...


class DecoderLM(nn.Module):
    """Decoder-only causal LM. ``forward`` returns logits [B, S, V] (or hidden states when ``lm_head is None``),
    or with ``labels=`` the next-token cross-entropy computed from the hidden states and the head in chunks
    (:func:`~lightning_llm.kernels.loss.head_loss.head_cross_entropy`). A sequence classifier (``config.num_labels > 0``,
    a reward model) has a ``score`` head instead of ``lm_head`` and returns every position's scores [B, S, L]; a row's
    scores are those of its last token that is not padding (:func:`~.scores.sequence_scores`, transformers' rule)."""

    computes_loss: ClassVar[bool] = True
    """``forward(..., labels=)`` returns the token cross-entropy (what a task's fused loss path asks for)."""
    static_kv_cache: ClassVar[bool] = True
    """``forward(..., kv_cache=)`` takes a :class:`~.decoding.StaticKVCache` (``cache_implementation="static"``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.family != "decoder":
            raise ValueError(f"DecoderLM needs a decoder config, got family={config.family!r}")
        self.config = config
        device = torch.empty(0).device  # where the caller builds: "meta" under `with torch.device("meta")`
        self.init_seed: int = draw_init_seed()
        """The init's seed (:mod:`.init`): every initial value is a function of it and the parameter's name."""
        self.weights_source: WeightsSource | None = None
        """Where :func:`~.init.materialize` reads weights from (a lazily loaded HF checkpoint), else None."""
        h = config.hidden_size
        with torch.device("meta"):  # built empty: the init below writes every value once
            self.embed_tokens: nn.Embedding | None = (
                ScaledEmbedding(config.vocab_size, h, scale=h ** 0.5) if config.scale_embeddings
                else nn.Embedding(config.vocab_size, h))
            self.embed_positions: nn.Embedding | None = (
                nn.Embedding(config.max_position_embeddings, h) if config.position == "learned" else None
            )
            self.dropout = nn.Dropout(config.dropout)
            moe = set(config.moe_layers)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(
                config, mlp=MoEBlock(config, i) if i in moe else None, attn=_attention_layer(config, i))
                for i in range(config.num_layers)})
            self.norm: nn.Module | None = build_norm(config) if config.final_norm else None
            head_cls = NormHead if config.norm_head else nn.Linear
            classifier = config.num_labels > 0
            self.lm_head: nn.Linear | None = None if classifier else head_cls(h, config.vocab_size, bias=False)
            self.score: nn.Linear | None = nn.Linear(h, config.num_labels, bias=False) if classifier else None
            self.rope_cos: Tensor | None
            self.rope_sin: Tensor | None
            if config.position == "rope":
                table = (config.max_position_embeddings, config.rotary_dim)
                self.register_buffer("rope_cos", torch.empty(table, dtype=torch.float32), persistent=False)  # [P, R]
                self.register_buffer("rope_sin", torch.empty(table, dtype=torch.float32), persistent=False)  # [P, R]
            else:
                self.rope_cos = None
                self.rope_sin = None
        self.routing: RoutingStats | None = None
        """The MoE layers' router statistics of a training step (``None`` without MoE layers): see :mod:`.layers.routing`."""
        if config.moe is not None:
            self.routing = RoutingStats(config.moe_layers, num_experts=config.moe.num_experts,
                                        top_k=config.moe.top_k, aux_loss_coef=config.moe.aux_loss_coef,
                                        bias_update_rate=config.moe.bias_update_rate)
        self.tie_weights()
        tied = {"lm_head.weight": "embed_tokens.weight"} if config.tie_embeddings and self.lm_head is not None else {}
        self.init_plan: InitPlan = plan_for_modules(self, std=config.initializer_range, tied=tied)
        """What each parameter starts as (read by :func:`~.init.materialize`, also for shards)."""
        if device.type != "meta":
            materialize(self, device)

    # ------------------------------------------------------------------ init

    def _rope_tables(self, device: torch.device | None) -> tuple[Tensor, Tensor]:
        c = self.config
        return precompute_rope(c.rotary_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, device=device)

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``embed_tokens.weight`` when ``tie_embeddings``."""
        if self.config.tie_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers(self) -> None:
        """Recompute the (non-persistent) rotary tables in place, on their current device (after ``to_empty``), and
        fill the MoE routers' correction biases from the HF checkpoint being loaded (``weights_source``), else zero
        (a checkpoint loaded afterwards brings its own)."""
        with torch.no_grad():
            if self.rope_cos is not None and self.rope_sin is not None and not self.rope_cos.is_meta:
                cos, sin = self._rope_tables(device=self.rope_cos.device)
                self.rope_cos.copy_(cos)
                self.rope_sin.copy_(sin)
            source = self.weights_source
            for key, block in self.layers.items():
                bias = getattr(getattr(block.mlp, "gate", None), "e_score_correction_bias", None)
                if bias is None or bias.is_meta:
                    continue
                name = f"layers.{key}.mlp.gate.e_score_correction_bias"
                if source is not None and source.has(name):
                    bias.copy_(source.read(name, full_index(bias.shape, bias.device), bias.dtype))
                else:
                    bias.zero_()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from :attr:`init_plan` (normal(std=initializer_range) for linear and
        embedding weights, zero biases, unit norms) and the buffers.

        The values depend only on :attr:`init_seed` and the parameter names, not on torch's generator state, so a
        pipeline stage (modules removed), a shard or a model built on the meta device gets the same values as the
        whole model on one device.
        """
        self.tie_weights()
        init_whole(self)
        self.init_buffers()

    def reset_parameters(self) -> None:
        """Alias of :meth:`init_weights`."""
        self.init_weights()

    @torch.no_grad()
    def update_router_biases(self, loads: Tensor) -> None:
        """DeepSeek-V3's aux-free balancing, after an optimizer step: per MoE layer held here,
        ``bias += rate * sign(mean(load) - load)`` on the correction bias its router adds to the scores to choose
        experts (``loads`` [L, E]: top-k assignments per expert over the global batch and accumulation window, so every
        rank moves its copy the same way)."""
        assert self.routing is not None and self.config.moe is not None
        rate = self.config.moe.bias_update_rate
        for key, block in self.layers.items():
            bias = getattr(block.mlp.gate, "e_score_correction_bias", None) if int(key) in self.routing.index else None
            if bias is not None:
                load = loads[self.routing.index[int(key)]].to(bias.device, torch.float64)
                bias.add_((rate * torch.sign(load.mean() - load)).to(bias.dtype))

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: Tensor | None = None,  # [B, S] token ids, or hidden [B, S, H] when embed_tokens is None
        *,
        attention_mask: Tensor | None = None,  # [B, S], 1 = token, 0 = padding
        position_ids: Tensor | None = None,  # [B, S] or [S]; default arange(S) (per segment with segment_ids)
        segment_ids: Tensor | None = None,  # [B, S] packed rows: 1..k per example, 0 padding; attention per example
        inputs_embeds: Tensor | None = None,  # [B, S, H] instead of input_ids
        kv_cache: KVCache | None = None,  # incremental decoding: attention_mask then covers past + new tokens
        labels: Tensor | None = None,  # [B, S] next-token ids (-100 ignored): return the loss instead of logits
        reduction: Literal["mean", "none"] = "mean",  # of the loss with labels: mean over tokens, or [B, S]
        temperature: float = 1.0,  # with labels: the loss of logits / temperature (RL's sampling temperature)
        token_scores: bool = False,  # with labels: TokenScores (per-token loss, entropy, hidden) instead of a loss
        head_loss: HeadLoss | None = None,  # with labels: head_loss(hidden, lm_head, labels, softcap=) instead
        logits_to_keep: int = 0,  # > 0: the logits of the last positions only [B, logits_to_keep, V] (decoding)
    ) -> Tensor | TokenScores:  # logits [B, S, V] (hidden [B, S, H] when lm_head is None; the loss with labels;
        # a sequence classifier's scores [B, S, L])
        if self.embed_tokens is None:
            # Pipeline stage after the first: the positional input is the hidden state of the previous stage.
            x = input_ids if input_ids is not None else inputs_embeds
            if x is None:
                raise ValueError("DecoderLM stage without embed_tokens needs the hidden state as first argument")
        else:
            if (input_ids is None) == (inputs_embeds is None):
                raise ValueError("DecoderLM.forward: pass exactly one of input_ids and inputs_embeds")
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        b, s = x.shape[0], x.shape[1]
        # total: the key columns (T); past: the first new token's column (a 0-dim tensor in a static cache's steps)
        total, past = kv_cache.columns(s) if kv_cache is not None else (s, 0)
        cached = not isinstance(past, int) or past > 0
        if cached and attention_mask is None:
            if not isinstance(past, int):
                raise ValueError("DecoderLM.forward: a static KV cache's decoding steps need the attention_mask of its "
                                 "columns")
            # SDPA's is_causal aligns the mask top-left, which is wrong for S < T: build an explicit mask.
            attention_mask = torch.ones(b, total, dtype=torch.bool, device=x.device)
        if segment_ids is not None and (cached or (attention_mask is not None and attention_mask.dim() != 2)):
            raise ValueError("DecoderLM.forward: segment_ids (packed rows) take a [B, S] attention_mask and no KV "
                             "cache")
        given = position_ids is not None  # the caller's (a context-parallel slice's are global: past its length)
        if position_ids is None and segment_ids is not None:
            position_ids = segment_positions(segment_ids)  # each example's own positions
        elif position_ids is None:
            position_ids = (torch.arange(past, total, device=x.device) if isinstance(past, int)
                            else past + torch.arange(s, device=x.device)).unsqueeze(0).expand(b, s)  # [B, S]
        elif position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, s)
        if self.embed_tokens is not None:
            # Positions are added where the tokens are embedded (first stage only).
            if self.embed_positions is not None:
                limit = self.embed_positions.num_embeddings
                if total > limit:
                    raise ValueError(f"DecoderLM: a sequence of {total} tokens (cached {past} + new {s}) is longer "
                                     f"than max_position_embeddings={limit}, the size of the learned position table")
                x = x + self.embed_positions(position_ids)
            x = self.dropout(x)

        # With a cache the positions count real tokens among the T columns, so they stay below T: no host read
        rope = self._rope(position_ids, bound=total, read=given and kv_cache is None,  # cos, sin [B, S, D], or None
                          exact=segment_ids is not None or not isinstance(past, int))
        if kv_cache is not None and rope_type(self.config.rope_scaling) == "longrope":
            self._check_longrope_cache(kv_cache, past, total)
        ropes = self._layer_ropes(rope, position_ids, bound=total)
        varlen = kv_cache is None and (attention_mask is None or attention_mask.dim() == 2) \
            and uses_varlen(self.config, x)
        cache_kw: dict[str, object] = {} if kv_cache is None else {"kv_cache": kv_cache}  # absent unless decoding
        if self._cores_need_token_mask():  # they build their own mask (or layout) from the tokens
            cache_kw["token_mask"] = self._token_mask(attention_mask, segment_ids, kv_cache, varlen=varlen)
            full = sliding = (None, False)
        else:
            layouts = self._layouts(attention_mask, segment_ids, x, total) if varlen else None
            full, sliding = layouts or self._shared_masks(
                self._masks(attention_mask, segment_ids, s, total, x.device, first=past), x)
        windowed, linear = set(self.config.sliding_layers), set(self.config.linear_layers)
        recurrent = (recurrent_rows(attention_mask, segment_ids, s), False) if linear else None
        routing = self._routing_input(attention_mask, segment_ids, b * s) if self.routing is not None else None
        moe = set(self.config.moe_layers)
        for key, layer in self.layers.items():
            mask, is_causal = recurrent if int(key) in linear else sliding if int(key) in windowed else full
            layer_kw = {**cache_kw, "routing": routing} if routing is not None and int(key) in moe else cache_kw
            x = layer(x, rope=ropes.get(key, rope), attn_mask=mask, is_causal=is_causal, **layer_kw)
        if self.routing is not None and any(block.training for block in self.layers.values()):
            self.routing.forward_done()  # a step's last expected forward starts the statistics' reduction
        if kv_cache is not None:
            kv_cache.advance(s)
        if self.norm is not None:
            x = self.norm(x)
        if self.score is not None:  # a sequence classifier: every position's scores, read at the last token
            if labels is not None:
                raise ValueError("DecoderLM with a score head (num_labels > 0) takes no labels: it scores sequences")
            return self.score(x)  # [B, S, L]
        if self.lm_head is None:
            return x
        cap = self.config.final_logit_softcap  # Gemma 2: cap * tanh(logits / cap), in the fused chunks too
        if labels is not None and head_loss is not None:  # another loss of the head, where its weights are whole
            return head_loss(x, self.lm_head, labels, softcap=cap)
        if labels is not None:  # fused with the head where exact: the [B, S, V] logits are never materialised
            backend = "triton" if use_fused_kernel(self.config.kernels, x) else "torch"
            if token_scores:
                return head_token_scores(x, self.lm_head, labels, temperature=temperature, backend=backend,
                                         softcap=cap)
            return head_cross_entropy(x, self.lm_head, labels, reduction=reduction, temperature=temperature,
                                      backend=backend, softcap=cap)
        if logits_to_keep:  # decoding reads the last position: the head runs on it alone (HF's logits_to_keep)
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x)  # [B, S, V]
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _routing_input(self, attention_mask: Tensor | None, segment_ids: Tensor | None, n: int) -> RoutingInput:
        """What the MoE layers record routing statistics of: the real tokens (padding and a packed row's tail are
        excluded from the load-balancing loss, as transformers excludes padding) while a training step records."""
        assert self.routing is not None
        if not self.routing.recording:
            return RoutingInput()
        keep = None
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] * attention_mask.shape[0] == n:
            keep = attention_mask.bool()
        if segment_ids is not None:
            keep = segment_ids > 0 if keep is None else keep & (segment_ids > 0)
        return RoutingInput(keep=None if keep is None else keep.reshape(-1), stats=self.routing)

    def _cores_need_token_mask(self) -> bool:
        """Whether an attention core rebuilds its mask from the tokens' :class:`~.layers.attention.TokenMask` (a core a layout
        installed through the declared hook)."""
        # The blocks' cores only (a walk over every module would cost each decoding step a Python loop over them).
        return any(getattr(getattr(getattr(layer, "self_attn", None), "core", None), "needs_token_mask", False)
                   for layer in self.layers.values())

    def _token_mask(self, attention_mask: Tensor | None, segment_ids: Tensor | None, kv_cache: KVCache | None, *,
                    varlen: bool) -> TokenMask:
        """The ingredients of this forward's mask; refused where they do not describe it (a cache, a 4-D mask,
        sliding-window layers)."""
        if kv_cache is not None or (attention_mask is not None and attention_mask.dim() != 2) \
                or self.config.sliding_layers:
            raise ValueError("DecoderLM: this attention core rebuilds the causal mask from the tokens (padding, "
                             "segments); it takes no KV cache, no 4-D attention_mask and no sliding-window layers")
        return TokenMask(keep=None if attention_mask is None else attention_mask.bool(), segment_ids=segment_ids,
                         varlen=varlen)

    def _rope(self, position_ids: Tensor, *, bound: int, read: bool, exact: bool = False
              ) -> tuple[Tensor, Tensor] | None:
        """cos, sin [B, S, D] for ``position_ids`` [B, S] of a forward of ``bound`` columns; ``read``: the
        caller's positions, which may pass ``bound`` (a context-parallel slice's are global); ``exact``: ``bound``
        may exceed the longest position + 1 (packed rows, a static cache's capacity)."""
        if self.rope_cos is None or self.rope_sin is None:
            return None
        values = not position_ids.is_meta and position_ids.numel() > 0  # the meta device (FLOP counts) has none
        c = self.config
        if rope_type(c.rope_scaling) == "longrope":
            return self._longrope(position_ids, bound=bound, on_device=read or exact)
        dynamic = rope_type(c.rope_scaling) == "dynamic"
        # The caller's positions are computed from (the table's values: the same fp32 product), not looked up, unless
        # `dynamic` rope needs their longest: reading it would wait for the device in every forward.
        longest = int(position_ids.max()) + 1 if read and values and dynamic else bound
        if longest <= self.rope_cos.shape[0] and not (read and values and not dynamic):
            return self.rope_cos[position_ids], self.rope_sin[position_ids]  # every position inside the table
        # Past the table (transformers has no such limit), or the caller's: computed from the positions. `dynamic`
        # rope picks its frequencies from this forward's longest position, as transformers' dynamic_rope_update does.
        return rope_from_positions(position_ids, c.rotary_dim, c.max_position_embeddings, c.rope_theta,
                                   c.rope_scaling, seq_len=longest,
                                   inv_freq=None if dynamic else self._inv_freq(position_ids.device))

    def _inv_freq(self, device: torch.device, which: str = "full") -> Tensor:
        """The rope frequencies [R/2] (not ``dynamic``) on ``device``, copied there once (not a buffer: never saved):
        ``full`` (LongRoPE's short factors), ``long`` (LongRoPE's long ones) or ``sliding`` (``config.sliding_rope``)."""
        cache = self.__dict__.setdefault("_rope_inv_freqs", {})
        cached = cache.get(which)
        if cached is None or cached.device != device:
            c = self.config
            theta, scaling = c.rope_theta, c.rope_scaling
            if which == "sliding":
                scaling = {k: v for k, v in (c.sliding_rope or {}).items() if k != "rope_theta"}
                theta = float((c.sliding_rope or {}).get("rope_theta", c.rope_theta))
            seq = longrope_original(scaling) + 1 if which == "long" else None
            cached = rope_inv_freq(c.rotary_dim, theta, scaling or None, max_positions=c.max_position_embeddings,
                                   seq_len=seq).to(device)
            cache[which] = cached
        return cached

    def _longrope(self, position_ids: Tensor, *, bound: int, on_device: bool) -> tuple[Tensor, Tensor]:
        """LongRoPE as transformers' ``dynamic_rope_update`` picks it per forward: the long factors when the longest
        position + 1 passes ``original_max_position_embeddings``, else the short ones (the table's); ``on_device``:
        chosen from the positions on the device (no host read), where ``bound`` is not that length."""
        c = self.config
        assert self.rope_cos is not None and self.rope_sin is not None
        original = longrope_original(c.rope_scaling)
        if not on_device and bound <= min(original, self.rope_cos.shape[0]):
            return self.rope_cos[position_ids], self.rope_sin[position_ids]
        short, long = self._inv_freq(position_ids.device), self._inv_freq(position_ids.device, "long")
        inv_freq = torch.where(position_ids.max() + 1 > original, long, short) if on_device \
            else (long if bound > original else short)
        return rope_from_positions(position_ids, c.rotary_dim, c.max_position_embeddings, c.rope_theta,
                                   c.rope_scaling, seq_len=bound, inv_freq=inv_freq)

    def _check_longrope_cache(self, kv_cache: KVCache, past: int | Tensor, total: int) -> None:
        """Refuse a generation whose keys would mix LongRoPE's factors: cached with the short ones, continued past
        ``original_max_position_embeddings`` (where transformers' ``generate`` recomputes the whole sequence with the
        long ones)."""
        if not isinstance(past, int):
            return  # a static cache's steps: refused at its prefill
        original = longrope_original(self.config.rope_scaling)
        end = max(total, kv_cache.capacity or 0)
        if (total if past == 0 else past) <= original < end:
            raise ValueError(f"DecoderLM: LongRoPE generation across original_max_position_embeddings={original} "
                             f"(keys cached up to column {total if past == 0 else past}, the generation reaching "
                             f"{end}) is not supported: transformers recomputes the whole sequence with the long "
                             "factors there; keep prompt + max_new_tokens within it, or the prompt past it")

    def _layer_ropes(self, rope: tuple[Tensor, Tensor] | None, position_ids: Tensor, *, bound: int
                     ) -> dict[str, tuple[Tensor, Tensor] | None]:
        """The rope of the layers whose rope is not ``rope``: ``nope_layers`` none, the sliding layers
        ``config.sliding_rope``'s (computed from the positions, which are HF's fp32 product)."""
        c = self.config
        out: dict[str, tuple[Tensor, Tensor] | None] = {str(i): None for i in c.nope_layers}
        if rope is None or c.sliding_rope is None or not c.sliding_layers:
            return out
        theta = float(c.sliding_rope.get("rope_theta", c.rope_theta))
        scaling = {k: v for k, v in c.sliding_rope.items() if k != "rope_theta"} or None
        sliding = rope_from_positions(position_ids, c.rotary_dim, c.max_position_embeddings, theta, scaling,
                                      seq_len=bound, inv_freq=self._inv_freq(position_ids.device, "sliding"))
        return {**{str(i): sliding for i in c.sliding_layers}, **out}

    def _window(self, total: int) -> int | None:
        """The sliding layers' window, None where it covers every key (plain causal attention)."""
        window = self.config.sliding_window if self.config.sliding_layers else None
        return None if window is None or total <= window else window

    def _layouts(self, attention_mask: Tensor | None, segment_ids: Tensor | None, x: Tensor, total: int
                 ) -> tuple[tuple[AttentionMask, bool], tuple[AttentionMask, bool]] | None:
        """``(layout, is_causal)`` of the full-attention and the sliding-window layers on the varlen path (one
        layout per forward, ``attention.varlen_layout``); None where a window would count padding inside an example
        (the mask path then)."""
        b, s = x.shape[0], x.shape[1]
        window = self._window(total)
        if window is not None and not contiguous_sequences(attention_mask, segment_ids):
            return None
        plain = attention_mask is None and segment_ids is None and not self.config.attention_sinks
        # (plain rows take SDPA is_causal; with sinks every row takes the kernel that returns its log-sum-exp)
        layout = None if plain else varlen_layout(attention_mask, segment_ids, batch=b, seq=s, device=x.device)
        full: tuple[AttentionMask, bool] = (None, True) if layout is None else (layout, False)  # plain: SDPA causal
        if window is None:
            return full, full
        layout = layout or varlen_layout(None, None, batch=b, seq=s, device=x.device)
        return full, (layout.with_window(window), False)

    @staticmethod
    def _shared_masks(masks: tuple[tuple[Tensor | None, bool], tuple[Tensor | None, bool]], x: Tensor
                      ) -> tuple[tuple[Tensor | None, bool], tuple[Tensor | None, bool]]:
        """The boolean masks as additive ones in the attention's dtype (autocast's, else the hidden states'), each
        converted once for all the layers that share it (``masks.additive_mask``)."""
        device = x.device.type
        # not on meta; no torch.amp.is_autocast_available (torch 2.11's dynamo breaks the graph on it)
        autocast = device != "meta" and torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        (full, full_causal), (sliding, sliding_causal) = masks
        full_add = additive_mask(full, dtype)
        sliding_add = full_add if sliding is full else additive_mask(sliding, dtype)
        return (full_add, full_causal), (sliding_add, sliding_causal)

    def _masks(self, attention_mask: Tensor | None, segment_ids: Tensor | None, s: int, total: int,
               device: torch.device, *, first: int | Tensor = 0
               ) -> tuple[tuple[Tensor | None, bool], tuple[Tensor | None, bool]]:
        """``(attn_mask, is_causal)`` of the full-attention layers and of the sliding-window layers; ``first``: the
        column of the first query (a tensor in a static cache's decoding steps, which pass a [B, T] mask)."""
        window = self._window(total)
        if not isinstance(first, int):
            assert attention_mask is not None and attention_mask.dim() == 2 and segment_ids is None
            full = (causal_padding_mask(attention_mask, s, offset=first), False)
            return full, full if window is None else (causal_padding_mask(attention_mask, s, window, offset=first),
                                                      False)
        if segment_ids is not None:  # packed rows: block-diagonal, padding (segment 0) sees no real token
            keep = segment_ids > 0 if attention_mask is None else attention_mask.bool() & (segment_ids > 0)
            full = (causal_padding_mask(keep, s, segment_ids=segment_ids), False)  # [B, 1, S, S]
            if window is None:
                return full, full
            return full, (causal_padding_mask(keep, s, window, segment_ids=segment_ids), False)
        if attention_mask is None:
            full: tuple[Tensor | None, bool] = (None, True)
            if window is None:
                return full, full
            return full, (causal_mask(s, total, window, device=device)[None, None], False)  # [1, 1, S, T]
        if attention_mask.dim() == 2:
            full = (causal_padding_mask(attention_mask, s), False)  # [B, 1, S, past + S]
            if window is None:
                return full, full
            return full, (causal_padding_mask(attention_mask, s, window), False)
        mask = attention_mask.bool()  # already an attend-mask broadcastable to [B, N, S, T]
        if window is None:
            return (mask, False), (mask, False)
        return (mask, False), (mask & causal_mask(s, mask.shape[-1], window, device=device), False)


def _attention_layer(config: ModelConfig, layer: int) -> nn.Module | None:
    """The kind of attention layer of block ``layer`` (None: the block's default, ``block.Attention``)."""
    if layer in config.linear_layers:
        return GatedDeltaNet(config)
    return LatentAttention(config) if config.mla is not None else None
