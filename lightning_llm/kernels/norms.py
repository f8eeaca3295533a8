"""RMSNorm and LayerNorm: fused normalize + affine, Triton kernels with a plain-torch fallback.

``x`` ``[..., D]``, ``weight`` ``[D]``, ``bias`` ``[D]`` or None. Both backends compute in fp32 and return
``x.dtype``. The Triton backward reduces the weight/bias gradient in two stages (per-program partial sums
``[G, D]``, then a sum over ``G``).
"""

from __future__ import annotations

import torch

from ._backend import Backend, resolve_backend


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Reference RMSNorm in plain torch: ``x / sqrt(mean(x^2) + eps) * weight`` (fp32 math)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """Reference LayerNorm in plain torch (fp32 math, biased variance as ``nn.LayerNorm``)."""
    y = torch.nn.functional.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    )
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: Backend = "auto") -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ``[..., D]`` with ``weight`` ``[D]``; returns ``x.dtype``."""
    if resolve_backend(backend, x) == "torch":
        return rms_norm_torch(x, weight, eps)
    from .triton.norms import TritonNormFunction

    return TritonNormFunction.apply(x, weight, None, float(eps), True)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` ``[..., D]``; ``weight`` ``[D]``, ``bias`` ``[D]`` or None."""
    if resolve_backend(backend, x) == "torch":
        return layer_norm_torch(x, weight, bias, eps)
    from .triton.norms import TritonNormFunction

    return TritonNormFunction.apply(x, weight, bias, float(eps), False)
