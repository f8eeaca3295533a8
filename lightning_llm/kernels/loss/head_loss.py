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

A tensor-parallel head (``ColwiseParallel``: a plain ``nn.Linear`` whose weight rows, the vocabulary, are a DTensor
sharded over one mesh dimension) takes the vocab-parallel fused path instead
(:func:`~.tp_cross_entropy.vocab_parallel_fused_linear_cross_entropy`): the replicated hidden states (all-gathered
first when sequence parallelism hands over sequence shards) times the local weight shard, ``[C, V/tp]`` per chunk,
the softmax statistics all-reduced per chunk and the hidden-state gradient all-reduced once in backward; what the
head's input/output hooks would have done is done there. Anything else (a LoRA-wrapped head, a head sharded on a
2-D mesh, an entropy request under tp) runs ``head(hidden)`` and the cross-entropy on its logits, which under
``loss_parallel`` is the vocab-parallel cross-entropy on ``[B, S, V/tp]`` shards.
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._backend import Backend
from .cross_entropy import chunk_size_for, fused_linear_cross_entropy
from .tp_cross_entropy import vocab_parallel_fused_linear_cross_entropy

log = logging.getLogger(__name__)

__all__ = ["TokenScores", "fusable_head", "head_cross_entropy", "head_token_scores", "vocab_sharded_head"]


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


class TokenScores(NamedTuple):
    """What an RL update reads from the head, per token, without ``[B, S, V]`` logits (:func:`head_token_scores`)."""

    loss: Tensor
    """``[B, S]`` fp32 cross-entropy of ``logits / temperature`` (the negated log-prob of the label; 0 where
    ignored), differentiable."""
    entropy: Tensor
    """``[B, S]`` fp32 entropy of ``softmax(logits / temperature)``, no gradient, 0 where the label is ignored."""
    hidden: Tensor
    """``[B, S, H]`` the head's input (a value head reads it)."""


