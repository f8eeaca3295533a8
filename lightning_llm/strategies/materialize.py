"""Materializing a meta-device model after it was split and sharded: each rank allocates and fills only its shards.

The values come from the family's declarations (:mod:`lightning_llm.models.init`: the checkpoint a lazily loaded
model reads from, or its init plan); this module only says which elements of each global parameter a rank holds:
the local tensor of a DTensor (tensor-parallel or FSDP2 shard, 2-D included) and its global indices per dim.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from lightning_llm.models.init import full_index, materialize

log = logging.getLogger(__name__)

__all__ = ["materialize_shards", "shard_view"]


def _index_along(t: DTensor, dim: int) -> Tensor:
    """Global indices of dim ``dim`` that this rank's local tensor holds: an ``arange`` distributed with the
    placements that shard ``dim`` (others replicate), so uneven and strided (FSDP-over-TP) shards come out exactly
    as DTensor lays out the parameter. Local computation only (no source rank)."""
    n = t.shape[dim]
    placements = []
    for p in t.placements:
        if isinstance(p, _StridedShard) and p.dim == dim:  # FSDP2 over a tensor-parallel shard of the same dim
            placements.append(_StridedShard(0, split_factor=p.split_factor))
        elif isinstance(p, Shard) and p.dim == dim:
            placements.append(Shard(0))
        else:
            placements.append(Replicate())
    ids = torch.arange(n, device=t.to_local().device)
    return distribute_tensor(ids, t.device_mesh, placements, src_data_rank=None).to_local()


def shard_view(p: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(local tensor, global index per dim)`` of a parameter: a DTensor's shard, or a plain tensor whole."""
    if isinstance(p, DTensor):
        return p.to_local(), tuple(_index_along(p, d) for d in range(p.dim()))
    return p, full_index(p.shape, p.device)


def materialize_shards(module: nn.Module, device: torch.device) -> int:
    """Allocate and fill this rank's shards of every meta-device family model inside ``module``."""
    n = materialize(module, device, shard_view=shard_view)
    if n:
        log.info("materialized %d parameter tensors from the meta device (each rank allocates and fills its own "
                 "shards only)", n)
    return n
