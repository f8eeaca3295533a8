"""Rotary position embedding applied to q and k (HF Llama ``rotate_half`` convention).

Layout: q ``[B, S, Hq, D]``, k ``[B, S, Hk, D]`` (sequence before heads, i.e. the projection output viewed
as heads *before* the usual transpose to ``[B, H, S, D]``; a transposed ``[B, H, S, D]`` tensor can be passed
as ``x.transpose(1, 2)``, any strides are fine as long as the last dim is contiguous). ``Hq != Hk`` (GQA/MQA)
is supported. ``cos``/``sin`` are ``[S, D]`` (shared by the batch), ``[B, S, D]`` (e.g. gathered with
position ids: ``cos_table[position_ids]``), or ``[B, S, 1, D]``; ``D`` is even and the halves follow HF
(``cos = cat(cos_half, cos_half)``, but the halves need not be equal).

``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``; math in
fp32, outputs in the input dtypes. Gradients flow to q and k, not to cos/sin.
"""

from __future__ import annotations

import torch

from ._backend import Backend, resolve_backend


def _normalize_cos_sin(cos: torch.Tensor, sin: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos/sin as contiguous ``[Bc, S, D]`` with ``Bc`` in ``{1, B}``."""
    B, S, _, D = q.shape
    out = []
    for t in (cos, sin):
        if t.dim() == 4:  # [Bc, S, 1, D]
            if t.shape[2] != 1:
                raise ValueError(f"4-d cos/sin must be [B, S, 1, D], got {tuple(t.shape)}")
            t = t.squeeze(2)
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[1:] != (S, D) or t.shape[0] not in (1, B):
            raise ValueError(
                f"cos/sin must be [S, D], [B, S, D] or [B, S, 1, D] with S={S}, D={D}; got {tuple(t.shape)}"
            )
        out.append(t.contiguous())
    return out[0], out[1]


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q/k must be [B, S, H, D] with equal B, S, D; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[3] % 2:
        raise ValueError(f"head dim must be even, got {q.shape[3]}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch rotary embedding, same contract as :func:`apply_rotary`."""
    _check(q, k)
    cos, sin = _normalize_cos_sin(cos, sin, q)
    c = cos.float().unsqueeze(2)  # [Bc, S, 1, D]
    s = sin.float().unsqueeze(2)
    qf, kf = q.float(), k.float()
    return (qf * c + _rotate_half(qf) * s).to(q.dtype), (kf * c + _rotate_half(kf) * s).to(k.dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[B, S, Hq, D]`` and k ``[B, S, Hk, D]`` by cos/sin; returns new ``(q, k)`` tensors."""
    if resolve_backend(backend, q) == "torch":
        return apply_rotary_torch(q, k, cos, sin)
    from .triton.rope import TritonRotaryFunction

    _check(q, k)
    cos, sin = _normalize_cos_sin(cos, sin, q)
    return TritonRotaryFunction.apply(q, k, cos, sin)
