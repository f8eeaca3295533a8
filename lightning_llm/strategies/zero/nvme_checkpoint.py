"""``deepspeed_zero3_nvme`` checkpoints in the engine's layout-free format (:mod:`..engine.hybrid_checkpoint`), so
that they resume exactly: under ``deepspeed_zero3_nvme`` again, and at every native layout (zero3, tp, one device...).

Why not DeepSpeed's own: DeepSpeed 0.19.8 saves an NVMe run as its zero files plus a copy of the optimizer's swap
folder (``offloaded_tensors/``) and, loading it, copies that folder back; measured on 2 ranks after 4 steps
(``tests/checkpoints/test_nvme.py``, DeepSpeed's ``save_checkpoint`` then its ``load_checkpoint`` into a fresh nvme
engine), the loaded engine's parameters and fp32 masters differ from the saved ones by up to 1.2e-2, in the swapped
sub-groups and in those kept in memory alike, and it holds no Adam moments at all. Such checkpoints stay refused
(:func:`.nvme.refuse_nvme_checkpoint`).

What is written: per trainable parameter its fp32 master (``model.<name>``) and Adam's states
(``optim_0/model.<name>/exp_avg``, ``.../exp_avg_sq`` and the sub-group's ``step``), full tensors, gathered over the
ranks one optimizer sub-group at a time (the sub-group swapped in once, read, released), each parameter's tensors
kept and written by one rank (parameter ``i`` by rank ``i % world``); frozen parameters gathered as they are; plus
``meta.pt`` as every native layout writes it. A rank stages its share of the full tensors in host memory (about
``12 Ψ / world`` bytes for fp32 Adam: what its swap files hold). Loading reads one sub-group's tensors at a time
(every rank the whole sub-group: ``12 x sub_group_size`` bytes at most), copies each rank's slice into its masters
and states (swapped in, written, swapped out again) and the sub-group's masters into its parameter partitions (or their
swap files), as DeepSpeed's optimizer step does. The ZeRO-3 optimizer's sub-group methods used here are DeepSpeed's own
internals (its ``safe_get_full_*`` helpers swap a whole sub-group in per parameter and state); the resume tests hold
the result to the uninterrupted run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

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


@torch.no_grad()
def nvme_checkpoint_state(engine: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(state, optimizer_meta)`` for :func:`~..engine.hybrid_checkpoint.write_hybrid` from a DeepSpeed ZeRO-3
    engine (a collective: call on every rank)."""
    import deepspeed

    opt = engine.optimizer
    rank, world = _rank_world()
    order = {id(p): i for i, (_, p) in enumerate(engine.module.named_parameters())}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, torch.Tensor] = {}
    keys, kinds = _state_keys(opt)
    for gi, members in enumerate(_sub_groups(opt)):
        swapped = _swapped_in(opt, gi)
        flat = opt.fp32_partitioned_groups_flat[gi]
        state = opt.optimizer.state[flat]
        for p, offset, numel in members:
            mine = order[id(p)] % world == rank
            name = names[id(p)]
            for key, tensor in ((None, flat), *((k, state[k]) for k in keys)):
                full = opt._fp32_state_allgather(p, tensor.narrow(0, offset, numel))
                if mine:
                    (model if key is None else optim)[name if key is None else f"{name}/{key}"] = full.cpu().clone()
            if mine:
                for k, (kind, _) in kinds.items():
                    if kind == "scalar":
                        optim[f"{name}/{k}"] = state[k].detach().cpu().clone()
        if swapped:
            opt._release_swap_buffers(gi)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            with deepspeed.zero.GatheredParameters([p]):
                if order[id(p)] % world == rank:
                    model[name] = p.data.detach().cpu().clone()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups]
    return {"model": model, "optim_0": optim}, [{"param_groups": groups, "kinds": kinds}]


def _read(path: Path, wanted: dict[str, Any]) -> None:
    name = f"--ckpt_path={path}"
    with dcp_refusals():
        dcp.load(wanted, storage_reader=SafeFileSystemReader(path, name=name), planner=SafeLoadPlanner(name=name))