def vocab_sharded_head(head: nn.Module, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` DTensors of a tensor-parallel head whose rows (the vocabulary) are sharded over one mesh
    dimension (``ColwiseParallel``), when the vocab-parallel fused loss is exact for it: a plain ``nn.Linear`` fed
    either the full replicated hidden states or a sequence-parallel DTensor of them; else None."""
    from torch.distributed.tensor import DTensor, Shard

    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if type(head) is not nn.Linear or not isinstance(weight, DTensor):
        return None
    for t in (weight, bias):
        if t is not None and (t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),)):
            return None
    if not isinstance(hidden, DTensor) and tuple(hidden.shape[:-1]) != tuple(labels.shape):
        return None  # a local sequence shard: only the module's input hook knows how to gather it
    return weight, bias


def _vocab_parallel_loss(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, *,
                         reduction: Literal["mean", "sum", "none"], temperature: float, backend: Backend,
                         softcap: float | None = None) -> Tensor:
    """The fused loss of a vocab-sharded head (:func:`vocab_sharded_head`): each rank's ``[C, V/tp]`` logit chunks,
    the softmax statistics all-reduced per chunk; the loss is identical on every rank of the head's mesh."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):  # sequence parallel: [B, S/tp, H] shards -> the full sequence (all-gather)
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
    if isinstance(labels, DTensor):
        labels = labels.full_tensor()
    w, b = weight.to_local(), (bias.to_local() if bias is not None else None)  # differentiable: grads stay sharded
    hidden, w, b = _head_dtype(hidden, w, b)
    if temperature != 1.0 and softcap is None:
        hidden, b = hidden / temperature, (b / temperature if b is not None else None)
    per_rank = -(-weight.shape[0] // mesh.size())  # torch.chunk's split of the vocabulary rows (the widest shard)
    # Chunks sized by the widest shard: every rank runs the same chunk loop (each chunk all-reduces).
    chunk = chunk_size_for(hidden.numel() // hidden.shape[-1], per_rank, hidden.shape[-1], hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        return vocab_parallel_fused_linear_cross_entropy(
            hidden, w, labels, vocab_start=min(mesh.get_local_rank() * per_rank, weight.shape[0]),
            group=mesh.get_group(), bias=b, reduction=reduction, chunk_size=chunk, backend=backend,
            softcap=_softcap(softcap, temperature))


def _head_dtype(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The operands for the dtype ``head(hidden)`` would compute in: autocast's when it is on, else the weight's. The
    hidden states are cast here; an fp32 weight (a master under autocast) is passed as it is, and the fused loss casts
    it once and accumulates its gradient in fp32 itself (no bf16 gradient cast back to fp32)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if weight.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16):
            return hidden.to(dtype), weight, bias
        return hidden.to(dtype), weight.to(dtype), (bias.to(dtype) if bias is not None else None)
    return hidden.to(weight.dtype), weight, bias


def _softcap(softcap: float | None, temperature: float) -> tuple[float, float] | None:
    """The fused kernels' ``(cap, factor)`` of logits soft-capped to ``cap * tanh(x / cap)``, then divided by the
    temperature (the capped logits are what sampling divides: transformers caps in forward)."""
    return None if softcap is None else (softcap, softcap / temperature)


def head_cross_entropy(
    hidden: Tensor,
    head: nn.Module,
    labels: Tensor,
    *,
    reduction: Literal["mean", "sum", "none"] = "mean",
    temperature: float = 1.0,
    fused: bool = True,
    backend: Backend = "auto",
    with_entropy: bool = False,
    softcap: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``head(hidden) / temperature`` against ``labels`` (-100 ignored), fp32 math; see the module
    docstring.

    ``reduction="none"`` returns per-token losses ``[B, S]`` (0 where ignored; the fused path then recomputes each
    chunk's logits in backward), tensors of their own, never views: a model returns them, and FSDP2 hooks its
    pre-backward all-gather on a module's outputs, which an in-place op on a view would silently detach (it warns
    of every view output). ``fused=False`` always calls the head. ``with_entropy`` (per-token only) also returns the
    entropy ``[B, S]`` (see :class:`TokenScores`). ``softcap``: the head's logits soft-capped to ``cap * tanh(logits /
    cap)`` before the temperature (Gemma 2's ``final_logit_softcapping``), in the fused chunks too."""
    if with_entropy and reduction != "none":
        raise ValueError(f"with_entropy=True needs reduction='none', got {reduction!r}")
    out = _head_loss(hidden, head, labels, reduction=reduction, temperature=temperature, fused=fused,
                     backend=backend, with_entropy=with_entropy, softcap=softcap)
    if reduction != "none":
        return out
    return tuple(map(_not_a_view, out)) if with_entropy else _not_a_view(out)


def _not_a_view(t: Tensor) -> Tensor:
    """``t``, or a copy when it is a view (every path's per-token rows are ``[B*S].view(B, S)``: B*S numbers)."""
    return t if t._base is None else t.clone()


def _head_loss(hidden: Tensor, head: nn.Module, labels: Tensor, *, reduction: Literal["mean", "sum", "none"],
               temperature: float, fused: bool, backend: Backend, with_entropy: bool, softcap: float | None = None
               ) -> Tensor | tuple[Tensor, Tensor]:
    found = fusable_head(head) if fused else None
    if found is None and fused and not with_entropy:
        sharded = vocab_sharded_head(head, hidden, labels)
        if sharded is not None:
            return _vocab_parallel_loss(hidden, *sharded, labels, reduction=reduction, temperature=temperature,
                                        backend=backend, softcap=softcap)
    if found is None:
        logits = head(hidden)  # [B, S, V] (a vocab-sharded DTensor under loss_parallel)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        flat = logits.flatten(0, 1).float() / temperature
        loss = F.cross_entropy(flat, labels.flatten(), ignore_index=-100, reduction=reduction)
        if reduction != "none":
            return loss
        if not with_entropy:
            return loss.view(labels.shape)
        with torch.no_grad():
            logp = torch.log_softmax(flat, dim=-1)
            entropy = torch.where(labels.flatten() != -100, -(logp.exp() * logp).sum(-1), 0.0)
        return loss.view(labels.shape), entropy.view(labels.shape)
    weight, bias = found
    if temperature != 1.0 and softcap is None:  # (h W^T + b) / T = (h / T) W^T + b / T: gradients flow through it
        hidden, bias = hidden / temperature, (bias / temperature if bias is not None else None)
    hidden, weight, bias = _head_dtype(hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):
        return fused_linear_cross_entropy(hidden, weight, labels, bias=bias, reduction=reduction, backend=backend,
                                          loss_dtype=torch.float32, with_entropy=with_entropy,
                                          softcap=_softcap(softcap, temperature))


def head_token_scores(hidden: Tensor, head: nn.Module, labels: Tensor, *, temperature: float = 1.0,
                      fused: bool = True, backend: Backend = "auto", softcap: float | None = None) -> TokenScores:
    """Per-token cross-entropy and entropy of ``head(hidden) / temperature`` (soft-capped first: ``softcap``) and the
    hidden states themselves: log-probs for PPO/GRPO without the ``[B, S, V]`` logits (the fused path where
    :func:`fusable_head` allows)."""
    loss, entropy = head_cross_entropy(hidden, head, labels, reduction="none", temperature=temperature, fused=fused,
                                       backend=backend, with_entropy=True, softcap=softcap)
    return TokenScores(loss=loss, entropy=entropy, hidden=hidden)
