"""Ranks that end a generation together: where every decoding step runs collectives among ranks that decode other
rows (ZeRO-3's per-layer all-gathers over the data-parallel ranks; an MoE layer's token exchange over the
expert-parallel ranks), a rank whose rows all ended must still take part until every rank's have."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopTogether"]


class StopTogether:
    """A decoding model whose ranks of ``group`` end a generation at the same step: ``generate`` asks
    :meth:`all_ended` at each of its stop checks (every :data:`~lightning_llm.generation.sampling.STOP_CHECK_EVERY`
    tokens), so every rank runs the same number of decoding forwards. A pipeline's decoder decodes in lock-step
    through it (its micro-batch ring stops each micro-batch on its own rows)."""

    def __init__(self, model: Any, group: Any, device: torch.device) -> None:
        self.model, self.group, self.device = model, group, device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def all_ended(self, ended: bool) -> bool:
        inner = getattr(self.model, "all_ended", None)
        if inner is not None:  # a decoder that agrees over a group of its own already (ZeRO-3's per-layer fallback)
            ended = inner(ended)
        flag = torch.tensor([0.0 if ended else 1.0], device=self.device)  # on the device: NCCL takes no CPU tensor
        dist.all_reduce(flag, group=self.group)
        return float(flag) == 0.0
