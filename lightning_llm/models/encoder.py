"""Bidirectional encoders with an optional pooler and classification head: BERT, RoBERTa, XLM-R, MegatronBERT
(learned positions), DeBERTa-v2/v3 (disentangled attention over relative positions, ``models/layers/deberta.py``) and
ModernBERT (rotary positions, alternating global and sliding-window layers, GLU feed-forward).

Module tree::

    embed_tokens       nn.Embedding [V, H]
    embed_positions    nn.Embedding [P, H] (position="learned") or None
    embed_token_types  nn.Embedding [T, H] or None (type_vocab_size == 0)
    embed_norm         norm or None (BERT/RoBERTa/DeBERTa/ModernBERT: yes; MegatronBERT: no)
    layers             nn.ModuleDict {"0": TransformerBlock | DisentangledBlock, ...}
    rel_embeddings     nn.Embedding [2 span, H] (DeBERTa's relative positions, read by every layer) or None
    rel_norm           norm or None (DeBERTa's norm_rel_ebd)
    final_norm         norm or None (MegatronBERT's ``encoder.ln``, ModernBERT's ``final_norm``)
    pooler             nn.Linear [H -> H] (then ``pooler_activation``) or None
    pooler_norm        norm or None (ModernBERT's prediction head)
    classifier         nn.Linear [H -> num_labels] or None

A pre-norm encoder with an embedding norm (ModernBERT) has no attention norm in its first block (``nn.Identity``):
the embeddings arrive normed. Attention masks: padding keys are masked (``[B, 1, 1, S]``); sliding-window layers
(``config.sliding_layers``) see the keys within ``sliding_window // 2`` columns, masked with the dtype's lowest value
(``[B, 1, S, S]``, transformers' eager mask: a query with no key in reach spreads its attention evenly, as there);
DeBERTa masks padding queries too (its own attention, ``layers/deberta.py``). Every path is SDPA or eager over a mask: no
varlen kernel (``config.attention=varlen`` is refused).

Shape legend: B batch, S sequence, H hidden, L labels, D head dim.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .init import InitPlan, WeightsSource, draw_init_seed, init_whole, materialize, plan_for_modules
from .layers.block import TransformerBlock, activation, build_norm
from .layers.deberta import DisentangledBlock, RelativePositions, relative_index, relative_table
from .layers.masks import key_padding_mask
from .layers.rope import rope_from_positions, rope_inv_freq

log = logging.getLogger(__name__)

__all__ = ["EncoderModel"]


_POOLER_ACTIVATIONS = ("tanh", "gelu", "gelu_tanh", "relu", "silu")


def _check(config: ModelConfig) -> None:
    bad = []
    if config.family != "encoder":
        bad.append(f"an encoder config, got family={config.family!r}")
    if config.position not in ("learned", "rope", "none"):
        bad.append(f"position learned, rope or none, got {config.position!r}")
    if config.disentangled is not None and (config.pre_norm or config.position == "rope"):
        bad.append("disentangled attention (DeBERTa) post-norm without rotary positions")
    if config.position == "rope" and config.rope_scaling:
        bad.append(f"plain rotary positions (no rope_scaling), got {config.rope_scaling}")
    if config.attention == "varlen":
        bad.append("attention auto or sdpa (encoders attend over a mask; no varlen kernel is built for them)")
    if config.pooling not in ("cls", "mean") or config.pooler_activation not in _POOLER_ACTIVATIONS:
        bad.append(f"pooling cls or mean and a pooler activation of {_POOLER_ACTIVATIONS}, got {config.pooling!r}, "
                   f"{config.pooler_activation!r}")
    if config.moe is not None or config.mla is not None or config.qkv_packed:
        bad.append("no moe, mla or qkv_packed (decoder options)")
    if bad:
        raise ValueError(f"EncoderModel needs {'; '.join(bad)}")


class EncoderModel(nn.Module):
    """Encoder. ``forward`` returns logits [B, L] with a classifier, else the last hidden state [B, S, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        _check(config)
        self.config = config
        device = torch.empty(0).device  # where the caller builds: "meta" under `with torch.device("meta")`
        self.init_seed: int = draw_init_seed()
        """The init's seed (:mod:`.init`): every initial value is a function of it and the parameter's name."""
        self.weights_source: WeightsSource | None = None
        """Where :func:`~.init.materialize` reads weights from (a lazily loaded HF checkpoint), else None."""
        h = config.hidden_size
        dis = config.disentangled
        with torch.device("meta"):  # built empty: the init below writes every value once
            self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, h)
            self.embed_positions: nn.Embedding | None = (
                nn.Embedding(config.max_position_embeddings, h) if config.position == "learned" else None
            )
            self.embed_token_types: nn.Embedding | None = (
                nn.Embedding(config.type_vocab_size, h) if config.type_vocab_size > 0 else None
            )
            self.embed_norm: nn.Module | None = build_norm(config) if config.embedding_norm else None
            self.dropout = nn.Dropout(config.dropout)
            self.layers = nn.ModuleDict({str(i): DisentangledBlock(config, first=i == 0) if dis is not None
                                         else TransformerBlock(config) for i in range(config.num_layers)})
            if config.pre_norm and config.embedding_norm and config.num_layers:
                self.layers["0"].attn_norm = nn.Identity()  # ModernBERT: the embeddings arrive normed
            self.rel_embeddings: nn.Embedding | None = None
            self.rel_norm: nn.Module | None = None
            if dis is not None and dis.relative_attention:
                self.rel_embeddings, self.rel_norm = relative_table(config)
            self.final_norm: nn.Module | None = build_norm(config) if config.final_norm else None
            self.pooler: nn.Linear | None = nn.Linear(h, h, bias=config.pooler_bias) if config.pooler else None
            self.pooler_norm: nn.Module | None = build_norm(config) if config.pooler and config.pooler_norm else None
            cls_p = config.dropout if config.classifier_dropout is None else config.classifier_dropout
            self.pooler_dropout = nn.Dropout(cls_p if config.pooler_dropout is None else config.pooler_dropout)
            self.classifier_dropout = nn.Dropout(cls_p)
            self.classifier: nn.Linear | None = nn.Linear(h, config.num_labels) if config.num_labels > 0 else None
        self.init_plan: InitPlan = plan_for_modules(self, std=config.initializer_range)
        """What each parameter starts as (read by :func:`~.init.materialize`, also for shards)."""
        if device.type != "meta":
            materialize(self, device)

    # ------------------------------------------------------------------ init

    def init_buffers(self) -> None:
        """No buffers (rotary frequencies are computed per device, :meth:`_rope`)."""

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from :attr:`init_plan` (normal(std=initializer_range), zero biases, unit
        norms): a function of :attr:`init_seed` and the parameter names only (see :mod:`.init`)."""
        init_whole(self)

    def reset_parameters(self) -> None:
        """Alias of :meth:`init_weights`."""
        self.init_weights()

    # ------------------------------------------------------------------ positions and masks

    def default_position_ids(self, input_ids: Tensor) -> Tensor:
        """Positions [B, S]: arange(S), or RoBERTa-style (count of non-pad tokens + pad id) when position_offset>0."""
        b, s = input_ids.shape[0], input_ids.shape[1]
        off = self.config.position_offset
        if off > 0 and input_ids.dtype in (torch.int32, torch.int64):
            nonpad = input_ids.ne(self.config.pad_token_id).long()  # [B, S]
            return torch.cumsum(nonpad, dim=1) * nonpad + (off - 1)
        return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s) + off

    def _inv_freq(self, theta: float, device: torch.device) -> Tensor:
        """Rotary frequencies [D/2] (fp32) for ``theta`` on ``device``, copied there once (not a buffer: a model cast
        to bf16 keeps them fp32, and nothing is saved)."""
        cache: dict[tuple[float, torch.device], Tensor] = self.__dict__.setdefault("_inv_freqs", {})
        if (theta, device) not in cache:
            assert self.config.head_dim is not None
            cache[(theta, device)] = rope_inv_freq(self.config.head_dim, theta).to(device)
        return cache[(theta, device)]

    def _rope(self, position_ids: Tensor, theta: float) -> tuple[Tensor, Tensor]:  # cos, sin [B, S, D] fp32
        c = self.config
        assert c.head_dim is not None
        return rope_from_positions(position_ids, c.head_dim, c.max_position_embeddings, theta, None,
                                   seq_len=position_ids.shape[-1], inv_freq=self._inv_freq(theta, position_ids.device))

    def _window_mask(self, keep: Tensor | None, s: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """Sliding layers' mask [B|1, 1, S, S]: the keys within ``sliding_window // 2`` columns that are real tokens;
        additive with the dtype's lowest value where padding is masked (transformers' eager mask), else boolean."""
        assert self.config.sliding_window is not None
        cols = torch.arange(s, device=device)
        allowed = ((cols[:, None] - cols[None, :]).abs() <= self.config.sliding_window // 2)[None, None]  # [1,1,S,S]
        if keep is None:
            return allowed
        allowed = allowed & keep[:, None, None, :]
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def _layer_inputs(self, x: Tensor, attention_mask: Tensor | None,
                      position_ids: Tensor | None) -> list[dict[str, Any]]:
        """Each layer's keyword inputs (mask, rotary tables or DeBERTa's relative positions), built once per
        forward and shared by the layers that take the same."""
        c = self.config
        b, s = x.shape[0], x.shape[1]
        keep = attention_mask.bool() if attention_mask is not None else None
        if c.disentangled is not None:
            kw: dict[str, Any] = {"attn_mask": None if keep is None else keep[:, None, :, None] & keep[:, None, None, :]}
            if self.rel_embeddings is not None:
                table = self.rel_embeddings.weight
                table = self.rel_norm(table) if self.rel_norm is not None else table
                kw["relative"] = RelativePositions(table, relative_index(s, c.disentangled, c.max_position_embeddings,
                                                                         device=x.device))
            first = {**kw, "keep": attention_mask} if c.disentangled.conv_kernel_size else kw  # the convolution's
            return [first if key == "0" else kw for key in self.layers]
        full: dict[str, Any] = {"attn_mask": key_padding_mask(attention_mask) if attention_mask is not None else None}
        sliding = set(c.sliding_layers)
        local = dict(full)
        if sliding:
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            local["attn_mask"] = self._window_mask(keep, s, x.device, dtype)
        if c.position == "rope":
            if position_ids is None:
                position_ids = torch.arange(s, device=x.device).unsqueeze(0).expand(b, s)
            full["rope"] = self._rope(position_ids, c.rope_theta)
            theta = float((c.sliding_rope or {}).get("rope_theta", c.rope_theta))  # plain RoPE (checked: config)
            if sliding:
                local["rope"] = full["rope"] if theta == c.rope_theta else self._rope(position_ids, theta)
        return [local if int(key) in sliding else full for key in self.layers]

    # ------------------------------------------------------------------ forward

    def _embed(self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None,
               position_ids: Tensor | None) -> Tensor:  # [B, S, H]
        assert self.embed_tokens is not None
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids)  # [B, S, H]
        # transformers' padding_idx: the padding token's row gets no gradient (an nn.Embedding padding_idx would be a
        # local row of each vocabulary shard under tensor parallelism, so the rows are cut here instead)
        x = torch.where(input_ids.eq(self.config.pad_token_id)[..., None], x.detach(), x)
        types = None
        if self.embed_token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(b, s, dtype=torch.long, device=input_ids.device)
            types = self.embed_token_types(token_type_ids)
        positions = None
        if self.embed_positions is not None:
            if position_ids is None:
                position_ids = self.default_position_ids(input_ids)
            positions = self.embed_positions(position_ids)
            if self.config.position_offset > 0:  # RoBERTa's position table has padding_idx too: padding's id is it
                positions = torch.where(position_ids.eq(self.config.pad_token_id)[..., None], positions.detach(),
                                        positions)
        # transformers' order of the sums: BERT words + types + positions, DeBERTa words + positions + types
        for part in ((positions, types) if self.config.disentangled is not None else (types, positions)):
            if part is not None:
                x = x + part
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.config.disentangled is not None and attention_mask is not None:
            x = x * attention_mask[..., None].to(x.dtype)  # DeBERTa zeroes the padding rows
        return self.dropout(x)

    def _pool(self, x: Tensor, attention_mask: Tensor | None) -> Tensor | None:  # hidden [B, S, H] -> [B, H]
        if self.pooler is None:
            return None
        if self.config.pooling == "mean" and attention_mask is not None:
            m = attention_mask[..., None].to(x.dtype)
            feats = (x * m).sum(dim=1) / m.sum(dim=1)
        elif self.config.pooling == "mean":
            feats = x.mean(dim=1)
        else:
            feats = x[:, 0]
        pooled = self.pooler(self.pooler_dropout(feats))
        act = self.config.pooler_activation
        pooled = torch.tanh(pooled) if act == "tanh" else activation(act, pooled)
        return self.pooler_norm(pooled) if self.pooler_norm is not None else pooled

    def encode(
        self,
        input_ids: Tensor,  # [B, S] ids, or hidden [B, S, H] when embed_tokens is None (pipeline stage)
        *,
        attention_mask: Tensor | None = None,  # [B, S], 1 = token, 0 = padding
        token_type_ids: Tensor | None = None,  # [B, S]; default zeros
        position_ids: Tensor | None = None,  # [B, S]; default see default_position_ids
    ) -> tuple[Tensor, Tensor | None]:  # hidden [B, S, H], pooled [B, H] or None
        if self.embed_tokens is None:
            x = input_ids  # hidden state from the previous pipeline stage
        else:
            x = self._embed(input_ids, attention_mask, token_type_ids, position_ids)
        for layer, kw in zip(self.layers.values(), self._layer_inputs(x, attention_mask, position_ids)):
            x = layer(x, **kw)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x, self._pool(x, attention_mask)

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:  # logits [B, L] with a classifier, else hidden [B, S, H]
        hidden, pooled = self.encode(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids
        )
        if self.classifier is None:
            return hidden
        feats = pooled if pooled is not None else hidden[:, 0]  # [B, H]
        return self.classifier(self.classifier_dropout(feats))  # [B, L]
