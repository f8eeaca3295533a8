"""Counters of what a training step does, for tests and benchmarks: the ``torch.distributed`` collectives it calls
(:class:`CollectiveCounter`), the aten calls of its tail after backward (:class:`StepTailCounter`) and the reads of
tensor values by the host (:class:`HostReadCounter`)."""

from __future__ import annotations

import collections
import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

__all__ = ["COLLECTIVES", "CollectiveCounter", "HOST_READS", "HostReadCounter", "StepTailCounter"]


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "barrier",
               "all_gather_object", "broadcast_object_list")
"""The ``torch.distributed`` functions :class:`CollectiveCounter` counts."""


class _Wrapping(pl.Callback):
    """Functions wrapped by a counter from ``on_train_start`` to the end of ``fit`` (or inside a ``with`` block):
    :meth:`_targets` names ``(owner, attribute)`` pairs, :meth:`_wrap` makes each wrapper; an attribute the owner
    only inherited is deleted again afterwards."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def _targets(self) -> list[tuple[Any, str]]:
        raise NotImplementedError

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    def _install(self) -> None:
        for owner, name in self._targets():
            fn = getattr(owner, name)
            self._saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self._wrap(name, fn))

    def _uninstall(self) -> None:
        for owner, name, fn in reversed(self._saved):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._saved = []

    @contextlib.contextmanager
    def _installed(self) -> Iterator[None]:
        """Wrapped inside the block, unless they already are."""
        installed = not self._saved
        if installed:
            self._install()
        try:
            yield
        finally:
            if installed:
                self._uninstall()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()


class CollectiveCounter(_Wrapping):
    """Calls of ``torch.distributed``'s collectives in each training step (forward, backward, optimizer step):
    ``steps[i]`` lists ``(function, group ranks, elements)`` per call of batch ``i``.

    A wrapper around each function of :data:`COLLECTIVES`, installed from ``on_train_start`` to the end of ``fit``.
    It sees every call made through Python (the native engine, Lightning's logging, ``deepspeed.comm``), not DDP's
    C++ reducer nor DTensor's functional collectives (tensor-parallel communication inside the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[tuple[str, str, int]]] = []
        self._current: list[tuple[str, str, int]] | None = None

    def count(self, step: int, fn: str, *, group: str | None = None, min_elements: int = 0) -> int:
        """Calls of ``fn`` in batch ``step`` (over ``group``: its ranks joined by commas), each moving at least
        ``min_elements`` elements (e.g. gradient buckets, not the logged loss)."""
        return sum(1 for f, g, n in self.steps[step] if f == fn and group in (None, g) and n >= min_elements)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._current is not None:
                bound = sig.bind_partial(*args, **kwargs).arguments
                group = bound.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
                tensors = [t for v in bound.values() for t in (v if isinstance(v, list) else [v])
                           if isinstance(t, torch.Tensor)]
                self._current.append((name, ",".join(map(str, ranks)), max((t.numel() for t in tensors), default=0)))
            return fn(*args, **kwargs)

        return counted

    def _targets(self) -> list[tuple[Any, str]]:
        # all_gather_single / reduce_scatter_single: FSDP2's, torch >= 2.10
        return [(dist, name) for name in COLLECTIVES if hasattr(dist, name)]

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[tuple[str, str, int]]]:
        """Count the collectives called inside the block (e.g. one generation): yields the list of
        ``(function, group ranks, elements)`` it fills."""
        calls: list[tuple[str, str, int]] = []
        previous, self._current = self._current, calls
        try:
            with self._installed():
                yield calls
        finally:
            self._current = previous

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._current = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._current is not None:
            self.steps.append(self._current)
        self._current = None


class _AtenCalls(TorchDispatchMode):
    """Counts every aten call dispatched while it is active (by overload name)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


class StepTailCounter(pl.Callback):
    """The aten calls of each training step from the end of backward to the end of the step (gradient reduction,
    the non-finite check, clipping, the optimizer and scheduler steps, zeroing): ``steps[i]`` is a ``Counter`` by
    op. Per-step work that grows with the number of parameter tensors shows here as calls that grow with the model."""

    def __init__(self) -> None:
        self.steps: list[collections.Counter[str]] = []
        self._mode: _AtenCalls | None = None

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._mode is None:
            self._mode = _AtenCalls()
            self._mode.__enter__()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.steps.append(self._mode.calls)
            self._mode = None


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
              "masked_select", "argwhere", "unique", "bincount", "equal", "allclose", "repeat_interleave",
              "__getitem__")
"""What :class:`HostReadCounter` counts, as ``torch.Tensor`` methods (and the ``torch`` functions of the same name):
the host reading a value (``item``, ``float(t)``, ``bool(t)``, ``tolist``, a copy to the host), and the ops whose
output shape depends on the values, so that on a GPU they wait for it too (``nonzero``, a boolean-mask index,
``repeat_interleave`` by a tensor without ``output_size``, ``unique``, ``bincount``). Also ``torch.cuda.synchronize``
and :data:`_FROM_HOST`."""

_TORCH_READS = ("nonzero", "masked_select", "argwhere", "unique", "bincount", "equal", "allclose",
                "repeat_interleave")
"""The functions of :data:`HOST_READS` also wrapped as ``torch.NAME``."""

_FROM_HOST = ("tensor", "as_tensor", "asarray")
"""``torch`` functions counted when they copy host data (numbers, lists) to a ``device=`` the caller names: a copy from
pageable host memory that a GPU stream waits for (``LightningModule.log`` of a Python number makes one)."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HOST_DIRS = (os.path.join(_TORCH_DIR, "utils", "data") + os.sep, os.path.join(_TORCH_DIR, "optim") + os.sep)
"""Reads there are of host tensors by design: the data loader's (sampler, collate) and the step counters torch's
non-fused optimizers keep on the host (``_get_value``)."""
_OURS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # lightning_llm/
_THIS_FILE = os.path.abspath(__file__)
_LIGHTNING_LOOP = (os.sep + os.path.join("lightning", "pytorch", "trainer") + os.sep,
                   os.sep + os.path.join("lightning", "pytorch", "loops") + os.sep)


