"""Softmax cross-entropy over large vocabularies, and fused linear + cross-entropy.

``logits`` ``[..., V]`` with ``target`` ``[...]`` (int64 class ids; ``ignore_index`` rows contribute 0 loss and 0
gradient). Per token: ``loss = (1 - eps) * (lse - x_t) + eps * (lse - mean_j x_j) + z_loss * lse^2`` with
``lse = logsumexp(x)`` (label smoothing as ``F.cross_entropy``, z-loss as PaLM / Liger). ``reduction="mean"``
divides by the number of non-ignored tokens (NaN when there are none, like torch). Losses are returned in the
logits dtype (math in fp32).

The gradient is computed in the forward pass (one extra sweep over the row while it is hot) and kept instead of
the logits, so the softmax is never materialised twice; backward only scales it by the upstream gradient (in
place: backward through the same graph twice is refused). The fused linear CE chunks over tokens so the full
``[N, V]`` logits never exist: per chunk ``logits = h @ W.T (+ b)``, CE writes dlogits in place of the chunk's
logits, then ``dh = dlogits @ W`` and ``dW += dlogits.T @ h`` are accumulated during the forward.

Precision: every matmul runs in the hidden states' dtype (bf16/fp16 on tensor cores; a higher-precision weight, an
fp32 master under autocast, is cast once), accumulating in fp32 inside the GEMM. The head's gradients sum over every
chunk in an fp32 buffer, rounded once at the end (:func:`accumulate_mm`: on CUDA one GEMM with an fp32 output per
chunk; an fp32 weight receives the buffer itself as its gradient).
"""

from __future__ import annotations

import logging
from typing import Callable, Literal

import torch
import torch.nn.functional as F

from .._backend import Backend, resolve_backend

log = logging.getLogger(__name__)

Reduction = Literal["mean", "sum", "none"]


