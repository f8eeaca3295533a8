"""The task's optimizer from its ``OptimConfig`` (``--model.optim.*``): AdamW's groups, or Muon's split by role.

Reads the config by attribute (``lr``, ``weight_decay``, ``betas``, ``eps``, ``fused``, ``muon_*``), so this package
needs nothing of the tasks that call it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lightning_llm.optim.muon import MUON_DEFAULTS, MuonWithAdamW
from lightning_llm.optim.roles import MuonSplit, split_parameters

log = logging.getLogger(__name__)

__all__ = ["build_muon", "default_fused", "muon_param_groups"]


def default_fused(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW serves ``params``: every one on a device torch has the kernel for, floating point,
    and all DTensor shards or all plain tensors (one fused call takes all of a device's parameters: a
    tensor-parallel plan that leaves some modules replicated mixes them; foreach then)."""
    supported = _get_fused_kernels_supported_devices()
    kinds = {isinstance(p, DTensor) for p in params}
    return bool(params) and len(kinds) == 1 and all(p.device.type in supported and p.is_floating_point()
                                                    for p in params)


def _decays(p: torch.Tensor) -> bool:
    return len(getattr(p, "ds_shape", p.shape)) >= 2  # DeepSpeed's zero.Init leaves 1-D placeholders


def muon_param_groups(split: MuonSplit, cfg: Any) -> list[dict[str, Any]]:
    """AdamW's two groups (matrices decay, vectors do not) over ``split.adamw``, then one Muon group per way a
    tensor holds matrices (whole, stacked experts, fused parts), at ``cfg.muon_lr`` (default ``cfg.lr``)."""
    groups: list[dict[str, Any]] = [
        {"params": [p for p in split.adamw if _decays(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in split.adamw if not _decays(p)], "weight_decay": 0.0}]
    by_layout: dict[tuple[int, ...], list[nn.Parameter]] = {tuple(k): [] for k in _every_rank_kinds(split)}
    for p, layout in split.muon.items():
        by_layout[tuple(layout)].append(p)
    muon = {**MUON_DEFAULTS, "momentum": cfg.muon_momentum, "nesterov": cfg.muon_nesterov,
            "ns_steps": cfg.muon_ns_steps, "adjust_lr_fn": cfg.muon_adjust_lr}
    lr = cfg.lr if cfg.muon_lr is None else cfg.muon_lr
    for layout, params in by_layout.items():
        groups.append({**muon, "params": params, "muon": True, "matrices": layout, "lr": lr,
                       "weight_decay": cfg.weight_decay})
    return groups


def _every_rank_kinds(split: MuonSplit) -> list[tuple[int, ...]]:
    """The kinds of matrices (:class:`~.roles.Matrices`) any rank holds, in one order: every rank gets the same
    groups (empty where its pipeline stage holds none of a kind), so an LR scheduler's per-group state and a
    checkpoint's groups mean the same group on every rank. A collective when distributed."""
    mine = sorted({tuple(m) for m in split.muon.values()})
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted({k for kinds in every for k in kinds})


def check_muon_config(cfg: Any) -> None:
    """One-line errors naming the bad ``--model.optim`` value."""
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise ValueError(f"--model.optim.muon_momentum={cfg.muon_momentum}: expected 0 <= momentum < 1")
    if cfg.muon_ns_steps < 1 or cfg.muon_ns_steps >= 100:
        raise ValueError(f"--model.optim.muon_ns_steps={cfg.muon_ns_steps}: expected 1 to 99 Newton-Schulz steps")
    if cfg.muon_adjust_lr not in ("original", "match_rms_adamw"):
        raise ValueError(f"--model.optim.muon_adjust_lr={cfg.muon_adjust_lr!r}: expected original or "
                         "match_rms_adamw")
    if cfg.muon_lr is not None and cfg.muon_lr <= 0:
        raise ValueError(f"--model.optim.muon_lr={cfg.muon_lr}: expected a positive learning rate")


def check_muon_strategy(strategy: Any) -> None:
    """Refuse, in one line, Lightning's FSDP1, whose flat parameters hold no matrix whole and say nothing of what they
    hold: Muon would run on slices of flattened tensors (another update). DeepSpeed's ZeRO steps on flat partitions
    too, but declares what they hold (:meth:`~.muon.MuonWithAdamW.hold_flat_partition`). The native presets shard
    the same way with Muon exact."""
    names = {c.__name__ for c in type(strategy).__mro__}
    if "FSDPStrategy" in names:
        raise ValueError("--model.optim.name=muon: not under Lightning's fsdp (FSDP1's flat parameters hold no matrix "
                         "whole); use --trainer.strategy=zero3 (FSDP2), where Muon equals one device's")


def build_muon(task: nn.Module, cfg: Any, *, replica_group: Any = None,
               strategy: Any = None) -> tuple[MuonWithAdamW, MuonSplit]:
    """:class:`~.muon.MuonWithAdamW` over ``task``'s trainable parameters split by role, and the split (the run
    summary prints it). ``replica_group``: the data-parallel replicas that share Newton-Schulz out (plain
    parameters with averaged gradients; ``None``: one replica); ``strategy``: the trainer's, checked
    (:func:`check_muon_strategy`)."""
    check_muon_config(cfg)
    if strategy is not None:
        check_muon_strategy(strategy)
    split = split_parameters(task, adapters_on_muon=cfg.muon_adapters)
    groups = muon_param_groups(split, cfg)
    params = [p for g in groups for p in g["params"]]
    fused = default_fused(params) if cfg.fused is None else cfg.fused
    optimizer = MuonWithAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused,
                              replica_group=replica_group)
    # As build_adamw: the GradScaler unscales first (one foreach kernel); the fused AdamW groups step unscaled.
    optimizer._step_supports_amp_scaling = False
    if split.adapters:
        where = ("their matrices on Muon (--model.optim.muon_adapters=true)" if cfg.muon_adapters
                 else "AdamW (--model.optim.muon_adapters=true puts their matrices on Muon)")
        log.info("Muon: the %d trainable PEFT adapter tensors train with %s; the frozen base weights take no "
                 "optimizer", len(split.adapters), where)
    return optimizer, split
