"""The Triton implementations of :mod:`lightning_llm.kernels`' ops, jitted kernels in autograd Functions, one file per
op family (``norms.py``, ``rope.py``, ``gated.py``, ``cross_entropy.py``). Each module imports ``triton``: the ops
import them on the first call that resolves to the triton backend, never at package import."""
