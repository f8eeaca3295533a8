"""Vocab-parallel cross-entropy on 2 gloo processes equals the full-vocab cross-entropy (value and gradient); so does
the fused linear + vocab-parallel cross-entropy (chunks of the head's row shard, no logits), directly and through
``head_cross_entropy`` on a ``ColwiseParallel`` head with and without sequence parallelism.

Each rank holds a column shard of the same full logits; the gradient of the full logits is reassembled with an
all-gather and compared with a float64 ``F.cross_entropy`` reference.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (inherited by spawned workers)

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lightning_llm.kernels._backend import triton_available

WORLD = 2
TOL = 1e-5  # fp32 logits, relative to the reference's max magnitude


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(out, ref) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _worker(rank: int, port: int, backend: str) -> None:
    from lightning_llm.kernels import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(0)
        # (V, split) - equal shards with the default vocab_start, and uneven shards with explicit vocab_start
        for V, sizes in ((130, None), (131, (70, 61))):
            full = torch.randn(3, 4, V, generator=g, dtype=torch.float64) * 3
            target = torch.randint(0, V, (3, 4), generator=g)
            target[0, 1] = target[2, 3] = -100
            widths = sizes or (V // WORLD,) * WORLD
            start = sum(widths[:rank])
            for reduction in ("mean", "sum", "none"):
                local = full[..., start:start + widths[rank]].float().requires_grad_(True)
                loss = vocab_parallel_cross_entropy(
                    local, target, vocab_start=None if sizes is None else start, reduction=reduction, backend=backend
                )
                full64 = full.clone().requires_grad_(True)
                ref = F.cross_entropy(full64.view(-1, V), target.view(-1), reduction=reduction)
                ref = ref.view(3, 4) if reduction == "none" else ref
                up = torch.randn(ref.shape, generator=g, dtype=torch.float64)
                (gref,) = torch.autograd.grad(ref, [full64], up)
                (glocal,) = torch.autograd.grad(loss, [local], up.float())
                parts = [torch.empty(3, 4, w) for w in widths]
                if sizes is None:
                    dist.all_gather(parts, glocal.contiguous())
                else:  # all_gather needs equal sizes: pad to the widest shard
                    padded = [torch.zeros(3, 4, max(widths)) for _ in widths]
                    mine = torch.zeros(3, 4, max(widths))
                    mine[..., : widths[rank]] = glocal
                    dist.all_gather(padded, mine)
                    parts = [p[..., :w] for p, w in zip(padded, widths)]
                gfull = torch.cat(parts, -1)
                tag = f"rank {rank} V={V} {reduction} {backend}"
                assert _rel(loss, ref) <= TOL, f"loss {tag}: {_rel(loss, ref):.2e}"
                assert _rel(gfull, gref) <= TOL, f"grad {tag}: {_rel(gfull, gref):.2e}"
        _dtensor_check(rank, backend)
        _fused_check(rank, backend)
        _sharded_head_check(rank, backend)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Done: leave like every other test worker (barrier, destroy the group, os._exit), so that no gloo thread or C++
    # static destructor can abort the finished process in interpreter teardown (SIGABRT seen once in CI here).
    from lightning_llm.reliability import leave_process, shutdown_process_group

    shutdown_process_group()
    leave_process(0)


def _dtensor_check(rank: int, backend: str) -> None:
    """A DTensor sharded on the vocab dim is accepted (its local shard is used) and gets its gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_llm.kernels import vocab_parallel_cross_entropy

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(1)
    full = torch.randn(6, 10, generator=g)
    target = torch.randint(0, 10, (6,), generator=g)
    dt = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(dt, target, backend=backend)
    loss.backward()
    full64 = full.double().requires_grad_(True)
    ref = F.cross_entropy(full64, target)
    ref.backward()
    assert _rel(loss, ref) <= TOL
    assert _rel(dt.grad.full_tensor(), full64.grad) <= TOL


