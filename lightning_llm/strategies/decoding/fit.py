"""Whether what a decoding session would gather fits: the rule every layout's gather-once path shares."""

from __future__ import annotations

from typing import Any

import psutil
import torch
import torch.distributed as dist

__all__ = ["MIB", "fit_in_free_memory", "free_memory_bytes"]

MIB = 2**20


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the CUDA allocator's view, else the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def fit_in_free_memory(extra: int, *, device: torch.device, group: Any) -> tuple[bool, str]:
    """``(fits, why)``: whether ``extra`` bytes take at most half the free memory of the fullest rank of ``group``
    (a collective: every rank of ``group`` calls it at once and gets the same answer)."""
    free = torch.tensor([free_memory_bytes(device)], dtype=torch.long, device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN, group=group)
    least = int(free)
    fits = extra <= least // 2
    return fits, (f"{extra / MIB:.1f} MiB gathered {'fit' if fits else 'exceed'} half the {least / MIB:.0f} MiB free "
                  "on the fullest rank")
