"""Fused kernels: Triton implementations wrapped in autograd Functions, each with a plain-torch fallback.

Every op takes ``backend``: ``"auto"`` (triton when the input is on CUDA and triton is importable, else torch),
``"triton"`` (on CPU only with ``TRITON_INTERPRET=1``, else ``RuntimeError``) or ``"torch"``. Triton is
imported lazily, on the first triton-backend call, so importing this package never needs it.

========================  ============================================================================================
``_backend.py``           the ``backend`` choice every op makes (``resolve_backend``)
``norms.py``              RMSNorm, LayerNorm
``rope.py``               rotary on q/k ``[B, S, H, D]``
``gated.py``              SwiGLU, GeGLU
``delta_rule.py``         Gated DeltaNet's chunked delta rule and causal conv (flash-linear-attention's on CUDA)
``triton/``               the Triton implementations (jitted kernels in autograd Functions), one file per family
``loss/``                 the LM head's losses: ``cross_entropy.py`` (CE, fused linear CE), ``tp_cross_entropy.py``
                          (vocab-parallel CE), ``head_loss.py`` (the head's CE and token scores, fused where exact),
                          ``divergence.py`` / ``head_divergence.py`` (distillation's student-teacher divergences)
========================  ============================================================================================
"""

from ._backend import Backend, resolve_backend, triton_available
from .loss.cross_entropy import cross_entropy, cross_entropy_torch, fused_linear_cross_entropy
from .gated import geglu, geglu_torch, swiglu, swiglu_torch
from .norms import layer_norm, layer_norm_torch, rms_norm, rms_norm_torch
from .rope import apply_rotary, apply_rotary_torch
from .loss.tp_cross_entropy import vocab_parallel_cross_entropy

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
