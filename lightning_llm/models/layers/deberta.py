"""DeBERTa-v2/v3's disentangled attention (He et al. 2021), as transformers' ``modeling_deberta_v2`` computes it.

Every query-key score is the sum of three terms, each divided by ``sqrt(D * (1 + len(pos_att_type)))``:

* content to content: ``q_i . k_j``;
* content to position (``c2p``): ``q_i . pk[idx(i, j)]``, ``pk`` the relative embeddings through the key projection
  (``k_proj`` with ``share_att_key``, else ``pos_key_proj``);
* position to content (``p2c``): ``k_j . pq[idx(i, j)]``, ``pq`` through the query projection.

``idx(i, j) = clamp(bucket(i - j) + span, 0, 2 span - 1)``: the relative distance of the columns, log-bucketed beyond
``position_buckets // 2`` (:func:`log_buckets`), as a row of the table of ``2 span`` relative embeddings the encoder
holds once for every layer (``EncoderModel.rel_embeddings``, layer-normed with ``rel_norm``). Padding: a query or key
that is padding is masked with the dtype's lowest value (transformers' ``masked_fill``), so a padding query spreads
its attention evenly over the row, as there.

The block (:class:`DisentangledBlock`) is BERT's post-norm block; its attention takes ``relative=``
(:class:`RelativePositions`) instead of rotary tables. No parallel code: tensor parallelism splits the heads of
``q_proj``/``k_proj``/``v_proj`` and of ``pos_key_proj``/``pos_query_proj`` (column-parallel, whole heads), the
relative embeddings stay replicated (``models/parallel_spec.py``).

Shape legend: B batch, N heads (this rank's), S sequence, D head dim, P = 2 span relative embeddings, H hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config import ModelConfig
from .configs import DisentangledConfig
from .block import TransformerBlock, activation, build_norm, init_linear

__all__ = ["DisentangledAttention", "DisentangledBlock", "RelativePositions", "TokenConvolution", "log_buckets",
           "relative_index"]


def log_buckets(rel: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """Relative distances ``rel`` (long) with those beyond ``bucket_size // 2`` mapped to log-spaced buckets up to
    ``max_position`` (transformers' ``make_log_bucket_position``: the same float ops in the same order, so the
    buckets are identical), as long."""
    mid = bucket_size // 2
    sign = torch.sign(rel)
    inside = (rel < mid) & (rel > -mid)
    magnitude = torch.where(inside, torch.full_like(rel, mid - 1), rel.abs())
    ratio = torch.log(torch.tensor((max_position - 1) / mid))  # a 0-d CPU tensor: a scalar to device ops, no copy
    logged = torch.ceil(torch.log(magnitude / mid) / ratio * (mid - 1)) + mid
    return torch.where(magnitude <= mid, rel.to(logged.dtype), logged * sign).long()


def relative_index(seq: int, config: DisentangledConfig, max_position_embeddings: int, *,
                   device: torch.device) -> Tensor:
    """``idx`` [S, S] (long): the row of the relative-embedding table that query column ``i`` reads for key column
    ``j``."""
    cols = torch.arange(seq, dtype=torch.long, device=device)
    rel = cols[:, None] - cols[None, :]  # [S, S] i - j
    if config.position_buckets > 0:
        rel = log_buckets(rel, config.position_buckets, config.max_distance(max_position_embeddings))
    span = config.span(max_position_embeddings)
    return torch.clamp(rel + span, 0, 2 * span - 1)


@dataclass(frozen=True)
class RelativePositions:
    """What every disentangled attention layer of one forward reads: the (normed) relative-embedding table and which
    row each (query, key) pair takes."""

    embeddings: Tensor
    """[P, H] the table after ``rel_norm`` (each layer applies its own dropout)."""
    index: Tensor
    """[S, S] long: :func:`relative_index`."""


class DisentangledAttention(nn.Module):
    """Self-attention with DeBERTa's relative scores (module docstring). Projections: ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj`` (biased), and without ``share_att_key`` ``pos_key_proj`` (``c2p``) and ``pos_query_proj``
    (``p2c``). Head counts come from the tensors (``view(..., -1, D)``), so a column-parallel split of whole heads
    works unchanged."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dis = config.disentangled
        assert dis is not None and config.head_dim is not None
        self.head_dim: int = config.head_dim
        self.relative: bool = dis.relative_attention
        self.c2p, self.p2c = "c2p" in dis.pos_att_type, "p2c" in dis.pos_att_type
        self.share: bool = dis.share_att_key
        self.scale: float = math.sqrt(config.head_dim * (1 + len(dis.pos_att_type)))  # divides every score
        h, inner = config.hidden_size, config.num_heads * config.head_dim
        self.q_proj = nn.Linear(h, inner)
        self.k_proj = nn.Linear(h, inner)
        self.v_proj = nn.Linear(h, inner)
        self.o_proj = nn.Linear(inner, h)
        own = self.relative and not self.share
        self.pos_key_proj: nn.Linear | None = nn.Linear(h, inner) if own and self.c2p else None
        self.pos_query_proj: nn.Linear | None = nn.Linear(h, inner) if own and self.p2c else None
        self.pos_dropout = nn.Dropout(config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def reset_parameters(self, std: float) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.pos_key_proj, self.pos_query_proj):
            if lin is not None:
                init_linear(lin, std)

    def _heads(self, x: Tensor) -> Tensor:  # [..., S, N*D] -> [..., N, S, D]
        return x.unflatten(-1, (-1, self.head_dim)).transpose(-3, -2)

    def _relative_scores(self, q: Tensor, k: Tensor, relative: RelativePositions) -> Tensor:
        """c2p + p2c [B, N, S, S], divided by the scale."""
        b, n, s, _ = q.shape
        rel = self.pos_dropout(relative.embeddings)  # [P, H]
        index = relative.index.expand(b, n, s, s)
        scores: Tensor | int = 0
        if self.c2p:
            pos_key = self.k_proj if self.pos_key_proj is None else self.pos_key_proj
            pk = self._heads(pos_key(rel))  # [N, P, D]
            scores = scores + torch.matmul(q, pk.transpose(-1, -2)).gather(-1, index) / self.scale  # q_i . pk[idx]
        if self.p2c:
            pos_query = self.q_proj if self.pos_query_proj is None else self.pos_query_proj
            pq = self._heads(pos_query(rel))  # [N, P, D]
            by_key = torch.matmul(k, pq.transpose(-1, -2))  # [B, N, S_key, P]
            scores = scores + by_key.gather(-1, index.transpose(-1, -2)).transpose(-1, -2) / self.scale
        assert isinstance(scores, Tensor)
        return scores

    def forward(
        self,
        x: Tensor,  # [B, S, H]
        *,
        attn_mask: Tensor | None = None,  # bool [B, 1, S, S]: True where both query and key are real tokens
        relative: RelativePositions | None = None,
    ) -> Tensor:  # [B, S, H]
        b, s, _ = x.shape
        q, k, v = (self._heads(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))  # [B, N, S, D]
        scores = torch.matmul(q, k.transpose(-1, -2) / self.scale)  # [B, N, S, S]
        if self.relative:
            if relative is None:
                raise ValueError("DisentangledAttention: relative_attention needs relative= (the encoder's table)")
            scores = scores + self._relative_scores(q, k, relative)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        probs = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)  # [B, S, N*D]
        return self.o_proj(out)


