"""Device values on their way to the host without a wait: what a training step reads back (the non-finite guard's
decision) and shows (the progress bar's loss).

A host read of a device tensor (``float(t)``, ``t.item()``, ``bool(t)``) waits for every kernel queued before it and
leaves the device idle while the host queues work again. :func:`host_copy` starts a copy into pinned host memory on
the stream (CUDA) and records an event after it: reading the copy waits for that point of the stream only
(:meth:`HostCopy.wait`), or not at all once :meth:`HostCopy.done`; on the CPU it is a clone.

:class:`ProgressBar` puts such copies in the progress bar: Lightning turns every ``prog_bar=True`` value into a Python
number at every batch end (``_ResultCollection.metrics``), which for a device tensor is a host read per step; a host
copy that has arrived is read without waiting.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["HostCopy", "ProgressBar", "host_copy"]


class HostCopy(NamedTuple):
    """A host copy of a device tensor (:func:`host_copy`)."""

    value: Tensor
    """The copy on the host (read it after :meth:`wait`, or once :meth:`done`)."""
    ready: Any
    """A CUDA event recorded after the copy, or ``None`` (made synchronously)."""

    def done(self) -> bool:
        """Whether the copy has arrived (never waits)."""
        return self.ready is None or bool(self.ready.query())

    def wait(self) -> Tensor:
        """The copy, once it has arrived (waits for the stream up to the copy only, not for later kernels)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.value


def host_copy(t: Tensor) -> HostCopy:
    """``t`` (detached) copied to the host without blocking: on CUDA into pinned memory, an event recorded after the
    copy on the current stream; elsewhere a plain copy (a clone on the CPU)."""
    t = t.detach()
    if t.device.type != "cuda":
        return HostCopy(t.to("cpu", copy=True), None)
    value = t.to("cpu", non_blocking=True)  # pinned, asynchronous
    ready = torch.cuda.Event()
    ready.record()
    return HostCopy(value, ready)


class ProgressBar:
    """Values a task shows in the progress bar (``prog_bar=True``, not sent to the logger: log the same values under
    their own names for that), each from the newest host copy that has arrived: on a GPU usually the previous step's,
    read without waiting for the device; on the CPU the step's own."""

    def __init__(self) -> None:
        self._copies: dict[str, list[HostCopy]] = {}

    def show(self, task: Any, name: str, value: Tensor) -> None:
        """Copy ``value`` (a 0-d tensor) towards the host and log the newest arrived copy of ``name`` to the bar."""
        copies = self._copies.setdefault(name, [])
        copies.append(host_copy(value.float()))
        arrived = [i for i, c in enumerate(copies) if c.done()]
        if not arrived:
            return  # nothing has arrived yet (the first step on a GPU): the bar keeps its previous value
        newest = arrived[-1]
        del copies[:newest]  # older copies are never shown
        task.log(name, copies[0].value, prog_bar=True, logger=False, on_step=True, on_epoch=False)
