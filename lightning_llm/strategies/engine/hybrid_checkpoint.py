"""Layout-free checkpoints of the 3-D strategy: ``torch.distributed.checkpoint`` keyed by global names.

A checkpoint directory saved at any (dp, tp, pp, zero_stage) loads at any other, optimizer state included::

    <dir>/.metadata, <dir>/__<rank>_0.distcp
        {"model": {fqn: tensor},                     # LightningModule state-dict names (``model.layers.0...``)
         "optim_0": {"<fqn>/<state key>": tensor}}   # e.g. ``model.layers.0.mlp.up_proj.weight/exp_avg``
    <dir>/meta.pt   everything else Lightning checkpoints (loops, schedulers, callbacks, datamodule) plus, per
                    optimizer, its param-group hyperparameters and the kind of each state key

Why this works across layouts: names are global (a pipeline split keeps ``layers.2...``); TP/FSDP shards are
DTensors whose DCP metadata is the full tensor, so DCP reads whichever chunks the new layout needs; a tensor that
several ranks hold whole (data-parallel replicas) is written once. Optimizer states are flattened per parameter name
(not per position in ``param_groups``) so a rank that now owns different parameters (another pipeline split or ZeRO
partition) reads exactly its own. One process (``strategy=3d`` with all degrees 1) reads and writes the same format.

Every function here that touches tensors is a collective: call it on all ranks.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_llm.checkpoint import (
    CheckpointError,
    SafeEmptyLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    dcp_refusals,
    first_line,
    load_file,
    read_dcp_metadata,
)
from lightning_llm.files import atomic_open, atomic_path
from lightning_llm.models.quantize import is_quantized
from lightning_llm.reliability import publish, remove_path, staging_path

log = logging.getLogger(__name__)

__all__ = [
    "META_FILE",
    "checkpoint_state",
    "consolidated_state_dict",
    "dcp_contents",
    "every_rank_agrees",
    "from_lightning_checkpoint",
    "is_hybrid_checkpoint",
    "load_hybrid",
    "meta_bytes",
    "optimizer_flat_state",
    "save_hybrid",
    "write_hybrid",
]

META_FILE = "meta.pt"
LAYOUT_KEYS = ("fused", "foreach", "capturable")
"""Param-group keys a resume keeps from this run's optimizer: how the step runs on this layout (a fused kernel takes
all of a device's parameters: tensor parallelism may mix DTensors and plain ones where the saving layout had not)."""
FORMAT = "lightning_llm.dcp/1"


def is_hybrid_checkpoint(path: str | Path) -> bool:
    p = Path(path) / META_FILE
    if not p.is_file():
        return False
    return _read_meta(Path(path)).get("format") == FORMAT


def _read_meta(path: Path) -> dict[str, Any]:
    """``meta.pt``: plain data, read with the restricted unpickler (``lightning_llm.checkpoint.safe_load``)."""
    return load_file(path / META_FILE, name=f"{path}: {META_FILE}")


def _inner(opt: Optimizer) -> Optimizer:
    return getattr(opt, "_optimizer", opt)  # LightningOptimizer


def _stateful(opt: Optimizer) -> Optimizer | None:
    """The torch optimizer that holds the states: the partitioned (ZeRO-1/2) optimizer's local one."""
    opt = _inner(opt)
    return getattr(opt, "local_optimizer", opt) if hasattr(opt, "local_optimizer") else opt


def _names(module: nn.Module, opt: Optimizer) -> dict[int, str]:
    """Parameter name by tensor id, also for the fp32 master copies an offloading optimizer updates instead."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for pid, master in getattr(_inner(opt), "masters", {}).items():
        names[id(master)] = names[pid]
    return names


def optimizer_flat_state(module: nn.Module, opt: Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """``({"<fqn>/<key>": tensor}, meta)`` for the parameters whose state this rank holds, and the layout-free meta
    (hyperparameters of every param group, and ``{key: ("param" | "scalar", dtype)}``)."""
    names = _names(module, opt)
    inner = _stateful(opt)
    flat: dict[str, Tensor] = {}
    kinds: dict[str, tuple[str, torch.dtype]] = {}
    if inner is not None:
        for p, state in inner.state.items():
            fqn = names.get(id(p))
            if fqn is None:
                raise RuntimeError("optimizer holds a parameter that is not in the module")
            for k, v in state.items():
                if not isinstance(v, Tensor):
                    continue
                kind = "param" if v.shape == p.shape and v.dim() > 0 else "scalar"
                kinds[k] = (kind, v.dtype)
                flat[f"{fqn}/{k}"] = v
    groups = [{k: v for k, v in g.items() if k != "params"} for g in _inner(opt).param_groups]
    return flat, {"param_groups": groups, "kinds": kinds}


def _merge_kinds(local: dict[str, Any]) -> dict[str, Any]:
    """State-key kinds known to any rank (a pipeline rank or ZeRO owner may hold no state)."""
    if not dist.is_initialized():
        return local
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    out: dict[str, Any] = {}
    for d in every:
        out.update(d)
    return out


def checkpoint_state(module: nn.Module,
                     optimizers: Sequence[Optimizer]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(state, optimizer_meta)``: the live tensors DCP writes (``model`` and ``optim_<i>`` per parameter name) and
    each optimizer's layout-free meta. A collective (the state keys' kinds are merged over the ranks)."""
    state: dict[str, Any] = {"model": saved_model_state(module)}
    opt_meta = []
    for i, opt in enumerate(optimizers):
        flat, meta = optimizer_flat_state(module, opt)
        meta["kinds"] = _merge_kinds(meta["kinds"])
        state[f"optim_{i}"] = flat
        opt_meta.append(meta)
    return state, opt_meta


