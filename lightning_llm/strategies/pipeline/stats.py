"""Per-step measurements of ``strategy=pp``: busy/idle time per pipeline rank and live saved-activation bytes.

* :class:`BusyTimer` adds up the time spent inside stage forward/backward and the loss; idle fraction of a rank
  = 1 - busy / step wall time (the pipeline bubble plus communication waits).
* :class:`ActivationMeter` counts bytes of activations saved for backward that are alive, via saved-tensor hooks.
* :func:`last_stage_loss` gives every pipeline rank the step's loss (on the device); :class:`StepStatsLog` keeps
  each step's numbers and gathers every pipeline rank's into rows when they are read (logging steps, the end of
  fit); :func:`log_step_stats` logs a row through the task.
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

__all__ = ["BusyTimer", "ActivationMeter", "StepStatsLog", "last_stage_loss", "log_step_stats"]


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


class StepStatsLog:
    """Each pipelined training step's numbers, gathered over the pipeline group when they are read: the step's loss
    (already the last stage's, a device tensor) and this rank's host numbers (busy and wall seconds, activation bytes)
    wait in :attr:`pending`, and :meth:`flush` (at logging steps and when fit ends: every pipeline rank calls it at
    the same steps) turns them into rows with one collective and one read, instead of a read in every step."""

    def __init__(self, rows: list[dict[str, Any]], *, last_pp_rank: int, pp_size: int, group: Any,
                 device: torch.device) -> None:
        self.rows = rows
        self.pending: list[tuple[Tensor, list[float], int]] = []  # (step loss, [busy, wall, peak, per mb], m)
        self.last_pp_rank, self.pp_size, self.group, self.device = last_pp_rank, pp_size, group, device
        self.measured = False  # the steps had an activation meter

    def add(self, loss: Tensor, *, busy: float, wall: float, meter: ActivationMeter | None,
            n_microbatches: int) -> None:
        peak = float(meter.peak) if meter is not None else 0.0
        per_mb = float(meter.packed) / n_microbatches if meter is not None else 0.0
        self.pending.append((loss.detach().reshape(()), [busy, wall, peak, per_mb], n_microbatches))
        self.measured = self.measured or meter is not None

    def flush(self) -> list[dict[str, Any]]:
        """Rows of the pending steps (appended to :attr:`rows`; a collective: every pipeline rank calls it):
        ``loss``, ``busy_s``, ``wall_s``, ``idle_frac`` (lists over pipeline ranks), ``n_microbatches`` and, with a
        meter, ``peak_act_bytes``/``act_bytes_per_mb``."""
        if not self.pending:
            return []
        pending, self.pending = self.pending, []
        numbers = torch.tensor([x for _, n, _ in pending for x in n], dtype=torch.float64)
        local = numbers.pin_memory() if self.device.type == "cuda" else numbers
        local = local.to(self.device, non_blocking=True)
        gathered = [torch.zeros_like(local) for _ in range(self.pp_size)]
        dist.all_gather(gathered, local, group=self.group)
        losses = torch.stack([loss.to(self.device, torch.float64) for loss, _, _ in pending])
        g = torch.cat([torch.stack(gathered).reshape(-1), losses]).cpu()  # the one read
        per_rank = g[:-len(pending)].reshape(self.pp_size, len(pending), 4)  # [pp, steps, 4]
        out = []
        for i, (_, _, m) in enumerate(pending):
            s = per_rank[:, i]  # [pp, 4]: busy, wall, peak bytes, bytes per micro-batch
            row = {"loss": float(g[len(g) - len(pending) + i]), "busy_s": s[:, 0].tolist(), "wall_s": s[:, 1].tolist(),
                   "idle_frac": (1 - s[:, 0] / s[:, 1]).tolist(), "n_microbatches": m}
            if self.measured:
                row.update(peak_act_bytes=s[:, 2].tolist(), act_bytes_per_mb=s[:, 3].tolist())
            out.append(row)
        self.rows.extend(out)
        return out


def last_stage_loss(losses: list[Tensor], *, last_stage_rank: int, group: Any, device: torch.device) -> Tensor:
    """The step loss on every pipeline rank: the mean of the last stage's micro-batch losses, broadcast from it (a
    device collective; nothing is read on the host)."""
    local = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros(())
    loss = local.to(device=device, dtype=torch.float32).reshape(1).contiguous()
    dist.broadcast(loss, src=last_stage_rank, group=group)
    return loss[0]


def log_step_stats(module: pl.LightningModule, row: dict[str, Any], *, batch_size: int) -> None:
    """``pp/busy_s_rank{r}``, ``pp/idle_frac_rank{r}`` (and ``pp/peak_act_mb_rank{r}``) for every pipeline rank."""
    for r in range(len(row["busy_s"])):
        module.log(f"pp/busy_s_rank{r}", row["busy_s"][r], on_step=True, on_epoch=False, batch_size=batch_size)
        module.log(f"pp/idle_frac_rank{r}", row["idle_frac"][r], on_step=True, on_epoch=False, batch_size=batch_size)
        if "peak_act_bytes" in row:
            module.log(f"pp/peak_act_mb_rank{r}", row["peak_act_bytes"][r] / 2**20, on_step=True,
                       on_epoch=False, batch_size=batch_size)
