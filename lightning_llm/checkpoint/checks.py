"""Checks that turn an unloadable checkpoint directory into one :class:`CheckpointError` naming the path and what is
wrong.

A cut or incomplete checkpoint otherwise fails deep inside DCP or DeepSpeed with a traceback that never names the
file, and under several processes only some ranks fail, so the others hang in a collective or die of a gloo error.
These checks read only indexes and sizes (a zip file's central directory, DCP's ``.metadata``, DeepSpeed's ``latest``
tag and file names), never the tensors, and reach the same verdict on every rank because all ranks look at the same
files before any of them starts loading. The indexes they read go through :mod:`.safe_load`'s restricted
unpicklers; whether the other files would run code is :func:`~.safe_load.verify_checkpoint`'s, which every caller
runs first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import Strategy

from lightning_llm.checkpoint.errors import CheckpointError, UnsafeCheckpointError, check_torch_file, first_line
from lightning_llm.checkpoint.safe_load import DEEPSPEED_GLOBALS, load_file, read_dcp_metadata

__all__ = ["check_deepspeed_dir", "check_engine_dir", "check_strategy_reads"]


# ---------------------------------------------------------------------------------------------- engine (DCP) dirs
def _check_dcp_index(path: Path, name: str) -> None:
    """``.metadata`` (DCP's index) is readable and every shard file it names exists with all the bytes it indexes."""
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{name}: incomplete checkpoint directory: .metadata (the index of its shards) is "
                              "missing")
    try:
        metadata = read_dcp_metadata(path, name=f"{name}: .metadata")
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # any unpickling failure means the same to the user
        raise CheckpointError(f"{name}: corrupt checkpoint directory: .metadata cannot be read "
                              f"({first_line(e)})") from e
    needed: dict[str, int] = {}  # shard file -> bytes its index entries reach
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, n in sorted(needed.items()):
        shard = path / rel
        if not shard.is_file():
            raise CheckpointError(f"{name}: incomplete checkpoint directory: shard {rel} is missing "
                                  f"({_plural(len(needed), 'shard file')} in its index)")
        size = shard.stat().st_size
        if size < n:
            raise CheckpointError(f"{name}: truncated checkpoint directory: shard {rel} has {size} bytes, its "
                                  f"index needs {n}")


def check_engine_dir(path: str | Path, *, name: str, meta_file: str = "meta.pt") -> None:
    """Raise :class:`CheckpointError` if a sharded checkpoint directory of the parallel engine (DCP shards, their
    ``.metadata`` index and ``meta_file``) lacks a file or has one cut short. A path that is not a directory, or a
    directory holding neither index, is left to the caller's own "not a checkpoint" message."""
    p = Path(path)
    if not p.is_dir() or not ((p / ".metadata").exists() or (p / meta_file).exists()):
        return
    _check_dcp_index(p, name)
    meta = p / meta_file
    if not meta.is_file():
        raise CheckpointError(f"{name}: incomplete checkpoint directory: {meta_file} (loop, scheduler and optimizer "
                              "metadata) is missing")
    check_torch_file(meta, name=f"{name}: {meta_file}")


# ---------------------------------------------------------------------------------------------- DeepSpeed dirs
def _deepspeed_rank_file(tag_dir: Path, rank: int, kind: str) -> Path:
    """``zero_pp_rank_R_mp_rank_00_<kind>.pt`` (bf16 runs name optimizer files ``bf16_zero_pp_rank_...``)."""
    plain = tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_{kind}.pt"
    bf16 = tag_dir / f"bf16_{plain.name}"
    return bf16 if bf16.exists() and not plain.exists() else plain


def _deepspeed_world_size(model_file: Path, name: str) -> int:
    # mmap: reads the pickled metadata, maps the tensors without reading them
    state: dict[str, Any] = load_file(model_file, name=name, mmap=True, allowed=DEEPSPEED_GLOBALS)
    return int(state.get("dp_world_size", 1))


