"""Fused kernels: Triton implementations wrapped in autograd Functions, each with a plain-torch fallback.

Every op takes ``backend``: ``"auto"`` (triton when the input is on CUDA and triton is importable, else torch),
``"triton"`` (on CPU only with ``TRITON_INTERPRET=1``, else ``RuntimeError``) or ``"torch"``. Triton is
imported lazily, on the first triton-backend call, so importing this package never needs it.

Families: :mod:`.norms` (RMSNorm, LayerNorm), :mod:`.rope` (rotary on q/k ``[B, S, H, D]``), :mod:`.gated`
(SwiGLU, GeGLU), :mod:`.cross_entropy` (CE and fused linear CE), :mod:`.tp_cross_entropy` (vocab-parallel CE).
"""

from ._backend import Backend, resolve_backend, triton_available
from .cross_entropy import cross_entropy, cross_entropy_torch, fused_linear_cross_entropy
from .gated import geglu, geglu_torch, swiglu, swiglu_torch
from .norms import layer_norm, layer_norm_torch, rms_norm, rms_norm_torch
from .rope import apply_rotary, apply_rotary_torch
from .tp_cross_entropy import vocab_parallel_cross_entropy

__all__ = [
    "Backend",
    "apply_rotary",
    "apply_rotary_torch",
    "cross_entropy",
    "cross_entropy_torch",
    "fused_linear_cross_entropy",
    "geglu",
    "geglu_torch",
    "layer_norm",
    "layer_norm_torch",
    "resolve_backend",
    "rms_norm",
    "rms_norm_torch",
    "swiglu",
    "swiglu_torch",
    "triton_available",
    "vocab_parallel_cross_entropy",
]
