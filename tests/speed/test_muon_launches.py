"""A Muon step's kernel launches do not grow with the number of hidden matrices of one shape: Newton-Schulz runs on
a batch of them (the matrices of a stacked tensor, and same-shape tensors together), and momentum, Nesterov and
weight decay are multi-tensor ops. Counted on the CPU with torch's profiler (top-level aten ops of one
``MuonWithAdamW.step`` after a first): 10 or 40 hidden 32 x 32 matrices beside 8 stacked experts. Measured: 106 and
226 ops (the 40-layer step adds 3 ops a matrix, none of them a matmul); with one Newton-Schulz per matrix and one
launch per parameter as before, 576 and 1626."""

from __future__ import annotations

from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_llm.optim.muon import MuonWithAdamW

MATMULS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm", "aten::baddbmm")


def _step_ops(n: int) -> Counter[str]:
    torch.manual_seed(0)
    dense = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(n)]
    experts = torch.nn.Parameter(torch.randn(8, 32, 16))
    for p in [*dense, experts]:
        p.grad = torch.randn_like(p)
    opt = MuonWithAdamW([{"params": dense, "muon": True},
                         {"params": [experts], "muon": True, "matrices": (1, 1, 1, -1)}], lr=0.01)
    opt.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    return Counter(e.name for e in prof.events()
                   if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def test_matmuls_do_not_grow_with_the_matrices_of_a_shape() -> None:
    few, many = _step_ops(10), _step_ops(40)
    matmuls = [sum(c[k] for k in MATMULS) for c in (few, many)]
    total = [sum(c.values()) for c in (few, many)]
    print(f"Muon step, 10 / 40 hidden matrices + 8 experts: {total[0]} / {total[1]} top-level aten ops, "
          f"matmuls {matmuls[0]} / {matmuls[1]}")
    assert matmuls[0] == matmuls[1] > 0
    assert total[1] - total[0] <= 4 * 30  # a few elementwise ops a matrix (the update's), no Newton-Schulz per matrix
