"""Parameter initialisation as data: layout-independent random init, and materialising meta-device models.

Every initial parameter value of a model family is a pure function of ``(model.init_seed, parameter name, element
index)``: a counter-based generator (SplitMix64 outputs -> Box-Muller normals) computes the value of any element
without generating the ones before it. So a rank holding one shard of a parameter (a tensor-parallel slice, an FSDP2
row block, a pipeline stage's layers) computes exactly the values the whole tensor has on one device, without ever
holding the whole tensor, and the init consumes nothing of torch's global generator (a model built on the meta
device and one built on the CPU leave the same RNG state behind).

What each parameter gets is declared as :data:`InitPlan` (name -> :class:`Init`) by the family at construction
(``model.init_plan``): ``normal(std)``, ``zeros`` or ``ones``, keyed by the name whose stream it draws from (a tied
LM head draws from ``embed_tokens.weight``). :func:`materialize` turns the meta tensors of a module into real ones and
fills each from the module's checkpoint source (``model.weights_source``, set by a lazy HF load) or its plan; it
works on the tensors a caller hands it with their global indices, so the strategies pass shards (this module holds no
parallel code).

Shapes: ``index`` is one ``LongTensor`` of global indices per dim of the parameter (a shard is the cartesian
product of them); values are generated for ``prod(len(i) for i in index)`` elements.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from .layers.block import LayerNorm, RMSNorm

log = logging.getLogger(__name__)

__all__ = ["Init", "InitPlan", "WeightsSource", "canonical_name", "draw_init_seed", "fill_", "init_plan_of",
           "init_whole", "is_meta", "materialize", "materialize_in_parts", "normal_values", "plan_for_modules"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK = 1 << 17  # elements generated at a time
FILL_SCRATCH_BYTES = _CHUNK * 160
"""Peak scratch of :func:`fill_` (the generator's int64/float64 temporaries of one chunk: 18-25 MB measured)."""


def _signed(x: int) -> int:
    """A uint64 as the int64 with the same bits (torch has no uint64 arithmetic)."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(seed: int, counter: Tensor) -> Tensor:
    """The ``counter``-th output (0-based, int64 tensor) of SplitMix64 seeded with ``seed``, as int64 bits.

    int64 multiplication wraps modulo 2**64 in torch's kernels, which is the uint64 arithmetic SplitMix64 needs
    (checked against a pure-Python implementation in the tests)."""
    z = (counter + 1) * _signed(_GOLDEN) + _signed(seed)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def normal_values(seed: int, flat_index: Tensor) -> Tensor:
    """Standard normals (float64) of elements ``flat_index`` of the stream ``seed``: Box-Muller on the two 32-bit
    halves of SplitMix64's output ``i`` (uniforms in (0, 1), so ``|z| < 6.7``)."""
    bits = splitmix64(seed, flat_index)
    u1 = (_shr(bits, 32).double() + 0.5) * 2.0**-32
    u2 = ((bits & 0xFFFFFFFF).double() + 0.5) * 2.0**-32
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def name_seed(init_seed: int, name: str) -> int:
    """The stream of one parameter: a stable hash of the model's seed and the parameter's name (not Python's
    salted ``hash``, so every process agrees)."""
    digest = hashlib.blake2b(f"{init_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def draw_init_seed() -> int:
    """A model's seed, drawn once from torch's CPU generator (so ``torch.manual_seed`` decides the init)."""
    return int(torch.randint(0, 2**62, (1,), device="cpu"))


@dataclass(frozen=True)
class Init:
    """How one parameter starts: ``normal`` (mean 0, ``std``) drawn from the stream of ``key``, or ``constant``."""

    kind: str  # "normal" | "constant" | "log_uniform"
    value: float = 0.0  # std of a normal, the constant, or a log-uniform's upper bound
    key: str = ""  # the name whose random stream a normal draws from (the parameter's own; a tied head's source)
    low: float = 0.0  # a log-uniform's lower bound

    @staticmethod
    def normal(std: float, key: str) -> Init:
        return Init("normal", std, key)

    @staticmethod
    def constant(value: float) -> Init:
        return Init("constant", value)

    @staticmethod
    def log_uniform(low: float, high: float, key: str) -> Init:
        """``log(u)``, ``u`` uniform in ``[low, high)`` (Gated DeltaNet's decay rates ``A_log``)."""
        return Init("log_uniform", high, key, low)


InitPlan = dict[str, Init]
"""Parameter name (relative to the family model) -> its :class:`Init`."""


def full_index(shape: Sequence[int], device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    """The index of a whole tensor: ``arange(n)`` per dim."""
    return tuple(torch.arange(n, device=device) for n in shape)


@torch.no_grad()
def fill_(local: Tensor, init: Init, *, seed: int, index: Sequence[Tensor], shape: Sequence[int]) -> None:
    """Write ``init``'s values of the elements ``index`` (global, one index per dim of ``shape``) into ``local``
    (whose shape is ``[len(i) for i in index]``). Normal values are computed in float64, in row chunks."""
    if init.kind == "constant":
        local.fill_(init.value)
        return
    if local.numel() == 0:
        return
    stream = name_seed(seed, init.key)
    dev = local.device
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    rest = torch.zeros((), dtype=torch.long, device=dev)  # flat offsets of dims 1.. (broadcast) [n1*n2*...]
    for d in range(1, len(shape)):
        rest = (rest.unsqueeze(-1) + index[d].to(dev) * strides[d])
    rest = rest.reshape(-1)
    rows = index[0].to(dev) * strides[0] if len(shape) else torch.zeros(1, dtype=torch.long, device=dev)
    per_row = max(rest.numel(), 1)
    step = max(1, _CHUNK // per_row)
    flat_local = local.view(rows.numel(), per_row) if local.is_contiguous() else None
    for a in range(0, rows.numel(), step):
        b = min(a + step, rows.numel())
        flat = (rows[a:b, None] + rest[None, :]).reshape(b - a, per_row)
        if init.kind == "log_uniform":  # the top 53 bits of SplitMix64's output as a uniform in [0, 1)
            u = _shr(splitmix64(stream, flat), 11).double() * 2.0**-53
            vals = torch.log(init.low + (init.value - init.low) * u).to(local.dtype)
        else:
            vals = (normal_values(stream, flat) * init.value).to(local.dtype)
        if flat_local is not None:
            flat_local[a:b].copy_(vals)
        else:
            local[a:b].copy_(vals.view(local[a:b].shape))


# ----------------------------------------------------------------------------------------------- plans and names

# PEFT wrappers insert these path components around a module they adapt or copy; the wrapped module's parameters
# keep their own identity (the same init and the same checkpoint tensor).
_WRAPPER_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def canonical_name(name: str) -> str:
    """A parameter name without PEFT's wrapper components (``q_proj.base_layer.weight`` -> ``q_proj.weight``,
    ``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``)."""
    return _WRAPPER_PARTS.sub("", name)


def plan_for_modules(model: nn.Module, *, std: float, tied: dict[str, str] | None = None) -> InitPlan:
    """The conventional transformer init of ``model``'s parameters by module type: linear and embedding weights
    ``normal(std)``, biases zero, norm weights one (``RMSNorm``/``LayerNorm``; an offset ``RMSNorm``'s ``1 - offset``),
    norm biases zero. ``tied`` maps a
    parameter that shares another's storage to that one (it draws from the same stream)."""
    plan: InitPlan = {}
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in mod.named_parameters(recurse=False):
            name = prefix + attr
            if isinstance(mod, (RMSNorm, LayerNorm, nn.LayerNorm)):
                plan[name] = Init.constant(getattr(mod, "initial_weight", 1.0) if attr == "weight" else 0.0)
            elif attr in getattr(mod, "param_inits", ()):  # declared normal(std) weights (MoE routers, experts)
                plan[name] = Init.normal(std, key=name)
            elif attr in getattr(mod, "zero_inits", ()):  # declared zeros (gpt-oss's expert biases)
                plan[name] = Init.constant(0.0)
            elif attr in getattr(mod, "declared_inits", {}):  # (name, std) -> Init (Gated DeltaNet's A_log, ...)
                plan[name] = mod.declared_inits[attr](name, std)
            elif isinstance(mod, (nn.Linear, nn.Embedding)) and attr == "weight":
                plan[name] = Init.normal(std, key=name)
            elif attr == "bias":
                plan[name] = Init.constant(0.0)
            else:
                raise ValueError(f"no init rule for parameter {name!r} of a {type(mod).__name__}")
    for copy, source in (tied or {}).items():
        plan[copy] = plan[source]
    return plan


def init_plan_of(model: nn.Module) -> InitPlan:
    """The family model's declared plan (``model.init_plan``)."""
    plan = getattr(model, "init_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} declares no init_plan")
    return plan


@torch.no_grad()
def init_whole(model: nn.Module) -> None:
    """Fill every (whole, plain) parameter of a family model from its ``init_plan``."""
    plan, seed = init_plan_of(model), int(getattr(model, "init_seed"))
    for name, p in model.named_parameters():
        init = plan.get(canonical_name(name))
        if init is None:
            raise ValueError(f"{type(model).__name__}: no init for parameter {name!r}")
        fill_(p, init, seed=seed, index=full_index(p.shape, p.device), shape=p.shape)


class WeightsSource(Protocol):
    """Where a lazily loaded model's weights come from (e.g. a local HF checkpoint, :mod:`.hf.source`)."""

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds the parameter ``name`` (canonical, relative to the family model)."""

    def read(self, name: str, index: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        """Elements ``index`` (one global index tensor per dim) of parameter ``name``, as ``dtype``."""


# ----------------------------------------------------------------------------------------------- materialize

ShardView = Callable[[Tensor], tuple[Tensor, tuple[Tensor, ...]]]
"""``param -> (local tensor to write, its global index per dim)``; the default is the tensor itself, whole."""


def _whole(t: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    return t, full_index(t.shape, t.device)


def is_meta(t: Tensor) -> bool:
    """Whether ``t`` (or a DTensor's local shard) lives on the meta device."""
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard
    return local.is_meta


def _family_roots(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that declare an ``init_plan`` (family models), outermost first; a family never nests in another."""
    out: list[tuple[str, nn.Module]] = []
    for name, mod in root.named_modules():
        inside = any(n == "" or name.startswith(f"{n}.") for n, _ in out)
        if getattr(mod, "init_plan", None) is not None and not inside:
            out.append((name, mod))
    return out


def _meta_params(root: nn.Module) -> Iterator[tuple[str, nn.Module, str, Tensor]]:
    """``(family path, family model, name inside it, tensor)`` of every meta parameter, once per tensor."""
    seen: set[int] = set()
    for path, fam in _family_roots(root):
        for name, p in fam.named_parameters():
            if id(p) not in seen and is_meta(p):
                seen.add(id(p))
                yield path, fam, name, p


@torch.no_grad()
def materialize(root: nn.Module, device: torch.device | str, *, shard_view: ShardView = _whole) -> int:
    """Allocate every meta tensor of ``root`` on ``device`` and fill it: from the family model's ``weights_source``
    when the checkpoint holds the parameter, else from its ``init_plan``; rotary tables and other buffers are
    recomputed by the family's ``init_buffers``. Parameters that are already real keep their values (they are put
    back after ``to_empty``, which FSDP2 needs on whole units), and tensors shared under several names stay shared.
    Returns the number of parameters filled. A meta parameter outside a family model is an error (nothing declares
    how to initialise it).

    ``shard_view`` gives the local tensor and global index of a (possibly sharded) parameter; the default treats
    every tensor as whole."""
    todo = list(_meta_params(root))
    stray = [n for n, p in root.named_parameters() if is_meta(p)
             and id(p) not in {id(t) for *_, t in todo}]
    if stray:
        raise ValueError(f"cannot materialize {stray[:5]}: meta parameters outside a model family (only family "
                         "models declare an init plan; build other modules on a real device)")
    if not todo and not any(is_meta(b) for b in root.buffers()):
        return 0
    names = {id(t): (path, name) for path, _, name, t in todo}
    shared = _shared_names(root)
    targets = _holding_meta(root)
    inside = tuple(f"{prefix}." if prefix else "" for prefix in targets)
    keep = {n: shard_view(t)[0].detach().clone() for n, t in _named_tensors(root)
            if not is_meta(t) and n.startswith(inside)}
    for prefix in targets:
        root.get_submodule(prefix).to_empty(device=device)
    _retie(root, shared)
    tensors = dict(_named_tensors(root))
    for n, saved in keep.items():
        shard_view(tensors[n])[0].copy_(saved)
    wanted = set(names.values())
    for path, fam in _family_roots(root):
        _fill_family(fam, [(name, p) for name, p in fam.named_parameters() if (path, name) in wanted], shard_view)
        init_buffers = getattr(fam, "init_buffers", None)
        if init_buffers is not None:
            init_buffers()
    return len(todo)


@torch.no_grad()
def materialize_in_parts(fam: nn.Module, device: torch.device | str, *,
                         each: Callable[[str, nn.Module], None]) -> None:
    """Materialize a meta-device family model (whole tensors, from its ``weights_source`` or ``init_plan``) one part
    at a time: each direct child, each entry of a child ``ModuleList``/``ModuleDict`` (a block). ``each(path, part)`` runs right
    after a part is filled (e.g. to quantize its weights), so only one part is ever held at full precision beside
    what ``each`` leaves. The values equal :func:`materialize`'s; tied weights stay one tensor."""
    shared = _shared_names(fam)
    parts: list[tuple[str, nn.Module]] = []
    for name, child in fam.named_children():
        parts += ([(f"{name}.{i}", m) for i, m in child.named_children()]
                  if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [(name, child)])
    for path, part in parts:
        if any(is_meta(t) for t in (*part.parameters(), *part.buffers())):
            part.to_empty(device=device)
            _retie(fam, shared)  # a tied head takes the embedding filled before it (or fills it first)
            _fill_family(fam, [(f"{path}.{n}", p) for n, p in part.named_parameters()], _whole)
        each(path, part)
    for name, buf in list(fam.named_buffers(recurse=False)):  # the family's own (rotary tables): computed below
        if buf.is_meta:
            fam._buffers[name] = torch.empty_like(buf, device=device)
    init_buffers = getattr(fam, "init_buffers", None)
    if init_buffers is not None:
        init_buffers()


def _holding_meta(root: nn.Module) -> list[str]:
    """The modules ``to_empty`` is applied to: ``root`` when it is a family model or holds meta tensors itself, else
    each direct child that holds one (the task's ``model`` - whole FSDP2 units -, a reference copy). Only these: a
    module-wide ``to_empty`` also empties what is no parameter or buffer, e.g. torchmetrics' metric states, which
    then hold garbage (an SFT run under tensor parallelism logged ROUGE-L inf)."""
    def has_meta(m: nn.Module, *, recurse: bool = True) -> bool:
        return any(is_meta(t) for t in (*m.parameters(recurse=recurse), *m.buffers(recurse=recurse)))

    if getattr(root, "init_plan", None) is not None or has_meta(root, recurse=False):
        return [""]
    return [name for name, child in root.named_children() if has_meta(child)]


def _fill_family(fam: nn.Module, params: list[tuple[str, Tensor]], shard_view: ShardView) -> None:
    plan, source = init_plan_of(fam), getattr(fam, "weights_source", None)
    seed = int(getattr(fam, "init_seed"))
    for name, p in params:
        key = canonical_name(name)
        local, index = shard_view(p)
        if source is not None and source.has(key):
            local.copy_(source.read(key, index, local.dtype))
            continue
        init = plan.get(key)
        if init is None:
            raise ValueError(f"{type(fam).__name__}: no init for parameter {name!r} (init_plan lacks {key!r})")
        fill_(local, init, seed=seed, index=index, shape=p.shape)


def _named_tensors(root: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from root.named_parameters()
    yield from root.named_buffers()


def _shared_names(root: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor (tied weights)."""
    groups: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _retie(root: nn.Module, shared: list[list[str]]) -> None:
    """``to_empty`` may replace parameters by new objects: make each tied group one parameter again."""
    for first, *others in shared:
        p = root.get_parameter(first)
        for name in others:
            mod_name, _, attr = name.rpartition(".")
            owner = root.get_submodule(mod_name)
            if getattr(owner, attr) is not p:
                setattr(owner, attr, p)
