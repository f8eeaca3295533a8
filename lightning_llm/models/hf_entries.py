"""The weight-mapping vocabulary of :mod:`.hf`: one entry per Hugging Face key (or group of keys) and our parameters.

* :class:`Entry`: one HF key <-> one or more of our parameters (``split`` on load, ``merge`` on save: GPT-2's fused
  ``c_attn``, Baichuan's ``W_pack`` row order).
* :class:`Stacked`: many HF keys <-> one of our parameters: an MoE layer's experts, stored per expert on disk
  (``experts.N.gate_proj``/``up_proj``, Mixtral's ``experts.N.w1``/``w3``) and fused in memory (``gate_up_proj``
  [E, 2I, H]: expert ``e`` is the rows of its parts in order). A lazy read of some experts (an expert-parallel rank's)
  reads only their tensors (:class:`~.hf_source.StackedMapped`).

:func:`moe_mlp_entries` gives the entries of one MoE layer's feed-forward for the HF families that have one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .config import ModelConfig

__all__ = ["Entry", "Stacked", "lin", "moe_mlp_entries", "MOE_KINDS"]

MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
"""HF model types whose feed-forward layers may be Mixture-of-Experts blocks."""


@dataclass(frozen=True)
class Entry:
    hf: str  # HF key without the base-model prefix (``top`` entries are top-level keys)
    ours: tuple[str, ...]
    group: str = "base"  # base | lm_head | pooler | classifier
    top: bool = False  # key lives at top level of a head model (lm_head.*, classifier.*)
    split: Callable[[Tensor], Sequence[Tensor]] | None = None
    merge: Callable[[Sequence[Tensor]], Tensor] | None = None


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


def lin(hf: str, ours: str, bias: bool, **kw: Any) -> list[Entry]:
    out = [Entry(f"{hf}.weight", (f"{ours}.weight",), **kw)]
    if bias:
        out.append(Entry(f"{hf}.bias", (f"{ours}.bias",), **kw))
    return out


def moe_mlp_entries(config: ModelConfig, kind: str, layer: int) -> list[Entry | Stacked]:
    """The feed-forward entries of MoE layer ``layer`` of an HF ``kind`` (Mixtral: ``block_sparse_moe`` with experts
    ``w1`` gate, ``w3`` up, ``w2`` down; Qwen2/3-MoE: ``mlp`` with ``gate_proj``/``up_proj``/``down_proj`` experts,
    Qwen2-MoE's ``shared_expert`` and ``shared_expert_gate``)."""
    moe = config.moe
    assert moe is not None
    ours = f"layers.{layer}.mlp"
    e = moe.num_experts
    if kind == "mixtral":
        hf = f"layers.{layer}.block_sparse_moe"
        gate_up = tuple((f"{hf}.experts.{i}.w1.weight", f"{hf}.experts.{i}.w3.weight") for i in range(e))
        down = tuple((f"{hf}.experts.{i}.w2.weight",) for i in range(e))
    else:
        hf = f"layers.{layer}.mlp"
        gate_up = tuple((f"{hf}.experts.{i}.gate_proj.weight", f"{hf}.experts.{i}.up_proj.weight") for i in range(e))
        down = tuple((f"{hf}.experts.{i}.down_proj.weight",) for i in range(e))
    out: list[Entry | Stacked] = [*lin(f"{hf}.gate", f"{ours}.gate", False),
                                  Stacked(f"{ours}.experts.gate_up_proj", gate_up),
                                  Stacked(f"{ours}.experts.down_proj", down)]
    if moe.shared_intermediate_size:
        for name in ("gate_proj", "up_proj", "down_proj"):
            out += lin(f"{hf}.shared_expert.{name}", f"{ours}.shared_expert.{name}", False)
        if moe.shared_gate:
            out += lin(f"{hf}.shared_expert_gate", f"{ours}.shared_expert_gate", False)
    return out
