"""Crafted checkpoints for tests/checkpoints/test_safe_load.py: real checkpoints of short runs (one device, the native engine,
DeepSpeed) and the pre-engine layouts, each with one object added whose unpickling runs a shell command that writes a
marker file, as a checkpoint crafted by someone else would."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_llm.cli import main

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this runs ``touch MARKER`` (what ``weights_only=False`` or plain ``pickle.load`` would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.marker}",)


def fit_args(out: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), "--trainer.max_steps=2",
            "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={out}",
            f"--data.cache_dir={out.parent / 'cache'}", "--data.generated_docs=40", *extra]


def saved_run(out: Path, *extra: str) -> Path:
    """The checkpoint of a 2-step run (``last.ckpt``: a file or a directory, by strategy)."""
    args = fit_args(out, "--trainer.devices=1", "--trainer.enable_checkpointing=true",
                    "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={out / 'ckpt'}",
                    "--trainer.callbacks.save_last=true", *extra)
    assert main(args) == 0
    return out / "ckpt" / "last.ckpt"


def _add_to_torch_file(path: Path, marker: Path) -> None:
    obj = torch.load(path, map_location="cpu", weights_only=False)
    obj["payload"] = Payload(marker)
    torch.save(obj, path)


def _add_to_metadata(directory: Path, marker: Path) -> None:
    with (directory / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    metadata.planner_data = Payload(marker)
    with (directory / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def legacy_layouts(plain: Path, root: Path) -> dict[str, Path]:
    """The pre-engine layouts of ``plain``'s weights: a tp / ZeRO-3 DCP directory, pipeline-rank files, ZeRO-1/2's
    ``model.pt`` directory (as tests/checkpoints/test_export.py writes them)."""
    from lightning_llm.export.legacy import save_sharded, stage_checkpoint_file

    full = torch.load(plain, weights_only=True)
    meta = {k: v for k, v in full.items() if k not in ("state_dict", "optimizer_states")}
    sd = full["state_dict"]
    out = {"legacy_sharded": save_sharded(root / "legacy_sharded", model_state=sd, metadata=meta)}
    pp = root / "legacy_pp"
    pp.mkdir()
    keys = sorted(sd)
    for r, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        torch.save({**meta, "state_dict": {k: sd[k] for k in part}}, stage_checkpoint_file(pp, r))
    out["legacy_pp"] = pp
    zero = root / "legacy_zero"
    zero.mkdir()
    torch.save(full, zero / "model.pt")
    out["legacy_zero"] = zero
    return out


CRAFTED = {
    # name: (source checkpoint, the file the payload goes into, relative to it; "" = the checkpoint file itself)
    "ckpt": ("plain", ""),
    "engine_meta": ("engine", "meta.pt"),
    "engine_metadata": ("engine", ".metadata"),
    "deepspeed": ("deepspeed", "checkpoint/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    "legacy_sharded": ("legacy_sharded", "meta.pt"),
    "legacy_pp": ("legacy_pp", "pp-stage-rank-01.ckpt"),
    "legacy_zero": ("legacy_zero", "model.pt"),
}


def craft(sources: dict[str, Path], name: str, root: Path, marker: Path) -> Path:
    """A copy of ``sources[CRAFTED[name][0]]`` under ``root`` with the payload added to one of its files."""
    source, rel = CRAFTED[name]
    src = sources[source]
    dst = root / name / src.name
    dst.parent.mkdir(parents=True)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    target = dst / rel if rel else dst
    if target.name == ".metadata":
        _add_to_metadata(dst, marker)
    else:
        _add_to_torch_file(target, marker)
    return dst


def dcp_object_checkpoint(engine: Path, root: Path, marker: Path, *, key: str = "payload") -> Path:
    """``engine``'s directory re-saved by DCP with an object stored in a shard under ``model.<key>`` (beside the
    weights, or in a weight's place; DCP pickles it with ``torch.save``, its planner unpickles it with
    ``weights_only=False``)."""
    import torch.distributed.checkpoint as dcp

    from lightning_llm.strategies.engine.hybrid_checkpoint import dcp_contents

    dst = root / f"dcp_object_{key}" / engine.name
    dst.mkdir(parents=True)
    state = dcp_contents(engine)
    state["model"][key] = Payload(marker)
    dcp.save(state, checkpoint_id=dst, no_dist=True)
    shutil.copy(engine / "meta.pt", dst / "meta.pt")
    return dst
