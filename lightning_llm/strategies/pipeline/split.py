"""Splitting the built-in model families into pipeline stages (also used by the 3-D strategy).

The split is DATA declared by each model family (:class:`~lightning_llm.models.parallel_spec.ParallelSpec`): which
modules go on the first stage (embeddings), which on the last (final norm, heads) and where the block container is.
Blocks are divided into contiguous runs
(balanced by count or by parameters, or at explicit split points).

Two operations on a built model:

* :func:`stage_module` -> a *view* of the model for one stage: a shallow copy whose ``layers`` hold only that stage's
  blocks and whose first/last-stage modules are ``None``. It shares every Parameter with the model, so the model
  itself (what Lightning checkpoints and what the optimizer sees) and the stage modules (what the schedule runs)
  stay one set of weights. The families' ``forward`` treats a missing first module as "input is the hidden state"
  and missing last modules as "return hidden states".
* :func:`prune_model` -> deletes, in place, everything the local stages do not use, so parameter names stay global
  (``layers.2.mlp.up_proj.weight``) and each rank's state dict is its shard of the full one.

A module that wraps a family model and adds modules after it (PPO's actor-critic: a value head on the policy's last
hidden state) declares ``pipeline_last_modules`` (names of its own children): its family's spec is then taken with
dotted paths (``policy.layers``), the declared modules join the last stage, and the wrapper's ``forward`` must return
its trunk's output where those modules are ``None`` (a stage before the last), as the families do.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lightning_llm.models import PARALLEL_SPECS, ParallelSpec, parallel_spec_of

log = logging.getLogger(__name__)

__all__ = ["StageSpec", "layout_of", "module_at", "split_layers", "stage_specs",
           "stage_ranks", "stage_module", "prune_model", "tied_across_stages"]


def module_at(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at a dotted ``path`` (``policy.layers``), or None where a split removed it."""
    mod: nn.Module | None = model
    for name in path.split("."):
        mod = getattr(mod, name, None) if mod is not None else None
    return mod


def _set_at(model: nn.Module, path: str, value: nn.Module | None) -> None:
    parent, _, name = path.rpartition(".")
    owner = module_at(model, parent) if parent else model
    if owner is not None and getattr(owner, name, None) is not None:
        setattr(owner, name, value)


def _wrapped_spec(prefix: str, spec: ParallelSpec, extra: tuple[str, ...]) -> ParallelSpec:
    """A family's spec seen from a wrapper holding it at ``prefix`` (``"policy."``) with ``extra`` last modules."""
    def tied(model: nn.Module) -> tuple[tuple[str, str], ...]:
        inner = module_at(model, prefix[:-1])
        return tuple((prefix + a, prefix + b) for a, b in spec.tied(inner)) if inner is not None else ()

    return dataclasses.replace(spec, first=tuple(prefix + n for n in spec.first),
                               last=(*(prefix + n for n in spec.last), *extra), layers=prefix + spec.layers,
                               tied=tied)


