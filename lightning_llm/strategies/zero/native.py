"""Torch-native ZeRO engine pieces, applied by :class:`~lightning_llm.strategies.engine.strategy.ParallelEngine` (``zero*``).

Every function takes the data-parallel :class:`DeviceMesh` (the ``dp`` dim of ``ParallelDims``' mesh) explicitly, so
the same pieces shard over a sub-group when tensor/pipeline parallel dims are added later.

* Stages 1 and 2: :class:`PartitionedOptimizer`. Parameters stay whole on every rank (like DDP); each trainable
  parameter is *owned* by one data-parallel rank (greedy balance by size) and only the owner keeps its optimizer
  state. Gradients are reduced by :class:`~..grad_buckets.GradReducer` in buckets during backward: stage 1
  all-reduces them (all ranks keep full gradients, 4Ψ); stage 2 reduces each bucket to its owner and drops it on the
  other ranks (4Ψ/N). After the owner's local step the updated parameters are broadcast from their owners in
  buckets (:class:`~..grad_buckets.OwnerBroadcast`, each bucket's parameters packed into one buffer, so it moves
  them in place). This holds exactly ZeRO's model states per rank: stage 1 = 4Ψ + 4Ψ + 8Ψ/N, stage 2 =
  4Ψ + 12Ψ/N in fp32 (see ``benchmarks/results/zero-cpu.md``).
  FSDP2 with ``reshard_after_forward=False`` was not used for stage 2: it keeps its own parameter shard next to the
  all-gathered whole parameters (4Ψ + 16Ψ/N when parameters are whole at the step), or - with its default resharding
  after backward - only shards at the step, i.e. stage 3's memory.
* Stage 3: FSDP2 ``fully_shard`` on the units of :func:`fsdp_units` (parameters, gradients and optimizer states all
  sharded: 16Ψ/N), with :class:`MixedPrecisionPolicy` from the Trainer precision and :class:`CPUOffloadPolicy`.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_llm.logs import PER_RANK
from lightning_llm.models import family_roots
from lightning_llm.strategies.mesh import over_experts
from lightning_llm.strategies.engine.grad_buckets import (
    DEFAULT_BUCKET_MB,
    GradReducer,
    OwnerBroadcast,
)

log = logging.getLogger(__name__)

def fsdp_units(task: nn.Module, path: str = "model") -> tuple[str, ...]:
    """Stage-3 units, as module paths relative to the task (innermost first): the family's
    :attr:`~lightning_llm.models.parallel_spec.ParallelSpec.fsdp_units` of the model at ``path`` (``task.model``;
    each transformer block one all-gather/reduce-scatter unit; the backbone root takes the embeddings, final norm and
    head, and keeps tied embedding/head weights in one unit) for every family model inside it (PPO's actor-critic:
    the policy and a separate critic trunk), or that model whole for a model of no registered family. A task's own
    modules outside these units (a value head, modules outside ``task.model``) stay replicated (their gradients are
    averaged over ``dp``)."""
    try:
        model = task.get_submodule(path)
    except AttributeError:
        model = None
    roots = family_roots(model) if isinstance(model, nn.Module) else []
    if not roots:
        return (path,)
    return tuple(f"{path}.{prefix}{unit}".rstrip(".") for prefix, _, spec in roots for unit in spec.fsdp_units)


# ------------------------------------------------------------------------------------------------ stage 3 (FSDP2)


def fsdp_mixed_precision(precision: str) -> Any:
    """FSDP2 ``MixedPrecisionPolicy`` for a Lightning precision flag (compute dtype for params, fp32 reductions)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision.startswith("bf16-mixed"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision.startswith("16-mixed"):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # 32-true, bf16-true: parameters are already in their compute dtype


def apply_fsdp(
    root: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    units: Iterable[str],
    reshard_after_forward: bool = True,
    precision: str = "32-true",
    offload: bool = False,
) -> list[str]:
    """Shard ``root``'s submodules matching ``units`` (``named_modules`` paths, ``*`` = one component) with FSDP2, innermost
    units first. Returns the sharded paths; raises ``ValueError`` if no pattern matched anything."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": fsdp_mixed_precision(precision),
    }
    if offload:
        # Pinned host memory needs an accelerator runtime; plain pageable memory on CPU-only machines.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    modules = dict(root.named_modules())
    done: list[str] = []
    for pattern in units:
        for path in [p for p in modules if p and module_path_matches(p, pattern)]:
            fully_shard(modules[path], **kwargs)
            done.append(path)
    if not done:
        raise ValueError(f"ZeRO stage 3: none of the FSDP units {tuple(units)} matched a module of "
                         f"{type(root).__name__}; is the backbone built in configure_model()?")
    log.info("ZeRO-3: %d FSDP2 units over dp=%d (offload=%s, precision=%s)", len(done), dp_mesh.size(), offload,
             precision)
    return done


def shard_experts(root: nn.Module, *, edp_mesh: DeviceMesh, replicas: int, precision: str = "32-true",
                  offload: bool = False) -> list[str]:
    """ZeRO-3 under expert parallelism: every module holding expert-parallel shards (DTensors on the ``ep`` mesh)
    becomes an FSDP2 unit over ``edp_mesh``, the ranks holding the same experts (before the blocks' units, which
    then leave these parameters to it). Its gradients are summed over ``edp`` and divided by all ``replicas``: each
    expert rank's gradient already sums the tokens of its whole ``ep`` group. Returns the paths."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    kwargs: dict[str, Any] = {"mesh": edp_mesh, "reshard_after_forward": True,
                              "mp_policy": fsdp_mixed_precision(precision)}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    done = []
    for path, module in list(root.named_modules()):
        own = list(module.parameters(recurse=False))
        if own and all(isinstance(p, DTensor) and over_experts(p.device_mesh) for p in own):
            fully_shard(module, **kwargs)
            module.set_gradient_divide_factor(float(replicas))  # type: ignore[operator]
            done.append(path)
    log.info("ZeRO-3: %d expert units over edp=%d", len(done), edp_mesh.size())
    return done


