"""Regional compilation: ``torch.compile`` on each transformer block of a family model, as torchtitan does.

Each block is compiled in place with ``nn.Module.compile`` (the module keeps its class, parameter names, state-dict
keys and hooks: checkpoints and exports hold no ``_orig_mod.``), lazily: nothing is traced until the first forward,
so a strategy's later tensor-parallel plan, activation checkpointing or FSDP2 units still apply to the same modules
(dynamo skips FSDP2's hooks, ``torch._dynamo.config.skip_fsdp_hooks``). Identical blocks share one compiled graph.
Which attribute holds the blocks is the family's :class:`~lightning_llm.models.parallel_spec.ParallelSpec` ``layers``.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from .parallel_spec import parallel_spec_of

log = logging.getLogger(__name__)

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> int:
    """``block.compile(**compile_kwargs)`` for every transformer block of ``model`` (a family model, possibly inside
    PEFT wrappers); returns how many. A model of no registered family is refused: its blocks are unknown."""
    found = parallel_spec_of(model)
    if found is None:
        raise ValueError(f"--model.compile=true: {type(model).__name__} is not a model family of lightning_llm "
                         "(models/parallel_spec.py), so its transformer blocks are unknown; compile it in your task's "
                         "build_model() instead")
    _, backbone, spec = found
    blocks = list(getattr(backbone, spec.layers).values())
    for block in blocks:
        block.compile(**compile_kwargs)
    log.info("torch.compile: %d transformer blocks of %s compiled (regional; traced at the first forward)",
             len(blocks), type(backbone).__name__)
    return len(blocks)
