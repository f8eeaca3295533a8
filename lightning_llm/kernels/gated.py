"""Gated activations ``act(gate) * up`` (SwiGLU, GeGLU) with Triton kernels and a plain-torch fallback.

``gate`` and ``up`` have the same shape ``[..., F]`` (e.g. the two halves of an MLP up-projection); the
output has that shape. Math in fp32, output in the promoted input dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from ._backend import Backend, resolve_backend


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in plain torch."""
    dtype = torch.promote_types(gate.dtype, up.dtype)
    return (F.silu(gate.float()) * up.float()).to(dtype)


def geglu_torch(gate: torch.Tensor, up: torch.Tensor, approximate: Literal["none", "tanh"] = "none") -> torch.Tensor:
    """``gelu(gate) * up`` in plain torch (``approximate`` as in ``torch.nn.functional.gelu``)."""
    dtype = torch.promote_types(gate.dtype, up.dtype)
    return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """Fused ``silu(gate) * up``."""
    if resolve_backend(backend, gate) == "torch":
        return swiglu_torch(gate, up)
    from .triton.gated import TritonGLUFunction

    return TritonGLUFunction.apply(gate, up, "silu")


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: Literal["none", "tanh"] = "none",
    backend: Backend = "auto",
) -> torch.Tensor:
    """Fused ``gelu(gate) * up``; ``approximate="none"`` uses exact erf gelu, ``"tanh"`` the tanh approximation."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if resolve_backend(backend, gate) == "torch":
        return geglu_torch(gate, up, approximate)
    from .triton.gated import TritonGLUFunction

    return TritonGLUFunction.apply(gate, up, "gelu" if approximate == "none" else "gelu_tanh")