def module_path_matches(path: str, pattern: str) -> bool:
    """``*`` matches exactly one dotted component (``model.layers.*`` is the blocks, not their submodules)."""
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


# ------------------------------------------------------------------------------------------------ stages 1 and 2


def partition_parameters(params: list[Tensor], world_size: int) -> list[int]:
    """Owner rank of each parameter: largest first onto the least-loaded rank (deterministic on every rank)."""
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    load = [0] * world_size
    owner = [0] * len(params)
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += params[i].numel()
    return owner


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class PartitionedOptimizer(Optimizer):
    """ZeRO stage 1/2 around an already-built optimizer: same param groups and hyperparameters (so LR schedulers keep
    working on ``param_groups``), but the inner optimizer only holds this rank's owned parameters.

    Gradients are reduced by the strategy's :class:`~..grad_buckets.GradReducer` (to their :meth:`owner` under stage
    2); the optimizer ``step`` runs the closure (forward + backward, gradients reduced), steps the owned parameters and
    broadcasts them from their owners in buckets of ``bucket_size_mb``.
    """

    def __init__(self, optimizer: Optimizer, *, dp_mesh: DeviceMesh, stage: int, offload: bool = False,
                 bucket_size_mb: float = DEFAULT_BUCKET_MB) -> None:
        if stage not in (1, 2):
            raise ValueError(f"PartitionedOptimizer: stage={stage}, must be 1 or 2 (stage 3 is FSDP2)")
        self.stage = stage
        self.offload = offload
        self.group = dp_mesh.get_group()
        self.world = dp_mesh.size()
        self.rank = dp_mesh.get_local_rank()
        groups = optimizer.param_groups
        params = [p for g in groups for p in g["params"]]
        self._owner_of = dict(zip(map(id, params), partition_parameters(params, self.world)))
        super().__init__(groups, optimizer.defaults)  # reuses the group dicts: an LR scheduler sees the same lr
        self.owned = [p for p in params if self._owner_of[id(p)] == self.rank]
        # Owned parameters the inner optimizer updates: the parameters themselves, or fp32 CPU masters when offloading.
        self._master: dict[int, nn.Parameter] = {}
        inner_groups = []
        self._outer: list[int] = []  # the full group of each inner group (a rank owning none of a group skips it)
        for index, g in enumerate(groups):
            mine = [p for p in g["params"] if self._owner_of[id(p)] == self.rank]
            if offload:
                mine = [self._master.setdefault(id(p), nn.Parameter(_local(p).detach().to("cpu", torch.float32,
                                                                                            copy=True)))
                        for p in mine]
            if mine:
                inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": mine})
                self._outer.append(index)
        # Every hyperparameter is in the group dicts, so the optimizer class needs no constructor defaults.
        self.local_optimizer = type(optimizer)(inner_groups) if inner_groups else None
        # Packs each broadcast bucket's parameters into one buffer (their storage moves; values, shapes, identity
        # stay), so the broadcast after every step sends and receives in place.
        self._broadcast = OwnerBroadcast(params, [self._owner_of[id(p)] for p in params], group=self.group,
                                         rank=self.rank, bucket_size_mb=bucket_size_mb) if self.world > 1 else None
        log.info("ZeRO-%d: rank %d owns %d/%d tensors (%s of %s elements)%s", stage, self.rank, len(self.owned),
                 len(params), f"{sum(p.numel() for p in self.owned):,}", f"{sum(p.numel() for p in params):,}",
                 ", optimizer offloaded to CPU" if offload else "", extra=PER_RANK)

    @property
    def masters(self) -> dict[int, nn.Parameter]:
        """``id(parameter) -> fp32 CPU master`` of the owned parameters when offloading (what the states belong to)."""
        return dict(self._master)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the owned parameters into their fp32 masters: after weights were loaded into the parameters (a
        resume), the masters would otherwise still hold the values from construction and overwrite them."""
        for p in self.owned:
            master = self._master.get(id(p))
            if master is not None:
                master.copy_(_local(p).detach().to(master.device, master.dtype))

    def owner(self, p: Tensor) -> int:
        return self._owner_of[id(p)]

    @property
    def skips_on_found_inf(self) -> bool:
        """Whether a ``found_inf`` tensor set on this optimizer (the non-finite guard's flag, as a GradScaler sets it)
        skips the step on the device: the owned parameters are stepped by torch's fused kernel where they live (not
        offloaded to CPU masters, whose kernel would read a device flag before it arrives)."""
        return not self.offload and bool(self.param_groups) and all(g.get("fused") for g in self.param_groups)

    # ------------------------------------------------------------------------------------------ optimizer API
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # forward + backward; the strategy's reducer has reduced the gradients
        if self.local_optimizer is not None:
            for mine, index in zip(self.local_optimizer.param_groups, self._outer, strict=True):
                # lr from the scheduler, etc., from the group it came from (not by position: groups this rank owns
                # nothing of are not in the inner optimizer)
                mine.update({k: v for k, v in self.param_groups[index].items() if k != "params"})
            if self.offload:
                for p in self.owned:
                    m = self._master[id(p)]
                    m.grad = None if p.grad is None else _local(p.grad).to("cpu", torch.float32)
            found_inf = getattr(self, "found_inf", None)
            if found_inf is not None:  # handed to the fused kernel: 1.0 leaves every owned weight and moment
                self.local_optimizer.found_inf = found_inf
            try:
                self.local_optimizer.step()
            finally:
                self.local_optimizer.__dict__.pop("found_inf", None)
            if self.offload:
                for p in self.owned:
                    _local(p).copy_(self._master[id(p)])
        if self._broadcast is not None:
            self._broadcast()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for m in self._master.values():
            m.grad = None

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (owned parameters only)."""
        return {"rank": self.rank, "world_size": self.world, "stage": self.stage,
                # lr etc. of the full groups: the inner groups get them from here before every step
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "state": self.local_optimizer.state_dict() if self.local_optimizer is not None else None}

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world or state["rank"] != self.rank:
            raise ValueError(f"ZeRO-{self.stage} optimizer shard was saved by rank {state['rank']} of "
                             f"{state['world_size']}; this is rank {self.rank} of {self.world} (resume with the same "
                             "number of data-parallel ranks, or load the consolidated weights instead)")
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        if self.local_optimizer is not None and state["state"] is not None:
            self.local_optimizer.load_state_dict(state["state"])

    # Lightning's generic checkpointing calls these; shards go through the strategy's own save/load.
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.local_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.load_local_state_dict(state_dict)


