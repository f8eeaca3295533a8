"""The LM-head cross-entropy of a model's last hidden states: fused (no ``[N, V]`` logits) where that is exact,
the head called as a module otherwise.

``head_cross_entropy(hidden [B, S, H], head, labels [B, S])`` equals ``F.cross_entropy(head(hidden).float(), labels)``
(``ignore_index=-100``). The fused path (:func:`~.cross_entropy.fused_linear_cross_entropy`: the Triton kernel on
CUDA, chunks of plain torch elsewhere) reads the head's weight directly, so it is taken only when calling the head
as a module would do nothing else:

* the head is a plain ``nn.Linear``, or declares its effective weight (``effective_weight()``, e.g. Baichuan's
  NormHead), or is peft's ``ModulesToSaveWrapper`` around one of these (its active trained copy);
* the head has no forward hooks (tensor parallelism's input/output redistribution, DeepSpeed ZeRO-3's parameter
  gathering, a value head reading the head's input) and its weight is a plain tensor (not a DTensor shard, not a
  partitioned DeepSpeed parameter). FSDP2 units are gathered by the enclosing model's forward, where this runs.

Anything else (a LoRA-wrapped head, a tensor-parallel head) runs ``head(hidden)`` and the cross-entropy on its
logits, which under ``loss_parallel`` is the vocab-parallel cross-entropy on ``[B, S, V/tp]`` shards.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._backend import Backend
from .cross_entropy import fused_linear_cross_entropy

log = logging.getLogger(__name__)

__all__ = ["fusable_head", "head_cross_entropy"]


def _active_copy(head: nn.Module) -> nn.Module:
    """The module a peft ``ModulesToSaveWrapper`` forwards to (its single active trained copy), else ``head``."""
    copies = getattr(head, "modules_to_save", None)
    if not isinstance(copies, nn.ModuleDict) or getattr(head, "disable_adapters", False):
        return head
    active = getattr(head, "active_adapters", None) or []
    if len(active) != 1 or active[0] not in copies:
        return head
    if head._forward_hooks or head._forward_pre_hooks:
        return head
    return copies[active[0]]


def fusable_head(head: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight [V, H], bias [V] or None)`` the head multiplies by, when the fused path is exact for it; else None."""
    head = _active_copy(head)
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    if type(head) is nn.Linear:
        weight, bias = head.weight, head.bias
    elif callable(getattr(head, "effective_weight", None)):
        weight, bias = head.effective_weight(), getattr(head, "bias", None)
    else:
        return None
    for t in (weight, bias):
        if t is not None and (type(t) not in (Tensor, nn.Parameter) or hasattr(t, "ds_id") or t.is_meta):
            return None  # a DTensor shard, a partitioned DeepSpeed parameter: only the module's call sees it whole
    return weight, bias


def head_cross_entropy(
    hidden: Tensor,
    head: nn.Module,
    labels: Tensor,
    *,
    reduction: Literal["mean", "sum", "none"] = "mean",
    fused: bool = True,
    backend: Backend = "auto",
) -> Tensor:
    """Cross-entropy of ``head(hidden)`` against ``labels`` (-100 ignored), fp32 math; see the module docstring.

    ``reduction="none"`` returns per-token losses ``[B, S]`` (0 where ignored; the fused path then recomputes each
    chunk's logits in backward). ``fused=False`` always calls the head."""
    found = fusable_head(head) if fused else None
    if found is None:
        logits = head(hidden)  # [B, S, V] (a vocab-sharded DTensor under loss_parallel)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                               reduction=reduction)
        return loss.view(labels.shape) if reduction == "none" else loss
    weight, bias = found
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # What autocast would run head(hidden) in; the casts are differentiable, so gradients reach fp32 masters.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    else:
        hidden = hidden.to(weight.dtype)
    with torch.autocast(device_type, enabled=False):
        return fused_linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction, backend=backend,
                                          loss_dtype=torch.float32)
