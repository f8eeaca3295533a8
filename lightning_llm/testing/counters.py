"""Counters of what a training step does, for tests and benchmarks: the ``torch.distributed`` collectives it calls
(:class:`CollectiveCounter`) and the aten calls of its tail after backward (:class:`StepTailCounter`)."""

from __future__ import annotations

import collections
import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import override

__all__ = ["COLLECTIVES", "CollectiveCounter", "StepTailCounter"]


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "barrier",
               "all_gather_object", "broadcast_object_list")
"""The ``torch.distributed`` functions :class:`CollectiveCounter` counts."""


class CollectiveCounter(pl.Callback):
    """Calls of ``torch.distributed``'s collectives in each training step (forward, backward, optimizer step):
    ``steps[i]`` lists ``(function, group ranks, elements)`` per call of batch ``i``.

    A wrapper around each function of :data:`COLLECTIVES`, installed from ``on_train_start`` to the end of ``fit``.
    It sees every call made through Python (the native engine, Lightning's logging, ``deepspeed.comm``), not DDP's
    C++ reducer nor DTensor's functional collectives (tensor-parallel communication inside the model)."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, str, int]]] = []
        self._current: list[tuple[str, str, int]] | None = None
        self._saved: dict[str, Any] = {}

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

    def _install(self) -> None:
        for name in COLLECTIVES:
            if hasattr(dist, name):  # all_gather_single / reduce_scatter_single: FSDP2's, torch >= 2.10
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))

    def _uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[tuple[str, str, int]]]:
        """Count the collectives called inside the block (e.g. one generation): yields the list of
        ``(function, group ranks, elements)`` it fills."""
        calls: list[tuple[str, str, int]] = []
        previous, self._current = self._current, calls
        installed = not self._saved
        if installed:
            self._install()
        try:
            yield calls
        finally:
            self._current = previous
            if installed:
                self._uninstall()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

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

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()


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
