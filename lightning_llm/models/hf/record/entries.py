"""The weight-mapping vocabulary of :mod:`lightning_llm.models.hf`: one entry per Hugging Face key (or group of keys)
and our parameters.

* :class:`Entry`: one HF key <-> one or more of our parameters (``split`` on load, ``merge`` on save: GPT-2's fused
  ``c_attn``, Baichuan's ``W_pack`` row order); :func:`row_split` for a tensor whose row blocks are our parameters
  (Phi-3's ``qkv_proj``, ``gate_up_proj``), read lazily block by block (:class:`~..source.RowsMapped`).
* :class:`Stacked`: many HF keys <-> one of our parameters: an MoE layer's experts, stored per expert on disk
  (``experts.N.gate_proj``/``up_proj``, Mixtral's ``experts.N.w1``/``w3``) and fused in memory (``gate_up_proj``
  [E, 2I, H]: expert ``e`` is the rows of its parts in order). A lazy read of some experts (an expert-parallel rank's)
  reads only their tensors (:class:`~..source.StackedMapped`).
* :class:`Fused`: one HF tensor holding every expert in another layout (gpt-oss: ``gate_up_proj`` [E, H, 2I], the
  input dim first and the gate and up columns alternating), or its MXFP4 blocks and scales; read lazily by expert
  (:class:`~..source.PermutedMapped`, :class:`~..source.Mxfp4Mapped`).

:func:`experts_entries` gives the entries of an MoE layer's feed-forward stored per expert (a family with another
layout writes its own: gpt-oss's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...config import ModelConfig
from ..source import CheckpointFiles, Mxfp4Mapped, PermutedMapped

__all__ = ["Entry", "Fused", "Stacked", "experts_entries", "head_entries", "lin", "interleave", "deinterleave",
           "row_split"]


@dataclass(frozen=True)
class Entry:
    hf: str  # HF key without the base-model prefix (``top`` entries are top-level keys)
    ours: tuple[str, ...]
    group: str = "base"  # base | lm_head | pooler | classifier
    top: bool = False  # key lives at top level of a head model (lm_head.*, classifier.*)
    split: Callable[[Tensor], Sequence[Tensor]] | None = None
    merge: Callable[[Sequence[Tensor]], Tensor] | None = None
    row_blocks: bool = False
    """``split`` cuts dim 0 into consecutive blocks, ours in order (a fused projection: Phi-3's ``qkv_proj``,
    ModernBERT's ``Wqkv``, ``Wi``): a lazy read of some of our rows reads only those rows of the stored tensor
    (:class:`~..source.RowsMapped`)."""


@dataclass(frozen=True)
class Stacked:
    """Our parameter ``ours`` [E, R, C] whose slice ``[e]`` is the dim-0 concatenation of the HF tensors
    ``hf[e]`` (each [r_j, C], ``sum_j r_j = R``)."""

    ours: str
    hf: tuple[tuple[str, ...], ...]  # per expert, its parts in row order (keys without the base-model prefix)
    group: str = "base"

    def keys(self) -> list[str]:
        return [k for parts in self.hf for k in parts]

    def save_entries(self, rows: Sequence[int]) -> list[Entry]:
        """One :class:`Entry` per HF key, picking its rows of our tensor (``rows``: each part's row count)."""
        out: list[Entry] = []
        for e, parts in enumerate(self.hf):
            start = 0
            for key, r in zip(parts, rows):
                out.append(Entry(key, (self.ours,), group=self.group,
                                 merge=lambda ts, e=e, lo=start, hi=start + r: ts[0][e, lo:hi]))
                start += r
        return out


def deinterleave(t: Tensor, dim: int) -> Tensor:
    """Alternating gate/up entries along ``dim`` (``g0, u0, g1, u1, ...``) -> the gate half then the up half."""
    pairs = t.unflatten(dim, (-1, 2))  # [..., I, 2, ...]: (gate, up) per j
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim)


def interleave(t: Tensor, dim: int) -> Tensor:
    """Inverse of :func:`deinterleave`."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


@dataclass(frozen=True)
class Fused:
    """Our parameter ``ours`` from one HF tensor ``hf`` holding every expert: ours is ``hf.permute(dims)`` (our dim
    ``d`` is the HF tensor's dim ``dims[d]``), and with ``interleaved`` our dim 1 holds the gate rows then the up rows
    where the HF tensor alternates gate and up (gpt-oss's ``gate_up_proj`` columns). An MXFP4 checkpoint (gpt-oss as
    published) stores a matrix as ``{hf}_blocks`` [E, R, C/32, 16] uint8 and ``{hf}_scales`` [E, R, C/32] uint8,
    dequantized ``[E, R, C]``: the HF tensor transposed, i.e. our layout (``dims == (0, 2, 1)``)."""

    ours: str
    hf: str
    dims: tuple[int, ...]
    interleaved: bool = False
    group: str = "base"

    def to_hf(self, t: Tensor) -> Tensor:
        """Our tensor in the HF tensor's layout."""
        if self.interleaved:
            t = interleave(t, 1)
        inverse = sorted(range(len(self.dims)), key=lambda d: self.dims[d])
        return t.permute(inverse).contiguous()

    def save_entry(self) -> Entry:
        return Entry(self.hf, (self.ours,), group=self.group, merge=lambda ts: self.to_hf(ts[0]))

    def locate(self, files: CheckpointFiles, stored: dict[str, str]
               ) -> tuple[PermutedMapped | Mxfp4Mapped, tuple[int, ...], tuple[str, ...]] | None:
        """``(reader, our shape, the HF keys it reads)`` from a checkpoint holding the tensor or its MXFP4 blocks and
        scales (``stored``: normalised key -> stored key); None where it holds neither."""
        if self.hf in stored:
            shape = files.meta(stored[self.hf]).shape
            return (PermutedMapped(stored[self.hf], self.dims, self.interleaved), tuple(shape[d] for d in self.dims),
                    (self.hf,))
        blocks, scales = f"{self.hf}_blocks", f"{self.hf}_scales"
        if self.dims != (0, 2, 1) or blocks not in stored or scales not in stored:
            return None
        b, sc = files.meta(stored[blocks]), files.meta(stored[scales])
        if b.dtype != torch.uint8 or sc.dtype != torch.uint8 or b.dim() != 4 or b.shape[-1] != 16 \
                or tuple(sc.shape) != tuple(b.shape[:3]):
            raise ValueError(f"{blocks} {tuple(b.shape)} {b.dtype} / {scales} {tuple(sc.shape)} {sc.dtype}: not MXFP4 "
                             "blocks [E, R, G, 16] and scales [E, R, G] of uint8")
        shape = (b.shape[0], b.shape[1], b.shape[2] * 32)
        return Mxfp4Mapped(stored[blocks], stored[scales], self.interleaved), shape, (blocks, scales)


def row_split(hf: str, ours: tuple[str, ...], rows: tuple[int, ...] | None = None) -> Entry:
    """One HF tensor whose dim-0 blocks of ``rows`` rows (``None``: equal blocks) are our parameters ``ours`` in
    order (a fused projection's weight or bias: Phi-3's ``qkv_proj`` = q, k, v rows; ``gate_up_proj`` = gate then up
    rows; ModernBERT's ``Wqkv``, ``Wi``)."""
    def split(t: Tensor) -> list[Tensor]:
        return [x.contiguous() for x in (t.split(list(rows), dim=0) if rows else t.chunk(len(ours), dim=0))]

    return Entry(hf, ours, split=split, merge=lambda ts: torch.cat(list(ts), dim=0), row_blocks=True)


def lin(hf: str, ours: str, bias: bool, **kw: Any) -> list[Entry]:
    out = [Entry(f"{hf}.weight", (f"{ours}.weight",), **kw)]
    if bias:
        out.append(Entry(f"{hf}.bias", (f"{ours}.bias",), **kw))
    return out


def head_entries(config: ModelConfig, head: str) -> list[Entry]:
    """A decoder's head: a sequence classifier's ``score`` (``config.num_labels > 0``: loaded from a
    ``...ForSequenceClassification``, fresh from any other class), else the LM head unless the class is a bare
    ``...Model``."""
    if config.num_labels > 0:
        return lin("score", "score", False, group="classifier", top=True)
    if head not in ("base", "cls"):  # Baichuan's NormHead stores the raw weight too (normalised in forward)
        return lin("lm_head", "lm_head", False, group="lm_head", top=True)
    return []


def experts_entries(config: ModelConfig, hf: str, ours: str, *, names: tuple[str, str, str] = (
        "gate_proj", "up_proj", "down_proj"), shared: str = "shared_expert") -> list[Entry | Stacked | Fused]:
    """The feed-forward entries of an MoE layer whose experts are stored one tensor per expert and projection
    (``hf``: the layer's HF module, ``ours``: ours): the router ``{hf}.gate``, experts ``{hf}.experts.N.{name}``
    (``names``: gate, up, down; Mixtral's ``w1``, ``w3``, ``w2``), the correction bias of an aux-free router, a
    shared expert under ``shared`` (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``) and its gate."""
    moe = config.moe
    assert moe is not None
    gate, up, down = names
    e = moe.num_experts
    gate_up = tuple((f"{hf}.experts.{i}.{gate}.weight", f"{hf}.experts.{i}.{up}.weight") for i in range(e))
    downs = tuple((f"{hf}.experts.{i}.{down}.weight",) for i in range(e))
    out: list[Entry | Stacked | Fused] = [*lin(f"{hf}.gate", f"{ours}.gate", False),
                                          Stacked(f"{ours}.experts.gate_up_proj", gate_up),
                                          Stacked(f"{ours}.experts.down_proj", downs)]
    if moe.score_bias:  # a buffer (DeepSeek-V3, GLM-4.5: the correction bias of the aux-free balancing)
        out.append(Entry(f"{hf}.gate.e_score_correction_bias", (f"{ours}.gate.e_score_correction_bias",)))
    if moe.shared_intermediate_size:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out += lin(f"{hf}.{shared}.{name}", f"{ours}.shared_expert.{name}", config.mlp_bias)
        if moe.shared_gate:
            out += lin(f"{hf}.shared_expert_gate", f"{ours}.shared_expert_gate", False)
    return out
