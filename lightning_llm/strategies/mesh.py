"""Parallel degrees and the named device mesh built from them — the one place that validates the layout.

No module-level state: a strategy owns one :class:`ParallelDims` and passes the mesh it builds to whatever
needs it (Megatron's global ``parallel_state`` is what this replaces).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

log = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "cp", "tp")
"""Mesh dimension order, outermost first: tensor-parallel ranks are adjacent (fastest links), context-parallel ranks
next to them (inside a node with tp: every attention layer all-gathers keys/values over cp), then data parallel,
pipeline outermost."""

REPLICA_DIM = "dp_cp"
"""The flattened ``dp x cp`` mesh dim (only built when ``cp > 1``): the ranks holding the same parameters. Gradients
are averaged, ZeRO partitions and FSDP2 shards over it; the data sampler is keyed by ``dp`` alone."""


@dataclass
class ParallelDims:
    """Data-, context-, tensor- and pipeline-parallel degrees. One of them may be ``-1`` (inferred from the world
    size)."""

    dp: int = -1
    """Data-parallel degree (replicas, or ZeRO/FSDP shards)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of pipeline ranks)."""
    cp: int = 1
    """Context-parallel degree: ranks sharing each sequence (every rank holds ``1/cp`` of its tokens)."""
    ep: int = 1
    """Expert-parallel degree: ranks among the ``dp x cp`` replicas that share an MoE layer's experts (not a factor
    of the world size: borrowed from the replicas, so it must divide ``dp x cp``)."""

    def resolved(self, world_size: int) -> ParallelDims:
        """Degrees with ``-1`` filled in; raises ``ValueError`` naming the degrees when they cannot fit."""
        degrees = {"data_parallel_size": self.dp, "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                   "context_parallel_size": self.cp}
        for name, d in {**degrees, "expert_parallel_size": self.ep}.items():
            if d == 0 or d < -1:
                raise ValueError(f"{name}={d}: must be a positive integer or -1 (inferred)")
        unknown = [n for n, d in degrees.items() if d == -1]
        if len(unknown) > 1:
            raise ValueError(f"only one parallel degree may be -1, got {', '.join(unknown)}")
        known = math.prod(d for d in degrees.values() if d != -1)
        if unknown:
            if world_size % known:
                others = ", ".join(f"{n}={d}" for n, d in degrees.items() if n != unknown[0])
                raise ValueError(
                    f"cannot infer {unknown[0]}: the other degrees ({others}) multiply to {known}, "
                    f"which does not divide the world size {world_size} (devices x nodes)"
                )
            degrees[unknown[0]] = world_size // known
        elif known != world_size:
            desc = " x ".join(f"{n}={d}" for n, d in degrees.items())
            raise ValueError(f"parallel degrees {desc} multiply to {known}, but the world size is {world_size} "
                             "(devices x nodes); their product must equal it")
        out = ParallelDims(dp=degrees["data_parallel_size"], tp=degrees["tensor_parallel_size"],
                           pp=degrees["pipeline_parallel_size"], cp=degrees["context_parallel_size"], ep=self.ep)
        if self.ep == -1:
            out.ep = out.replicas
        if out.ep < 1 or out.replicas % out.ep:
            raise ValueError(f"expert_parallel_size={self.ep} must divide the {out.replicas} data x context parallel "
                             f"ranks (data_parallel_size={out.dp} x context_parallel_size={out.cp}): experts are spread "
                             "over ranks borrowed from the replicas")
        return out

    @property
    def world_size(self) -> int:
        assert -1 not in (self.dp, self.tp, self.pp, self.cp), "call resolved() first"
        return self.dp * self.cp * self.tp * self.pp

    def routing_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The 1-D mesh of the ranks whose tokens and layers make one global batch (``pp x dp x cp`` of this rank's
        tensor-parallel index), over which an MoE model's router statistics are summed; ``None`` for one rank."""
        if self.pp * self.dp * self.cp == 1:
            return None
        return mesh["pp", "dp", "cp"]._flatten("pp_dp_cp")

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters and different tokens: ``dp x cp`` (what gradients are averaged over)."""
        return self.dp * self.cp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """A 4-D mesh named ``("pp", "dp", "cp", "tp")``; size-1 dims are kept so callers can always index by name."""
        shape = (self.pp, self.dp, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        log.debug("device mesh pp=%d dp=%d cp=%d tp=%d on %s", *shape, device_type)  # the run summary states it
        return mesh


EXPERT_REPLICA_DIM = "edp"
"""The ranks holding the same experts under expert parallelism (``dp x cp / ep``): expert gradients are averaged,
and FSDP2 shards the experts, over it."""


def over_replicas(mesh: DeviceMesh) -> bool:
    """Whether a DTensor on ``mesh`` is sharded over the replicas (an FSDP2 parameter: its mesh holds ``dp``, the
    flattened ``dp x cp``, or, for experts, ``edp``)."""
    return bool({"dp", REPLICA_DIM, EXPERT_REPLICA_DIM} & set(mesh.mesh_dim_names or ()))


def over_experts(mesh: DeviceMesh) -> bool:
    """Whether a DTensor on ``mesh`` is an expert-parallel shard (its mesh holds ``ep``)."""
    return "ep" in set(mesh.mesh_dim_names or ())


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of the ranks holding the same parameters: ``dp``, or ``dp x cp`` flattened when ``cp > 1``
    (torch's ``_flatten``, as torchtitan names its ``dp_shard_cp``; build it once and keep it)."""
    return mesh["dp", "cp"]._flatten(REPLICA_DIM) if mesh.size(MESH_DIMS.index("cp")) > 1 else mesh["dp"]


def model_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of one replica's model ranks (``pp x tp``, flattened when both are > 1): they hold the same
    batch. Build it once and keep it."""
    pp, tp = (mesh.size(MESH_DIMS.index(d)) for d in ("pp", "tp"))
    if pp > 1 and tp > 1:
        return mesh["pp", "tp"]._flatten("pp_tp")
    return mesh["pp"] if pp > 1 else mesh["tp"]


def mesh_coordinate(mesh: DeviceMesh, dim: str) -> tuple[int, int]:
    """``(rank within dim, size of dim)`` for this process."""
    return mesh.get_local_rank(dim), mesh.size(mesh.mesh_dim_names.index(dim))


def device_type_of(root_device: torch.device) -> str:
    return "cuda" if root_device.type == "cuda" else "cpu"