def partition_optimizers(optimizers: list[Any], scheduler_configs: list[Any], *, dp_mesh: DeviceMesh, stage: int,
                         offload: bool, bucket_size_mb: float) -> tuple[list[PartitionedOptimizer], dict[int, int]]:
    """The task's optimizers as :class:`PartitionedOptimizer` (ZeRO-1/2) over ``dp_mesh``, their LR schedulers
    pointed at the wrappers (the same param-group dicts), and ZeRO-2's ``id(param) -> owner`` (empty for stage 1)."""
    wrapped, owners = [], {}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        zero = PartitionedOptimizer(opt, dp_mesh=dp_mesh, stage=stage, offload=offload, bucket_size_mb=bucket_size_mb)
        for cfg in scheduler_configs:
            if getattr(cfg.scheduler, "optimizer", None) is opt:
                cfg.scheduler.optimizer = zero
        if stage == 2:
            owners.update({id(p): zero.owner(p) for g in zero.param_groups for p in g["params"]})
        wrapped.append(zero)
    return wrapped, owners


@contextmanager
def gradient_sync_paused(module: nn.Module, reducer: GradReducer | None) -> Iterator[None]:
    """Skip gradient communication on accumulation micro-batches: the bucketed reduction and FSDP2's reduce-scatter
    wait for the last micro-batch of the accumulation window."""
    fsdp = [m for m in module.modules() if hasattr(m, "set_requires_gradient_sync")]
    for m in fsdp:
        m.set_requires_gradient_sync(False, recurse=False)
    try:
        if reducer is None:
            yield
        else:
            with reducer.pause():
                yield
    finally:
        for m in fsdp:
            m.set_requires_gradient_sync(True, recurse=False)