def _syncs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of ``name`` reads values (some only with certain arguments)."""
    if name == "__getitem__":  # a boolean-mask (or bool tensor) index: its output size is the mask's count
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts)
    if name in _FROM_HOST:  # host data copied to a device named by the caller (on a GPU: a blocking copy)
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)
    if name == "repeat_interleave":  # by a tensor of repeats, without the output size
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None
    return True


def _read_owner(frame: Any) -> tuple[str, str]:
    """``(owner, where)`` of a read made from ``frame``: ``lightning_llm`` when a frame of the package lies inward of
    Lightning's trainer and loops (our hooks, our strategies, a Lightning utility our code called), ``lightning`` for
    Lightning's own loop work (logging, the progress bar), ``data`` inside ``torch.utils.data`` (host tensors of the
    loader), ``host`` for the host step counters of torch's non-fused optimizers, else ``other``; ``where`` is
    ``file:line`` of the innermost frame of that owner (outside torch)."""
    outer = frame
    while outer is not None:  # the data loader's work (its sampler, collate) is host work wherever it is written
        if outer.f_code.co_filename.startswith(_HOST_DIRS[0]):
            return "data", f"{outer.f_code.co_filename}:{outer.f_lineno}"
        outer = outer.f_back
    if frame.f_code.co_filename.startswith(_HOST_DIRS[1]):
        return "host", f"{frame.f_code.co_filename}:{frame.f_lineno}"
    first = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _THIS_FILE and not path.startswith(_TORCH_DIR):
            here = f"{os.path.relpath(path, os.path.dirname(_OURS_DIR.rstrip(os.sep)))}:{frame.f_lineno}"
            if path.startswith(_OURS_DIR):
                return "lightning_llm", here
            if any(part in path for part in _LIGHTNING_LOOP):
                return "lightning", first or here
            first = first or here
        frame = frame.f_back
    return "other", first or "?"


class HostReadCounter(_Wrapping):
    """Host reads of tensor values in each training batch (:data:`HOST_READS`): on a GPU each one waits for the device
    to finish everything queued before it, and the device then idles while the host queues work again.

    The methods and functions are wrapped from ``on_train_start`` to the end of ``fit``; a batch's reads are those
    from its ``on_train_batch_start`` to the next batch's (its step, backward, optimizer step, logging, the progress
    bar), counted for the batches in ``steps`` (numbered from 0 over the whole fit, epochs included); reads of the
    data loader (``torch.utils.data``: host tensors) are left out. ``reads[batch]`` lists ``(owner, where, what)``
    per read (:func:`_read_owner`). With ``output``, rank 0 writes every rank's ``{"reads": {batch: [[owner, where,
    what], ...]}}`` there as JSON at the end of ``fit``."""

    def __init__(self, output: str | None = None, steps: tuple[int, int] = (3, 7)) -> None:
        """
        Args:
            output: JSON file rank 0 writes every rank's reads to at the end of fit.
            steps: First and last batch counted (numbered from 0 over the fit).
        """
        super().__init__()
        self.output = output
        self.first, self.last = steps
        self.reads: dict[int, list[tuple[str, str, str]]] = {}
        self._batch: int | None = None
        self._seen = -1
        self._inside = False

    def per_batch(self, owner: str = "lightning_llm") -> dict[int, int]:
        """Reads of ``owner`` in each counted batch."""
        return {b: sum(1 for o, _, _ in rows if o == owner) for b, rows in sorted(self.reads.items())}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._batch is not None and not self._inside and _syncs(name, args, kwargs):
                self._inside = True  # a read inside a read (torch's own Python) counts once
                try:
                    owner, where = _read_owner(sys._getframe(1))
                    if owner not in ("data", "host"):
                        self.reads[self._batch].append((owner, where, name))
                    return fn(*args, **kwargs)
                finally:
                    self._inside = False
            return fn(*args, **kwargs)

        counted.__name__ = getattr(fn, "__name__", name)
        return counted

    @contextlib.contextmanager
    def counting(self, batch: int = -1) -> Iterator[list[tuple[str, str, str]]]:
        """Count the reads made inside the block as batch ``batch`` (the counter's own check); yields their list."""
        self.reads[batch] = []
        previous, self._batch = self._batch, batch
        try:
            with self._installed():
                yield self.reads[batch]
        finally:
            self._batch = previous

    def _targets(self) -> list[tuple[Any, str]]:
        return [*((torch.Tensor, name) for name in HOST_READS),
                *((torch, name) for name in (*_TORCH_READS, *_FROM_HOST)), (torch.cuda, "synchronize")]

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._seen += 1  # batches of the fit so far (batch_idx restarts with each epoch)
        self._batch = self._seen if self.first <= self._seen <= self.last else None
        if self._batch is not None:
            self.reads[self._seen] = []

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch = None
        self._uninstall()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.output is None:
            return
        mine = {str(b): [list(r) for r in rows] for b, rows in self.reads.items()}
        every = [mine]
        if dist.is_available() and dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        if trainer.global_rank == 0:
            tmp = self.output + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"reads": every}, f)
            os.replace(tmp, self.output)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._batch = None
        super().teardown(trainer, pl_module, stage)