def _my_slice(full: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
    """This rank's ``numel`` elements of ``full`` flattened and zero-padded to ``numel x world`` (DeepSpeed's
    partition of a parameter)."""
    flat = full.reshape(-1)
    start = numel * rank
    out = torch.zeros(numel, dtype=flat.dtype)
    if start < flat.numel():
        n = min(numel, flat.numel() - start)
        out[:n] = flat[start:start + n]
    return out


@torch.no_grad()
def load_nvme_checkpoint(engine: Any, path: str | Path, *, optimizer: bool) -> dict[str, Any]:
    """Load a layout-free checkpoint directory (written by any layout) into a DeepSpeed ZeRO-3 engine: masters,
    Adam's states and steps (``optimizer``), then the parameters from the masters; weights only without
    ``optimizer`` (evaluation). Returns ``meta.pt``'s content (loops, schedulers, callbacks). A collective."""
    import deepspeed

    p = Path(path)
    meta = hckpt._read_meta(p)
    opt_meta = meta.pop("optimizer_meta", [])
    rank, _ = _rank_world()
    names = {id(prm): n for n, prm in engine.module.named_parameters()}
    opt = engine.optimizer if optimizer else None
    if opt is not None and hasattr(opt, "fp16_groups"):
        kinds = opt_meta[0]["kinds"] if opt_meta else {}
        keys = [k for k, (kind, _) in kinds.items() if kind == "param"]
        for gi, members in enumerate(_sub_groups(opt)):
            wanted: dict[str, Any] = {"model": {}, "optim_0": {}}
            for prm, _, _ in members:
                name = names[id(prm)]
                wanted["model"][name] = torch.empty(prm.ds_shape, dtype=torch.float32)
                for k, (kind, dtype) in kinds.items():
                    wanted["optim_0"][f"{name}/{k}"] = (torch.empty(prm.ds_shape, dtype=dtype) if kind == "param"
                                                        else torch.zeros((), dtype=dtype))
            _read(p, wanted)
            swapped = _swapped_in(opt, gi)
            flat = opt.fp32_partitioned_groups_flat[gi]
            state = opt.optimizer.state[flat]
            for k in keys:  # created at the first step where no offloading initialized them
                state.setdefault(k, torch.zeros_like(flat))
            for prm, offset, numel in members:
                name = names[id(prm)]
                flat.narrow(0, offset, numel).copy_(_my_slice(wanted["model"][name], numel, rank))
                for k in keys:
                    state[k].narrow(0, offset, numel).copy_(_my_slice(wanted["optim_0"][f"{name}/{k}"], numel, rank))
            for k, (kind, _) in kinds.items():
                if kind == "scalar" and members:
                    saved = wanted["optim_0"][f"{names[id(members[0][0])]}/{k}"]
                    state[k] = saved.clone() if torch.is_tensor(state.get(k, saved)) else saved.item()
            opt._reassign_or_swap_out_partitioned_parameters(gi)  # the masters into the parameters (or their files)
            if swapped:
                opt._optimizer_states_and_gradient_swap_out(gi)
        for group, saved in zip(opt.optimizer.param_groups, opt_meta[0]["param_groups"] if opt_meta else []):
            group.update(saved)
    for name, prm in engine.module.named_parameters():
        if opt is not None and prm.requires_grad:
            continue
        wanted = {"model": {name: torch.empty(prm.ds_shape, dtype=prm.dtype)}}
        _read(p, wanted)
        with deepspeed.zero.GatheredParameters([prm], modifier_rank=0):
            if rank == 0:
                prm.data.copy_(wanted["model"][name].view_as(prm.data))
    meta.pop("format", None)
    meta["state_dict"] = dict.fromkeys(names.values())  # the names, for on_load_checkpoint hooks that check them
    log.info("loaded %s into DeepSpeed ZeRO-3 (saved at layout %s)", p, meta.get("layout"))
    return meta