def cross_entropy_torch(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Plain-torch (autograd) cross-entropy with the same contract as :func:`cross_entropy`."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V).float()
    t = target.reshape(-1)
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        valid = t != ignore_index
        loss = loss + torch.where(valid, z_loss * torch.logsumexp(x, -1).pow(2), 0.0)
    return _reduce(loss, t, ignore_index, reduction, target.shape).to(logits.dtype)


def _reduce(loss: torch.Tensor, t: torch.Tensor, ignore_index: int, reduction: str, shape) -> torch.Tensor:
    if reduction == "none":
        return loss.view(shape)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (t != ignore_index).sum()
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def ce_forward_torch(logits, target, ignore_index, label_smoothing, z_loss, scale=None, grad=None):
    """Torch twin of ``triton/cross_entropy.ce_forward``: per-row (loss, lse) fp32 and optional in-place grad.

    One ``[N, V]`` fp32 buffer besides the logits (``grad`` may alias ``logits``: they are read before it is
    written), and five sweeps over the rows: max, shift, exp, sum, and the gradient written once."""
    N, V = logits.shape
    x = logits.float()
    valid = target != ignore_index
    t = torch.where(valid, target, 0).unsqueeze(1)
    m = x.max(-1, keepdim=True).values
    e = x - m  # [N, V], <= 0: the shifted logits, then (in place) their exponentials
    xt = e.gather(1, t).squeeze(1)
    mean = e.mean(-1) if label_smoothing else None
    e.exp_()
    d = e.sum(-1)
    log_d = torch.log(d)
    lse = m.squeeze(1) + log_d
    loss = log_d - (1.0 - label_smoothing) * xt + z_loss * lse * lse
    if mean is not None:
        loss = loss - label_smoothing * mean
    loss = torch.where(valid, loss, 0.0)
    if grad is not None:
        s = valid.float() if scale is None else valid.float() * scale.float()  # [N] per-row weight (0: ignored)
        coef = (s * (1.0 + 2.0 * z_loss * lse) / d).unsqueeze(1)  # softmax = e / d, z-loss adds 2 z lse softmax
        g = torch.mul(e, coef, out=grad) if grad.dtype == e.dtype else e.mul_(coef)  # fp32 math, rounded once
        if label_smoothing:
            g.sub_((label_smoothing / V) * s.unsqueeze(1))
        g.scatter_add_(1, t, (-(1.0 - label_smoothing) * s).unsqueeze(1))
        if g is not grad:
            grad.copy_(g)
    return loss, torch.where(valid, lse, 0.0)


def _ce_impl(backend: str) -> Callable:
    if backend == "torch":
        return ce_forward_torch
    from ..triton.cross_entropy import ce_forward

    return ce_forward


def _mean_scale(target: torch.Tensor, ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of valid tokens, gradient scale) as fp32 device tensors (no host sync)."""
    n_valid = (target != ignore_index).sum().float().reshape(1)
    scale = 1.0 / n_valid.clamp_min(1.0) if reduction == "mean" else torch.ones_like(n_valid)
    return n_valid, scale


class _ScaledOnce:
    """Backward helper: multiply saved gradients by the upstream gradient in place, refusing a second use."""

    @staticmethod
    def check(ctx) -> None:
        if getattr(ctx, "consumed", False):
            raise RuntimeError("fused cross-entropy scales its saved gradient in place: backward through it twice "
                               "(retain_graph=True) is not supported")
        ctx.consumed = True


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, z_loss, backend, grad_enabled,
                inplace=False):
        V = logits.shape[-1]
        x = logits.reshape(-1, V)
        x = x if x.stride(-1) == 1 else x.contiguous()
        t = target.reshape(-1).contiguous()
        n_valid, scale = _mean_scale(t, ignore_index, reduction)
        grad = None
        if grad_enabled and ctx.needs_input_grad[0]:  # no sweep in eval
            grad = x if inplace else torch.empty_like(x)
            if grad.data_ptr() == logits.data_ptr():
                # The logits now hold their gradient: anything that saved them for its own backward must fail
                # loudly there (autograd's version check) instead of reading gradient values.
                torch.autograd.graph.increment_version(logits)
        rows, _ = _ce_impl(backend)(x, t, ignore_index, label_smoothing, z_loss, scale, grad)
        # Kept as an attribute, not a saved tensor: in place it is a view of the input whose version was just bumped.
        ctx.grad = grad
        ctx.reduction, ctx.shape = reduction, logits.shape
        if reduction == "mean":
            return (rows.sum() / n_valid[0]).to(logits.dtype)
        return _reduce(rows, t, ignore_index, reduction, target.shape).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        _ScaledOnce.check(ctx)
        grad, ctx.grad = ctx.grad, None
        g = grad_loss.reshape(-1, 1) if ctx.reduction == "none" else grad_loss
        grad.mul_(g.to(grad.dtype))
        return grad.view(ctx.shape), None, None, None, None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    backend: Backend = "auto",
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``logits [..., V]`` against ``target [...]``; see the module docstring.

    ``inplace_backward`` (Triton backend): the gradient is written over ``logits`` in the forward pass instead of
    into a new ``[N, V]`` buffer (Liger's memory: nothing beyond the logits), for callers that do not read the logits
    again. Their version counter is bumped, so an op that saved them for its backward fails loudly there."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if resolve_backend(backend, logits) == "torch":
        return cross_entropy_torch(logits, target, ignore_index=ignore_index, reduction=reduction,
                                   label_smoothing=label_smoothing, z_loss=z_loss)
    return CrossEntropyFunction.apply(logits, target, ignore_index, reduction, float(label_smoothing),
                                      float(z_loss), "triton", torch.is_grad_enabled(), inplace_backward)


MIN_CHUNK = 256
"""Fewest tokens per chunk (unless there are fewer): smaller chunks spend their time in per-chunk overheads (measured
on CPU: 64-token chunks of a 32k vocabulary took 1.3x the time of 1024-token ones)."""


def default_chunk_size(n: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk so a chunk's logits ``[C, V]`` hold about 2x the elements of the hidden states ``[N, H]`` (a
    power of two, rounded down; at least :data:`MIN_CHUNK`). At 32k tokens x 4096 x 128256 that is 2048 tokens: 512 MiB
    of bf16 logits per chunk, 16 chunks (``benchmarks/loss_memory.py``)."""
    target = max(1, (2 * n * hidden) // max(vocab, 1))
    return max(1, min(n, max(MIN_CHUNK, 1 << (target.bit_length() - 1))))


def chunk_size_for(n: int, vocab: int, hidden: int, device: torch.device) -> int:
    """The fused loss's tokens per chunk on ``device``: :func:`default_chunk_size`, and on CUDA at least ``H`` tokens
    (capped at ``n``). Each chunk adds its product into the head's fp32 weight gradient with one fp32-output GEMM,
    reading and writing ``8 V H`` bytes, so that traffic takes ``N / C`` passes; at ``C = H`` a chunk's bf16 logits
    are half that buffer's bytes, which exists anyway. (Qwen3-30B-A3B's head, 8192 tokens x 2048 x 151936 on an H200:
    256-token chunks made 32 passes over its 1.2 GiB buffer, 29 ms of a 121 ms step; 2048 tokens make 4.) The CPU
    keeps the memory rule: its GEMMs, not that traffic, bound the loss there."""
    chunk = default_chunk_size(n, vocab, hidden)
    if device.type != "cuda":
        return chunk
    return max(chunk, min(n, 1 << (max(hidden, 1).bit_length() - 1)))


def _entropy(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per row, fp32 ``[C]``: ``-sum p log p`` with ``log p = x - lse``."""
    logp = logits.float() - lse.unsqueeze(1)  # [C, V]
    return -torch.linalg.vecdot(logp.exp(), logp)


SoftCap = tuple[float, float]
"""``(cap, factor)``: a chunk's logits ``x`` become ``factor * tanh(x / cap)`` (Gemma 2's final soft-cap: ``factor =
cap``; divided by a sampling temperature ``T``: ``cap / T``)."""


def softcap_chunk(logits: torch.Tensor, softcap: SoftCap) -> torch.Tensor:
    """Soft-cap a chunk's logits ``[C, V]`` in place; returns ``tanh(x / cap)`` (a second ``[C, V]`` buffer), which
    :func:`softcap_grad` turns the capped logits' gradient back into the raw logits' with."""
    cap, factor = softcap
    t = torch.tanh(logits / cap)
    logits.copy_(t).mul_(factor)
    return t


def softcap_grad(grad: torch.Tensor, t: torch.Tensor, softcap: SoftCap) -> None:
    """``grad`` (dloss / d capped logits) -> dloss / d raw logits, in place: ``* factor / cap * (1 - t^2)`` (``t``,
    from :func:`softcap_chunk`, is overwritten)."""
    cap, factor = softcap
    grad.mul_(t.mul_(t).neg_().add_(1.0).mul_(factor / cap))


def _flce_chunks(hidden, weight, bias, target, ignore_index, ls, z, chunk, backend, scale, grads, entropy=None,
                 softcap=None):
    """Loop over token chunks; returns per-row fp32 losses. ``grads`` = (dh, dW, db) buffers or Nones;
    when any is given the chunk's dlogits (scaled by ``scale``: 1 element or ``[N]``) are contracted into them.
    ``entropy`` (fp32 ``[N]``, only without gradients: the logits must survive the cross-entropy) receives each
    row's entropy, 0 where the target is ignored. ``softcap``: each chunk's logits soft-capped first
    (:data:`SoftCap`), their gradient taken back through the cap."""
    ce = _ce_impl(backend)
    need_grad = any(g is not None for g in grads)
    N = hidden.shape[0]
    rows = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for s in range(0, N, chunk):
        e = min(s + chunk, N)
        h = hidden[s:e]  # [C, H]
        logits = chunk_logits(h, weight, bias)  # [C, V]
        t = softcap_chunk(logits, softcap) if softcap is not None else None
        sc = scale[s:e] if (scale is not None and scale.numel() > 1) else scale
        rows[s:e], lse = ce(logits, target[s:e], ignore_index, ls, z, sc, logits if need_grad else None)
        if entropy is not None:
            entropy[s:e] = torch.where(target[s:e] != ignore_index, _entropy(logits, lse), 0.0)
        if need_grad:  # `logits` now holds dloss/dlogits for the chunk
            if t is not None:
                softcap_grad(logits, t, softcap)
            contract_chunk(logits, h, weight, grads, s, e)
    return rows


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One token chunk's logits ``[C, V]`` of the head (or ``[C, V/tp]`` of its shard)."""
    return h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())


def contract_chunk(dlogits, h, weight, grads, s: int, e: int) -> None:
    """Accumulate a chunk's ``dlogits [C, V]`` into ``grads`` = (dh rows ``s:e``, dW, db), each optional; ``weight``
    is in the compute dtype (that of ``dlogits`` and ``h``)."""
    dh, dw, db = grads
    if dh is not None:
        torch.mm(dlogits, weight, out=dh[s:e])
    if dw is not None:
        accumulate_mm(dw, dlogits.t(), h)
    if db is not None:
        db.add_(dlogits.sum(0, dtype=torch.float32))


_FP32_OUT_GEMM: dict[str, bool] = {}
"""Per CUDA device: whether ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulates a bf16/fp16
product into an fp32 buffer correctly there (probed once, :func:`_fp32_out_gemm`)."""

FALLBACK_BLOCK_BYTES = 64 << 20
"""Largest low-precision temporary of :func:`accumulate_mm`'s blocked fallback."""


def _fp32_out_gemm(device: torch.device) -> bool:
    """Whether this device runs a low-precision GEMM with an fp32 output in one call (``aten::addmm.dtype_out``):
    CUDA, checked once on a small product against an fp32 reference; the meta device (shapes only), so code paths
    can be inspected without a GPU; not the CPU, which has no such kernel."""
    if device.type == "meta":
        return True
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _FP32_OUT_GEMM:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 48, device=device, generator=g).bfloat16()
        b = torch.randn(48, 80, device=device, generator=g).bfloat16()
        acc = torch.randn(64, 80, device=device, generator=g)
        ref = acc + a.float() @ b.float()
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.allclose(acc, ref, rtol=1e-4, atol=1e-4))
        except (RuntimeError, TypeError) as e:
            log.debug("fp32-output GEMM unavailable on %s: %s", key, e)
            ok = False
        _FP32_OUT_GEMM[key] = ok
        log.debug("fused linear CE on %s: head gradient by %s", key,
                  "fp32-output GEMM" if ok else "blocked low-precision products")
    return _FP32_OUT_GEMM[key]


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in the compute dtype. Low-precision operands stay low
    precision (tensor cores, fp32 accumulation inside the GEMM): on CUDA one GEMM writing fp32 into ``acc``, or,
    where that kernel is missing, the product in row blocks (each rounded once, then added in fp32). The CPU has no
    fp32-output low-precision GEMM: there the operands are upcast, so the sum stays exact."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _fp32_out_gemm(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    elif acc.device.type == "cuda":
        rows = max(1, FALLBACK_BLOCK_BYTES // max(1, b.shape[1] * a.element_size()))
        for r in range(0, a.shape[0], rows):
            acc[r:r + rows].add_(a[r:r + rows] @ b)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_operands(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's ``(weight, bias)`` in the hidden states' dtype, the compute dtype (a cast copy of an fp32 master
    under autocast, else the tensors themselves). Refuses a weight of lower precision than the hidden states, or a
    bias of another dtype than the weight."""
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"the bias ({bias.dtype}) must have the weight's dtype ({weight.dtype})")
    if weight.dtype != hidden.dtype and not (weight.dtype == torch.float32 and hidden.dtype in LOW_PRECISION):
        raise ValueError(f"hidden states ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype, or the weight "
                         "be an fp32 master of bf16/fp16 hidden states")
    return weight.to(hidden.dtype), (bias.to(hidden.dtype) if bias is not None else None)


def _grad_buffers(h2, weight, bias, need):
    """(dhidden in the hidden dtype, dW and db in fp32) as ``need`` asks: the head's gradients sum over every chunk,
    and a bf16 running sum of 16 chunks would lose bits a single matmul (fp32 accumulation) keeps. ``weight`` and
    ``bias`` are the caller's (their shapes; an fp32 master receives these buffers as its gradients)."""
    return (
        torch.empty_like(h2) if need[0] else None,
        torch.zeros_like(weight, dtype=torch.float32) if need[1] else None,
        torch.zeros_like(bias, dtype=torch.float32) if (bias is not None and need[3]) else None,
    )


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, reduction, ls, z, chunk_size, backend, grad_enabled,
                loss_dtype, with_entropy=False, softcap=None):
        H = hidden.shape[-1]
        h2 = hidden.reshape(-1, H)
        t = target.reshape(-1).contiguous()
        N, V = h2.shape[0], weight.shape[0]
        chunk = chunk_size or chunk_size_for(N, V, H, h2.device)
        n_valid, scale = _mean_scale(t, ignore_index, reduction)
        need = [grad_enabled and n for n in ctx.needs_input_grad]
        if reduction == "none":  # per-row upstream grads are unknown yet: recompute in backward
            grads = (None, None, None)
        else:
            grads = _grad_buffers(h2, weight, bias, need)
        ent = torch.empty(N, dtype=torch.float32, device=h2.device) if with_entropy else None
        wc, bc = compute_operands(hidden, weight, bias)
        rows = _flce_chunks(h2, wc, bc, t, ignore_index, ls, z, chunk, backend, scale, grads, ent, softcap)
        ctx.args = (ignore_index, reduction, ls, z, chunk, backend, hidden.shape, weight.dtype, softcap)
        if reduction == "none":
            ctx.save_for_backward(h2, wc, bc, t)
            if ent is None:
                return rows.view(target.shape).to(loss_dtype)
            ent = ent.view(target.shape)
            ctx.mark_non_differentiable(ent)  # the returned tensor itself (a view of a marked one would not be)
            return rows.view(target.shape).to(loss_dtype), ent
        ctx.save_for_backward(*grads)
        loss = rows.sum() / n_valid[0] if reduction == "mean" else rows.sum()
        return loss.to(loss_dtype)

    @staticmethod
    def backward(ctx, grad_loss, *_grad_entropy):  # the entropy output (when asked for) has no gradient
        ignore_index, reduction, ls, z, chunk, backend, shape, wdtype, softcap = ctx.args
        need = ctx.needs_input_grad
        if reduction == "none":
            h2, weight, bias, t = ctx.saved_tensors
            grads = _grad_buffers(h2, weight, bias, need)
            _flce_chunks(h2, weight, bias, t, ignore_index, ls, z, chunk, backend,
                         grad_loss.reshape(-1).float().contiguous(), grads, softcap=softcap)
        else:
            _ScaledOnce.check(ctx)
            grads = ctx.saved_tensors
            for g in grads:
                if g is not None:
                    g.mul_(grad_loss.to(g.dtype))
        dh, dw, db = grads
        dw, db = (None if g is None else g.to(wdtype) for g in (dw, db))  # accumulated in fp32, rounded once
        return (None if dh is None else dh.view(shape)), dw, None, db, *([None] * 10)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_size: int | None = None,
    backend: Backend = "auto",
    loss_dtype: torch.dtype | None = None,
    with_entropy: bool = False,
    softcap: SoftCap | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materialising the ``[N, V]`` logits.

    ``hidden`` ``[..., H]``, ``weight`` ``[V, H]`` (the LM head), ``bias`` ``[V]`` or None, ``target`` ``[...]``.
    ``chunk_size`` tokens per chunk (None: :func:`chunk_size_for`, about ``2 N H / V`` tokens, on CUDA at least ``H``). Each chunk's
    logits are in ``hidden.dtype``, the compute dtype: ``weight``/``bias`` share it, or are fp32 masters of bf16/fp16
    hidden states (cast once here, their gradients fp32 sums; see the module docstring). For
    ``reduction="none"`` the chunks are recomputed in backward.
    ``loss_dtype``: the returned loss's dtype (default ``hidden.dtype``; the math is fp32 either way).
    ``with_entropy`` (``reduction="none"`` only): also return each token's entropy of ``softmax(logits)``, fp32,
    without gradient, 0 where the target is ignored (RL logs it; one more pass over each chunk's logits).
    ``softcap`` (:data:`SoftCap`): the loss of soft-capped logits ``factor * tanh(logits / cap)`` (one more ``[C, V]``
    buffer per chunk).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if with_entropy and reduction != "none":
        raise ValueError(f"with_entropy=True needs reduction='none' (per-token values), got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    resolved = resolve_backend(backend, hidden)
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, target, bias, ignore_index, reduction,
                                                 float(label_smoothing), float(z_loss), chunk_size, resolved,
                                                 torch.is_grad_enabled(), loss_dtype or hidden.dtype, with_entropy,
                                                 softcap)
