"""What each flat partition of DeepSpeed's ZeRO optimizer holds, declared to the task's optimizer where it asks for it
(``hold_flat_partition``: Muon, :class:`lightning_llm.optim.MuonWithAdamW`).

DeepSpeed steps the task's optimizer (its client optimizer) on flat fp32 tensors: one partition per param group and
rank at ZeRO-1/2 (the group's parameters flattened end to end, padded, cut in ``world`` equal parts), one per sub-group
and rank at ZeRO-3 (each parameter cut in ``ceil(numel / world)`` runs, a rank's runs end to end). An elementwise
optimizer needs nothing more; Muon needs to know whose elements each run is, to orthogonalise each matrix whole. This
module reads that from DeepSpeed's own bookkeeping right after ``deepspeed.initialize``:

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``round_robin_bit16_groups`` / ``round_robin_bit16_offsets`` (each parameter's
  place in the group's flat buffer, checked against the parameter's storage, a view of ``bit16_groups_flat``),
  ``partition_size`` and the rank in ``real_dp_process_group``; checked against DeepSpeed's ``params_in_partition`` and
  ``first_offset`` (which parameters, from which element, a rank's partition starts with);
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``fp16_groups`` (the sub-groups' parameters), ``grad_position`` (each
  one's place in its sub-group's partition) and ``ds_tensor.ds_numel`` (its run), the sub-group's process group and
  ``sub_group_to_group_id``;

then every rank's runs are gathered once per partition and checked to tile each parameter in rank order. Anything else
(another optimizer wrapper: bf16 at ZeRO-1; optimizer states offloaded to the host or NVMe, where the update would run
on the host and its swap files; bookkeeping of another shape) is refused in one line before the first step.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["declare_flat_partitions", "refuse_optimizer_override"]

_Run = tuple[Any, int, int, int]  # (parameter, offset of this rank's run in the flat partition, first element, count)


def _refuse(why: str) -> ValueError:
    return ValueError(f"--model.optim.name=muon under DeepSpeed: {why}; use the native preset of the same stage "
                      "(--trainer.strategy=zero1/zero2/zero3), where Muon equals one device's too")


def refuse_optimizer_override(*, named: str | None, config_section: bool, optimizer: Any, task: Any) -> None:
    """Refuse, in one line, a DeepSpeed optimizer that would replace the task's Muon (its hidden matrices would train
    with AdamW): ``--trainer.strategy.optimizer=NAME`` (``named``), or an ``optimizer`` section in the DeepSpeed config
    (``config_section``: the task's optimizer is then never built; its ``optim.name`` tells)."""
    muon = (optimizer is not None and any(g.get("muon") for g in optimizer.param_groups)) or (
        optimizer is None and getattr(getattr(task, "optim", None), "name", None) == "muon")
    if not muon:
        return
    if named is not None:
        raise ValueError(f"--trainer.strategy.optimizer={named} replaces the task's Muon optimizer (its hidden "
                         "matrices would train with AdamW); drop it to keep Muon")
    if config_section:
        raise ValueError("the DeepSpeed config's optimizer section replaces the task's Muon optimizer (its hidden "
                         "matrices would train with it); remove the section to keep Muon")


def declare_flat_partitions(ds_optimizer: Any, client: Any, group_of: dict[int, int]) -> None:
    """Tell ``client`` (the task's optimizer, declaring ``hold_flat_partition``) what each flat partition DeepSpeed's
    ``ds_optimizer`` steps it on holds (see the module doc). ``group_of``: id(parameter) -> id(its param group of
    ``client``) from before ``deepspeed.initialize``. A collective over each partition's group."""
    try:  # every rank reads its own partitions, then all stop together if one cannot
        partitions, why = _partitions(ds_optimizer, client, group_of), ""
    except ValueError as e:
        partitions, why = [], str(e)
    except AttributeError as e:  # another DeepSpeed's optimizer
        partitions, why = [], str(_refuse(f"DeepSpeed's ZeRO optimizer is not the one this strategy reads ({e})"))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, why)
    if any(every):
        raise ValueError(next(w for w in every if w))
    for flat, index, group, runs in partitions:
        counts = _every_rank_counts(runs, group)
        client.hold_flat_partition(flat, [(p, offset, c) for (p, offset, _, _), c in zip(runs, counts)], group=group,
                                   param_group=index)
    log.info("%s: told the task's optimizer what its %d flat partitions hold (%d parameters)",
             type(ds_optimizer).__name__, len(partitions), sum(len(runs) for *_, runs in partitions))


