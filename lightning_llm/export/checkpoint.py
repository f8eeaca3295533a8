"""Any training checkpoint -> one consolidated Lightning-style checkpoint dict with full tensors (no process group
needed), from every layout our strategies write or wrote:

* a plain Lightning ``.ckpt`` file (one device, DDP, ``strategy=tp`` with ``save_distributed_checkpoint=False``);
* the engine's layout-free DCP directory (``3d``, and every native preset: any dp/tp/pp/ZeRO layout) -
  :mod:`lightning_llm.strategies.engine.hybrid_checkpoint`;
* a DeepSpeed checkpoint directory (:func:`lightning_llm.strategies.zero.deepspeed.consolidated_checkpoint`);
* the pre-engine layouts (:mod:`.legacy`): a ``strategy=tp`` / native ZeRO-3 DCP directory, a ``strategy=pp``
  directory (one file per pipeline rank), a native ZeRO-1/2 directory (``model.pt`` + optimizer shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_llm.checkpoint import load_file, verify_checkpoint
from lightning_llm.export.legacy import consolidate_checkpoint, is_pipeline_checkpoint, read_sharded
from lightning_llm.strategies.engine import hybrid_checkpoint
from lightning_llm.strategies.zero.deepspeed import consolidated_checkpoint, is_deepspeed_checkpoint

__all__ = ["read_checkpoint"]


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A consolidated Lightning-style checkpoint dict (``state_dict`` with full tensors, ``hyper_parameters``, ...)
    from any of the layouts listed in the module docstring."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"CKPT={p}: no such file or directory")
    verify_checkpoint(p, name=f"CKPT={p}")  # before anything is read: a crafted file never runs code
    if p.is_file():
        return load_file(p, name=f"CKPT={p}")
    if hybrid_checkpoint.is_hybrid_checkpoint(p):
        return hybrid_checkpoint.consolidated_state_dict(p, name=f"CKPT={p}")
    if is_pipeline_checkpoint(p):
        return consolidate_checkpoint(p)
    if (p / "model.pt").is_file():  # native ZeRO-1/2: replicated weights written once
        return load_file(p / "model.pt", name=f"CKPT={p}: model.pt")
    if (p / ".metadata").is_file() and (p / "meta.pt").is_file():  # TP / ZeRO-3 (ModelParallelStrategy layout)
        return read_sharded(p, name=f"CKPT={p}")
    if is_deepspeed_checkpoint(p):
        return consolidated_checkpoint(p)
    raise ValueError(f"CKPT={p}: not a checkpoint directory written by one of our strategies (3d, tp, pp, zero, "
                     "deepspeed)")