def meta_bytes(metadata: Mapping[str, Any], *, layout: Mapping[str, Any],
               optimizer_meta: list[dict[str, Any]]) -> bytes:
    """``meta.pt``'s content, serialized now: what it records cannot change while the shards are written later."""
    buf = io.BytesIO()
    torch.save({**metadata, "format": FORMAT, "layout": dict(layout), "optimizer_meta": optimizer_meta}, buf)
    return buf.getvalue()


def save_hybrid(
    path: str | Path,
    *,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    metadata: Mapping[str, Any],
    layout: Mapping[str, Any],
    is_global_zero: bool,
    on_shards_written: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``module``'s state dict and every optimizer's per-name state with DCP; rank 0 writes the metadata
    (:func:`write_hybrid`)."""
    state, opt_meta = checkpoint_state(module, optimizers)
    meta = meta_bytes(metadata, layout=layout, optimizer_meta=opt_meta) if is_global_zero else b""
    return write_hybrid(path, state, meta, is_global_zero=is_global_zero, on_shards_written=on_shards_written)


def write_hybrid(path: str | Path, state: dict[str, Any], meta: bytes, *, is_global_zero: bool,
                 group: dist.ProcessGroup | None = None,
                 on_shards_written: Callable[[Path], None] | None = None) -> Path:
    """Write ``state`` (:func:`checkpoint_state`, or a copy of it staged in host memory) with DCP and ``meta``
    (rank 0's :func:`meta_bytes`) as ``meta.pt``, over ``group`` (default: the world).

    Atomic: every rank writes into a staging directory beside ``path``; once all are done, rank 0 swaps it in
    (:func:`~lightning_llm.reliability.publish`). A crash at any moment leaves the previous checkpoint whole. Every
    step is agreed over the ranks (:func:`every_rank_agrees`): a failure on one rank (rank 0's metadata or swap, a
    disk full on one rank) raises on all of them, none is left waiting for it."""
    p = Path(path)
    staged = staging_path(p)

    def prepare() -> None:
        if is_global_zero and (staged.exists() or staged.is_symlink()):  # left by a crashed save
            remove_path(staged)

    every_rank_agrees(prepare, group)
    every_rank_agrees(lambda: staged.mkdir(parents=True, exist_ok=True), group)
    dcp.save(state, checkpoint_id=staged, process_group=group)

    def finish_shards() -> None:
        if on_shards_written is not None:  # fault injection in tests
            on_shards_written(p)
        if is_global_zero:
            with atomic_open(staged / META_FILE, "wb") as f:
                f.write(meta)

    every_rank_agrees(finish_shards, group)  # every rank's shards are complete
    every_rank_agrees(lambda: publish(staged, p) if is_global_zero else None, group)
    log.info("saved 3-D checkpoint to %s", p)
    return p


def every_rank_agrees(fn: Callable[[], Any], group: dist.ProcessGroup | None = None) -> None:
    """Run ``fn`` on every rank of ``group``, then agree: if it failed on any rank, raise on every rank (the
    failing rank its own exception, the others one naming that rank and its error). A collective."""
    error: Exception | None = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = e
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, None if error is None else first_line(error), group=group)
    if error is not None:
        raise error
    failed = [(rank, msg) for rank, msg in enumerate(every) if msg is not None]
    if failed:
        rank, msg = failed[0]
        raise CheckpointError(f"saving the checkpoint failed on rank {rank} of its group ({msg})")


def saved_model_state(module: nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of ``module``: its state dict without quantized frozen weights (torchao's tensors of
    a ``--model.quantize`` run, plain or as a DTensor's shards): they are rebuilt from the backbone, and a checkpoint
    keeps the quantization settings instead (their pickled subclass would not load with ``weights_only`` either)."""
    return {k: v for k, v in module.state_dict().items() if not is_quantized(getattr(v, "_local_tensor", v))}


def _template(module: nn.Module, opt: Optimizer, kinds: Mapping[str, tuple[str, torch.dtype]],
              saved: set[str], prefix: str) -> dict[str, Any]:
    """Empty state tensors, shaped and sharded like this rank's parameters, for DCP to fill: the keys the checkpoint
    holds for each (``saved``, DCP's flattened ``<prefix>.<fqn>/<key>``: an optimizer whose groups keep different
    states, Muon's momentum beside AdamW's moments, has no AdamW key for a Muon parameter)."""
    names = _names(module, opt)
    inner = _stateful(opt)
    out: dict[str, Any] = {}
    if inner is None:
        return out
    for group in inner.param_groups:
        for p in group["params"]:
            fqn = names[id(p)]
            for k, (kind, dtype) in kinds.items():
                if f"{prefix}.{fqn}/{k}" in saved:
                    out[f"{fqn}/{k}"] = (torch.zeros_like(p, dtype=dtype) if kind == "param"
                                         else torch.zeros((), dtype=dtype))
    return out


def _check_kind(path: Path, opt: Optimizer, saved: list[dict[str, Any]]) -> None:
    """Refuse an optimizer of another kind (Muon's groups against AdamW's): its states and groups would be paired
    with others."""
    groups = _inner(opt).param_groups
    if any(g.get("muon") for g in groups) != any(g.get("muon") for g in saved):
        def kind(gs: list[dict[str, Any]]) -> str:
            return f"{len(gs)} param groups ({'Muon + AdamW' if any(g.get('muon') for g in gs) else 'AdamW'})"
        raise ValueError(f"--ckpt_path={path}: its optimizer has {kind(saved)}, this run's has {kind(groups)}: resume "
                         "with the checkpoint's --model.optim.name, or load its weights only")


def _restore_groups(opt: Optimizer, saved: list[dict[str, Any]]) -> None:
    """The checkpoint's param-group hyper-parameters into this optimizer's groups, but for how this layout runs the
    step (:data:`LAYOUT_KEYS`). AdamW's groups pair by position; Muon's (``muon``) by the matrices they hold
    (``matrices``): a pipeline stage, or rank 0 that saved them, has only the kinds its layers hold."""
    groups = _inner(opt).param_groups
    muon = {tuple(g["matrices"]): g for g in saved if g.get("muon")}
    pairs = list(zip([g for g in groups if not g.get("muon")], [g for g in saved if not g.get("muon")]))
    pairs += [(g, muon[tuple(g["matrices"])]) for g in groups if g.get("muon") and tuple(g["matrices"]) in muon]
    for group, old in pairs:
        group.update({k: v for k, v in old.items() if k not in LAYOUT_KEYS})


def load_hybrid(
    path: str | Path,
    *,
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    strict: bool = True,
) -> dict[str, Any]:
    """Load a :func:`save_hybrid` directory into the already-parallelized ``module`` and its optimizers (pass none
    to load weights only); returns the Lightning metadata. The saved layout may differ from the current one."""
    p = Path(path)
    meta = _read_meta(p)
    if meta.get("format") != FORMAT:
        raise ValueError(f"--ckpt_path={p}: not a strategy=3d checkpoint directory")
    model_state = saved_model_state(module)
    saved_keys = set(read_dcp_metadata(p, name=f"--ckpt_path={p}: .metadata").state_dict_metadata)
    missing = [k for k in model_state if f"model.{k}" not in saved_keys]
    if missing and strict:
        raise KeyError(f"--ckpt_path={p}: the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    wanted = {"model": {k: v for k, v in model_state.items() if k not in missing}}
    opt_meta = meta.pop("optimizer_meta", [])
    for i, opt in enumerate(optimizers):
        if i < len(opt_meta):
            _check_kind(p, opt, opt_meta[i]["param_groups"])  # before reading a shard
            wanted[f"optim_{i}"] = _template(module, opt, opt_meta[i]["kinds"], saved_keys, f"optim_{i}")
    _read_shards(wanted, p)
    module.load_state_dict(wanted["model"], strict=False)  # DCP filled the tensors in place; this covers copies
    for opt in optimizers:  # offloaded fp32 masters follow the loaded weights
        refresh = getattr(_inner(opt), "refresh_masters", None)
        if refresh is not None:
            refresh()
    for i, opt in enumerate(optimizers):
        if i >= len(opt_meta):
            continue
        _restore_groups(opt, opt_meta[i]["param_groups"])
        inner = _stateful(opt)
        if inner is None:
            continue
        names = _names(module, opt)
        flat = wanted[f"optim_{i}"]
        for group in inner.param_groups:
            for prm in group["params"]:
                fqn = names[id(prm)]
                st = {k: flat[f"{fqn}/{k}"] for k in opt_meta[i]["kinds"] if f"{fqn}/{k}" in flat}
                if st:
                    inner.state[prm] = st
    meta.pop("format", None)
    meta["state_dict"] = wanted["model"]  # for on_load_checkpoint hooks (e.g. a PEFT task checks its keys)
    log.info("loaded 3-D checkpoint %s saved at layout %s", p, meta.get("layout"))
    return meta


def _read_shards(wanted: dict[str, Any], path: Path) -> None:
    """``dcp.load`` with a failure (a shard cut or corrupted in the middle, which the size checks before cannot see)
    raised as one line naming the directory. DCP gathers every rank's failure and raises on all of them, so every
    rank stops here with the same error."""
    from torch.distributed.checkpoint.api import CheckpointException

    name = f"--ckpt_path={path}"
    try:
        with dcp_refusals():
            dcp.load(wanted, storage_reader=SafeFileSystemReader(path, name=name), planner=SafeLoadPlanner(name=name))
    except CheckpointException as e:
        rank, (exc, _) = next(iter(e.failures.items()))
        raise CheckpointError(f"--ckpt_path={path}: corrupt checkpoint directory: reading its shards failed on rank "
                              f"{rank} ({first_line(exc)})") from e


def full_weights(module: nn.Module) -> dict[str, Tensor]:
    """The module's full (unsharded) weights on CPU on rank 0, ``{}`` elsewhere (a collective over DTensor shards)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    frozen_quantized = set(module.state_dict()) - set(saved_model_state(module))
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=bool(frozen_quantized)))
    # A view of a larger storage (ZeRO-1/2 pack parameters into their broadcast bucket's buffer) is cloned:
    # torch.save writes whole storages, so a file of a few tensors would otherwise hold whole buckets.
    return {k: v.clone() if isinstance(v, Tensor) and v.untyped_storage().nbytes() != v.nbytes else v
            for k, v in full.items()}


def load_full_weights(module: nn.Module, state_dict: Mapping[str, Tensor], *, strict: bool) -> None:
    """Full tensors into a (sharded, possibly pipeline-split) module; keys this rank does not hold are skipped."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    local = set(module.state_dict())
    set_model_state_dict(module, {k: v for k, v in state_dict.items() if k in local},
                         options=StateDictOptions(full_state_dict=True, strict=strict))


def dcp_contents(path: str | Path, *, name: str | None = None) -> dict[str, Any]:
    """Offline (no process group): every tensor and object of a DCP directory, loaded whole on this process (the
    index and stored objects through the restricted unpicklers; ``name`` starts their errors)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    out: dict[str, Any] = {}
    with dcp_refusals():
        _load_state_dict(out, storage_reader=SafeFileSystemReader(path, name=name),
                         planner=SafeEmptyLoadPlanner(name=name or str(path)), no_dist=True)
    return out


def consolidated_state_dict(path: str | Path, *, name: str | None = None) -> dict[str, Any]:
    """Offline (no process group): the full weights of a :func:`save_hybrid` directory, as a plain Lightning
    checkpoint dict (``state_dict`` with full tensors + the metadata; no optimizer states)."""
    p = Path(path)
    meta = _read_meta(p)
    sd = dcp_contents(p, name=name)
    meta.pop("optimizer_meta", None)
    return {**meta, "state_dict": dict(sd.get("model", {})), "optimizer_states": []}


def from_lightning_checkpoint(ckpt: str | Path, output: str | Path) -> Path:
    """Offline: convert a plain Lightning ``.ckpt`` (one device / DDP) into a ``strategy=3d`` directory holding its
    weights and loop/scheduler/data state. Optimizer states are not converted (Lightning keys them by position in
    ``param_groups``, not by name): a run resumed from the result starts with fresh optimizer states. To carry them,
    resume the ``.ckpt`` once with ``strategy=3d`` on one device and save from there."""
    src = load_file(Path(ckpt), name=str(ckpt))
    out = Path(output)
    staged = staging_path(out)  # written whole, then published: a crash leaves no directory that looks complete
    if staged.exists() or staged.is_symlink():  # left by a crashed conversion
        remove_path(staged)
    staged.parent.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save({"model": dict(src["state_dict"])}, checkpoint_id=staged, no_dist=True)
        meta = {k: v for k, v in src.items() if k not in ("state_dict", "optimizer_states")}
        with atomic_path(staged / META_FILE) as tmp:
            torch.save({**meta, "format": FORMAT, "layout": {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0},
                        "optimizer_meta": []}, tmp)
        publish(staged, out)
    except BaseException:
        remove_path(staged)
        raise
    return out
