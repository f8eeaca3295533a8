"""Whole copies for decoding under layouts that split the model (tensor parallel, pipeline): a rollout's generation
and no-grad forwards run as on one device.

Under tensor parallelism every layer of every decoding step runs collectives over the tp group; under a pipeline
every token crosses the stages (and one stage works at a time unless micro-batches fill them, which pays only where
a stage call carries enough work). For a rollout batch (its generation, then the no-grad forwards of its old and
reference log-probs) that is most of the time of small and mid-sized models. So, when the whole model and the frozen
models a generation calls fit (at most half the free memory of the fullest rank: :mod:`.fit`), a decoding session
assembles a whole copy of each on every rank, once per session: tensor-parallel shards all-gathered (one flat collective per
mesh, shard dimension and dtype; other DTensors, e.g. ZeRO-3 x tp shards of a 3-D layout, by ``full_tensor``, cast to
its compute dtype), the tensors of the other pipeline stages broadcast by the rank owning them (one flat buffer per
owner and dtype, all in flight together). The ranks of a replica (``share_group``: pp x tp) then work as one device
would, without a collective per token, sharing the rows out (:mod:`.shares`): a forward (old and reference
log-probs) runs each rank's share and all-gathers the outputs; a generation whose tokens depend on each row's own
logits and draws (greedy, GRPO's per-prompt draws) decodes each rank's share and all-gathers the tokens; beam search
and one generator's draws decode the whole batch on every rank with the same draws. The copies are skeletons on
the meta device taken before the model is split; a session fills their registries (a rank's own whole tensors are
shared, not copied) and empties them when it ends, so nothing stays allocated between rollouts. A copy runs in its
live module's mode (dropout off after the task's ``eval()``). Sessions nest like ZeRO-3's, so a rollout's
generation and no-grad forwards share one assembly.

Which frozen models a generation calls, the task declares (``decoding_frozen_models()``: an RL rollout's reference,
whose log-probs it computes inside the session; not a distillation teacher, which runs after the student sampled):
only those are copied; any other runs the layout's way wherever it is called. The task reaches the copies through
``contract.decoding_copy`` (its ``run_model``, ``run_frozen`` and policy calls) and through the decoder a session
yields. PEFT adapters switched off on the policy (the reference of a LoRA
policy) are switched off on its copy at each lookup. Where the copies would not fit, or with
``gather_for_decoding="per_layer"``, the layout decodes as it trains (the run summary names the path).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_llm.strategies.decoding.fit import MIB, fit_in_free_memory
from lightning_llm.strategies.decoding.shares import RowShare
from lightning_llm.strategies.pipeline.decode import PipelineDecoder

log = logging.getLogger(__name__)

__all__ = ["WholeCopies", "copy_skeletons", "meta_skeleton"]


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (nothing is allocated; taken
    before the model is split or sharded, so it has every block and plain tensors). Regional ``torch.compile`` is
    dropped from it (a compiled call is bound to the original module)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(module, memo)
    for m in skeleton.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    return skeleton


def copy_skeletons(model: nn.Module, frozen: dict[str, nn.Module], *, task: Any, dims: Any, mode: str,
                   offload: bool) -> tuple[dict[str, nn.Module], str]:
    """``(skeletons, layout)``: meta skeletons of ``model`` (``task.model``) and the ``frozen`` models a generation
    calls (the task's ``decoding_frozen_models()``) for :class:`WholeCopies`, taken before the split, where the layout splits the model (``dims``: tp or pp > 1) and
    decoding may use them (``mode`` not ``per_layer``), and the layout's name for the run summary; ``({}, "")``
    otherwise."""
    if dims.tp == 1 and dims.pp == 1 or mode == "per_layer":
        return {}, ""
    blocker = ("expert parallelism" if dims.ep > 1 else "context parallelism" if dims.cp > 1
               else "offloaded parameters" if offload
               else "quantized weights" if getattr(task, "quantize", None) is not None
               else "a task without a model attribute" if getattr(task, "model", None) is not model else None)
    if blocker is not None:
        log.info("generation decodes through the layout itself (no whole copies with %s)", blocker)
        return {}, ""
    layout = " x ".join(f"{name} x{n}" for name, n in (("pp", dims.pp), ("tp", dims.tp)) if n > 1)
    return {"model": meta_skeleton(model), **{path: meta_skeleton(m) for path, m in frozen.items()}}, layout


def _live_tensor(root: nn.Module, name: str) -> Tensor | None:
    """``root``'s parameter or buffer ``name`` where this rank holds it (a pipeline split removes other stages'
    modules), else ``None``."""
    *path, leaf = name.split(".")
    mod: nn.Module | None = root
    for part in path:
        mod = mod._modules.get(part) if mod is not None else None
    if mod is None:
        return None
    return mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers.get(leaf)


def _even_shard(t: DTensor) -> int | None:
    """The dimension a 1-D mesh shards ``t`` on in equal blocks (``Shard(d)``, ``d`` divisible), else ``None``."""
    placements = t.placements
    if t.device_mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard):
        return None
    dim = placements[0].dim
    return dim if t.shape[dim] % t.device_mesh.size() == 0 else None


def _is_tuner(m: nn.Module) -> bool:
    """A PEFT layer that can be switched off (``BaseTunerLayer``, ``ModulesToSaveWrapper``)."""
    return callable(getattr(m, "enable_adapters", None)) and isinstance(getattr(m, "disable_adapters", None), bool)


@dataclass
class _Slot:
    """One tensor of a copy: every registry entry holding it (tied weights: several), where it comes from."""

    root: str
    names: list[str]
    is_param: bool
    meta: Tensor  # the skeleton's own (restored when a session ends)
    entries: list[tuple[nn.Module, str]] = field(default_factory=list)
    owner: int = -1  # the pipeline rank that sends it; -1: every pipeline rank holds it
    dtype: torch.dtype | None = None  # what the copy holds it in (a floating parameter: the compute dtype)


class WholeCopies:
    """The whole copies of one engine set-up (see the module docstring). ``roots``: path (relative to the task) ->
    the live, split or sharded module; ``skeletons``: the same paths -> :func:`meta_skeleton` taken before the split;
    ``layout``: how the run summary names the layout the copies stand in for (``pp x2 x tp x2``).
    ``share_group``: the ranks that decode the same rows (a replica's pipeline and tensor-parallel ranks), which
    share a row-wise generation's rows. ``dtype``: the compute dtype of floating parameters (ZeRO-3's
    mixed-precision ``param_dtype``), ``None``: theirs.
    """

    def __init__(self, roots: dict[str, nn.Module], skeletons: dict[str, nn.Module], *, layout: str, mode: str,
                 device: torch.device, pp_group: Any, pp_size: int, share_group: Any,
                 dtype: torch.dtype | None) -> None:
        self.roots, self.skeletons, self.layout, self.device = roots, skeletons, layout, device
        self.pp_group, self.pp_size, self.share_group = pp_group, pp_size, share_group
        self.slots = [s for path, skel in skeletons.items() for s in self._slots_of(path, skel)]
        for s in self.slots:
            s.dtype = dtype if dtype is not None and s.is_param and s.meta.is_floating_point() else s.meta.dtype
        self.extra = sum(s.meta.numel() * s.dtype.itemsize for s in self.slots)  # type: ignore[union-attr]
        self._index = {id(m): (path, name) for path, live in roots.items() for name, m in live.named_modules()}
        self._tuners = {path: ([m for m in roots[path].modules() if _is_tuner(m)],
                               [m for m in skel.modules() if _is_tuner(m)]) for path, skel in skeletons.items()}
        self._plan: tuple[str, str] | None = None if mode == "auto" else (mode, f"gather_for_decoding={mode}")
        self._owners_known = False
        self._depth = 0

    @staticmethod
    def _slots_of(path: str, skeleton: nn.Module) -> list[_Slot]:
        by_id: dict[int, _Slot] = {}
        for kind, named in ((True, skeleton.named_parameters(remove_duplicate=False)),
                            (False, skeleton.named_buffers(remove_duplicate=False))):
            for name, t in named:
                slot = by_id.setdefault(id(t), _Slot(path, [], kind, t))
                slot.names.append(name)
                owner, _, leaf = name.rpartition(".")
                slot.entries.append((skeleton.get_submodule(owner), leaf))
        return list(by_id.values())

    # ------------------------------------------------------------------------------------------ plan
    def plan(self) -> tuple[str, str]:
        """``("once" | "per_layer", why)``; with ``auto`` decided at the first session by the ranks that assemble the
        copies together (``share_group``: each replica decides for itself)."""
        if self._plan is None:
            fits, why = fit_in_free_memory(self.extra, device=self.device, group=self.share_group)
            self._plan = ("once" if fits else "per_layer", why)
            log.info("decoding with whole copies: %s (%s)", *self._plan)
        return self._plan

    @property
    def falls_back(self) -> bool:
        """The plan is known and it is the layout's own decoding."""
        return self._plan is not None and self._plan[0] != "once"

    def note(self) -> str:
        """The run summary's line (no collective)."""
        layout = self.layout
        frozen = [path for path in self.roots if path != "model"]  # the frozen models a generation calls
        if self._plan is None:
            return (f"generation under {layout}: whole copies of the model{''.join(f' and {p}' for p in frozen)} "
                    f"({self.extra / MIB:.1f} MiB) assembled once per generation or rollout, decoded as on one "
                    "device, if they fit in half the free memory of every rank at the first generation, else through "
                    f"the {layout} layout itself (gather_for_decoding=auto; the choice is logged)")
        mode, why = self._plan
        if mode == "once":
            return (f"generation under {layout}: whole copies assembled once per generation or rollout, decoded as on "
                    f"one device, no collective per token ({why})")
        return f"generation under {layout}: through the {layout} layout itself, the fallback ({why})"

    # ------------------------------------------------------------------------------------------ assembly
    def _live(self, slot: _Slot) -> Tensor | None:
        return next((t for n in slot.names if (t := _live_tensor(self.roots[slot.root], n)) is not None), None)

    def _whole_locals(self, slots: list[int]) -> dict[int, Tensor]:
        """The whole tensors of ``slots`` (indices) from this rank's own: plain tensors as they are, tensor-parallel
        shards (one dimension of a 1-D mesh, even) all-gathered in one flat collective per mesh, placement and dtype,
        any other DTensor by ``full_tensor``; cast to the compute dtype."""
        out: dict[int, Tensor] = {}
        flat_groups: dict[tuple[Any, ...], list[tuple[int, Tensor]]] = {}
        for i in slots:
            live = self._live(self.slots[i])
            assert live is not None
            if not isinstance(live, DTensor):
                out[i] = live.detach()
            elif (dim := _even_shard(live)) is not None:
                flat_groups.setdefault((id(live.device_mesh), dim, live.dtype), []).append((i, live))
            else:
                out[i] = live.full_tensor().detach()
        pending = []
        for (_, dim, dtype), members in flat_groups.items():
            mesh = members[0][1].device_mesh
            flat = torch.cat([t.to_local().detach().reshape(-1) for _, t in members])
            gathered = torch.empty(mesh.size() * flat.numel(), dtype=dtype, device=flat.device)
            work = dist.all_gather_into_tensor(gathered, flat, group=mesh.get_group(), async_op=True)
            pending.append((work, gathered.view(mesh.size(), -1), dim, members))
        for work, gathered, dim, members in pending:
            work.wait()
            offset = 0
            for i, t in members:
                local = t.to_local()
                n = local.numel()
                pieces = gathered[:, offset:offset + n].reshape(gathered.shape[0], *local.shape)  # [ws, *local]
                out[i] = pieces.movedim(0, dim).reshape(t.shape)  # rank r's block is the r-th along ``dim``
                offset += n
        return {i: t.to(self.slots[i].dtype) for i, t in out.items()}  # a no-op where the dtype is the same

    def _find_owners(self) -> None:
        """Which pipeline rank sends each tensor (the lowest holding it; one object all-gather, the first time)."""
        have = [any(_live_tensor(self.roots[s.root], n) is not None for n in s.names) for s in self.slots]
        every = [have]
        if self.pp_size > 1:
            every = [None] * self.pp_size
            dist.all_gather_object(every, have, group=self.pp_group)
        for i, slot in enumerate(self.slots):
            holders = [r for r, h in enumerate(every) if h[i]]
            if not holders:
                raise RuntimeError(f"whole copies for decoding: no rank holds {slot.root}.{slot.names[0]}")
            slot.owner = -1 if len(holders) == len(every) else holders[0]
        self._owners_known = True

    def _assemble(self) -> list[Tensor]:
        """Every slot's whole tensor on this rank (the collectives of one assembly, see the module docstring)."""
        if not self._owners_known:
            self._find_owners()
        me = dist.get_rank(self.pp_group) if self.pp_size > 1 else 0
        mine = self._whole_locals([i for i, s in enumerate(self.slots) if s.owner in (-1, me)])
        out: list[Tensor | None] = [mine.get(i) for i in range(len(self.slots))]
        groups: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, s in enumerate(self.slots):
            if s.owner != -1:
                groups.setdefault((s.owner, s.dtype), []).append(i)  # type: ignore[arg-type]
        pending = []
        for (owner, dtype), idx in groups.items():
            if owner == me:
                flat = torch.cat([out[i].reshape(-1) for i in idx])  # type: ignore[union-attr]
            else:
                flat = torch.empty(sum(self.slots[i].meta.numel() for i in idx), dtype=dtype, device=self.device)
            work = dist.broadcast(flat, dist.get_global_rank(self.pp_group, owner), group=self.pp_group,
                                  async_op=True)
            pending.append((work, flat, idx, owner == me))
        for work, flat, idx, mine in pending:
            work.wait()
            if mine:
                continue
            offset = 0
            for i in idx:
                n = self.slots[i].meta.numel()
                out[i] = flat[offset:offset + n].view(self.slots[i].meta.shape)
                offset += n
        return out  # type: ignore[return-value]

    def _install(self, tensors: list[Tensor] | None) -> None:
        """Put ``tensors`` into the skeletons' registries (``None``: their meta tensors back)."""
        for i, slot in enumerate(self.slots):
            value: Tensor = slot.meta if tensors is None else tensors[i]
            if tensors is not None and slot.is_param:
                value = nn.Parameter(value, requires_grad=False)
            for module, leaf in slot.entries:
                (module._parameters if slot.is_param else module._buffers)[leaf] = value

    # ------------------------------------------------------------------------------------------ use
    def copy_of(self, module: Any) -> RowShare | None:
        """What to call for ``module`` (a live root, a submodule of one, or a pipeline's decoder) while a session
        holds the copies, else ``None``: its copy, whose work the ranks of ``share_group`` share out
        (:class:`~.shares.RowShare`: forwards and row-wise generations). A copy's PEFT layers follow the live ones
        (switched off or on)."""
        if not self._depth:
            return None
        if isinstance(module, PipelineDecoder):
            whole: Any = functools.partial(self._copy(self.roots["model"]), **module.extra)
        else:
            whole = self._copy(module)
        return RowShare(whole, self.share_group, self.device) if whole is not None else None

    def _copy(self, module: Any) -> nn.Module | None:
        """The copy of the live ``module``, in its mode: the skeleton was taken in the mode of set-up (training), and
        dropout must be off where the task switched it off (``eval()`` before generating)."""
        found = self._index.get(id(module))
        if found is None:
            return None
        path, name = found
        self._follow_adapters(path)
        skeleton = self.skeletons[path]
        whole = skeleton.get_submodule(name) if name else skeleton
        if whole.training != module.training:
            whole.train(module.training)
        return whole

    def _follow_adapters(self, path: str) -> None:
        live, copies = self._tuners[path]
        if not live:
            return
        off = live[0].disable_adapters  # adapters_disabled switches every layer of the policy together
        for m in copies:
            if m.disable_adapters != off:
                m.enable_adapters(not off)

    @contextlib.contextmanager
    def session(self) -> Iterator[bool]:
        """Yields whether the copies are held (``False``: the fallback plan). The outermost session assembles them
        and empties them when it ends."""
        if self.plan()[0] != "once":
            yield False
            return
        if not self._depth:
            self._install(self._assemble())
        self._depth += 1
        try:
            yield True
        finally:
            self._depth -= 1
            if not self._depth:
                self._install(None)
