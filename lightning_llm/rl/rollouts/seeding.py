"""Rollout seeding: which random numbers a rollout's sampling draws, so that a resumed run samples the same responses
and (per prompt) any number of devices samples what one device samples.

* :func:`rank_generator`: one generator per data-parallel replica and rollout, ``seed + 1_000_003 * rollout + rank``
  (the ranks of a replica, tensor- or pipeline-parallel, draw the same tokens);
* :func:`prompt_uniforms`: one CPU generator per prompt, from (seed, rollout, the prompt's record index, the sampling
  round of dynamic sampling) and not from the rank, so a prompt's responses do not depend on the rank or batch that
  holds it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["prompt_uniforms", "rank_generator", "rollout_seed"]


def rollout_seed(generation_seed: int | None) -> int:
    """``--model.generation_seed``, or the global seed when it is unset."""
    return int(generation_seed if generation_seed is not None else torch.initial_seed())


def rank_generator(seed: int, *, rollout: int, dp_rank: int, device: Any) -> torch.Generator:
    """The generator data-parallel rank ``dp_rank`` samples rollout ``rollout`` from."""
    g = torch.Generator(device=device)
    g.manual_seed((seed + 1_000_003 * rollout + dp_rank) % (2**63))
    return g


def prompt_uniforms(index: Tensor, repeats: int, steps: int, *, seed: int, rollout: int, draw: int = 0,
                    device: Any = "cpu") -> Tensor:
    """U(0, 1) draws [B * repeats, steps] (float64) for :func:`~lightning_llm.generation.generate`'s inverse-CDF
    sampling: the rows of prompt ``index[i]`` from its own generator, seeded from (``seed``, ``rollout``, the record
    index, the sampling round ``draw``)."""
    rows = []
    for i in index.tolist():
        mixed = ((seed * 1_000_003 + rollout) * 1_000_000_007 + int(i)) % (2**63)
        if draw:
            mixed = (mixed * 1_000_033 + draw) % (2**63)
        rows.append(torch.rand(repeats, steps, generator=torch.Generator().manual_seed(mixed), dtype=torch.float64))
    return torch.cat(rows).to(device)