# ------------------------------------------------------------------------------------------------ measurement


def model_state_bytes(module: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, int]:
    """Bytes this rank holds in live tensors, split into ``params``, ``grads`` and ``optim`` (optimizer states plus
    any master copies the optimizer updates). Storages are counted once (shared/tied/viewed tensors are not double
    counted); DTensors count their local shard; FSDP2's all-gathered parameters count while they are alive."""
    seen: set[tuple[int, str]] = set()

    def size(t: Tensor | None) -> int:
        if t is None:
            return 0
        t = _local(t)
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if st.data_ptr() == 0 or key in seen:
            return 0
        seen.add(key)
        return st.nbytes()

    out = {"params": 0, "grads": 0, "optim": 0}
    params = list(module.parameters())
    for p in params:
        out["params"] += size(p)
    for fsdp_param in _fsdp_params(module):  # unsharded FSDP2 buffers (alive between all-gather and reshard)
        for t in getattr(fsdp_param, "all_gather_outputs", None) or []:
            out["params"] += size(t)
    for p in params:
        out["grads"] += size(p.grad)
    module_ids = {id(p) for p in params}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # LightningOptimizer
        inner = getattr(opt, "local_optimizer", opt)
        if inner is None:
            continue
        for g in inner.param_groups:
            for p in g["params"]:
                if id(p) not in module_ids:  # master copies (offload) count as optimizer state
                    out["optim"] += size(p) + size(p.grad)
        for state in inner.state.values():
            for v in state.values():
                if isinstance(v, Tensor):
                    out["optim"] += size(v)
    return out


def _fsdp_params(module: nn.Module) -> list[Any]:
    out = []
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        if group is not None:
            out.extend(group.fsdp_params)
    return out