def _fused_check(rank: int, backend: str) -> None:
    """The fused linear + vocab-parallel cross-entropy on uneven row shards of the head, in chunks of 4 tokens and
    in default chunks (the shards' own widths would give 4 and 8 tokens here: every rank must run the same chunk
    loop): loss, dhidden (all-reduced), the shard's dW and db against float64 on the full head."""
    from lightning_llm.kernels.loss.tp_cross_entropy import vocab_parallel_fused_linear_cross_entropy

    g = torch.Generator().manual_seed(2)
    V, H, widths = 131, 8, (70, 61)
    start, width = sum(widths[:rank]), widths[rank]
    h, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((4, 4, H), (V, H), (V,)))
    target = torch.randint(0, V, (4, 4), generator=g)
    target[0, :2] = -100
    for reduction, chunk in (("mean", 4), ("sum", 4), ("none", 4), ("mean", None), ("none", None)):
        hl, wl, bl = (t.float().requires_grad_(True) for t in (h, w[start:start + width], b[start:start + width]))
        loss = vocab_parallel_fused_linear_cross_entropy(hl, wl, target, vocab_start=start, bias=bl,
                                                         reduction=reduction, chunk_size=chunk, backend=backend)
        h64, w64, b64 = (t.clone().requires_grad_(True) for t in (h, w, b))
        ref = F.cross_entropy((h64 @ w64.T + b64).view(-1, V), target.view(-1), reduction=reduction)
        ref = ref.view(4, 4) if reduction == "none" else ref
        up = torch.randn(ref.shape, generator=g, dtype=torch.float64)  # same draws on both ranks
        (loss * up.float()).sum().backward()
        (ref * up).sum().backward()
        errs = {"loss": _rel(loss, ref), "dh": _rel(hl.grad, h64.grad),
                "dW": _rel(wl.grad, w64.grad[start:start + width]), "db": _rel(bl.grad, b64.grad[start:start + width])}
        assert max(errs.values()) <= TOL, f"fused rank {rank} {reduction} chunk {chunk} {backend}: {errs}"


def _sharded_head_check(rank: int, backend: str) -> None:
    """head_cross_entropy on a ColwiseParallel head (131 rows over 2 ranks, torch.chunk's uneven split) takes the
    vocab-parallel fused path, fed the replicated hidden states or sequence-parallel DTensor shards of them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_llm.kernels.loss.head_loss import head_cross_entropy, vocab_sharded_head

    mesh = init_device_mesh("cpu", (WORLD,))
    for sequence_parallel in (False, True):
        torch.manual_seed(4)
        full = torch.nn.Linear(8, 131)
        hidden = torch.randn(2, 6, 8)
        labels = torch.randint(0, 131, (2, 6))
        labels[1, -2:] = -100
        ref_h = hidden.clone().requires_grad_(True)
        ref = F.cross_entropy(full(ref_h).view(-1, 131), labels.view(-1))
        ref.backward()
        head = parallelize_module(torch.nn.Linear(8, 131), mesh, ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1)))
        with torch.no_grad():
            head.weight.to_local().copy_(full.weight[66 * rank:66 * (rank + 1)])
            head.bias.to_local().copy_(full.bias[66 * rank:66 * (rank + 1)])
        h = hidden.clone().requires_grad_(True)
        x = DTensor.from_local(h[:, 3 * rank:3 * (rank + 1)], mesh, [Shard(1)]) if sequence_parallel else h
        assert vocab_sharded_head(head, x, labels) is not None
        loss = head_cross_entropy(x, head, labels, backend=backend)
        loss.backward()
        dh = h.grad[:, 3 * rank:3 * (rank + 1)] if sequence_parallel else h.grad
        want_dh = ref_h.grad[:, 3 * rank:3 * (rank + 1)] if sequence_parallel else ref_h.grad
        errs = {"loss": _rel(loss, ref.double()), "dh": _rel(dh, want_dh.double()),
                "dW": _rel(head.weight.grad.full_tensor(), full.weight.grad.double()),
                "db": _rel(head.bias.grad.full_tensor(), full.bias.grad.double())}
        assert max(errs.values()) <= TOL, f"sharded head sp={sequence_parallel} rank {rank} {backend}: {errs}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "backend",
    [pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="triton not installed")), "torch"],
)
def test_vocab_parallel_cross_entropy_matches_full(backend):
    mp.spawn(_worker, args=(_free_port(), backend), nprocs=WORLD, join=True)


def test_vocab_parallel_single_process_is_plain_cross_entropy():
    """Without a process group the op is the ordinary CE of the (whole) logits."""
    from lightning_llm.kernels import vocab_parallel_cross_entropy

    logits = torch.randn(5, 7, requires_grad=True)
    target = torch.tensor([0, 6, -100, 3, 3])
    loss = vocab_parallel_cross_entropy(logits, target, backend="torch")
    assert _rel(loss, F.cross_entropy(logits.double(), target)) <= TOL
