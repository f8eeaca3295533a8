"""Muon for the hidden weight matrices, torch's AdamW for the rest, as one optimizer on any layout.

:class:`MuonWithAdamW` is a ``torch.optim.AdamW`` whose param groups marked ``muon`` get ``torch.optim.Muon``'s update
(Jordan et al. 2024; the step of ``torch.optim._muon._single_tensor_muon``, operation for operation):

    B <- lerp(B, g, 1 - momentum)               momentum buffer (``momentum_buffer``, shaped like the parameter)
    U <- lerp(g, B, momentum)  (Nesterov)  or  B
    O <- Newton-Schulz(U)                      bf16, per matrix (:mod:`.orthogonalize`)
    p <- p * (1 - lr * weight_decay) - lr * ratio(rows, cols) * O

with ``ratio`` torch's ``adjust_lr_fn``: ``original`` sqrt(max(1, rows / cols)) or ``match_rms_adamw`` 0.2 x
sqrt(max(rows, cols)) (Moonlight), of each matrix's shape (a part of a fused tensor, one expert). The other groups
step exactly as ``torch.optim.AdamW`` over the same groups (its ``_init_group`` and functional ``adam``).

Everything but Newton-Schulz is elementwise and runs on whatever piece of the parameter this rank holds (a ZeRO-3 or
tensor-parallel shard, a ZeRO-1/2 owner's whole tensor, a flat partition of DeepSpeed's ZeRO holding runs of several
parameters' elements, declared by :meth:`MuonWithAdamW.hold_flat_partition`); :func:`~.orthogonalize.orthogonalized`
hands Newton-Schulz whole matrices. Every hyper-parameter lives in the param groups, so ZeRO-1/2 rebuild the optimizer over a rank's
share from its groups alone, and the states (``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) are
keyed per parameter like AdamW's: layout-free checkpoints reshard them.

A ``found_inf`` set on the optimizer (the non-finite guard's flag, 1.0 = skip) leaves every Muon weight and buffer as
it is, decided on the device; with fused AdamW groups the whole step then skips on the device
(:attr:`skips_on_found_inf`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr
from torch.optim.adam import adam

from lightning_llm.optim.orthogonalize import FlatSplit, NewtonSchulz, Orthogonalize, orthogonalized
from lightning_llm.optim.roles import Matrices

__all__ = ["FlatPartition", "MuonWithAdamW", "MUON_DEFAULTS", "STATE_TENSORS"]

MUON_DEFAULTS: dict[str, Any] = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.7750, 2.0315),
    "ns_steps": 5,
    "ns_eps": 1e-7,
    "adjust_lr_fn": "match_rms_adamw",
    "matrices": tuple(Matrices()),
}
"""A Muon group's keys besides ``lr`` and ``weight_decay`` (``muon: True``), torch.optim.Muon's defaults except
``adjust_lr_fn`` (Moonlight's, so Muon reuses AdamW's learning rate and weight decay)."""


STATE_TENSORS: dict[str, tuple[str, ...]] = {"adamw": ("exp_avg", "exp_avg_sq"), "muon": ("momentum_buffer",)}
"""The state tensors shaped like its parameter (in its dtype) a parameter keeps in each kind of group (AdamW's 0-d
``step`` besides): what the memory model counts per parameter of each role (:mod:`lightning_llm.memory`)."""


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FlatPartition(NamedTuple):
    """A 1-D tensor a wrapping optimizer steps in param group ``index`` (DeepSpeed ZeRO's partition): per parameter with
    elements in the partitions of ``group``, ``(parameter, offset of this rank's run in the tensor, elements each rank
    holds)`` (``pieces``, every rank alike; :class:`~.orthogonalize.FlatSplit`); ``rank`` in ``group``."""

    pieces: list[tuple[Tensor, int, tuple[int, ...]]]
    group: Any
    index: int
    rank: int


class MuonWithAdamW(torch.optim.AdamW):
    """AdamW whose groups with ``muon=True`` step with Muon (see the module doc).

    Args:
        params: param groups; a Muon group has ``muon: True`` and may set the keys of :data:`MUON_DEFAULTS`
            (``matrices``: a :class:`~.roles.Matrices` tuple, how its tensors hold matrices).
        replica_group: the process group over which plain (not DTensor) Muon parameters are replicated with the same
            averaged gradient (data-parallel replicas): Newton-Schulz is then shared out over it. ``None``: each rank
            orthogonalises what it holds.
        **adamw: torch.optim.AdamW's arguments, defaults of every group.
    """

    def __init__(self, params: Any, *, replica_group: Any = None, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self.replica_group = replica_group
        self.flat_partitions: dict[int, FlatPartition] = {}  # id(flat tensor) -> what it holds
        self._flat_loads: dict[Any, list[int]] = {}  # Newton-Schulz work dealt per rank of a flat partition's group
        for group in self.param_groups:
            group.setdefault("muon", False)
            if group["muon"]:
                for k, v in MUON_DEFAULTS.items():
                    group.setdefault(k, v)
                if group["adjust_lr_fn"] not in ("original", "match_rms_adamw"):
                    raise ValueError(f"Muon: adjust_lr_fn={group['adjust_lr_fn']!r}, expected 'original' or "
                                     "'match_rms_adamw'")

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict's: Adam's own reads a "step" from every parameter's state, which a Muon one has not (the
        # legacy float steps it converts never occur in this class's states).
        torch.optim.Optimizer.__setstate__(self, state)
        for group in self.param_groups:
            for key, value in (("amsgrad", False), ("maximize", False), ("foreach", None), ("capturable", False),
                               ("differentiable", False), ("decoupled_weight_decay", True), ("fused", None),
                               ("muon", False)):
                group.setdefault(key, value)

    def hold_flat_partition(self, flat: Tensor, pieces: Sequence[tuple[Tensor, int, Sequence[int]]], *, group: Any,
                            param_group: int) -> None:
        """Declare what ``flat`` holds: a 1-D tensor a wrapping optimizer (DeepSpeed's ZeRO) puts in param group
        ``param_group`` and steps this optimizer on, made of runs of the parameters' flattened elements partitioned
        over the ranks of ``group``. ``pieces``: for every parameter partitioned there, in an order every rank shares,
        ``(parameter, where this rank's run starts in flat, the elements each rank holds: rank r the ones after those
        of ranks < r)``, runs of 0 elements included. A Muon group then orthogonalises each parameter whole; an AdamW
        group steps ``flat`` elementwise as it is. A call on every rank of ``group``."""
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        checked = []
        for param, offset, counts in pieces:
            shape = tuple(getattr(param, "ds_shape", param.shape))
            if sum(counts) != math.prod(shape) or not 0 <= offset <= offset + counts[rank] <= flat.numel():
                raise ValueError(f"Muon: a flat partition of {flat.numel()} elements declared to hold {counts[rank]} "
                                 f"at {offset} of a {shape} parameter split {tuple(counts)} over the ranks")
            checked.append((param, int(offset), tuple(int(c) for c in counts)))
        self.flat_partitions[id(flat)] = FlatPartition(checked, group, param_group, rank)

    def held_parameters(self) -> dict[str, list[Tensor]]:
        """The parameters this rank steps, by kind of group (``muon``, ``adamw``): a group's tensors, and for a
        declared flat partition the parameters with elements in it (DeepSpeed's ZeRO-3 empties its groups between
        steps)."""
        out: dict[str, list[Tensor]] = {"muon": [], "adamw": []}
        for flat in self.flat_partitions.values():
            kind = "muon" if self.param_groups[flat.index]["muon"] else "adamw"
            out[kind] += [p for p, _, counts in flat.pieces if counts[flat.rank]]
        for group in self.param_groups:
            out["muon" if group["muon"] else "adamw"] += [p for p in group["params"]
                                                           if id(p) not in self.flat_partitions]
        return out

    @property
    def skips_on_found_inf(self) -> bool:
        """Whether a ``found_inf`` flag skips the whole step on the device: the Muon groups always do, the AdamW
        groups when fused (torch's fused kernel)."""
        return all(g["fused"] for g in self.param_groups if not g["muon"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_group(group)
        muon = [g for g in self.param_groups if g["muon"]]
        if muon:
            self._muon_groups(muon)
        return loss

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """torch.optim.Adam's step body for one group (AdamW: ``decoupled_weight_decay``)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])

    def _muon_groups(self, groups: list[dict[str, Any]]) -> None:
        """Momentum and Nesterov on this rank's pieces, Newton-Schulz on whole matrices, then the update."""
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.to(torch.bool)
        todo: list[tuple[dict[str, Any], Tensor, list[tuple[int, int | None]]]] = []
        # ^ (group, a local tensor, its runs: (item, offset in the flat tensor; None: the whole tensor))
        items: list[Orthogonalize] = []
        for group in groups:
            momentum, layout = group["momentum"], Matrices(*group["matrices"])
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grads = [_local(p.grad) for p in params]
            bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
            # torch.optim.Muon's lerps, one multi-tensor launch for all of a group's tensors
            if skip is not None:  # NaN/inf gradients must not reach the buffer the skip keeps
                grads = [torch.where(skip, torch.zeros_like(g), g) for g in grads]
                for buf, new in zip(bufs, torch._foreach_lerp(bufs, grads, 1 - momentum)):
                    buf.copy_(torch.where(skip, buf, new))
            else:
                torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = (torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"]
                       else [b.to(torch.bfloat16, copy=True) for b in bufs])
            for p, update in zip(params, updates):
                todo.append((group, _local(p), self._runs(p, update.bfloat16(), layout, items)))
        if not items:
            return
        first = groups[0]
        ns = NewtonSchulz(tuple(first["ns_coefficients"]), first["ns_steps"], first["ns_eps"])  # type: ignore[arg-type]
        if any((tuple(g["ns_coefficients"]), g["ns_steps"], g["ns_eps"]) != tuple(ns) for g in groups):
            raise ValueError("Muon: every Muon group must use the same Newton-Schulz settings")
        results = orthogonalized(items, ns, replica_group=self.replica_group, flat_loads=self._flat_loads)
        locals_ = [local for _, local, _ in todo]
        decay = [1 - group["lr"] * group["weight_decay"] for group, _, _ in todo]
        if skip is None:
            torch._foreach_mul_(locals_, decay)
        news = locals_ if skip is None else torch._foreach_mul(locals_, decay)
        for (group, local, runs), new in zip(todo, news):
            lr = group["lr"]
            for i, offset in runs:
                item = items[i]
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], item.layout.part_shape(item.shape))
                target = new if offset is None else new.narrow(0, offset, item.update.numel())
                target.add_(results[i], alpha=-adjusted)
            if skip is not None:
                local.copy_(torch.where(skip, local, new))

    def _runs(self, p: Tensor, update: Tensor, layout: Matrices,
              items: list[Orthogonalize]) -> list[tuple[int, int | None]]:
        """Append to ``items`` the matrices ``p`` holds (itself, or a flat partition's parameters) with their piece of
        ``update``; returns ``(item, offset in p)`` of each (``None``: the whole of ``p``)."""
        flat = self.flat_partitions.get(id(p))
        if flat is None:
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if len(shape) != layout.stack + 2:  # a wrapper's flat partition nobody declared: no matrix to orthogonalise
                raise RuntimeError(f"Muon: a {shape} tensor in a Muon group of {layout.stack} stacked dims and a matrix "
                                   "(a flat partition of an optimizer wrapper not declared with hold_flat_partition?)")
            items.append(Orthogonalize(p, update, layout))
            return [(len(items) - 1, None)]
        runs: list[tuple[int, int | None]] = []
        for param, offset, counts in flat.pieces:
            runs.append((len(items), offset))
            items.append(Orthogonalize(param, update.narrow(0, offset, counts[flat.rank]), layout,
                                       FlatSplit(counts, flat.group)))
        return runs
