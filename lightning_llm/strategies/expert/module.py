"""The module that replaces an MoE layer's routed experts under expert parallelism."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_llm.models.layers.moe import describe_ffn, expert_ffn
from lightning_llm.strategies.expert.dispatch import combine, dispatch

__all__ = ["ExpertParallelExperts", "shapes_only"]

_SHAPES_ONLY = [0]  # open shapes_only() blocks


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Inside: :class:`ExpertParallelExperts` give an output of the right shape and dtype (``0 x`` their input: it
    keeps the autograd graph) without exchanging tokens. For passes whose values nothing reads and that the other
    ranks of the ``ep`` group do not run at the same time: a pipeline stage's metadata inference (torch's
    ``PipelineStage`` runs a stage's forward, and backward, on placeholder inputs the first time a schedule of an input
    shape runs, so replicas whose batches have other shapes infer at other steps)."""
    _SHAPES_ONLY[0] += 1
    try:
        yield
    finally:
        _SHAPES_ONLY[0] -= 1


class ExpertParallelExperts(nn.Module):
    """``experts`` of one MoE layer with this rank's ``E / ep`` experts: the same parameters (``gate_up_proj``
    [E, 2I, H], ``down_proj`` [E, H, I], the experts' biases where they have them: every ``experts.expert_params``, as
    DTensors ``Shard(0)`` over the ``ep`` mesh, meta or real) and the same
    call, ``(tokens sorted by expert [M, H], rows per expert [E]) -> [M, H]``: the rows go to their experts' ranks,
    through this rank's experts (:func:`~lightning_llm.models.layers.moe.expert_ffn`) and back."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.ffn = dict(experts.ffn)
        self.ep_mesh, self.ep = ep_mesh, ep_mesh.size()
        self.group: Any = ep_mesh.get_group()
        self.expert_params: tuple[str, ...] = tuple(experts.expert_params)
        for name in self.expert_params:
            p = getattr(experts, name)
            # local chunks only (src_data_rank=None: every rank built the same values, or meta tensors)
            shard = p if isinstance(p, DTensor) else distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        if _SHAPES_ONLY[0]:
            return tokens * 0  # [M, H], as combine() returns
        local, local_counts, state = dispatch(tokens, counts, group=self.group, ep=self.ep)
        mine = {n: getattr(self, n).to_local() for n in self.expert_params}
        out = expert_ffn(local, local_counts, mine["gate_up_proj"], mine["down_proj"],
                         gate_up_bias=mine.get("gate_up_proj_bias"), down_bias=mine.get("down_proj_bias"), **self.ffn)
        return combine(out, state, group=self.group)

    def extra_repr(self) -> str:
        e, i2, h = self.gate_up_proj.shape
        return f"experts={e} over ep={self.ep}, hidden={h}, intermediate={i2 // 2}, {describe_ffn(self.ffn)}"
