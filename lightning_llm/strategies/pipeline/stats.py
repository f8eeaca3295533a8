"""Per-step measurements of ``strategy=pp``: busy/idle time per pipeline rank and live saved-activation bytes.

* :class:`BusyTimer` adds up the time spent inside stage forward/backward and the loss; idle fraction of a rank
  = 1 - busy / step wall time (the pipeline bubble plus communication waits).
* :class:`ActivationMeter` counts bytes of activations saved for backward that are alive, via saved-tensor hooks.
* :func:`gather_step_stats` collects every pipeline rank's numbers into one row (and the last stage's loss);
  :func:`log_step_stats` logs them through the task.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BusyTimer", "ActivationMeter", "gather_step_stats", "log_step_stats"]


class BusyTimer:
    """Seconds spent in wrapped calls since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.busy = 0.0

    def reset(self) -> None:
        self.busy = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0
        return run


class ActivationMeter:
    """Bytes of activations saved for backward that are alive, via saved-tensor hooks (storages counted once,
    parameters excluded). ``peak`` is the high-water mark, ``packed`` the total distinct bytes packed."""

    def __init__(self, params: list[Tensor]) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.stale: set[int] = set()  # alive before the current step began
        self.current = self.peak = self.packed = 0

    def reset(self) -> None:
        """Start a step: count only what this step saves (the stages' metadata inference keeps a few tensors
        alive for good; they are not this step's activations)."""
        # Saved tensors the last step left alive may be garbage in reference cycles: collect them so they do not
        # count as stale. Only then: a full collection takes ~0.5 s with torch/lightning/transformers loaded.
        if not set(self.live) <= self.stale:
            gc.collect()
        self.stale = set(self.live)
        self.current = self.peak = self.packed = 0

    def _pack(self, t: Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or t.device.type == "meta":
            return t
        entry = self.live.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.packed += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(t, ptr, self)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            if ptr in self.stale:
                self.stale.discard(ptr)
            else:
                self.current -= entry[1]
            del self.live[ptr]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, _Held) else h)


class _Held:
    __slots__ = ("tensor", "ptr", "meter")

    def __init__(self, tensor: Tensor, ptr: int, meter: ActivationMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


def gather_step_stats(
    *,
    losses: list[Tensor],
    busy: float,
    wall: float,
    meter: ActivationMeter | None,
    n_microbatches: int,
    last_pp_rank: int,
    pp_size: int,
    group: Any,
    device: torch.device,
) -> tuple[Tensor, dict[str, Any]]:
    """All-gather this step's numbers over the pipeline group (a collective: every pipeline rank calls it).

    Returns the step loss (the mean of the last stage's micro-batch losses, on every rank) and the stats row:
    ``loss``, ``busy_s``, ``wall_s``, ``idle_frac`` (lists over pipeline ranks), ``n_microbatches`` and, with a
    meter, ``peak_act_bytes``/``act_bytes_per_mb``.
    """
    local = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros(())
    peak = float(meter.peak) if meter is not None else 0.0
    per_mb = float(meter.packed) / n_microbatches if meter is not None else 0.0
    stats = torch.tensor([local.item(), busy, wall, peak, per_mb], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(pp_size)]
    dist.all_gather(gathered, stats, group=group)
    g = torch.stack(gathered).cpu()  # [pp, 5]: loss, busy, wall, peak bytes, bytes per micro-batch
    loss = g[last_pp_rank, 0]
    row = {"loss": float(loss), "busy_s": g[:, 1].tolist(), "wall_s": g[:, 2].tolist(),
           "idle_frac": (1 - g[:, 1] / g[:, 2]).tolist(), "n_microbatches": n_microbatches}
    if meter is not None:
        row.update(peak_act_bytes=g[:, 3].tolist(), act_bytes_per_mb=g[:, 4].tolist())
    return loss, row


def log_step_stats(module: pl.LightningModule, row: dict[str, Any], *, batch_size: int) -> None:
    """``pp/busy_s_rank{r}``, ``pp/idle_frac_rank{r}`` (and ``pp/peak_act_mb_rank{r}``) for every pipeline rank."""
    for r in range(len(row["busy_s"])):
        module.log(f"pp/busy_s_rank{r}", row["busy_s"][r], on_step=True, on_epoch=False, batch_size=batch_size)
        module.log(f"pp/idle_frac_rank{r}", row["idle_frac"][r], on_step=True, on_epoch=False, batch_size=batch_size)
        if "peak_act_bytes" in row:
            module.log(f"pp/peak_act_mb_rank{r}", row["peak_act_bytes"][r] / 2**20, on_step=True,
                       on_epoch=False, batch_size=batch_size)
