"""Checkpoint helpers for DTensor-sharded models: sharded save/load with ``torch.distributed.checkpoint`` (DCP) and a
consolidated full state dict. Reusable by any strategy whose parameters are DTensors (TP, FSDP2, 3-D).

Layout of a sharded checkpoint directory (compatible with Lightning's ``ModelParallelStrategy``)::

    <dir>/.metadata, <dir>/__<rank>_0.distcp   DCP files: {"state_dict": model, "optimizer_0": ..., ...}
    <dir>/meta.pt                              everything else Lightning puts in a checkpoint (loops, callbacks, ...)

Every function here that touches DTensors is a collective: call it on all ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

log = logging.getLogger(__name__)

__all__ = [
    "METADATA_FILENAME",
    "consolidate_sharded_checkpoint",
    "full_state_dict",
    "is_sharded_checkpoint",
    "load_sharded",
    "model_state_dict",
    "optimizer_state_dict",
    "save_sharded",
]

METADATA_FILENAME = "meta.pt"
"""Non-tensor checkpoint contents, written by rank 0 next to the DCP files (Lightning's name)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A directory written by :func:`save_sharded`."""
    p = Path(path)
    return p.is_dir() and (p / METADATA_FILENAME).is_file()


def model_state_dict(model: nn.Module, *, full: bool, cpu_offload: bool = True) -> dict[str, Any]:
    """Sharded (DTensor values) or full state dict. ``full=True`` gathers every tensor; with ``cpu_offload`` only
    rank 0 receives it (others get ``{}``), as Lightning's strategies expect."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload))


def optimizer_state_dict(
    model: nn.Module, optimizer: Optimizer, *, full: bool, cpu_offload: bool = True
) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (sharded or full, as :func:`model_state_dict`)."""
    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The consolidated model state dict (full tensors on CPU) on rank 0, ``{}`` elsewhere."""
    return model_state_dict(model, full=True, cpu_offload=True)


def save_sharded(
    path: str | Path,
    *,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a sharded checkpoint: each rank writes its own shards (no gather), rank 0 writes ``metadata``."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    if p.is_file():
        p.unlink()
    p.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {"state_dict": dict(model_state)}
    state.update({f"optimizer_{i}": dict(s) for i, s in enumerate(optimizer_states)})
    dcp.save(state, checkpoint_id=p)
    if _rank() == 0:
        torch.save(dict(metadata or {}), p / METADATA_FILENAME)
    log.info("saved sharded checkpoint to %s", p)
    return p


def load_sharded(
    path: str | Path,
    *,
    model: nn.Module,
    optimizers: Sequence[Optimizer] = (),
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a :func:`save_sharded` directory into an already-parallelized ``model`` (and ``optimizers``) in place;
    returns the metadata dict. The current sharding may differ from the saved one (DCP reshards on load)."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    if not is_sharded_checkpoint(p):
        raise FileNotFoundError(f"{p}: not a sharded checkpoint directory (no {METADATA_FILENAME})")
    module_state = {"state_dict": get_model_state_dict(model)}
    dcp.load(module_state, checkpoint_id=p)
    set_model_state_dict(model, module_state["state_dict"], options=StateDictOptions(strict=strict))
    for i, opt in enumerate(optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(model, opt)}
        dcp.load(optim_state, checkpoint_id=p)
        set_optimizer_state_dict(model, opt, optim_state_dict=optim_state[key])
    # meta.pt holds Lightning's loop/callback state and hparams (plain Python objects), written by save_sharded.
    return torch.load(p / METADATA_FILENAME, weights_only=False if weights_only is None else weights_only)


def consolidate_sharded_checkpoint(path: str | Path, output: str | Path) -> Path:
    """Offline (no process group): merge a sharded checkpoint into one ``torch.save`` file of full tensors with the
    metadata merged in, loadable by ``torch.load`` on any machine."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    p, out = Path(path), Path(output)
    dcp_to_torch_save(p, out)
    ckpt = torch.load(out, weights_only=False)
    ckpt.update(torch.load(p / METADATA_FILENAME, weights_only=False))
    torch.save(ckpt, out)
    return out
