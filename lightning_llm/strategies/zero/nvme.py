"""ZeRO-Infinity through DeepSpeed (``deepspeed_zero3_nvme``): parameter partitions and optimizer states swapped to
files under ``nvme_path`` by DeepSpeed's asynchronous I/O op (``async_io``, built on first use; it needs libaio).

What a rank keeps where (stage 3, ``N`` ranks, ``Ψ`` parameters, ``p`` bytes a parameter):

* the device: the parameters of the layers being computed (gathered, then released), activations;
* the disk: its parameter partition (``p Ψ/N``), the fp32 master partition, Adam's two moments and the fp32 gradient
  partition (``16 Ψ/N``): what ``deepspeed_zero3_offload`` keeps in host memory. DeepSpeed swaps only tensors of at
  least ``max(1 MiB, aio.block_size)`` bytes; smaller ones stay in host memory;
* the host: DeepSpeed's page-locked swap buffers: ``buffer_count`` (5) parameter buffers of the largest parameter
  partition or optimizer sub-group and ``4`` optimizer buffers of the largest sub-group (``sub_group_size``, 1e8 by
  default here, caps a sub-group: :func:`swap_buffer_numel`).

The swap files stay under ``nvme_path`` after the run as DeepSpeed leaves them (``zero_stage_3/<dtype>params/rankR``,
``zero_stage_3/optimizer/rankR``; the next run's set-up replaces them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch import nn

from lightning_llm.checkpoint import CheckpointError
from lightning_llm.strategies.zero.ops import check_build_lock

log = logging.getLogger(__name__)

__all__ = ["AioSettings", "LIBAIO_INSTALL", "SUB_GROUP_SIZE", "check_libaio", "check_nvme_path", "check_offload_device",
           "nvme_config", "partition_for_nvme", "rank_partition_numel", "refuse_nvme_checkpoint", "swap_buffer_bytes",
           "swap_buffer_numel", "swap_file_bytes"]

LIBAIO_INSTALL = "apt-get install -y libaio-dev"
"""The one command that installs the system library DeepSpeed's async I/O op builds against (Debian, Ubuntu)."""

SUB_GROUP_SIZE = 100_000_000
"""Elements per optimizer sub-group (DeepSpeed's ``sub_group_size``; its default 1e9 would size every swap buffer like
a rank's whole partition)."""

UNRESUMABLE = ("DeepSpeed 0.19.8 cannot resume or consolidate one whole (its own load gives back neither the "
               "parameters nor the fp32 masters, swapped or not, and no Adam moments; its zero files lack the swapped "
               "fp32 weights); deepspeed_zero3_nvme now writes the engine's layout-free format, which resumes "
               "exactly: resume from one of those")
"""Why checkpoints DeepSpeed wrote in its own format under ``deepspeed_zero3_nvme`` (before it wrote the layout-free
one, :mod:`.nvme_checkpoint`) are refused when read (``tests/checkpoints/test_nvme.py`` measures what its load
restores wrongly)."""

PARAM_BUFFERS, OPTIMIZER_BUFFERS = 5, 4  # DeepSpeed's defaults of offload_param / offload_optimizer buffer_count


@dataclass
class AioSettings:
    """DeepSpeed's asynchronous I/O (its ``aio`` config section) for the swap files; DeepSpeed's defaults."""

    block_size: int = 1_048_576
    """Bytes per read or write request (DeepSpeed swaps tensors of at least ``max(1 MiB, block_size)`` bytes)."""
    queue_depth: int = 8
    """Requests in flight per I/O handle."""
    intra_op_parallelism: int = 1
    """Threads that split one read or write."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Overlap submitting requests with waiting for completed ones."""


