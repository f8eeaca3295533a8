"""What one rank holds under a tp x pp x dp layout, and its memory peak while the model is set up.

Used by ``lightning_llm estimate`` (:mod:`lightning_llm.estimate`). The local element count of every parameter is
derived from the family's own declarations, as the engine applies them: the pipeline split
(:func:`~lightning_llm.strategies.pipeline.split.split_layers`: the first stage keeps the embeddings, the last the
final norm and head, a tied head is a copy there), the tensor-parallel plan (column-parallel: dim 0 sharded,
row-parallel linears: dim 1, vocab-parallel embedding: dim 0, everything else replicated) and FSDP2's dim-0 shards
under ZeRO-3 (``ceil`` chunks, as ``torch.chunk``).

Set-up peak of a rank (sharded construction, :mod:`lightning_llm.models.init`): its parameters are allocated at
once but become resident as they are filled, in order; the peak is the parameters plus the init generator's
scratch, or, when loading a checkpoint, the most of (parameters filled so far + the slice being copied in from the
file), plus a fixed base (process group, Lightning, data: measured on CPU with the debug model). Measured against
``benchmarks/memory.py`` (``benchmarks/results/memory-cpu.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["LayoutShare", "layout_share", "setup_peak_bytes"]

SETUP_BASE_BYTES = 20 * 2**20
"""Set-up memory besides the model (gloo process group, Lightning, the data module): 18-22 MB measured on CPU for
the debug model at 1 and 2 ranks (``benchmarks/memory.py``)."""


@dataclass(frozen=True)
class LayoutShare:
    """The parameters one rank of the fullest pipeline stage holds: ``numel`` elements, and ``read_peak``: the most
    elements resident while they are filled from a checkpoint in order (those filled so far plus the slice being
    copied in; untouched allocations are not resident yet)."""

    numel: int
    read_peak: int


def _tp_dim(style: Any, module: nn.Module, attr: str) -> int | None:
    """The dim a tensor-parallel style shards parameter ``attr`` of ``module`` on (None: replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return 0
        return 1 if attr == "weight" else None
    return None


def _stage_prefixes(model: nn.Module, pp: int) -> list[tuple[str, ...]]:
    """Module-path prefixes each pipeline stage keeps."""
    from lightning_llm.models import parallel_spec_of
    from lightning_llm.strategies.pipeline.split import split_layers

    spec = parallel_spec_of(model)[2]  # type: ignore[index]
    layers = split_layers(model, pp) if pp > 1 else [tuple(getattr(model, spec.layers).keys())]
    return [(*(f"{spec.layers}.{k}." for k in keys), *(f"{m}." for m in spec.first if s == 0),
             *(f"{m}." for m in spec.last if s == len(layers) - 1)) for s, keys in enumerate(layers)]


def layout_share(config: Any, *, tp: int = 1, pp: int = 1, dp: int = 1, zero3: bool = False) -> LayoutShare:
    """:class:`LayoutShare` of the fullest stage of ``config``'s model under the layout (see the module docstring)."""
    from lightning_llm.models import model_from_config, parallel_spec_of
    from lightning_llm.strategies.zero.native import module_path_matches

    with torch.device("meta"):
        model = model_from_config(config)
    spec = parallel_spec_of(model)[2]  # type: ignore[index]
    plan = spec.tp_plan(model, sequence_parallel=False, loss_parallel=True) if tp > 1 else {}
    modules = dict(model.named_modules())
    styles = {path: style for pattern, style in plan.items() for path in modules
              if module_path_matches(path, pattern)}
    best = LayoutShare(0, 0)
    for prefixes in _stage_prefixes(model, pp):
        numel = read_peak = 0
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):  # the order materialize fills them in
            if id(p) in seen or not name.startswith(prefixes):
                continue
            seen.add(id(p))  # a tied head is a second use here only when the stage lacks the embedding
            mod_name, _, attr = name.rpartition(".")
            shape = list(p.shape)
            d = _tp_dim(styles.get(mod_name), modules[mod_name], attr)
            if d is not None:
                shape[d] = math.ceil(shape[d] / tp)
            if zero3 and dp > 1 and shape:
                shape[0] = math.ceil(shape[0] / dp)
            n = math.prod(shape)
            read_peak = max(read_peak, numel + 2 * n)  # filled so far + this one + its slice read from the file
            numel += n
        if numel > best.numel:
            best = LayoutShare(numel, read_peak)
    return best


def setup_peak_bytes(share: LayoutShare, *, param_bytes: int, from_checkpoint: bool) -> int:
    """Peak memory of a rank while its model is set up (before the first step): see the module docstring."""
    from lightning_llm.models.init import FILL_SCRATCH_BYTES

    if from_checkpoint:
        return max(share.read_peak * param_bytes, share.numel * param_bytes) + SETUP_BASE_BYTES
    return share.numel * param_bytes + FILL_SCRATCH_BYTES + SETUP_BASE_BYTES