def layout_of(model: nn.Module) -> ParallelSpec:
    """The family spec of ``model`` itself (its ``first``/``last`` modules and ``layers`` container, dotted paths
    for a wrapper declaring ``pipeline_last_modules``, see the module docstring)."""
    found = parallel_spec_of(model)
    if found is not None and found[0] == "":
        return found[2]
    extra = getattr(model, "pipeline_last_modules", None)
    if found is not None and extra is not None:
        return _wrapped_spec(found[0], found[2], tuple(extra))
    known = ", ".join(c.__name__ for c in PARALLEL_SPECS)
    raise ValueError(f"pipeline parallelism can split the registered model families ({known}) and modules that "
                     f"wrap one declaring pipeline_last_modules; the task built {type(model).__name__}")


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its global index and the block keys it runs."""

    index: int
    num_stages: int
    layers: tuple[str, ...]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def _partition(weights: Sequence[float], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty runs minimising the heaviest run (exact DP, O(n^2 parts))."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-run weight splitting weights[:i] into k runs; cut[k][i]: start of the k-th run
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] - 1e-9:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_layers(
    model: nn.Module,
    num_stages: int,
    *,
    split_points: Sequence[int] | None = None,
    balance: Literal["layers", "params"] = "layers",
) -> list[tuple[str, ...]]:
    """Block keys of each of ``num_stages`` stages, in order.

    ``split_points`` are the block indices where stages 1..n-1 begin (e.g. ``[2]`` splits 4 blocks 2+2).
    Otherwise ``balance="layers"`` gives each stage the same number of blocks (earlier stages take the remainder) and
    ``balance="params"`` minimises the largest stage's parameter count, counting the embeddings on the first stage
    and the final norm and heads on the last.
    """
    layout = layout_of(model)
    family = parallel_spec_of(model)
    reason = family[2].pipeline_blocker(family[1]) if family is not None else None
    if reason is not None:
        raise ValueError(f"pipeline parallelism: {reason}")
    keys = list(module_at(model, layout.layers).keys())
    n = len(keys)
    if num_stages > n:
        raise ValueError(f"pipeline_parallel_size x stages_per_rank = {num_stages} stages, but the model has only {n} "
                         f"layers; every stage needs at least one layer")
    if split_points is not None:
        pts = [int(p) for p in split_points]
        if len(pts) != num_stages - 1 or pts != sorted(set(pts)) or (pts and (pts[0] <= 0 or pts[-1] >= n)):
            raise ValueError(f"split_points={list(split_points)}: need {num_stages - 1} strictly increasing block "
                             f"indices in 1..{n - 1} (where stages 1..{num_stages - 1} begin)")
        starts = [0, *pts]
    elif balance == "layers":
        base, extra = divmod(n, num_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        starts = [sum(sizes[:s]) for s in range(num_stages)]
    elif balance == "params":
        layers = module_at(model, layout.layers)
        weights = [float(sum(p.numel() for p in layers[k].parameters())) for k in keys]

        def count(names: Sequence[str]) -> float:
            mods = [module_at(model, a) for a in names]
            return float(sum(p.numel() for m in mods if m is not None for p in m.parameters()))

        weights[0] += count(layout.first)
        weights[-1] += count(layout.last)
        starts = _partition(weights, num_stages)
    else:
        raise ValueError(f"balance={balance!r}: expected 'layers' or 'params'")
    bounds = [*starts, n]
    return [tuple(keys[bounds[s]:bounds[s + 1]]) for s in range(num_stages)]


def stage_ranks(pp_size: int, stages_per_rank: int, *, style: Literal["loop", "v"] = "loop") -> list[int]:
    """Pipeline rank owning each global stage: round-robin (``loop``, interleaved 1F1B) or ``v`` (ZBV: rank r holds
    stages r and 2p-1-r)."""
    num = pp_size * stages_per_rank
    if style == "v":
        return [s if s < pp_size else num - 1 - s for s in range(num)]
    return [s % pp_size for s in range(num)]


def stage_specs(layer_split: list[tuple[str, ...]], pp_rank: int, owners: list[int]) -> list[StageSpec]:
    """The stages owned by ``pp_rank``, in increasing stage order."""
    num = len(layer_split)
    return [StageSpec(s, num, layer_split[s]) for s in range(num) if owners[s] == pp_rank]


_REGISTRIES = ("_modules", "_parameters", "_buffers", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
               "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _shallow_view(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` with its own registries (edits stay local) and its own forward hooks (the split
    model's guard against direct calls is not the view's: the schedule runs the views)."""
    view = copy.copy(module)
    for registry in _REGISTRIES:
        object.__setattr__(view, registry, type(getattr(module, registry))(getattr(module, registry)))
    return view


def stage_module(model: nn.Module, spec: StageSpec) -> nn.Module:
    """A view of ``model`` running only ``spec``'s part; shares all parameters and buffers with ``model``."""
    layout = layout_of(model)
    view = _shallow_view(model)

    def owner_in_view(path: str) -> tuple[nn.Module, str]:
        """The view's module owning ``path``'s last name; modules on the way become views too (once)."""
        *parents, name = path.split(".")
        mod = view
        for parent in parents:
            child = getattr(mod, parent)
            if not getattr(child, "_lightning_llm_stage_view", False):
                child = _shallow_view(child)
                object.__setattr__(child, "_lightning_llm_stage_view", True)
                setattr(mod, parent, child)
            mod = child
        return mod, name

    owner, name = owner_in_view(layout.layers)
    all_layers = getattr(owner, name)
    setattr(owner, name, nn.ModuleDict({k: all_layers[k] for k in spec.layers}))
    dropped = (() if spec.is_first else layout.first) + (() if spec.is_last else layout.last)
    for path in dropped:
        owner, name = owner_in_view(path)
        if getattr(owner, name, None) is not None:
            setattr(owner, name, None)
    return view


def tied_across_stages(model: nn.Module, num_stages: int) -> tuple[str, str] | None:
    """``(copy, source)``: the parameter names of a weight the family ties (a tied LM head) when a split puts its two
    uses on different stages; ``None`` otherwise."""
    tied = layout_of(model).tied(model)
    if num_stages < 2 or not tied:
        return None
    if len(tied) > 1:
        raise ValueError(f"pipeline parallelism supports one tied weight pair, {type(model).__name__} declares {tied}")
    return tied[0]


def prune_model(model: nn.Module, specs: Sequence[StageSpec]) -> None:
    """Delete, in place, the blocks and first/last modules that none of ``specs`` runs (names stay global)."""
    layout = layout_of(model)
    keep = {k for s in specs for k in s.layers}
    layers = module_at(model, layout.layers)
    for k in list(layers.keys()):
        if k not in keep:
            del layers[k]
    if not any(s.is_first for s in specs):
        for path in layout.first:
            _set_at(model, path, None)
    if not any(s.is_last for s in specs):
        for path in layout.last:
            _set_at(model, path, None)