def check_libaio() -> None:
    """Raise ``ValueError`` (one line) when DeepSpeed's async I/O op cannot be built here (no libaio)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or not builder.is_compatible(verbose=False):
        raise ValueError("--trainer.strategy=deepspeed_zero3_nvme: DeepSpeed's async I/O op needs libaio, which is not "
                         f"installed here; install it with `{LIBAIO_INSTALL}` (Debian/Ubuntu)")
    check_build_lock(builder.name)


def check_nvme_path(nvme_path: str | os.PathLike | None) -> Path:
    """The directory of the swap files, created if needed; ``ValueError`` (one line) when it cannot be written."""
    if not nvme_path:
        raise ValueError("--trainer.strategy=deepspeed_zero3_nvme needs --trainer.strategy.nvme_path=DIR: a directory "
                         "on a fast local disk for the swapped parameters and optimizer states")
    path = Path(nvme_path).expanduser().absolute()
    probe = path / f".lightning_llm-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            os.fsync(f.fileno())
    except OSError as e:
        raise ValueError(f"--trainer.strategy.nvme_path={nvme_path}: cannot write swap files there "
                         f"({e.strerror or e})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return path


def check_offload_device(device: str, nvme_path: str | None, *, stage: int, offloads: bool) -> Path | None:
    """``nvme_path`` checked (writable, libaio present) for ``offload_device=nvme``, before training; ``None`` for
    ``cpu``."""
    if device not in ("cpu", "nvme"):
        raise ValueError(f"DeepSpeedZeroStrategy: offload_device={device!r}; choose 'cpu' or 'nvme'")
    if device == "cpu":
        if nvme_path is not None:
            raise ValueError("DeepSpeedZeroStrategy: nvme_path is where offload_device='nvme' swaps the states "
                             "(--trainer.strategy=deepspeed_zero3_nvme); with offload_device='cpu' it is unused")
        return None
    if stage != 3 or not offloads:
        raise ValueError("DeepSpeedZeroStrategy: offload_device='nvme' swaps the parameters and optimizer states of "
                         "ZeRO stage 3: set stage=3, offload_optimizer=true and offload_params=true")
    path = check_nvme_path(nvme_path)
    check_libaio()
    return path


def nvme_config(*, nvme_path: Path, pin_memory: bool, aio: AioSettings) -> dict[str, Any]:
    """The DeepSpeed config sections that swap the parameters and optimizer states to ``nvme_path`` (the parameter
    buffers' ``buffer_size`` follows the model: :func:`swap_buffer_numel`, set at set-up)."""
    common = {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": pin_memory}
    return {"zero_optimization": {"sub_group_size": SUB_GROUP_SIZE,
                                  "offload_optimizer": {**common, "buffer_count": OPTIMIZER_BUFFERS},
                                  "offload_param": {**common, "buffer_count": PARAM_BUFFERS}},
            "aio": asdict(aio)}


def swap_buffer_numel(*, largest: int, rank_numel: int, sub_group_size: int = SUB_GROUP_SIZE) -> int:
    """Elements of one parameter swap buffer: the largest of a rank's parameter partitions (``largest``) and of its
    optimizer sub-groups (up to ``sub_group_size`` plus the parameter that crosses it, at most ``rank_numel``), which
    DeepSpeed reads the swapped parameters into when it builds the fp32 masters."""
    return max(largest, min(rank_numel, sub_group_size + largest))


def swap_buffer_bytes(*, largest: int, rank_numel: int, param_bytes: int,
                      sub_group_size: int = SUB_GROUP_SIZE) -> int:
    """Host bytes of DeepSpeed's page-locked swap buffers on one rank (parameters and optimizer states on NVMe)."""
    numel = swap_buffer_numel(largest=largest, rank_numel=rank_numel, sub_group_size=sub_group_size)
    sub_group = min(rank_numel, sub_group_size + largest)
    return PARAM_BUFFERS * numel * param_bytes + OPTIMIZER_BUFFERS * sub_group * 4


def rank_partition_numel(model: nn.Module, world: int) -> tuple[int, int]:
    """``(largest, total)`` elements of one rank's ZeRO-3 partitions of ``model``'s parameters (``ceil(n / world)``
    each, as DeepSpeed partitions them)."""
    sizes = [-(-p.numel() // world) for p in model.parameters()]
    return max(sizes, default=0), sum(sizes)


def partition_for_nvme(model: nn.Module, config: dict[str, Any], *, user_config: dict[str, Any],
                       world_size: int, checkpoints: bool) -> None:
    """Before ``deepspeed.initialize``: size the parameter swap buffers to ``model`` (unless ``user_config`` does) and
    partition it with ``deepspeed.zero.Init(module=...)`` reading the dtype from ``config``. ``deepspeed.initialize``
    would pass the module's dtype, which DeepSpeed 0.19.8's ``Init._set_dtype`` drops on its CPU accelerator (no fp16
    there: ``dtype or torch.float16 if fp16 else torch.bfloat16 ...``) and swap fp32 parameters as bfloat16
    (measured: the loss moved 1.4e-5 at step 0, 2.8e-4 at step 2)."""
    import deepspeed

    del checkpoints  # its checkpoints are layout-free directories now (nvme_checkpoint), which resume exactly
    zero = config["zero_optimization"]
    user = user_config.get("zero_optimization", {}).get("offload_param", {})
    if "offload_param" in zero and "buffer_size" not in user:
        largest, total = rank_partition_numel(model, world_size)
        zero["offload_param"]["buffer_size"] = swap_buffer_numel(
            largest=largest, rank_numel=total, sub_group_size=int(zero.get("sub_group_size", SUB_GROUP_SIZE)))
    deepspeed.zero.Init(module=model, config_dict_or_path=config)


def refuse_nvme_checkpoint(path: str | os.PathLike, *, name: str) -> None:
    """Refuse (one line) a checkpoint DeepSpeed wrote in its own format with its optimizer states on NVMe
    (``offloaded_tensors/`` in its tag directory): see :data:`UNRESUMABLE`."""
    if any(Path(path).glob("*/offloaded_tensors")):
        raise CheckpointError(f"{name}: a deepspeed_zero3_nvme checkpoint: {UNRESUMABLE}")


def swap_file_bytes(nvme_path: str | os.PathLike, rank: int) -> int:
    """Bytes of the swap files of ``rank`` under ``nvme_path`` (DeepSpeed's layout), as they are on disk now."""
    root = Path(nvme_path) / "zero_stage_3"
    return sum(f.stat().st_size for d in root.glob(f"*/rank{rank}") for f in d.iterdir() if f.is_file())
