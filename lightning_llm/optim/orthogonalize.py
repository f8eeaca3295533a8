"""Newton-Schulz on whole matrices, wherever a layout keeps a parameter's pieces.

Muon's momentum, Nesterov step, weight decay and update are elementwise: every rank does them on what it holds. Only
the orthogonalisation needs a whole matrix, and it is torch's own (``torch.optim._muon._zeropower_via_newtonschulz``,
bf16 iterations, one 2-D matrix per call; a tensor's matrices of one shape, stacked experts or fused parts, and the
one-matrix tensors of one shape that a rank orthogonalises in a step, the layers' repeats, run the same operations
batched in one call, :data:`BATCH_BYTES` at most) on each matrix of :class:`~.roles.Matrices`, so each
equals what ``torch.optim.Muon`` computes for that matrix alone. How a step gets whole matrices (:func:`orthogonalized`):

* **local**: a plain tensor on one rank (one device, ZeRO-1/2's owner, which holds the whole parameter and its
  reduced gradient), or a DTensor split only along its stacked dim (expert parallelism: a rank's experts are whole);
* **replicated**: a plain tensor every rank of ``replica_group`` holds with the same averaged gradient (ddp, the
  engine's ranks of a pipeline stage at ZeRO-0, tensor-parallel ranks included: the MoE experts stay whole there):
  the tensors are dealt out over the ranks (the costliest first, each to the least-loaded rank), each orthogonalises
  its share, and every owner broadcasts its results (one packed bf16 buffer per rank);
* **sharded**: a DTensor split along a matrix dim over a 1-D mesh (ZeRO-3's FSDP2 shards, tensor parallelism's
  column/row shards): dealt out the same way over the mesh's ranks; one all-to-all sends every shard of a matrix to its
  owner, which concatenates them, orthogonalises and sends each rank its shard of the result in a second
  all-to-all (bf16, packed: two collectives per mesh and step, whatever the number of matrices);
* **flat**: a run of a parameter's elements (flattened) in a flat partition (DeepSpeed's ZeRO: every rank of a group
  holds a contiguous run, in rank order, :class:`FlatSplit`): the same two all-to-alls over that group, the owner
  concatenating the runs into the whole parameter;
* a DTensor that more ranks hold than its 1-D mesh spans (tp shards under data-parallel replicas at ZeRO-0, ZeRO-3's
  stacked experts replicated over tp), or split over several mesh dims (ZeRO-3 with tensor parallelism): gathered
  whole on every rank of its mesh, dealt out over every rank that holds it as replicated tensors are (each
  orthogonalises about 1/N and broadcasts its results), each rank keeping its shard. (Stacked experts split along
  their stacked dim are whole on their rank and orthogonalised there, also where tp ranks repeat them under ZeRO-3:
  gathering every expert on every rank would cost expert parallelism its memory.)
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_llm.optim.roles import Matrices


__all__ = ["BATCH_BYTES", "FlatSplit", "NewtonSchulz", "Orthogonalize", "orthogonalized"]

BATCH_BYTES = 1 << 28
"""The most bf16 bytes of same-shaped matrices one batched Newton-Schulz call takes (its iterates, about 3x that for
square ones, are transient device memory)."""


class NewtonSchulz(NamedTuple):
    """torch.optim.Muon's iteration settings."""

    coefficients: tuple[float, float, float]
    steps: int
    eps: float

    def whole(self, x: Tensor, layout: Matrices) -> Tensor:
        """The orthogonalised ``x`` (a whole tensor, bf16; used up), each matrix of ``layout`` on its own: one batched
        iteration over all of them (a tensor's matrices share a shape), not a Python loop of launches per matrix."""
        rows, cols = x.shape[layout.stack:]
        inner = layout.inner if layout.inner > 0 else rows // (layout.parts * layout.outer)
        if layout.count(tuple(x.shape)) == 1:
            return self._one(x.reshape(rows, cols)).reshape(x.shape).contiguous()  # a tall one comes transposed
        # [M, outer, parts, inner, C] -> part j of every matrix as one matrix of outer x inner rows: [M x parts, R', C]
        blocks = x.reshape(-1, rows // (layout.parts * inner), layout.parts, inner, cols)
        mats = blocks.transpose(1, 2).reshape(-1, rows // layout.parts, cols)
        out = _newton_schulz_batched(mats, self.coefficients, self.steps, self.eps).view(-1, layout.parts, blocks.shape[1], inner, cols).transpose(1, 2)
        return out.reshape(x.shape).contiguous()

    def each(self, tensors: list[tuple[Tensor, Matrices]]) -> list[Tensor]:
        """:meth:`whole` of each ``(tensor, layout)``, the tensors that are one matrix batched by shape (a model's
        layers repeat theirs: one call per shape, not per tensor), at most :data:`BATCH_BYTES` of them a call."""
        out: list[Tensor | None] = [None] * len(tensors)
        single: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for k, (x, layout) in enumerate(tensors):
            if layout.count(tuple(x.shape)) == 1 and x.numel():
                single[tuple(x.shape[layout.stack:])].append(k)
            else:
                out[k] = self.whole(x, layout)
        for shape, ks in single.items():
            per = max(1, BATCH_BYTES // (2 * math.prod(shape)))
            for start in range(0, len(ks), per):
                chunk = ks[start:start + per]
                if len(chunk) == 1:
                    out[chunk[0]] = self.whole(*tensors[chunk[0]])
                    continue
                done = _newton_schulz_batched(torch.stack([tensors[k][0].reshape(shape) for k in chunk]),
                                              self.coefficients, self.steps, self.eps).contiguous()
                for k, o in zip(chunk, done):
                    out[k] = o.view(tensors[k][0].shape)
        return out  # type: ignore[return-value]

    def _one(self, m: Tensor) -> Tensor:
        return _zeropower_via_newtonschulz(m, self.coefficients, self.steps, self.eps)


def _newton_schulz_batched(g: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """:func:`torch.optim._muon._zeropower_via_newtonschulz`'s iteration, operation for operation, on a batch of
    matrices ``[B, R, C]`` at once (bitwise equal to it per matrix on the CPU: ``tests/optim/test_muon.py``)."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class FlatSplit(NamedTuple):
    """How a parameter, flattened, is split over the ranks of ``group`` (DeepSpeed ZeRO's flat partitions): rank ``r``
    holds ``counts[r]`` of its elements, those after the elements of the ranks before it."""

    counts: tuple[int, ...]
    group: Any


class Orthogonalize(NamedTuple):
    """One matrix parameter's update waiting for Newton-Schulz: ``param`` (plain or DTensor), ``update`` (this rank's
    piece of it, bf16, shaped like the parameter's local tensor; ``flat``: this rank's run of its flattened elements,
    1-D), its ``layout``."""

    param: Tensor
    update: Tensor
    layout: Matrices
    flat: FlatSplit | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's global shape (DeepSpeed's ZeRO-3 leaves an empty tensor and records it in ``ds_shape``)."""
        return tuple(getattr(self.param, "ds_shape", self.param.shape))


class _Split(NamedTuple):
    """How a tensor of ``shape`` is cut along ``dim`` over the ranks of a group: rank ``r`` holds ``sizes[r]`` of it,
    after those of the ranks before it."""

    shape: tuple[int, ...]
    dim: int
    sizes: tuple[int, ...]

    def piece(self, rank: int) -> list[int]:
        shape = list(self.shape)
        shape[self.dim] = self.sizes[rank]
        return shape

    def offset(self, rank: int) -> int:
        return sum(self.sizes[:rank])


def _sharded_dims(p: DTensor) -> list[int]:
    return [pl.dim for pl in p.placements if isinstance(pl, Shard) or hasattr(pl, "dim")]


def orthogonalized(items: list[Orthogonalize], ns: NewtonSchulz, *, replica_group: Any = None,
                   flat_loads: dict[Any, list[int]] | None = None) -> list[Tensor]:
    """Each item's update orthogonalised, as this rank's piece (the shape of ``update``), in order (see the module
    doc). A collective over the groups involved: every rank of them calls it with the same parameters.
    ``flat_loads``: per process group, the work each rank was dealt by earlier calls (DeepSpeed steps one param group
    at a time), carried on so that the calls of a step share it out together."""
    out: list[Tensor | None] = [None] * len(items)
    replicated, sharded, flat, gathered, local = [], defaultdict(list), defaultdict(list), [], []
    for i, item in enumerate(items):
        p = item.param
        if item.flat is not None:
            if len(item.flat.counts) > 1:
                flat[item.flat.group].append(i)
            else:
                local.append(i)
            continue
        if not isinstance(p, DTensor):
            if replica_group is not None and dist.get_world_size(replica_group) > 1:
                replicated.append(i)
            else:
                local.append(i)
            continue
        dims = _sharded_dims(p)
        if all(d < item.layout.stack for d in dims):  # whole matrices here (a rank's experts)
            local.append(i)
        elif p.device_mesh.ndim == 1 and not _repeated(p.device_mesh, replica_group):
            sharded[p.device_mesh].append(i)
        else:
            gathered.append(i)
    done = ns.each([(items[i].update.view(items[i].shape) if items[i].flat else items[i].update, items[i].layout)
                    for i in local])
    for i, o in zip(local, done):
        out[i] = o.view(-1) if items[i].flat else o
    if replicated:
        _replicated(items, replicated, out, ns, replica_group)
    for mesh, idx in sharded.items():
        _exchanged(items, {i: _dtensor_split(items[i].param, mesh.size()) for i in idx}, out, ns, mesh.get_group())
    for group, idx in flat.items():
        load = None if flat_loads is None else flat_loads.setdefault(group, [0] * dist.get_world_size(group))
        _exchanged(items, {i: _Split((math.prod(items[i].shape),), 0, items[i].flat.counts) for i in idx}, out, ns,
                   group, load=load)
    if gathered:
        _gathered(items, gathered, out, ns, replica_group)
    return out  # type: ignore[return-value]


def _cost(item: Orthogonalize) -> int:
    """Newton-Schulz's work on a tensor: per matrix ~ rows x cols x min(rows, cols) multiply-adds per iteration."""
    shape = item.shape
    rows, cols = item.layout.part_shape(shape)
    return item.layout.count(shape) * rows * cols * min(rows, cols)


def _deal(items: list[Orthogonalize], idx: list[int], n: int, load: list[int] | None = None) -> dict[int, int]:
    """Owner (group rank) of each item, every rank alike: the costliest first, each to the least-loaded rank, so
    each rank orthogonalises about 1/n of the work. ``load``: each rank's work so far, updated (less its minimum)."""
    load = [0] * n if load is None else load
    owner = {}
    for i in sorted(idx, key=lambda i: (-_cost(items[i]), i)):
        r = min(range(n), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += _cost(items[i])
    least = min(load)
    load[:] = [x - least for x in load]
    return owner


def _replicated(items: list[Orthogonalize], idx: list[int], out: list[Tensor | None], ns: NewtonSchulz,
                group: Any) -> None:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    owner = _deal(items, idx, n)
    mine = [i for i in idx if owner[i] == me]
    for i, o in zip(mine, ns.each([(items[i].update, items[i].layout) for i in mine])):
        out[i] = o
    for src in range(n):
        mine = [i for i in idx if owner[i] == src]
        if not mine:
            continue
        if src == me:
            flat = torch.cat([out[i].reshape(-1) for i in mine])  # type: ignore[union-attr]
        else:
            flat = torch.empty(sum(items[i].update.numel() for i in mine), dtype=torch.bfloat16,
                               device=items[mine[0]].update.device)
        dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
        if src != me:
            for i, piece in zip(mine, flat.split([items[i].update.numel() for i in mine])):
                out[i] = piece.view(items[i].update.shape)


def _dtensor_split(p: DTensor, n: int) -> _Split:
    """A DTensor sharded over a 1-D mesh of ``n`` ranks, as torch.chunk cuts it."""
    (placement,) = p.placements
    d = placement.dim  # type: ignore[attr-defined]
    return _Split(tuple(p.shape), d, tuple(Shard.local_shard_size_and_offset(p.shape[d], n, r)[0] for r in range(n)))


def _exchanged(items: list[Orthogonalize], splits: dict[int, _Split], out: list[Tensor | None], ns: NewtonSchulz,
               group: Any, *, load: list[int] | None = None) -> None:
    """Each item's pieces to its owner (one all-to-all over ``group``), Newton-Schulz on the whole tensor there (cut as
    ``splits`` says), each rank's piece of the result back (another one). ``load``: :func:`_deal`'s."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    idx = list(splits)
    owner = _deal(items, idx, n, load)
    device = items[idx[0]].update.device
    for i in idx:
        if list(items[i].update.shape) != splits[i].piece(me):
            raise RuntimeError(f"Muon: a piece of {items[i].shape} is {tuple(items[i].update.shape)}, not the "
                               f"{splits[i].piece(me)} its split gives this rank")
    # 1. every piece to its tensor's owner
    by_dest = [[i for i in idx if owner[i] == r] for r in range(n)]
    owned = by_dest[me]
    send = torch.cat([items[i].update.reshape(-1) for r in range(n) for i in by_dest[r]])
    recv_sizes = [sum(math.prod(splits[i].piece(s)) for i in owned) for s in range(n)]
    recv = torch.empty(sum(recv_sizes), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(recv, send.to(torch.bfloat16), recv_sizes,
                           [sum(items[i].update.numel() for i in by_dest[r]) for r in range(n)], group=group)
    # 2. the owner's tensors, whole, orthogonalised
    pieces = iter(recv.split([math.prod(splits[i].piece(s)) for s in range(n) for i in owned]))
    from_rank = [[next(pieces).view(splits[i].piece(s)) for i in owned] for s in range(n)]
    wholes = [(torch.cat([from_rank[s][k] for s in range(n)], dim=splits[i].dim).view(items[i].shape),
               items[i].layout) for k, i in enumerate(owned)]
    results = {i: o.view(splits[i].shape) for i, o in zip(owned, ns.each(wholes))}
    # 3. each rank its piece of every result
    back = [results[i].narrow(splits[i].dim, splits[i].offset(r), splits[i].sizes[r]).reshape(-1)
            for r in range(n) for i in owned]
    send_back = torch.cat(back) if back else torch.empty(0, dtype=torch.bfloat16, device=device)
    mine_sizes = [sum(items[i].update.numel() for i in by_dest[r]) for r in range(n)]
    got = torch.empty(sum(mine_sizes), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(got, send_back, mine_sizes,
                           [sum(math.prod(splits[i].piece(r)) for i in owned) for r in range(n)], group=group)
    pieces = iter(got.split([items[i].update.numel() for r in range(n) for i in by_dest[r]]))
    for r in range(n):
        for i in by_dest[r]:
            out[i] = next(pieces).view(items[i].update.shape)


_flat_groups: dict[Any, Any] = {}  # a multi-dimensional mesh -> the process group of its ranks (flattened once)


def _gathered(items: list[Orthogonalize], idx: list[int], out: list[Tensor | None], ns: NewtonSchulz,
              replica_group: Any) -> None:
    """Sharded matrices that more ranks hold than their mesh spans (over 2 mesh dims, ZeRO-3 with tensor
    parallelism; or over one mesh repeated by replicas: tp shards under data-parallel replicas, ZeRO-3's experts
    replicated over tp): each gathered whole on every rank of its mesh, dealt out over every rank that holds it
    (:func:`_replicated`: each orthogonalises about 1/N of them and broadcasts its results), each rank keeping its
    shard."""
    whole, by_group = list(items), defaultdict(list)
    for i in idx:
        p, u = items[i].param, items[i].update
        full = DTensor.from_local(u, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        whole[i] = items[i]._replace(update=full)
        by_group[_dealing_group(p.device_mesh, replica_group)].append(i)
    results: list[Tensor | None] = [None] * len(items)
    for group, ids in by_group.items():
        _replicated(whole, ids, results, ns, group)
    for i in idx:
        p = items[i].param
        out[i] = distribute_tensor(results[i], p.device_mesh, p.placements, src_data_rank=None).to_local()


def _repeated(mesh: Any, replica_group: Any) -> bool:
    """Whether more ranks hold the same parameter with the same gradient than ``mesh`` spans."""
    return replica_group is not None and dist.get_world_size(replica_group) > mesh.size()


def _dealing_group(mesh: Any, replica_group: Any) -> Any:
    """The ranks a gathered matrix is dealt over: every rank holding it (the replicas' group where it is larger than
    the mesh), else the mesh's ranks (a multi-dimensional mesh flattened once)."""
    if _repeated(mesh, replica_group):
        return replica_group
    if mesh not in _flat_groups:
        _flat_groups[mesh] = mesh._flatten("muon_" + "_".join(mesh.mesh_dim_names)).get_group()
    return _flat_groups[mesh]
