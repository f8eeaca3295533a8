"""``deepspeed_zero3_nvme`` checkpoints in the engine's layout-free format (:mod:`..engine.hybrid_checkpoint`), so
that they resume exactly: under ``deepspeed_zero3_nvme`` again, and at every native layout (zero3, tp, one device...).

Why not DeepSpeed's own: DeepSpeed 0.19.8 saves an NVMe run as its zero files plus a copy of the optimizer's swap
folder (``offloaded_tensors/``) and, loading it, copies that folder back; measured on 2 ranks after 4 steps
(``tests/checkpoints/test_nvme.py``, DeepSpeed's ``save_checkpoint`` then its ``load_checkpoint`` into a fresh nvme
engine), the loaded engine's parameters and fp32 masters differ from the saved ones by up to 1.2e-2, in the swapped
sub-groups and in those kept in memory alike, and it holds no Adam moments at all. Such checkpoints stay refused
(:func:`.nvme.refuse_nvme_checkpoint`).

What is written: per trainable parameter its fp32 master (``model.<name>``) and Adam's states
(``optim_0/model.<name>/exp_avg``, ``.../exp_avg_sq`` and the sub-group's ``step``); frozen parameters as they are;
plus ``meta.pt`` as every native layout writes it. **No tensor is gathered**: each rank writes the elements it holds
(DeepSpeed partitions a parameter flattened, ``ceil(n / world)`` elements a rank) as DCP chunks of the full tensor,
the N-d boxes its flat range covers (:func:`flat_range_boxes`: at most ``2 ndim - 1``), so DCP's metadata describes
the full tensors and every native layout reads whichever chunks it needs. Saving walks the optimizer's sub-groups (each
swapped in once, its partition copied, released): a rank stages its own shard, ``12 Ψ / world`` bytes for fp32 Adam
(what its swap files hold), and nothing of other ranks'. Loading reads one sub-group at a time, each rank only its own
boxes (``12 x`` its sub-group's elements at most), into its masters and states (swapped in, written, swapped out
again) and the sub-group's masters into its parameter partitions (or their swap files), as DeepSpeed's optimizer step
does. A frozen parameter is gathered alone (``GatheredParameters``), its own range kept. The ZeRO-3 optimizer's
sub-group methods used here are DeepSpeed's own internals; the resume tests hold the result to the uninterrupted run,
and ``tests/checkpoints/test_nvme.py`` measures the bytes each rank stages and reads, and its host memory's peak.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from lightning_llm.checkpoint import dcp_refusals
from lightning_llm.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from lightning_llm.strategies.engine import hybrid_checkpoint as hckpt

log = logging.getLogger(__name__)

__all__ = ["load_nvme_checkpoint", "nvme_checkpoint_state"]


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _state_keys(opt: Any) -> tuple[list[str], dict[str, tuple[str, torch.dtype]]]:
    """Adam's per-element state keys (``exp_avg``, ``exp_avg_sq``) and every key's kind for ``meta.pt``."""
    state = opt.optimizer.state[opt.fp32_partitioned_groups_flat[0]]
    kinds = {k: ("param" if v.dim() > 0 and k != "step" else "scalar", v.dtype) for k, v in state.items()
             if torch.is_tensor(v)}
    return [k for k, (kind, _) in kinds.items() if kind == "param"], kinds


def _sub_groups(opt: Any) -> list[list[tuple[Any, int, int]]]:
    """Per optimizer sub-group: ``(parameter, offset, numel)`` of each parameter in the sub-group's flat partition."""
    groups: list[list[tuple[Any, int, int]]] = [[] for _ in opt.fp16_groups]
    for group in opt.fp16_groups:
        for p in group:
            gi, offset, numel = opt.grad_position[opt.get_param_id(p)]
            groups[gi].append((p, offset, numel))
    return groups


def _swapped_in(opt: Any, gi: int) -> bool:
    if opt._swappable_optimizer_subgroup(gi):
        opt._optimizer_states_and_gradient_swap_in(gi)
        return True
    return False


def _rank_range(numel: int, part: int, rank: int) -> tuple[int, int]:
    """``(start, count)``: the elements of a parameter flattened (``numel``) that ``rank`` holds in DeepSpeed's
    partition of ``part`` elements a rank (the last ones padded)."""
    start = min(part * rank, numel)
    return start, max(0, min(part, numel - start))