def _partitions(opt: Any, client: Any, group_of: dict[int, int]) -> list[tuple[Any, int, Any, list[_Run]]]:
    kind = type(opt).__name__
    if kind == "DeepSpeedZeroOptimizer":
        if opt.cpu_offload:
            raise _refuse("offloaded optimizer states (DeepSpeed would run the update on the host)")
        partitions = _zero12(opt)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        if opt.offload_optimizer or opt.swap_optimizer:
            raise _refuse("offloaded optimizer states (DeepSpeed would run the update on the host or its swap files)")
        partitions = _zero3(opt)
    else:
        raise _refuse(f"its {kind} optimizer wrapper (bf16 at ZeRO-1?) is not one whose flat partitions this "
                      "strategy reads")
    for flat, index, _, runs in partitions:
        params = client.param_groups[index]["params"]
        if params and (len(params) != 1 or params[0] is not flat):
            raise _refuse(f"param group {index} holds other tensors than the flat partition DeepSpeed steps it on")
        if any(group_of.get(id(p)) != id(client.param_groups[index]) for p, *_ in runs):
            raise _refuse(f"a flat partition of param group {index} holds parameters of another group")
    return partitions


def _zero12(opt: Any) -> list[tuple[Any, int, Any, list[_Run]]]:
    """Per param group: (its fp32 partition, index, process group, runs)."""
    out = []
    for i, flat in enumerate(opt.single_partition_of_fp32_groups):
        group = opt.real_dp_process_group[i]
        size, rank = int(opt.partition_size[i]), dist.get_rank(group)
        base = opt.bit16_groups_flat[i]
        lo, hi = rank * size, (rank + 1) * size
        runs: list[_Run] = []
        for p, start in zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_offsets[i], strict=True):
            if p.data_ptr() != base.data_ptr() + start * base.element_size():
                raise _refuse(f"DeepSpeed's offsets of param group {i} are not where its parameters live")
            first, last = max(lo, start), min(hi, start + p.numel())
            runs.append((p, first - lo, first - start, last - first) if last > first else (p, 0, 0, 0))
        held = [p for p, _, _, count in runs if count]
        if flat.numel() != size or {id(p) for p in held} != {id(p) for p in opt.params_in_partition[i]} or (
                held and next(f for _, _, f, c in runs if c) != opt.first_offset[i]):
            raise _refuse(f"DeepSpeed's partition of param group {i} is not the one its offsets and partition size "
                          "give (another DeepSpeed version?)")
        out.append((flat, i, group, runs))
    return out


def _zero3(opt: Any) -> list[tuple[Any, int, Any, list[_Run]]]:
    """Per sub-group: (its fp32 partition, its param group's index, process group, runs)."""
    out = []
    for s, params in enumerate(opt.fp16_groups):
        group = opt.sub_group_process_groups[s]
        rank, offset = dist.get_rank(group), 0
        runs: list[_Run] = []
        for p in params:
            part = int(p.ds_tensor.ds_numel)
            if list(opt.grad_position[opt.get_param_id(p)]) != [s, offset, part]:
                raise _refuse(f"DeepSpeed's place of a parameter in sub-group {s} is not its runs end to end "
                              "(another DeepSpeed version?)")
            first = min(part * rank, p.ds_numel)
            runs.append((p, offset, first, max(0, min(part, p.ds_numel - first))))
            offset += part
        flat = opt.fp32_partitioned_groups_flat[s]
        if flat.numel() != offset:
            raise _refuse(f"DeepSpeed's fp32 partition of sub-group {s} has {flat.numel()} elements, its parameters' "
                          f"runs {offset}")
        out.append((flat, opt.sub_group_to_group_id[s], group, runs))
    return out


def _every_rank_counts(runs: list[_Run], group: Any) -> list[tuple[int, ...]]:
    """Per run's parameter, the elements each rank of ``group`` holds, checked to tile it in rank order."""
    mine = [(tuple(getattr(p, "ds_shape", p.shape)), first, count) for p, _, first, count in runs]
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    counts = []
    for k, (shape, _, _) in enumerate(mine):
        held = [ranks[k] if k < len(ranks) else None for ranks in every]
        position = 0
        for entry in held:
            if entry is None or entry[0] != shape or (entry[2] and entry[1] != position):
                raise _refuse(f"the ranks' flat partitions do not hold a {shape} parameter in rank order")
            position += entry[2]
        if position != math.prod(shape):
            raise _refuse(f"the ranks' flat partitions hold {position} elements of a {shape} parameter")
        counts.append(tuple(entry[2] for entry in held))
    return counts
