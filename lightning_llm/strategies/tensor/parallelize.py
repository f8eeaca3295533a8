"""Layout-independent pieces of the 3-D strategy: applying a tensor-parallel plan, reducing gradients that DTensor
leaves ``Partial``, and the global gradient norm over every shard, stage and replica.

Each function takes the meshes/groups it needs explicitly (no global parallel state), so the single-dimension
strategies can share them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_llm.contract import task_accepts_sharded_logits, user_task
from lightning_llm.models import family_roots
from lightning_llm.models.tp_plans import TPPlan
from lightning_llm.strategies.mesh import over_replicas
from lightning_llm.strategies.tensor.plans import tp_plan, validate_tp_for

log = logging.getLogger(__name__)

__all__ = ["apply_tensor_parallel", "clip_grads_by_global_norm", "global_grad_norm", "reduce_partial_grads",
           "sharded_logits_for"]


def local_loss(out: Any) -> Any:
    """A replicated DTensor loss (from ``loss_parallel``) -- bare or under ``"loss"`` in a step output -- as a plain
    tensor, keeping the autograd graph, so Lightning's logging and backward see ordinary tensors."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    if isinstance(out, dict) and isinstance(out.get("loss"), DTensor):
        return {**out, "loss": out["loss"].full_tensor()}
    return out


def sharded_logits_for(task: Any, *, requested: bool, tp: int) -> bool:
    """Whether the LM head keeps vocab-sharded logits for ``task``: asked for (``loss_parallel``), tensor parallel,
    and the task's loss declares it handles DTensor shards (:func:`~lightning_llm.contract.accepts_sharded_logits`).
    Otherwise the task's code receives full plain logits (one all-gather per step), logged once."""
    if not requested or tp == 1:
        return False
    if task_accepts_sharded_logits(task):
        return True
    if not user_task(task):  # the library's own unmarked losses (classification heads) need no word
        return False
    log.info("%s's loss is not marked @accepts_sharded_logits: the model's outputs reach it as full plain tensors "
             "(vocab-parallel logits are all-gathered over tp=%d every step)", type(task).__name__, tp)
    return False


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    seen: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.append((name, seen[id(p)]))
        else:
            seen[id(p)] = name
    return out


def _set_param(model: nn.Module, name: str, p: nn.Parameter) -> None:
    mod_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(mod_name), attr, p)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = True,
    plan: TPPlan | None = None,
) -> nn.Module:
    """Shard ``model`` in place with ``parallelize_module`` following ``plan`` (default: our families' plan, which
    tolerates modules removed by a pipeline split). Tied weights are re-tied to the sharded parameter. With the
    default plan a second family model inside ``model`` (PPO's separate critic trunk) gets its own family's plan,
    without sequence parallelism or sharded logits (its output feeds a replicated value head)."""
    validate_tp_for(model, tp_mesh.size())
    if tp_mesh.size() == 1:
        return model
    if plan is None:
        for _, other, _ in family_roots(model)[1:]:
            apply_tensor_parallel(other, tp_mesh, sequence_parallel=False, loss_parallel=False)
    plan = plan if plan is not None else tp_plan(model, sequence_parallel=sequence_parallel,
                                                 loss_parallel=loss_parallel)
    _refuse_wrapped_copies(model, plan)
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    tied = _tied(model)
    parallelize_module(model, tp_mesh, plan)
    for name, p in model.named_parameters():  # SequenceParallel re-creates params as trainable
        if name in trainable:
            p.requires_grad_(trainable[name])
    for dst, src in tied:
        mod_name, _, attr = src.rpartition(".")
        _set_param(model, dst, getattr(model.get_submodule(mod_name), attr))
    log.info("tensor-parallel plan applied: %d entries over tp=%d", len(plan), tp_mesh.size())
    return model


def _refuse_wrapped_copies(model: nn.Module, plan: TPPlan) -> None:
    """A planned module that peft replaced by a ``modules_to_save`` wrapper (a trained full copy beside the frozen
    original) has no column/row split: refuse by name before torch's ``NotImplementedError`` mid-set-up."""
    import fnmatch

    for path, module in model.named_modules():
        if isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict) and any(
                fnmatch.fnmatchcase(path, key) for key in plan):
            raise ValueError(f"tensor parallelism: {path} is trained in full through peft's modules_to_save, whose "
                             "wrapped copy cannot be split column/row-wise; train it with a layout that keeps whole "
                             "modules (ddp, zero1/2/3, deepspeed_*, pp) or leave it out of modules_to_save")