def flat_range_boxes(shape: Sequence[int], start: int, count: int) -> list[tuple[list[int], list[int]]]:
    """The N-d boxes ``(offsets, sizes)`` of a row-major tensor of ``shape`` that its flat elements ``[start, start +
    count)`` cover, in order (each box's elements are a contiguous run of the range): a partial first row, the whole
    rows, a partial last row, recursively."""
    if count <= 0:
        return []
    if len(shape) <= 1:
        return [([start], [count])]
    row, end, out = math.prod(shape[1:]), start + count, []
    lo = start
    if lo % row:  # the first row, partly
        take = min(end, (lo // row + 1) * row) - lo
        out += [([lo // row, *o], [1, *z]) for o, z in flat_range_boxes(shape[1:], lo % row, take)]
        lo += take
    if (whole := (end - lo) // row) > 0:
        out.append(([lo // row, *[0] * (len(shape) - 1)], [whole, *shape[1:]]))
        lo += whole * row
    if lo < end:  # the last row, partly
        out += [([lo // row, *o], [1, *z]) for o, z in flat_range_boxes(shape[1:], 0, end - lo)]
    return out


def _sharded(mine: torch.Tensor, shape: Sequence[int], part: int, rank: int, world: int) -> Any:
    """``mine`` (this rank's elements of a tensor of ``shape`` partitioned flat, ``part`` a rank) as a
    ``ShardedTensor`` of the full tensor whose local shards are views of ``mine`` (every rank's boxes computed here:
    no collective); a 0-d tensor: itself on the rank holding it, ``None`` on the others."""
    if len(shape) == 0:
        return mine.reshape(()) if mine.numel() else None
    numel = math.prod(shape)
    local, pos = [], 0
    for offsets, sizes in flat_range_boxes(shape, *_rank_range(numel, part, rank)):
        n = math.prod(sizes)
        local.append(Shard(mine[pos:pos + n].view(sizes), ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")))
        pos += n
    every = [ShardMetadata(o, z, f"rank:{r}/cpu") for r in range(world)
             for o, z in flat_range_boxes(shape, *_rank_range(numel, part, r))]
    meta = ShardedTensorMetadata(every, torch.Size(shape), TensorProperties(dtype=mine.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def _without_none(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if v is not None}


@torch.no_grad()
def nvme_checkpoint_state(engine: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(state, optimizer_meta)`` for :func:`~..engine.hybrid_checkpoint.write_hybrid` from a DeepSpeed ZeRO-3
    engine: this rank's elements of every tensor (``ShardedTensor`` boxes), nothing gathered (see the module
    docstring). Call on every rank."""
    import deepspeed

    opt = engine.optimizer
    rank, world = _rank_world()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    keys, kinds = _state_keys(opt)
    for gi, members in enumerate(_sub_groups(opt)):
        swapped = _swapped_in(opt, gi)
        flat = opt.fp32_partitioned_groups_flat[gi]
        state = opt.optimizer.state[flat]
        for p, offset, part in members:
            name, (_, count) = names[id(p)], _rank_range(p.ds_numel, part, rank)
            model[name] = _sharded(flat.narrow(0, offset, count).clone(), p.ds_shape, part, rank, world)
            for k, (kind, _) in kinds.items():
                optim[f"{name}/{k}"] = (_sharded(state[k].narrow(0, offset, count).clone(), p.ds_shape, part, rank,
                                                 world) if kind == "param"
                                        else state[k].detach().cpu().clone())  # a step: the same on every rank
        if swapped:
            opt._release_swap_buffers(gi)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # gathered alone, this rank's range kept
            part = -(-p.ds_numel // world)
            start, count = _rank_range(p.ds_numel, part, rank)
            with deepspeed.zero.GatheredParameters([p]):
                mine = p.data.detach().reshape(-1)[start:start + count].cpu().clone()
            model[name] = _sharded(mine, p.ds_shape, part, rank, world)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    return {"model": _without_none(model), "optim_0": _without_none(optim)}, [{"param_groups": groups, "kinds": kinds}]


def _read(path: Path, wanted: dict[str, Any]) -> None:
    name = f"--ckpt_path={path}"
    with dcp_refusals():
        dcp.load(wanted, storage_reader=SafeFileSystemReader(path, name=name), planner=SafeLoadPlanner(name=name))


def _read_sub_group(path: Path, members: list[tuple[Any, int, int]], names: dict[int, str],
                    kinds: dict[str, tuple[str, torch.dtype]], rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's elements of the masters and states of one sub-group's parameters, read from the checkpoint (only
    the chunks overlapping its boxes), by name: ``model.<name>``'s as ``<name>``, ``<name>/<key>``; scalars whole."""
    wanted: dict[str, Any] = {"model": {}, "optim_0": {}}
    mine: dict[str, torch.Tensor] = {}
    for prm, _, part in members:
        name, (_, count) = names[id(prm)], _rank_range(prm.ds_numel, part, rank)
        for key, kind, dtype in ((None, "param", torch.float32), *((k, kind, d) for k, (kind, d) in kinds.items())):
            fqn = name if key is None else f"{name}/{key}"
            if kind == "scalar":
                wanted["optim_0"][fqn] = mine[fqn] = torch.zeros((), dtype=dtype)
                continue
            mine[fqn] = torch.empty(count, dtype=dtype)
            template = _sharded(mine[fqn], prm.ds_shape, part, rank, world)
            if template is not None:
                wanted["model" if key is None else "optim_0"][fqn] = template
    _read(path, wanted)
    return mine


@torch.no_grad()
def load_nvme_checkpoint(engine: Any, path: str | Path, *, optimizer: bool) -> dict[str, Any]:
    """Load a layout-free checkpoint directory (written by any layout) into a DeepSpeed ZeRO-3 engine: masters,
    Adam's states and steps (``optimizer``), then the parameters from the masters; weights only without
    ``optimizer`` (evaluation). Returns ``meta.pt``'s content (loops, schedulers, callbacks). A collective."""
    import deepspeed

    p = Path(path)
    meta = hckpt._read_meta(p)
    opt_meta = meta.pop("optimizer_meta", [])
    rank, world = _rank_world()
    names = {id(prm): n for n, prm in engine.module.named_parameters()}
    opt = engine.optimizer if optimizer else None
    if opt is not None and hasattr(opt, "fp16_groups"):
        if opt_meta:  # a Muon checkpoint's momentum buffers have no place in DeepSpeed's Adam: one line, before a read
            hckpt._check_kind(p, opt.optimizer, opt_meta[0]["param_groups"])
        kinds = opt_meta[0]["kinds"] if opt_meta else {}
        for gi, members in enumerate(_sub_groups(opt)):
            mine = _read_sub_group(p, members, names, kinds, rank, world)
            swapped = _swapped_in(opt, gi)
            flat = opt.fp32_partitioned_groups_flat[gi]
            state = opt.optimizer.state[flat]
            for k, (kind, _) in kinds.items():
                if kind == "param":  # created at the first step where no offloading initialized them
                    state.setdefault(k, torch.zeros_like(flat))
            for prm, offset, part in members:
                name = names[id(prm)]
                for key, target in ((None, flat), *((k, state[k]) for k, (kind, _) in kinds.items()
                                                      if kind == "param")):
                    got = mine[name if key is None else f"{name}/{key}"]
                    target.narrow(0, offset, part).zero_()[:got.numel()].copy_(got)  # the padding: zeros
            for k, (kind, _) in kinds.items():
                if kind == "scalar" and members:
                    saved = mine[f"{names[id(members[0][0])]}/{k}"]
                    state[k] = saved.clone() if torch.is_tensor(state.get(k, saved)) else saved.item()
            opt._reassign_or_swap_out_partitioned_parameters(gi)  # the masters into the parameters (or their files)
            if swapped:
                opt._optimizer_states_and_gradient_swap_out(gi)
        for group, saved in zip(opt.optimizer.param_groups, opt_meta[0]["param_groups"] if opt_meta else []):
            group.update(saved)
    for name, prm in engine.module.named_parameters():
        if opt is not None and prm.requires_grad:
            continue
        wanted = {"model": {name: torch.empty(prm.ds_shape, dtype=prm.dtype)} if rank == 0 else {}}  # one at a time
        _read(p, wanted)
        with deepspeed.zero.GatheredParameters([prm], modifier_rank=0):
            if rank == 0:
                prm.data.copy_(wanted["model"][name].view_as(prm.data))
    meta.pop("format", None)
    meta["state_dict"] = dict.fromkeys(names.values())  # the names, for on_load_checkpoint hooks that check them
    log.info("loaded %s into DeepSpeed ZeRO-3 (saved at layout %s)", p, meta.get("layout"))
    return meta
