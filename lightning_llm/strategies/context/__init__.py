"""Context parallelism: the ranks of a cp group share each sequence, every rank training on ``1/cp`` of its tokens.

* :mod:`.sharding`: which columns a rank holds (load-balanced causal chunks ``r`` and ``2 cp - 1 - r``) and its
  slice of a batch (global positions added first);
* :mod:`.attention`: the attention across the slices (all-gather of keys/values, differentiable), installed where
  the family declares its attention cores (``ParallelSpec.attention_cores``) by :func:`apply_context_parallel`.

The engine does the rest with what it has: the loss of each rank is the mean over its labelled tokens, weighted by
their count over ``dp x cp`` (``contract.replica_loss``), and gradients are averaged over ``dp x cp``
(``mesh.REPLICA_DIM``), so a step equals one device's on the whole batch.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor, nn

from lightning_llm.models.parallel_spec import ParallelSpec, parallel_spec_of
from lightning_llm.strategies.context.attention import ContextParallelAttention, SharedMask
from lightning_llm.strategies.context.sharding import chunk_size, local_columns, order_gathered, shard_batch
from lightning_llm.strategies.zero.native import module_path_matches

log = logging.getLogger(__name__)

__all__ = ["ContextParallelAttention", "apply_context_parallel", "family_spec", "chunk_size", "local_columns",
           "order_gathered", "shard_batch", "slice_step"]


def family_spec(model: nn.Module) -> ParallelSpec:
    """The spec of the model's family, or a one-line refusal naming why its sequence cannot be split."""
    found = parallel_spec_of(model)
    if found is None:
        raise ValueError(f"context_parallel_size > 1 needs a model of a registered family (models/parallel_spec.py); "
                         f"{type(model).__name__} declares no attention cores")
    _, backbone, spec = found
    reason = spec.context_parallel_blocker(backbone)
    if reason is None and spec.attention_cores is None:
        reason = f"the {type(backbone).__name__} family declares no attention cores (ParallelSpec.attention_cores)"
    if reason is not None:
        raise ValueError(f"context_parallel_size > 1: {reason}")
    return spec


def apply_context_parallel(model: nn.Module, *, group: Any, cp: int, rank: int) -> int:
    """Replace the family's attention cores inside ``model`` by :class:`ContextParallelAttention` over ``group``
    (this rank is ``rank`` of ``cp``); returns how many. The cores hold no parameters: names, shapes and
    checkpoints are unchanged."""
    spec = family_spec(model)
    prefix, backbone, _ = parallel_spec_of(model)  # type: ignore[misc]
    assert spec.attention_cores is not None
    targets = [n for n, _ in backbone.named_modules() if n and module_path_matches(n, spec.attention_cores)]
    shared = SharedMask()  # one mask per forward for all the cores
    for name in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = backbone.get_submodule(parent_name) if parent_name else backbone
        setattr(parent, leaf, ContextParallelAttention(group=group, cp=cp, rank=rank, shared=shared))
    if not targets:
        raise ValueError(f"context_parallel_size > 1: no module of {type(backbone).__name__} matches its declared "
                         f"attention cores {spec.attention_cores!r}")
    log.debug("context parallelism: %d attention cores of %s%s replaced (cp rank %d/%d)", len(targets), prefix,
              type(backbone).__name__, rank, cp)
    return len(targets)


def slice_step(hook: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, cp: int, rank: int, model: nn.Module
               ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a task's ``training/validation/test_step`` with this rank's slice of the batch every rank
    of the cp group received (``model``'s family gives packed rows their positions); predict is refused."""
    if hook == "predict_step":
        raise ValueError(f"context_parallel_size={cp}: predict is not supported under context parallelism (it "
                         "generates or returns whole-row outputs); predict with context_parallel_size=1")
    spec = family_spec(model)
    _check_length(args[0] if args else kwargs["batch"], limit=spec.position_limit(parallel_spec_of(model)[1]), cp=cp)
    cut = dict(cp=cp, rank=rank, positions=spec.segment_positions)
    if args:
        return (shard_batch(args[0], **cut), *args[1:]), kwargs
    return args, {**kwargs, "batch": shard_batch(kwargs["batch"], **cut)}


def _check_length(batch: Any, *, limit: int | None, cp: int) -> None:
    """Refuse rows longer than ``limit`` (the family's ``position_limit``: a learned position table, or ``dynamic``
    RoPE, whose frequencies depend on the whole row's longest position)."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not isinstance(ids, Tensor) or limit is None:
        return
    seq = ids.shape[1]
    if seq > limit:
        raise ValueError(f"context_parallel_size={cp}: rows of {seq} tokens are longer than the model's "
                         f"max_position_embeddings={limit}, past which its positions depend on the whole row (a "
                         "learned position table ends there; dynamic RoPE's frequencies follow the row's longest "
                         "position; for LongRoPE the limit is its original_max_position_embeddings, past which its "
                         "long factors apply): keep rows within it")