def check_deepspeed_dir(path: str | Path, *, name: str, world_size: int | None = None) -> int | None:
    """Raise :class:`CheckpointError` if a DeepSpeed ZeRO checkpoint directory (``latest`` naming a tag directory
    of model and per-rank optimizer files) lacks a file or has one cut short; with ``world_size`` (a resume, which
    loads optimizer state), also if it was written by another number of ranks: DeepSpeed refuses to repartition
    ZeRO optimizer state except from its universal format. Returns the number of ranks that wrote it."""
    p = Path(path)
    if not p.is_dir():
        return None  # Lightning's own check says that a DeepSpeed checkpoint is a directory
    if not (p / "latest").is_file():
        raise CheckpointError(f"{name}: not a DeepSpeed checkpoint directory (no 'latest' file naming its tag)")
    tag = (p / "latest").read_text().strip()
    tag_dir = p / tag
    if not tag_dir.is_dir():
        raise CheckpointError(f"{name}: incomplete DeepSpeed checkpoint: 'latest' names {tag}/, which is missing")
    stage3 = any(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))  # ZeRO-3 partitions the weights too
    model_file = _deepspeed_rank_file(tag_dir, 0, "model_states") if stage3 else tag_dir / "mp_rank_00_model_states.pt"
    files = [model_file]
    if not model_file.is_file():
        raise CheckpointError(f"{name}: incomplete DeepSpeed checkpoint: {tag}/{model_file.name} is missing")
    saved = _deepspeed_world_size(model_file, f"{name}: {tag}/{model_file.name}")
    for rank in range(saved):
        files.append(_deepspeed_rank_file(tag_dir, rank, "optim_states"))
        if stage3 and rank > 0:
            files.append(_deepspeed_rank_file(tag_dir, rank, "model_states"))
    for f in files[1:]:
        if not f.is_file():
            raise CheckpointError(f"{name}: incomplete DeepSpeed checkpoint: {tag}/{f.name} is missing (it was "
                                  f"written by {_plural(saved, 'rank')})")
        check_torch_file(f, name=f"{name}: {tag}/{f.name}")
    if world_size is not None and saved != world_size:
        raise CheckpointError(_world_size_message(name, p, tag, saved, world_size))
    return saved


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith("s") else f"{n} {word}s"


def _world_size_message(name: str, path: Path, tag: str, saved: int, now: int) -> str:
    src, dst = path / tag, path / f"{tag}_universal"
    return (f"{name}: this DeepSpeed ZeRO checkpoint was written by {_plural(saved, 'rank')} and this run has {now}; "
            f"DeepSpeed cannot repartition its optimizer state. Resume with {_plural(saved, 'process')} "
            "(--trainer.devices x "
            f"--trainer.num_nodes), or convert it once with 'python -m deepspeed.checkpoint.ds_to_universal "
            f"--input_folder {src} --output_folder {dst} --inject_missing_state' and resume with "
            '{"checkpoint": {"load_universal": true}} in --trainer.strategy.config')


# ---------------------------------------------------------------------------------------------- which strategy reads it
def check_strategy_reads(path: str | Path, strategy: Any, *, name: str) -> None:
    """Raise :class:`CheckpointError` if ``path`` is a checkpoint directory and ``strategy`` reads one ``.ckpt`` file
    only (Lightning's single-device and DDP strategies: ``Strategy.load_checkpoint`` ``torch.load``-s the path, and
    a directory fails there with a traceback). The message says which strategies read the directory."""
    p = Path(path)
    if not p.is_dir() or type(strategy).load_checkpoint is not Strategy.load_checkpoint:
        return
    if (p / "latest").is_file():
        what = "a DeepSpeed checkpoint directory"
        how = ("resume it with the DeepSpeed preset that wrote it (--trainer.strategy=deepspeed_zero1|2|3) or write "
               "its weights out with `lightning_llm export`")
    elif (p / "meta.pt").is_file() or (p / ".metadata").is_file():
        what = "a checkpoint directory of the parallel engine (tp, pp, cp, zero1/2/3, 3d)"
        how = ("any layout of the engine resumes it: --trainer.strategy=3d (plain data parallelism at its default "
               "sizes, also on one device), zero1/2/3, tp, pp or cp; or write its weights out with "
               "`lightning_llm export`")
    else:
        what = "a directory"
        how = "give the .ckpt file inside it"
    raise CheckpointError(f"{name} is {what}; the strategy {type(strategy).__name__} reads one .ckpt file: "
                          f"{how}")
