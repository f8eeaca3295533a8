"""ZeRO-3's side of a decoding session (:mod:`lightning_llm.strategies.decoding`).

Under ZeRO-3 every forward all-gathers each FSDP2 unit and frees it after (``reshard_after_forward=True``), so a
generation of ``N`` tokens would move the whole model ``N + 1`` times. When the gathered parameters fit, they are
all-gathered **once** for the whole generation (FSDP2's explicit ``unshard()``, resharding after forward switched off
meanwhile), the decoding steps communicate nothing, and they are resharded when it ends; the task's frozen models
(an RL reference) are gathered with it, every unit's all-gather in flight at once. Sessions nest: an RL task opens one
around a whole rollout, so its generation and its no-grad forwards of the policy and the reference share the one
gather. When they do not fit
(more than half the free device memory, or ``gather_for_decoding="per_layer"``), FSDP2 keeps gathering unit by unit
in every step; the data-parallel ranks then also agree on when to stop (an early-ending rank would otherwise pair
its next collectives with another rank's decoding steps). The run summary names the path (:func:`decoding_note`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_llm.strategies.decoding.fit import MIB, fit_in_free_memory
from lightning_llm.strategies.decoding.stop import StopTogether

log = logging.getLogger(__name__)

__all__ = ["GatherForDecoding", "ZeroDecoding", "gathered_extra_bytes"]

GatherForDecoding = Literal["auto", "once", "per_layer"]


def _fsdp_units(module: nn.Module) -> list[Any]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def gathered_extra_bytes(module: nn.Module, *, dtype: torch.dtype | None) -> int:
    """Bytes a rank allocates when every FSDP2 unit inside ``module`` is gathered, in ``dtype`` (the mixed-precision
    ``param_dtype``; ``None``: the parameter's): FSDP2 allocates each parameter whole over its shard dimension (the
    mesh's first: dp, or an MoE expert's edp; a tp dimension stays sharded) beside the shard it keeps."""
    total = 0
    for p in module.parameters():
        if isinstance(p, DTensor):
            total += p.to_local().numel() * p.device_mesh.size(0) * (dtype or p.dtype).itemsize
    return total


class ZeroDecoding:
    """The ZeRO-3 decoding plan of one engine set-up: ``once`` or ``per_layer`` (with ``auto``, decided at the first
    generation by every data-parallel rank together: see the module docstring), and the session that applies it to
    ``models``: the task's model and its frozen models (an RL rollout's reference forward then needs no gather of its
    own either)."""

    def __init__(self, models: Sequence[nn.Module], *, mode: GatherForDecoding, device: torch.device, dp_group: Any,
                 dtype: torch.dtype | None) -> None:
        self.mode, self.device, self.dp_group = mode, device, dp_group
        self.units = [unit for m in models for unit in _fsdp_units(m)]  # fixed once the engine has sharded them
        self.extra = sum(gathered_extra_bytes(m, dtype=dtype) for m in models)  # bytes a gather allocates
        self._plan: tuple[str, str] | None = None if mode == "auto" else (mode, f"gather_for_decoding={mode}")
        self._depth = 0  # sessions open (nested: the outermost gathers and reshards)

    def plan(self) -> tuple[str, str]:
        """``("once" | "per_layer", why)``. With ``auto`` a collective over the data-parallel ranks the first time
        (a generation, which every rank runs): they take the least free memory of them, so all choose alike."""
        if self._plan is None:
            fits, why = fit_in_free_memory(self.extra, device=self.device, group=self.dp_group)
            self._plan = ("once" if fits else "per_layer", why)
            log.info("ZeRO-3 decoding: %s (%s)", *self._plan)
        return self._plan

    def note(self) -> str:
        """The run summary's line (no collective: before the first generation an ``auto`` plan is still open)."""
        if self._plan is None:
            return (f"generation under ZeRO-3: parameters all-gathered once per generation if the {self.extra / MIB:.1f}"
                    " MiB fit in half the free memory of every data-parallel rank at the first generation, else "
                    "per-layer all-gathers in every decoding step (gather_for_decoding=auto; the choice is logged)")
        mode, why = self._plan
        if mode == "once":
            return (f"generation under ZeRO-3: parameters all-gathered once per generation, no collective per token "
                    f"({why})")
        return (f"generation under ZeRO-3: per-layer all-gathers in every decoding step, the fallback ({why}); "
                "data-parallel ranks stop together")

    @contextlib.contextmanager
    def session(self, decoder: Any) -> Iterator[Any]:
        """``decoder`` with the model gathered until the outermost session ends (sessions nest: a rollout keeps the
        policy gathered from its generation through its no-grad forwards)."""
        if self.plan()[0] == "per_layer":
            yield StopTogether(decoder, self.dp_group, self.device)
            return
        if self._depth:
            self._depth += 1
            try:
                yield decoder
            finally:
                self._depth -= 1
            return
        units = self.units
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        self._depth = 1
        try:
            for handle in [unit.unshard(async_op=True) for unit in units]:  # all in flight at once, then awaited
                if handle is not None:
                    handle.wait()
            yield decoder
        finally:
            self._depth = 0
            for unit in units:
                unit.reshard()
                unit.set_reshard_after_forward(True, recurse=False)  # as the engine shards every unit
