"""The distillation divergence of a student's LM head on its last hidden states against a teacher's: what the
student's forward computes in place of the cross-entropy (its ``head_loss``), where ZeRO-3 holds its head whole.

The dispatch is :mod:`.head_loss`'s for the cross-entropy: the chunked path (:func:`~.divergence.fused_linear_divergence`)
where reading the head's weight is exact (:func:`~.head_loss.fusable_head`), the vocabulary-parallel chunks for a
tensor-parallel head (:func:`~.head_loss.vocab_sharded_head`: each rank's ``[C, V/tp]`` logits of both models, the
teacher's head sharded by the same plan), and whole logits otherwise (a LoRA-wrapped head, ``fused=False``).

The teacher's head weight is read as it is held: the same vocabulary shard as the student's under tensor
parallelism, gathered whole (``full_tensor``, no gradient) where another layout shards it (ZeRO-3's rows over the
data-parallel ranks, a 2-D mesh).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from .cross_entropy import SoftCap
from .divergence import Divergence, divergence_chunk_size, fused_linear_divergence, token_divergence
from .head_loss import _head_dtype, fusable_head, vocab_sharded_head

__all__ = ["TeacherOutput", "head_divergence"]


class TeacherOutput(NamedTuple):
    """What the divergence reads of the teacher for a batch of tokens."""

    hidden: Tensor
    """``[B, S, Ht]`` its last hidden states (after its final norm: what its head reads), no gradient."""
    head: nn.Module
    """Its LM head (``[Ht -> V]``)."""
    softcap: float | None = None
    """Its logits' soft-cap (Gemma 2's ``final_logit_softcapping``), None without one."""


def _weight(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    effective = getattr(head, "effective_weight", None)
    return (effective() if callable(effective) else head.weight), getattr(head, "bias", None)


def _teacher_operands(head: nn.Module, like: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The teacher head's ``(weight, bias)``, detached: the local rows matching the student's vocabulary-sharded
    ``like`` (a DTensor), else whole."""
    from torch.distributed.tensor import DTensor

    out = []
    for t in _weight(head):
        if t is None:
            out.append(None)
            continue
        t = t.detach()
        same = isinstance(t, DTensor) and like is not None and t.device_mesh == like.device_mesh \
            and tuple(t.placements) == tuple(like.placements) and t.shape[0] == like.shape[0]
        if same:
            t = t.to_local()
        elif isinstance(t, DTensor):
            t = t.full_tensor()
            if like is not None:  # a whole teacher head beside a sharded student head: its rows of this shard
                t = t[_shard_rows(like)]
        out.append(t)
    return out[0], out[1]


def _shard_rows(like: Tensor) -> slice:
    """The global rows a Shard(0) DTensor ``like`` holds on this rank (torch.chunk's split)."""
    mesh = like.device_mesh
    per_rank = -(-like.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, like.shape[0])
    return slice(start, min(start + per_rank, like.shape[0]))


def _scaled(hidden: Tensor, bias: Tensor | None, temperature: float, softcap: float | None
            ) -> tuple[Tensor, Tensor | None, SoftCap | None]:
    """The operands of ``logits / T``: the hidden states (and bias) divided by ``T`` (autograd carries it to the
    gradient), or with a soft-cap the cap's factor ``cap / T`` (the capped logits are what the temperature divides)."""
    if softcap is not None:
        return hidden, bias, (softcap, softcap / temperature)
    if temperature == 1.0:
        return hidden, bias, None
    return hidden / temperature, (bias / temperature if bias is not None else None), None


def head_divergence(hidden: Tensor, head: nn.Module, labels: Tensor, teacher: TeacherOutput, *,
                    kind: Divergence = "reverse_kl", beta: float = 0.5, temperature: float = 1.0, fused: bool = True,
                    softcap: float | None = None, reduction: Literal["sum", "none"] = "sum") -> Tensor:
    """The sum (fp32 scalar) over the tokens whose label is not -100 of the divergence ``kind`` between the
    student's ``softmax(head(hidden) / T)`` and the teacher's; see the module docstring. ``softcap``: the student's
    logits' soft-cap. ``reduction="none"``: the per-token divergences ``[B, S]`` (0 where ignored), without gradient
    on the chunked paths."""
    if fused:
        found = fusable_head(head)
        if found is not None:
            return _chunked(hidden, *found, labels, teacher, kind=kind, beta=beta, temperature=temperature,
                            softcap=softcap, like=None, reduction=reduction)
        sharded = vocab_sharded_head(head, hidden, labels)
        if sharded is not None:
            return _chunked(hidden, *sharded, labels, teacher, kind=kind, beta=beta, temperature=temperature,
                            softcap=softcap, like=sharded[0], reduction=reduction)
    rows = _on_logits(hidden, head, labels, teacher, kind=kind, beta=beta, temperature=temperature, softcap=softcap)
    return rows if reduction == "none" else rows.sum()


def _chunked(hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, teacher: TeacherOutput, *,
             kind: Divergence, beta: float, temperature: float, softcap: float | None, like: Tensor | None,
             reduction: Literal["sum", "none"]) -> Tensor:
    """The chunked divergence; ``like``: the student's vocabulary-sharded weight (a DTensor) under tensor parallelism,
    whose local rows both heads contribute, else None (whole heads)."""
    from torch.distributed.tensor import DTensor, Replicate

    group = None
    if like is not None:
        mesh = like.device_mesh
        group = mesh.get_group()
        if isinstance(hidden, DTensor):  # sequence parallel: [B, S/tp, H] shards -> the whole sequence
            hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
        if isinstance(labels, DTensor):
            labels = labels.full_tensor()
        weight, bias = weight.to_local(), (bias.to_local() if bias is not None else None)
    tw, tb = _teacher_operands(teacher.head, like)
    hidden, bias, cap = _scaled(hidden, bias, temperature, softcap)
    th, tb, tcap = _scaled(teacher.hidden.detach(), tb, temperature, teacher.softcap)
    hidden, weight, bias = _head_dtype(hidden, weight, bias)
    th, tw, tb = _head_dtype(th, tw, tb)
    # Chunks sized by the widest shard: every rank of a tensor-parallel group runs the same loop (each chunk reduces).
    width = -(-like.shape[0] // like.device_mesh.size()) if like is not None else weight.shape[0]
    chunk = divergence_chunk_size(labels.numel(), width, max(hidden.shape[-1], th.shape[-1]), hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        return fused_linear_divergence(hidden, weight, th, tw, labels, kind=kind, beta=beta, bias=bias,
                                       teacher_bias=tb, softcap=cap, teacher_softcap=tcap, chunk_size=chunk,
                                       group=group, reduction=reduction)


def _capped(logits: Tensor, softcap: float | None) -> Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _on_logits(hidden: Tensor, head: nn.Module, labels: Tensor, teacher: TeacherOutput, *, kind: Divergence,
               beta: float, temperature: float, softcap: float | None) -> Tensor:
    """The per-token divergences ``[B, S]`` on both models' whole ``[B, S, V]`` logits (the student's head called as
    a module)."""
    logits = head(hidden)
    if hasattr(logits, "full_tensor"):  # a vocabulary-sharded DTensor
        logits = logits.full_tensor()
    th, tw, tb = _head_dtype(teacher.hidden, *_teacher_operands(teacher.head))  # (no fp32 copy for autocast to undo)
    with torch.no_grad():
        teacher_logits = _capped(torch.nn.functional.linear(th, tw, tb), teacher.softcap)
    rows = token_divergence(_capped(logits, softcap), teacher_logits, kind=kind, beta=beta, temperature=temperature)
    return torch.where(labels != -100, rows, 0.0)
