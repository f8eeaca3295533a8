"""Fused kernels vs a float64 torch reference, both backends, forward and every input/weight gradient.

Runs on CPU: the triton backend goes through Triton's interpreter (``TRITON_INTERPRET=1``, set below before
anything can import triton; tests/conftest.py sets it too). Shapes are tiny and odd on purpose (non-powers of
two, a vocab of 131 that spans two CE blocks, N not a multiple of the chunk size).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import

import pytest
import torch
import torch.nn.functional as F

from lightning_llm import kernels as K
from lightning_llm.kernels._backend import triton_available

# Max error relative to the reference's max magnitude: max|out - ref| / max|ref|, per dtype of the inputs.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}

BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="triton not installed")),
    "torch",
]
DTYPES = [torch.float32, torch.float16]
MAX_ERR: dict[str, float] = {}  # observed errors, printed with `pytest -s` (see the last test)


_CURRENT = {"backend": "?"}


@pytest.fixture(autouse=True)
def _record_backend(request):
    callspec = getattr(request.node, "callspec", None)
    _CURRENT["backend"] = callspec.params.get("backend", "?") if callspec else "?"


def check(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    key = f"{name.split('[')[0]} {str(dtype).replace('torch.', '')} {_CURRENT['backend']}"
    MAX_ERR[key] = max(MAX_ERR.get(key, 0.0), err)
    assert err <= TOL[dtype], f"{name}: relative error {err:.3e} > {TOL[dtype]:.0e}"


def leaf(shape, dtype, scale=1.0, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
    return t.requires_grad_(True)


def ref64(*ts):
    return [t.detach().double().requires_grad_(True) for t in ts]


def grads(out, inputs, seed=1):
    """Backpropagate a fixed random upstream gradient; return (upstream, input grads)."""
    up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    gs = torch.autograd.grad(out, inputs, up.to(out.dtype), allow_unused=True)
    return up, gs


# --------------------------------------------------------------------------------------------- backend choice


def test_resolve_backend(monkeypatch):
    x = torch.zeros(2)
    assert K.resolve_backend("auto", x) == "torch"
    assert K.resolve_backend("torch", x) == "torch"
    with pytest.raises(ValueError):
        K.resolve_backend("cuda", x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if triton_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            K.resolve_backend("triton", x)


# ----------------------------------------------------------------------------------------------------- norms


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
@pytest.mark.parametrize("kind", ["rms", "layer", "layer_nobias"])
def test_norms(kind, dtype, backend):
    D, eps = 37, 1e-5
    x = leaf((3, 5, D), dtype, scale=2.0, shift=0.5)
    w = leaf((D,), dtype, scale=0.3, shift=1.0, seed=2)
    b = leaf((D,), dtype, scale=0.3, seed=3) if kind == "layer" else None
    params = [x, w] + ([b] if b is not None else [])
    xr, wr, *br = ref64(*params)
    if kind == "rms":
        out = K.rms_norm(x, w, eps, backend=backend)
        ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * wr
    else:
        out = K.layer_norm(x, w, b, eps, backend=backend)
        ref = F.layer_norm(xr, (D,), wr, br[0] if br else None, eps)
    assert out.dtype == dtype
    check(f"{kind}_norm fwd", out, ref, dtype)
    up, gs = grads(out, params)
    gr = torch.autograd.grad(ref, [xr, wr, *br], up)
    for name, g, r in zip(["dx", "dweight", "dbias"], gs, gr):
        check(f"{kind}_norm {name}", g, r, dtype)


# ------------------------------------------------------------------------------------------------------ rope


def _rope_ref(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cos_kind", ["SD", "BSD_position_ids", "BS1D"])
def test_rope(cos_kind, dtype, backend):
    B, S, HQ, HK, D = 2, 5, 3, 1, 10  # GQA: 3 query heads, 1 kv head; half dim 5
    q = leaf((B, S, HQ, D), dtype)
    # k given as a transposed [B, H, S, D] tensor (non-contiguous strides)
    k = leaf((B, HK, S, D), dtype, seed=4).detach().transpose(1, 2).requires_grad_(True)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    table = torch.arange(12, dtype=torch.float64)[:, None] * inv[None]  # [max_pos, D/2]
    emb = torch.cat([table, table], -1)
    if cos_kind == "SD":
        cos, sin = emb[:S].cos(), emb[:S].sin()  # [S, D]
        c4, s4 = cos[None, :, None], sin[None, :, None]
    else:
        pos = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 9, 11, 2]])  # arbitrary position ids [B, S]
        cos, sin = emb[pos].cos(), emb[pos].sin()  # [B, S, D]
        c4, s4 = cos[:, :, None], sin[:, :, None]
        if cos_kind == "BS1D":
            cos, sin = c4, s4
    qo, ko = K.apply_rotary(q, k, cos.to(dtype), sin.to(dtype), backend=backend)
    qr, kr = ref64(q, k)
    c4, s4 = c4.to(dtype).double(), s4.to(dtype).double()
    qref, kref = _rope_ref(qr, c4, s4), _rope_ref(kr, c4, s4)
    check("rope fwd_q", qo, qref, dtype)
    check("rope fwd_k", ko, kref, dtype)
    out = torch.cat([qo.flatten(), ko.flatten()])
    up, (dq, dk) = grads(out, [q, k])
    dqr, dkr = torch.autograd.grad(torch.cat([qref.flatten(), kref.flatten()]), [qr, kr], up)
    check("rope dq", dq, dqr, dtype)
    check("rope dk", dk, dkr, dtype)


# ---------------------------------------------------------------------------------------------------- gated


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["swiglu", "geglu_none", "geglu_tanh"])
def test_gated(act, dtype, backend):
    gate = leaf((3, 37), dtype, scale=2.5)
    up = leaf((3, 37), dtype, seed=5)
    gr, ur = ref64(gate, up)
    if act == "swiglu":
        out = K.swiglu(gate, up, backend=backend)
        ref = F.silu(gr) * ur
    else:
        approx = act.split("_")[1]
        out = K.geglu(gate, up, approximate=approx, backend=backend)
        ref = F.gelu(gr, approximate=approx) * ur
    check(f"{act} fwd", out, ref, dtype)
    upg, gs = grads(out, [gate, up])
    for name, g, r in zip(["dgate", "dup"], gs, torch.autograd.grad(ref, [gr, ur], upg)):
        check(f"{act} {name}", g, r, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_gelu_erf_accuracy(backend):
    """The exact-gelu path (erf) over a wide range, including the tails, at fp32 accuracy."""
    gate = torch.linspace(-9.0, 9.0, 601, dtype=torch.float32).requires_grad_(True)
    up = torch.ones_like(gate)
    out = K.geglu(gate, up, approximate="none", backend=backend)
    g64 = gate.detach().double().requires_grad_(True)
    ref = F.gelu(g64)
    check("gelu_erf fwd", out, ref, torch.float32)
    (d,) = torch.autograd.grad(out.sum(), gate)
    (dr,) = torch.autograd.grad(ref.sum(), g64)
    check("gelu_erf dgate", d, dr, torch.float32)


# --------------------------------------------------------------------------------------------- cross entropy


def _ce_ref(logits, target, ignore_index, reduction, ls, z):
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none", label_smoothing=ls)
    valid = target != ignore_index
    loss = loss + torch.where(valid, z * torch.logsumexp(logits, -1) ** 2, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def _targets(shape, V, ignore_index=-100, seed=6):
    t = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::4] = ignore_index  # every 4th token ignored
    return t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls,z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
def test_cross_entropy(ls, z, reduction, dtype, backend):
    V = 131  # > the interpreter's 128 block: exercises the online-softmax loop and the tail mask
    logits = leaf((3, 4, V), dtype, scale=3.0)
    ignore_index = -1 if ls else -100
    target = _targets((3, 4), V, ignore_index)
    out = K.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=ls,
                          z_loss=z, backend=backend)
    (lr,) = ref64(logits)
    ref = _ce_ref(lr.view(-1, V), target.view(-1), ignore_index, reduction, ls, z)
    ref = ref.view(3, 4) if reduction == "none" else ref
    assert out.dtype == dtype
    check(f"cross_entropy fwd[{reduction},{ls},{z}]", out, ref, dtype)
    up, (g,) = grads(out, [logits])
    (gr,) = torch.autograd.grad(ref, [lr], up)
    check(f"cross_entropy dlogits[{reduction},{ls},{z}]", g, gr, dtype)
    assert (g.view(-1, V)[target.view(-1) == ignore_index] == 0).all()


def test_cross_entropy_inplace_backward():
    """``inplace_backward=True`` (Triton): the same loss and gradient as a separate buffer, written over the logits
    (no [N, V] allocation); an op that saved the logits for its backward then fails loudly, never reads gradient
    values."""
    V = 131
    base = torch.randn(6, V, dtype=torch.float64)
    target = _targets((6,), V)
    ref_x = base.float().requires_grad_(True)
    ref = K.cross_entropy(ref_x, target, backend="triton")
    ref.backward()
    leaf_x = base.float().requires_grad_(True)
    logits = leaf_x * 1.0  # a non-leaf whose producer (mul by a constant) saves nothing
    out = K.cross_entropy(logits, target, backend="triton", inplace_backward=True)
    assert torch.equal(out, ref)
    assert not torch.equal(logits.detach(), base.float())  # now the (unscaled) gradient
    out.backward()
    assert torch.equal(leaf_x.grad, ref_x.grad)
    saved = base.float().requires_grad_(True)
    logits = saved.exp()  # exp saves its output for backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        K.cross_entropy(logits, target, backend="triton", inplace_backward=True).backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_large_logits_and_all_ignored(backend):
    logits = torch.tensor([[1000.0, -1000.0, 999.0], [0.0, 0.0, 0.0]], requires_grad=True)
    target = torch.tensor([2, 0])
    out = K.cross_entropy(logits, target, backend=backend)
    check("cross_entropy fwd_large", out, _ce_ref(logits.detach().double(), target, -100, "mean", 0.0, 0.0),
          torch.float32)
    ignored = torch.full((2,), -100)
    assert torch.isnan(K.cross_entropy(logits, ignored, backend=backend))  # like torch: 0 / 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_grad_and_frozen_weight(backend):
    """Forward-only CE (no gradient sweep) and fused linear CE with a frozen LM head."""
    V = 131
    logits, target = torch.randn(5, V, dtype=torch.float64), _targets((5,), V)
    with torch.no_grad():
        out = K.cross_entropy(logits.float().requires_grad_(True), target, reduction="sum", backend=backend)
    check("cross_entropy fwd_nograd", out, _ce_ref(logits, target, -100, "sum", 0.0, 0.0), torch.float32)
    hidden = leaf((7, 16), torch.float32)
    weight = torch.randn(V, 16)
    out = K.fused_linear_cross_entropy(hidden, weight, _targets((7,), V), chunk_size=3, backend=backend)
    (dh,) = torch.autograd.grad(out, [hidden])
    hr = hidden.detach().double().requires_grad_(True)
    ref = _ce_ref(hr @ weight.double().t(), _targets((7,), V), -100, "mean", 0.0, 0.0)
    check("fused_linear_ce fwd_frozen", out, ref, torch.float32)
    check("fused_linear_ce dhidden_frozen", dh, torch.autograd.grad(ref, [hr])[0], torch.float32)


@pytest.mark.skipif(not triton_available(), reason="triton not installed")
def test_cross_entropy_backward_twice_is_refused():
    logits = torch.randn(2, 5, requires_grad=True)
    loss = K.cross_entropy(logits, torch.tensor([1, 2]), backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


# ---------------------------------------------------------------------------------- fused linear + cross-entropy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size,with_bias", [(4, True), (5, False), (None, True), (64, False)])
def test_fused_linear_cross_entropy(chunk_size, with_bias, reduction, dtype, backend):
    N, H, V, ls, z = 13, 24, 131, 0.1, 1e-3  # 13 tokens: chunks 4 and 5 leave a remainder
    hidden = leaf((N, H), dtype, scale=0.5)
    weight = leaf((V, H), dtype, scale=0.5, seed=7)
    bias = leaf((V,), dtype, scale=0.1, seed=8) if with_bias else None
    target = _targets((N,), V)
    out = K.fused_linear_cross_entropy(hidden, weight, target, bias=bias, reduction=reduction, label_smoothing=ls,
                                       z_loss=z, chunk_size=chunk_size, backend=backend)
    params = [hidden, weight] + ([bias] if with_bias else [])
    hr, wr, *br = ref64(*params)
    logits = hr @ wr.t() + (br[0] if br else 0.0)
    ref = _ce_ref(logits, target, -100, reduction, ls, z)
    tag = f"[{reduction},{chunk_size},{with_bias}]"
    check(f"fused_linear_ce fwd{tag}", out, ref, dtype)
    up, gs = grads(out, params)
    for name, g, r in zip(["dhidden", "dweight", "dbias"], gs, torch.autograd.grad(ref, [hr, wr, *br], up)):
        check(f"fused_linear_ce {name}{tag}", g, r, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy_of_soft_capped_logits(reduction, backend):
    """Gemma 2's final soft-cap divided by a temperature (``factor * tanh(x / cap)``, ``factor = cap / T``) inside the
    chunks: the loss and every gradient of ``CE(cap * tanh(h W^T / cap) / T)``; the cap binds (logits up to ~8)."""
    N, H, V, cap, temperature = 13, 24, 131, 3.0, 0.7
    hidden = leaf((N, H), torch.float32, scale=1.0)
    weight = leaf((V, H), torch.float32, scale=0.4, seed=7)
    target = _targets((N,), V)
    out = K.fused_linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_size=5, backend=backend,
                                       softcap=(cap, cap / temperature))
    hr, wr = ref64(hidden, weight)
    logits = torch.tanh(hr @ wr.t() / cap) * cap / temperature
    assert float((hr @ wr.t()).abs().max()) > 2 * cap
    ref = _ce_ref(logits, target, -100, reduction, 0.0, 0.0)
    check(f"fused_linear_ce softcap fwd[{reduction}]", out, ref, torch.float32)
    up, gs = grads(out, [hidden, weight])
    for name, g, r in zip(["dhidden", "dweight"], gs, torch.autograd.grad(ref, [hr, wr], up)):
        check(f"fused_linear_ce softcap {name}[{reduction}]", g, r, torch.float32)


def test_default_chunk_size():
    from lightning_llm.kernels.loss.cross_entropy import default_chunk_size

    assert default_chunk_size(32768, 128256, 4096) == 2048  # chunk logits ~ 2x hidden in size (2093 -> 2048)
    assert default_chunk_size(8192, 128256, 4096) == 512  # 523 -> 512
    assert default_chunk_size(8192, 128000, 2048) == 256  # 262 -> 256
    assert default_chunk_size(8192, 128000, 64) == 256  # 8 -> at least MIN_CHUNK tokens
    assert default_chunk_size(3, 10, 100) == 3
    assert default_chunk_size(5, 10**6, 8) == 5


def test_chunks_on_cuda_cover_the_hidden_size():
    """On CUDA a chunk covers at least H tokens (the head's fp32 weight gradient is read and written once per chunk);
    the CPU keeps the memory rule. Sizes only: no device is touched."""
    from lightning_llm.kernels.loss.cross_entropy import chunk_size_for

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert chunk_size_for(8192, 151936, 2048, cuda) == 2048  # Qwen3-30B-A3B's head: 256 -> 2048 (4 chunks, not 32)
    assert chunk_size_for(8192, 151936, 2048, cpu) == 256
    assert chunk_size_for(32768, 128256, 4096, cuda) == 4096  # the logits rule gives 2048
    assert chunk_size_for(65536, 32000, 2048, cuda) == 8192  # the logits rule is larger: kept
    assert chunk_size_for(1000, 151936, 2048, cuda) == 1000  # at most the tokens there are


def test_zz_report_max_errors():
    """The largest relative error seen per kernel, dtype and backend over this file's tests (printed with -s), each
    within its dtype's tolerance, and every kernel and dtype checked under each backend that ran (triton where
    installed, torch). Runs last in the file (its name), in the same process as the others (make test's workers take
    whole files)."""
    if not MAX_ERR:
        pytest.skip("no kernel test ran in this process before this one: run the whole file")
    tolerance = {str(dtype).replace("torch.", ""): tol for dtype, tol in TOL.items()}
    seen: dict[str, set[str]] = {}
    for key in sorted(MAX_ERR):
        kernel_dtype, backend = key.rsplit(" ", 1)
        dtype = kernel_dtype.rsplit(" ", 1)[1]
        print(f"{key:48s} {MAX_ERR[key]:.2e} (tolerance {tolerance[dtype]:.0e})")
        assert MAX_ERR[key] <= tolerance[dtype], f"{key}: {MAX_ERR[key]:.2e} > {tolerance[dtype]:.0e}"
        seen.setdefault(backend, set()).add(kernel_dtype)
    assert "torch" in seen and len({frozenset(checked) for checked in seen.values()}) == 1, seen
