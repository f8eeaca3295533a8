"""Bidirectional encoder (BERT / RoBERTa / MegatronBERT family) with an optional pooler and classification head.

Module tree::

    embed_tokens       nn.Embedding [V, H]
    embed_positions    nn.Embedding [P, H] (learned absolute positions)
    embed_token_types  nn.Embedding [T, H] or None (type_vocab_size == 0)
    embed_norm         norm or None (BERT/RoBERTa: yes; MegatronBERT: no)
    layers             nn.ModuleDict {"0": TransformerBlock, ...}
    final_norm         norm or None (MegatronBERT's ``encoder.ln``)
    pooler             nn.Linear [H -> H] (tanh applied in forward) or None
    classifier         nn.Linear [H -> num_labels] or None

Shape legend: B batch, S sequence, H hidden, L labels.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .init import InitPlan, WeightsSource, draw_init_seed, init_whole, materialize, plan_for_modules
from .layers import TransformerBlock, build_norm, key_padding_mask

log = logging.getLogger(__name__)

__all__ = ["EncoderModel"]


class EncoderModel(nn.Module):
    """Encoder. ``forward`` returns logits [B, L] with a classifier, else the last hidden state [B, S, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.family != "encoder":
            raise ValueError(f"EncoderModel needs an encoder config, got family={config.family!r}")
        if config.position != "learned":
            raise ValueError(f"EncoderModel supports learned positions only, got position={config.position!r}")
        self.config = config
        device = torch.empty(0).device  # where the caller builds: "meta" under `with torch.device("meta")`
        self.init_seed: int = draw_init_seed()
        """The init's seed (:mod:`.init`): every initial value is a function of it and the parameter's name."""
        self.weights_source: WeightsSource | None = None
        """Where :func:`~.init.materialize` reads weights from (a lazily loaded HF checkpoint), else None."""
        h = config.hidden_size
        with torch.device("meta"):  # built empty: the init below writes every value once
            self.embed_tokens: nn.Embedding | None = nn.Embedding(config.vocab_size, h)
            self.embed_positions: nn.Embedding | None = nn.Embedding(config.max_position_embeddings, h)
            self.embed_token_types: nn.Embedding | None = (
                nn.Embedding(config.type_vocab_size, h) if config.type_vocab_size > 0 else None
            )
            self.embed_norm: nn.Module | None = build_norm(config) if config.embedding_norm else None
            self.dropout = nn.Dropout(config.dropout)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.num_layers)})
            self.final_norm: nn.Module | None = build_norm(config) if config.final_norm else None
            self.pooler: nn.Linear | None = nn.Linear(h, h) if config.pooler else None
            cls_p = config.dropout if config.classifier_dropout is None else config.classifier_dropout
            self.classifier_dropout = nn.Dropout(cls_p)
            self.classifier: nn.Linear | None = nn.Linear(h, config.num_labels) if config.num_labels > 0 else None
        self.init_plan: InitPlan = plan_for_modules(self, std=config.initializer_range)
        """What each parameter starts as (read by :func:`~.init.materialize`, also for shards)."""
        if device.type != "meta":
            materialize(self, device)

    # ------------------------------------------------------------------ init

    def init_buffers(self) -> None:
        """No buffers today (kept for symmetry with :class:`DecoderLM`)."""

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from :attr:`init_plan` (normal(std=initializer_range), zero biases, unit
        norms): a function of :attr:`init_seed` and the parameter names only (see :mod:`.init`)."""
        init_whole(self)

    def reset_parameters(self) -> None:
        """Alias of :meth:`init_weights`."""
        self.init_weights()

    # ------------------------------------------------------------------ forward

    def default_position_ids(self, input_ids: Tensor) -> Tensor:
        """Positions [B, S]: arange(S), or RoBERTa-style (count of non-pad tokens + pad id) when position_offset>0."""
        b, s = input_ids.shape[0], input_ids.shape[1]
        off = self.config.position_offset
        if off > 0 and input_ids.dtype in (torch.int32, torch.int64):
            nonpad = input_ids.ne(self.config.pad_token_id).long()  # [B, S]
            return torch.cumsum(nonpad, dim=1) * nonpad + (off - 1)
        return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s) + off

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
            b, s = input_ids.shape
            x = self.embed_tokens(input_ids)  # [B, S, H]
            if self.embed_token_types is not None:  # HF order: words + types + positions
                if token_type_ids is None:
                    token_type_ids = torch.zeros(b, s, dtype=torch.long, device=input_ids.device)
                x = x + self.embed_token_types(token_type_ids)
            if self.embed_positions is not None:
                if position_ids is None:
                    position_ids = self.default_position_ids(input_ids)
                x = x + self.embed_positions(position_ids)
            if self.embed_norm is not None:
                x = self.embed_norm(x)
            x = self.dropout(x)

        mask = key_padding_mask(attention_mask) if attention_mask is not None else None  # [B, 1, 1, S]
        for layer in self.layers.values():
            x = layer(x, attn_mask=mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        pooled = torch.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None  # [B, H]
        return x, pooled

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