@torch.no_grad()
def reduce_partial_grads(params: Iterable[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements: reduce ``Partial`` gradients of replicated parameters
    (sequence-parallel norms, LoRA factors next to sharded layers), and take the local shard of a gradient that
    came out replicated for a sharded parameter (a vocab-parallel embedding's, under pipeline x tensor parallel)."""
    for p in params:
        g = p.grad
        if (isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements
                and g.device_mesh == p.device_mesh):
            p.grad = g.redistribute(placements=p.placements)


def _copies(g: Tensor, *, world: int, pp: int, dp: int, grads_sharded_over_dp: bool) -> int:
    """How many ranks of one pipeline stage hold this exact local gradient (so its squared norm is counted once).

    A DTensor on mesh ``M`` is replicated over the world dims outside ``M`` (except ``pp``: stages hold different
    parameters) and over the dims of ``M`` where it is ``Replicate``. Plain tensors are replicated over ``dp x tp``,
    or only ``tp`` when ZeRO-2 keeps each gradient on its owner alone."""
    if isinstance(g, DTensor):
        mesh = g.device_mesh
        n = world // (mesh.size() * pp)
        for i, pl in enumerate(g.placements):
            if pl.is_replicate():
                n *= mesh.size(i)
        if grads_sharded_over_dp and not over_replicas(mesh):
            n //= dp
        return max(n, 1)
    n = world // pp
    return max(n // dp if grads_sharded_over_dp else n, 1)


def _local_grads(params: Iterable[nn.Parameter], skip: Iterable[nn.Parameter], **copies_kwargs: Any
                 ) -> dict[tuple[torch.device, torch.dtype, int], list[Tensor]]:
    """This rank's gradients (DTensor shards as local tensors), grouped by device, dtype and how many ranks hold the
    same local gradient (:func:`_copies`): each group is one foreach call."""
    skip_ids = {id(p) for p in skip}
    groups: dict[tuple[torch.device, torch.dtype, int], list[Tensor]] = {}
    for p in params:
        if p.grad is None or id(p) in skip_ids:
            continue
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        if local.numel():
            groups.setdefault((local.device, local.dtype, _copies(g, **copies_kwargs)), []).append(local)
    return groups


def global_grad_norm(
    params: Iterable[nn.Parameter],
    *,
    pp: int = 1,
    dp: int = 1,
    grads_sharded_over_dp: bool = False,
    skip: Iterable[nn.Parameter] = (),
    device: torch.device | None = None,
) -> Tensor:
    """The L2 norm of the full gradient of the whole model, across every TP shard, pipeline stage and ZeRO shard
    (a collective over the default group; every rank gets the same value), as an fp64 0-d tensor on ``device``: no
    host read. ``skip``: local copies that are not separate parameters (a tied LM head on the last pipeline stage).

    A constant number of kernels whatever the number of parameters: one ``torch._foreach_norm`` per device, dtype and
    replication count, each tensor's norm accumulated in fp64 (a gradient whose fp32 norm would overflow, |g| ~ 1e19,
    gives a finite norm), the squares summed in fp64."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = _local_grads(params, skip, world=world, pp=pp, dp=dp, grads_sharded_over_dp=grads_sharded_over_dp)
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, n), grads in groups.items():  # the sum over every rank of the squared local norms / their copies
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        sq += torch.stack(norms).square().sum().to(sq.device) / n
    if world > 1:
        dist.all_reduce(sq)
    return sq.sqrt()


@torch.no_grad()
def clip_grads_by_global_norm(params: list[nn.Parameter], max_norm: float, **norm_kwargs: Any) -> Tensor:
    """Scale every local gradient by ``min(1, max_norm / global norm)`` (one ``torch._foreach_mul_`` per device and
    dtype, the factor a device tensor, as ``torch.nn.utils.clip_grad_norm_`` does: nothing is read on the host);
    returns the norm (fp64 0-d tensor)."""
    params = list(params)
    total = global_grad_norm(params, **norm_kwargs)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in {id(p): p for p in params}.values():  # a parameter listed twice is scaled once
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in by_kind.items():
        torch._foreach_mul_(grads, scale.to(device=device, dtype=torch.float32))
    return total