class TokenConvolution(nn.Module):
    """DeBERTa-v2's convolution beside the first layer (transformers' ``ConvLayer``): ``norm(out + act(drop(conv(x))))``
    with the convolution over the sequence of the layer's input ``x`` zeroed at padding, and the result zeroed at
    padding. ``conv`` [H, H / groups, k] (same length: padding ``(k - 1) // 2``), ``norm`` a LayerNorm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dis = config.disentangled
        assert dis is not None
        k, h = dis.conv_kernel_size, config.hidden_size
        self.conv = nn.Conv1d(h, h, k, padding=(k - 1) // 2, groups=dis.conv_groups)
        self.conv.param_inits = ("weight",)  # type: ignore[assignment]  # normal(std), as a linear's (models/init.py)
        self.norm = build_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.act: str = dis.conv_activation

    def forward(self, x: Tensor, out: Tensor, keep: Tensor | None) -> Tensor:  # x, out [B, S, H]; keep [B, S]
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)  # [B, S, H]
        if keep is not None:
            y = y.masked_fill(~keep.bool()[..., None], 0.0)
        y = self.dropout(y)
        y = torch.tanh(y) if self.act == "tanh" else activation(self.act, y)
        y = self.norm(out + y)
        return y if keep is None else y * keep[..., None].to(y.dtype)


class DisentangledBlock(TransformerBlock):
    """BERT's post-norm block around :class:`DisentangledAttention`: ``norm(x + attn(x))``, ``norm(x + mlp(x))``;
    the first block of a DeBERTa-v2 with ``conv_kernel_size`` adds :class:`TokenConvolution` of its input (``conv``)."""

    def __init__(self, config: ModelConfig, *, first: bool = False) -> None:
        if config.pre_norm:
            raise ValueError("DisentangledBlock (DeBERTa) is post-norm: pre_norm must be False")
        super().__init__(config, attn=DisentangledAttention(config))
        dis = config.disentangled
        assert dis is not None
        self.conv: TokenConvolution | None = TokenConvolution(config) if first and dis.conv_kernel_size else None

    def forward(self, x: Tensor, *, attn_mask: Tensor | None = None,  # type: ignore[override]
                relative: RelativePositions | None = None, keep: Tensor | None = None) -> Tensor:  # [B, S, H]
        drop = self.dropout if self.training else (lambda t: t)
        h = self.attn_norm(x + drop(self.self_attn(x, attn_mask=attn_mask, relative=relative)))
        h = self.mlp_norm(h + drop(self.mlp(h)))
        return h if self.conv is None else self.conv(x, h, keep)  # keep: [B, S] the real tokens


def relative_table(config: ModelConfig) -> tuple[nn.Embedding, nn.Module | None]:
    """The encoder's relative-embedding table [2 span, H] and its norm (``rel_norm``, or None)."""
    dis = config.disentangled
    assert dis is not None
    span = dis.span(config.max_position_embeddings)
    return nn.Embedding(2 * span, config.hidden_size), build_norm(config) if dis.rel_norm else None
