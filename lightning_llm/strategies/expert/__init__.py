"""Expert parallelism: an MoE model's routed experts spread over the ``ep`` ranks, tokens sent to them and back.

``ep`` is borrowed from the data-parallel ranks (torchtitan's "dp2ep"): the ``dp x cp`` replicas of each
(pipeline stage, tensor-parallel rank) split into groups of ``ep`` consecutive ranks; each rank of a group holds
``E / ep`` experts of every MoE layer (``gate_up_proj`` and ``down_proj`` become DTensors ``Shard(0)`` on the ``ep``
mesh dim, so checkpoints keep the global ``[E, ...]`` tensors and reshard to any other ``ep``), and the ``dp x cp / ep``
ranks holding the same experts (the ``edp`` dim) average their gradients (ZeRO-3: FSDP2 shards them over ``edp``).
Everything else in the model (attention, routers, shared experts, dense layers) is placed as without experts.

The family declares where its experts are (``ParallelSpec.expert_modules``); :func:`apply_expert_parallel` replaces
each by :class:`ExpertParallelExperts` (same parameter names, same call), which dispatches (:mod:`.dispatch`).
"""

from __future__ import annotations

import fnmatch
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_llm.models import parallel_spec_of
from lightning_llm.strategies.expert.module import ExpertParallelExperts, shapes_only
from lightning_llm.strategies.mesh import ParallelDims

log = logging.getLogger(__name__)

__all__ = ["EXPERT_MESH_DIMS", "ExpertParallelExperts", "apply_expert_parallel", "expert_mesh", "expert_blocker",
           "shapes_only"]

EXPERT_MESH_DIMS = ("pp", "edp", "ep", "tp")
"""The mesh of expert parallelism: the replicas ``dp x cp`` (flattened, cp innermost) split into ``edp x ep``."""


def expert_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The ``(pp, edp, ep, tp)`` mesh over the same ranks as the engine's ``(pp, dp, cp, tp)`` one: row-major, so
    each ``ep`` group is ``ep`` consecutive replicas of one pipeline stage and tensor-parallel rank."""
    shape = (dims.pp, dims.replicas // dims.ep, dims.ep, dims.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


def expert_blocker(model: nn.Module, ep: int) -> str | None:
    """Why ``model`` cannot spread its experts over ``ep`` ranks (``None``: it can)."""
    found = parallel_spec_of(model)
    if found is None or found[2].expert_modules is None:
        return f"expert_parallel_size={ep}: {type(model).__name__} has no Mixture-of-Experts layers"
    moe = getattr(found[1].config, "moe", None)
    if moe is None:
        return f"expert_parallel_size={ep}: the model has no Mixture-of-Experts layers (ModelConfig.moe is None)"
    if moe.num_experts % ep:
        return (f"expert_parallel_size={ep} does not divide the model's {moe.num_experts} experts per layer (each "
                "expert-parallel rank holds the same number of whole experts)")
    return None


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Replace the family's routed experts in ``model`` (those a pipeline split kept) by
    :class:`ExpertParallelExperts` over ``mesh["ep"]``; returns their paths."""
    found = parallel_spec_of(model)
    assert found is not None and found[2].expert_modules is not None
    prefix, _, spec = found
    pattern = f"{prefix}{spec.expert_modules}"
    done = []
    for path, module in list(model.named_modules()):
        if path and _matches(path, pattern) and not isinstance(module, ExpertParallelExperts):
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, ExpertParallelExperts(module, mesh["ep"]))
            done.append(path)
    log.info("expert parallelism: %d expert modules over ep=%d", len(done), mesh["ep"].size())
    return done


def _matches(path: str, pattern: str) -> bool:
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))
