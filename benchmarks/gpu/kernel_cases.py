"""Kernel cases, correctness checks and timings shared by ``benchmarks/gpu/suite.py`` and ``benchmarks/gpu/kernel_bench.py``.

A :class:`Case` is one op of :mod:`lightning_llm.kernels` (optionally a variant that compiles another Triton
specialisation, e.g. CE with label smoothing) with four implementations: ``triton`` (the kernel), ``torch`` (the
package's plain-torch path, run in the same dtype), ``fp64`` (an independent float64 reference written here) and
``liger`` (Liger-Kernel's functional op, when ``liger_kernel`` imports). Shapes come from Liger-Kernel's benchmark
scripts (``benchmark/scripts/benchmark_*.py``: their x-value sweeps and ``extra_benchmark_configs``), see
:data:`LIGER_SHAPES`; :data:`SMOKE_SHAPES` are tiny odd shapes for Triton's CPU interpreter.

Error metric (as ``tests/kernels/test_kernels.py``): ``max|out - ref| / max|ref|`` per output/gradient tensor, computed in
float64; a non-finite output counts as an infinite error.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_llm import kernels as K

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL: dict[str, float] = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}
TORCH_MARGIN = 1.25
"""In bf16/fp16 a kernel passes when its error against float64 is within ``TOL`` or within this factor of the plain
torch path's own error against float64 (at some shapes torch itself is further off than ``TOL``: fp16 fused linear
CE at 4096 x 4096 x 128256 on the H200, 2.97e-2 against a 1e-2 tolerance); against torch, within the sum of both."""
"""Largest allowed relative error, vs the float64 reference and vs the torch path in the same dtype."""
PROVIDERS = ("triton", "eager", "compile", "liger")
Shape = dict[str, int]
Inputs = tuple[list[Tensor], list[Any]]  # (leaves that get gradients, constant arguments)

# Liger-Kernel benchmark sweeps; "check" points are run against float64 (sizes chosen so the float64 copies fit
# next to everything else on an 80 GB card), "time" is the point that is timed (the sweep's largest).
LIGER_SHAPES: dict[str, dict[str, Any]] = {
    # benchmark_rms_norm.py: M=2048, H in 2^10..2^15
    "rms_norm": dict(check=[dict(rows=2048, hidden=1024), dict(rows=2048, hidden=32768)],
                     time=dict(rows=2048, hidden=32768)),
    # benchmark_layer_norm.py: M=4096, N in 2^10..2^14
    "layer_norm": dict(check=[dict(rows=4096, hidden=1024), dict(rows=4096, hidden=16384)],
                       time=dict(rows=4096, hidden=16384)),
    # benchmark_rope.py: bsz 1, 32 q / 8 kv heads; hidden 512..8192 at seq 2048, seq 2^10..2^14 at hidden 8192
    "apply_rotary": dict(check=[dict(batch=1, seq=2048, q_heads=32, kv_heads=8, head_dim=16),
                                dict(batch=1, seq=16384, q_heads=32, kv_heads=8, head_dim=256)],
                         time=dict(batch=1, seq=16384, q_heads=32, kv_heads=8, head_dim=256)),
    # benchmark_swiglu.py: B=4, T in 2^10..2^13, intermediate 11008
    "swiglu": dict(check=[dict(rows=4 * 1024, width=11008), dict(rows=4 * 4096, width=11008)],
                   time=dict(rows=4 * 8192, width=11008)),
    # benchmark_geglu.py: bsz=8, T in 2^10..2^13, intermediate 11008, gelu_pytorch_tanh
    "geglu": dict(check=[dict(rows=8 * 1024, width=11008), dict(rows=8 * 2048, width=11008)],
                  time=dict(rows=8 * 8192, width=11008)),
    "geglu[erf]": dict(check=[dict(rows=8 * 1024, width=11008)], time=None),
    # benchmark_cross_entropy.py: B=8, T=2048 (BT=16384), V in 2^12..2^17
    "cross_entropy": dict(check=[dict(rows=16384, vocab=4096), dict(rows=2048, vocab=131072)],
                          time=dict(rows=16384, vocab=131072)),
    "cross_entropy[ls=0.1,z=1e-4,sum]": dict(check=[dict(rows=2048, vocab=131072)], time=None),
    "vocab_parallel_cross_entropy": dict(check=[dict(rows=2048, vocab=131072)], time=dict(rows=16384, vocab=131072)),
    # benchmark_fused_linear_cross_entropy.py: H=4096, V=128256, BT in 2^12..2^15 (timed by gpu.py's flce part)
    "fused_linear_cross_entropy": dict(check=[dict(rows=4096, hidden=4096, vocab=128256)], time=None),
    "fused_linear_cross_entropy[none,bias]": dict(check=[dict(rows=1000, hidden=4096, vocab=128256)], time=None),
}
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "rms_norm": dict(check=[dict(rows=6, hidden=37)], time=dict(rows=6, hidden=37)),
    "layer_norm": dict(check=[dict(rows=6, hidden=37)], time=dict(rows=6, hidden=37)),
    "apply_rotary": dict(check=[dict(batch=2, seq=5, q_heads=3, kv_heads=1, head_dim=10)],
                         time=dict(batch=2, seq=5, q_heads=3, kv_heads=1, head_dim=10)),
    "swiglu": dict(check=[dict(rows=3, width=37)], time=dict(rows=3, width=37)),
    "geglu": dict(check=[dict(rows=3, width=37)], time=dict(rows=3, width=37)),
    "geglu[erf]": dict(check=[dict(rows=3, width=37)], time=None),
    "cross_entropy": dict(check=[dict(rows=12, vocab=131)], time=dict(rows=12, vocab=131)),
    "cross_entropy[ls=0.1,z=1e-4,sum]": dict(check=[dict(rows=12, vocab=131)], time=None),
    "vocab_parallel_cross_entropy": dict(check=[dict(rows=12, vocab=131)], time=dict(rows=12, vocab=131)),
    "fused_linear_cross_entropy": dict(check=[dict(rows=13, hidden=24, vocab=131)], time=None),
    "fused_linear_cross_entropy[none,bias]": dict(check=[dict(rows=13, hidden=24, vocab=131)], time=None),
}


@dataclass
class Case:
    """One kernel (or kernel variant) with its implementations, tensor names and ideal-traffic model."""

    name: str
    make: Callable[[Shape, torch.dtype, torch.device, torch.Generator], Inputs]
    fns: dict[str, Callable[..., Any]]
    out_names: tuple[str, ...]
    grad_names: tuple[str, ...]
    traffic: Callable[[Shape, int], tuple[int, int]] | None = None
    """(forward bytes, forward+backward bytes) of an ideal kernel: every input read once, every output written once."""
    providers: tuple[str, ...] = PROVIDERS
    check_shapes: list[Shape] = field(default_factory=list)
    time_shape: Shape | None = None


@dataclass
class CheckRow:
    kernel: str
    shape: str
    dtype: str
    tensor: str
    err_fp64: float
    err_torch: float
    torch_err_fp64: float
    tol: float

    @property
    def tolerance(self) -> float:
        """``tol``, widened in low precision to what torch's own path reaches (:data:`TORCH_MARGIN`)."""
        return self.tol if self.dtype == "fp32" else max(self.tol, TORCH_MARGIN * self.torch_err_fp64)

    @property
    def ok(self) -> bool:
        both = self.tolerance + (self.torch_err_fp64 if self.dtype != "fp32" else 0.0)
        return self.err_fp64 <= self.tolerance and self.err_torch <= max(self.tol, both)

    def describe(self) -> str:
        return (f"{self.kernel} {self.dtype} {self.tensor} (shape {self.shape}): error {self.err_fp64:.3e} vs float64, "
                f"{self.err_torch:.3e} vs torch, tolerance {self.tolerance:.2e} (torch's own error vs float64 "
                f"{self.torch_err_fp64:.3e})")


def fmt_shape(shape: Shape) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _rand(shape: Sequence[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator,
          scale: float = 1.0, shift: float = 0.0) -> Tensor:
    return (torch.randn(tuple(shape), generator=gen, device=device) * scale + shift).to(dtype).requires_grad_(True)


def _targets(rows: int, vocab: int, device: torch.device, gen: torch.Generator) -> Tensor:
    t = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    t[::10] = -100  # every 10th token ignored
    return t


def _ce64(logits: Tensor, target: Tensor, reduction: str = "mean", ls: float = 0.0, z: float = 0.0) -> Tensor:
    loss = F.cross_entropy(logits, target, ignore_index=-100, reduction="none", label_smoothing=ls)
    valid = target != -100
    loss = loss + torch.where(valid, z * torch.logsumexp(logits, -1) ** 2, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def _rope64(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos[None, :, None] + torch.cat((-x2, x1), -1) * sin[None, :, None]


def liger_functional() -> tuple[Any | None, str]:
    """(``liger_kernel.transformers.functional`` or None, why not)."""
    try:
        return importlib.import_module("liger_kernel.transformers.functional"), ""
    except Exception as e:  # noqa: BLE001 - any import problem only disables the provider
        return None, f"liger_kernel not importable ({type(e).__name__}: {str(e)[:80]})"


# ------------------------------------------------------------------------------------------------------ the cases


def _norm_cases(LF: Any) -> list[Case]:
    def make_rms(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> Inputs:
        return [_rand((s["rows"], s["hidden"]), dt, dev, g, 2.0, 0.5), _rand((s["hidden"],), dt, dev, g, 0.3, 1.0)], []

    def make_ln(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> Inputs:
        x, w = make_rms(s, dt, dev, g)[0]
        return [x, w, _rand((s["hidden"],), dt, dev, g, 0.3)], []

    def traffic(s: Shape, e: int, vectors: int) -> tuple[int, int]:
        x, v = s["rows"] * s["hidden"] * e, s["hidden"] * e
        return 2 * x + vectors * v, 5 * x + 3 * vectors * v  # bwd: read x, dy, w; write dx, dw (, db)

    rms = Case("rms_norm", make_rms, {
        "triton": lambda x, w: K.rms_norm(x, w, 1e-6, backend="triton"),
        "torch": lambda x, w: K.rms_norm_torch(x, w, 1e-6),
        "fp64": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    }, ("y",), ("dx", "dweight"), lambda s, e: traffic(s, e, 1))
    ln = Case("layer_norm", make_ln, {
        "triton": lambda x, w, b: K.layer_norm(x, w, b, 1e-5, backend="triton"),
        "torch": lambda x, w, b: K.layer_norm_torch(x, w, b, 1e-5),
        "fp64": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    }, ("y",), ("dx", "dweight", "dbias"), lambda s, e: traffic(s, e, 2))
    if LF is not None:
        rms.fns["liger"] = lambda x, w: LF.liger_rms_norm(x, w, 1e-6)
        ln.fns["liger"] = lambda x, w, b: LF.liger_layer_norm(x, w, b, 1e-5)
    return [rms, ln]


def _rope_case(LF: Any) -> Case:
    def make(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> Inputs:
        B, S, D = s["batch"], s["seq"], s["head_dim"]
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        emb = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat([emb, emb], -1)  # [S, D]
        q, k = _rand((B, S, s["q_heads"], D), dt, dev, g), _rand((B, S, s["kv_heads"], D), dt, dev, g)
        return [q, k], [emb.cos().to(dt), emb.sin().to(dt)]

    def traffic(s: Shape, e: int) -> tuple[int, int]:
        qk = s["batch"] * s["seq"] * (s["q_heads"] + s["kv_heads"]) * s["head_dim"] * e
        cs = 2 * s["seq"] * s["head_dim"] * e
        return 2 * qk + cs, 4 * qk + 2 * cs

    case = Case("apply_rotary", make, {
        "triton": lambda q, k, c, s: K.apply_rotary(q, k, c, s, backend="triton"),
        "torch": K.apply_rotary_torch,
        "fp64": lambda q, k, c, s: (_rope64(q, c, s), _rope64(k, c, s)),
    }, ("q_out", "k_out"), ("dq", "dk"), traffic)
    if LF is not None:  # liger wants [B, H, S, D] and cos [1, S, D]
        def liger_rope(q: Tensor, k: Tensor, c: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
            qo, ko = LF.liger_rope(q.transpose(1, 2), k.transpose(1, 2), c[None], s[None])
            return qo.transpose(1, 2), ko.transpose(1, 2)

        case.fns["liger"] = liger_rope
    return case


def _gated_cases(LF: Any) -> list[Case]:
    def make(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> Inputs:
        return [_rand((s["rows"], s["width"]), dt, dev, g, 2.5), _rand((s["rows"], s["width"]), dt, dev, g)], []

    def traffic(s: Shape, e: int) -> tuple[int, int]:
        t = s["rows"] * s["width"] * e
        return 3 * t, 8 * t  # fwd: read gate, up, write out; bwd: read gate, up, dout, write dgate, dup

    sw = Case("swiglu", make, {
        "triton": lambda a, b: K.swiglu(a, b, backend="triton"), "torch": K.swiglu_torch,
        "fp64": lambda a, b: F.silu(a) * b}, ("out",), ("dgate", "dup"), traffic)
    ge = Case("geglu", make, {
        "triton": lambda a, b: K.geglu(a, b, approximate="tanh", backend="triton"),
        "torch": lambda a, b: K.geglu_torch(a, b, "tanh"),
        "fp64": lambda a, b: F.gelu(a, approximate="tanh") * b}, ("out",), ("dgate", "dup"), traffic)
    erf = Case("geglu[erf]", make, {
        "triton": lambda a, b: K.geglu(a, b, approximate="none", backend="triton"),
        "torch": lambda a, b: K.geglu_torch(a, b, "none"),
        "fp64": lambda a, b: F.gelu(a) * b}, ("out",), ("dgate", "dup"), traffic)
    if LF is not None:
        sw.fns["liger"] = LF.liger_swiglu
        ge.fns["liger"] = LF.liger_geglu  # tanh-approximate gelu, like Liger's benchmark
    return [sw, ge, erf]


def _ce_cases(LF: Any) -> list[Case]:
    def make(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator) -> Inputs:
        return [_rand((s["rows"], s["vocab"]), dt, dev, g, 2.0)], [_targets(s["rows"], s["vocab"], dev, g)]

    def traffic(s: Shape, e: int) -> tuple[int, int]:
        x = s["rows"] * s["vocab"] * e
        return x + 8 * s["rows"], 2 * x + 8 * s["rows"]  # read logits (+ targets); fwd+bwd also writes dlogits

    ce = Case("cross_entropy", make, {  # in place, like Liger's: the logits are not read again here
        "triton": lambda x, t: K.cross_entropy(x, t, backend="triton", inplace_backward=True),
        "torch": K.cross_entropy_torch, "fp64": _ce64}, ("loss",), ("dlogits",), traffic)
    kw = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-4)
    smooth = Case("cross_entropy[ls=0.1,z=1e-4,sum]", make, {
        "triton": lambda x, t: K.cross_entropy(x, t, backend="triton", **kw),
        "torch": lambda x, t: K.cross_entropy_torch(x, t, **kw),
        "fp64": lambda x, t: _ce64(x, t, "sum", 0.1, 1e-4)}, ("loss",), ("dlogits",), traffic)
    vp = Case("vocab_parallel_cross_entropy", make, {  # one shard, no process group: the TP kernels on full rows
        "triton": lambda x, t: K.vocab_parallel_cross_entropy(x, t, backend="triton"),
        "torch": lambda x, t: K.vocab_parallel_cross_entropy(x, t, backend="torch"),
        "fp64": _ce64}, ("loss",), ("dlogits",), traffic, providers=("triton", "eager"))
    if LF is not None:
        ce.fns["liger"] = lambda x, t: LF.liger_cross_entropy(x, t)
    return [ce, smooth, vp]


def flce_inputs(s: Shape, dt: torch.dtype, dev: torch.device, g: torch.Generator, bias: bool = False) -> Inputs:
    """([hidden [N, H], weight [V, H] (, bias [V])], [target [N]]) for the fused linear cross-entropy."""
    h = _rand((s["rows"], s["hidden"]), dt, dev, g)
    w = _rand((s["vocab"], s["hidden"]), dt, dev, g, s["hidden"] ** -0.5)
    extra = [_rand((s["vocab"],), dt, dev, g, 0.1)] if bias else []
    return [h, w, *extra], [_targets(s["rows"], s["vocab"], dev, g)]


def _flce_cases(LF: Any) -> list[Case]:
    make = flce_inputs
    flce = Case("fused_linear_cross_entropy", make, {
        "triton": lambda h, w, t: K.fused_linear_cross_entropy(h, w, t, backend="triton"),
        "torch": lambda h, w, t: K.cross_entropy_torch(h @ w.t(), t),
        "fp64": lambda h, w, t: _ce64(h @ w.t(), t)}, ("loss",), ("dhidden", "dweight"))
    none = Case("fused_linear_cross_entropy[none,bias]", lambda *a: make(*a, bias=True), {
        "triton": lambda h, w, b, t: K.fused_linear_cross_entropy(h, w, t, bias=b, reduction="none", backend="triton"),
        "torch": lambda h, w, b, t: K.cross_entropy_torch(torch.addmm(b, h, w.t()), t, reduction="none"),
        "fp64": lambda h, w, b, t: _ce64(torch.addmm(b, h, w.t()), t, "none")},
        ("loss",), ("dhidden", "dweight", "dbias"))
    if LF is not None:
        flce.fns["liger"] = lambda h, w, t: LF.liger_fused_linear_cross_entropy(h, w, t)
    return [flce, none]


def build_cases(shapes: dict[str, dict[str, Any]], *, with_liger: bool = True) -> list[Case]:
    """Every case named in ``shapes`` (in the order of :data:`LIGER_SHAPES`), with its shapes attached."""
    LF = liger_functional()[0] if with_liger else None
    cases = [*_norm_cases(LF), _rope_case(LF), *_gated_cases(LF), *_ce_cases(LF), *_flce_cases(LF)]
    for c in cases:
        c.check_shapes = list(shapes.get(c.name, {}).get("check", []))
        c.time_shape = shapes.get(c.name, {}).get("time")
    return [c for c in cases if c.name in shapes]


# ------------------------------------------------------------------------------------------------- correctness


def rel_err(out: Tensor, ref: Tensor, chunk: int = 1 << 24) -> float:
    """``max|out - ref| / max|ref|`` in float64, in chunks (no full-size float64 copies); inf if either is not
    finite or the shapes differ."""
    if out.shape != ref.shape:
        return math.inf
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    diff = mag = 0.0
    for s in range(0, o.numel(), chunk):
        a, b = o[s:s + chunk].double(), r[s:s + chunk].double()
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            return math.inf
        diff = max(diff, float((a - b).abs().max()))
        mag = max(mag, float(b.abs().max()))
    return diff / max(mag, 1e-30)


def as_tuple(x: Any) -> tuple[Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def forward_backward(fn: Callable[..., Any], leaves: list[Tensor], consts: list[Any],
                     ups: list[Tensor] | None, gen: torch.Generator) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Outputs, input gradients for upstream gradients ``ups`` (drawn from ``gen`` when None), and ``ups``."""
    outs = as_tuple(fn(*leaves, *consts))
    if ups is None:
        ups = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, [u.to(o.dtype) for u, o in zip(ups, outs)])
    return [o.detach() for o in outs], [g.detach() for g in grads], ups


def _fresh(leaves: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    return [t.detach().to(dtype or t.dtype, copy=True).requires_grad_(True) for t in leaves]


def generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def check_case(case: Case, shape: Shape, dtype: str, device: torch.device, seed: int = 0) -> list[CheckRow]:
    """Run triton, torch (same dtype) and float64 forward+backward on the same inputs; one row per tensor."""
    gen = generator(device, seed)
    leaves, consts = case.make(shape, DTYPES[dtype], device, gen)
    # Each provider gets its own copy: a kernel may write its gradient over its input (in-place cross-entropy).
    out_t, grad_t, ups = forward_backward(case.fns["triton"], _fresh(leaves), consts, None, gen)
    out_r, grad_r, _ = forward_backward(case.fns["torch"], _fresh(leaves), consts, ups, gen)
    consts64 = [c.double() if torch.is_tensor(c) and c.is_floating_point() else c for c in consts]
    out_x, grad_x, _ = forward_backward(case.fns["fp64"], _fresh(leaves, torch.float64), consts64,
                                        [u.double() for u in ups], gen)
    names = case.out_names + case.grad_names
    rows = [CheckRow(case.name, fmt_shape(shape), dtype, n, rel_err(t, x), rel_err(t, r), rel_err(r, x), TOL[dtype])
            for n, t, r, x in zip(names, out_t + grad_t, out_r + grad_r, out_x + grad_x)]
    if len(rows) != len(names):
        raise RuntimeError(f"{case.name}: expected tensors {names}, got {len(rows)}")
    return rows


def check_all(cases: Sequence[Case], dtypes: Sequence[str], device: torch.device,
              out_of_time: Callable[[], bool] = lambda: False) -> tuple[list[CheckRow], list[str], list[str]]:
    """All check shapes x dtypes: (rows, failures (mismatches and exceptions), skipped for the time budget)."""
    rows: list[CheckRow] = []
    failures: list[str] = []
    skipped: list[str] = []
    for case in cases:
        for shape in case.check_shapes:
            for dtype in dtypes:
                if out_of_time():
                    skipped.append(f"{case.name} {dtype} (shape {fmt_shape(shape)})")
                    continue
                try:
                    new = check_case(case, shape, dtype, device)
                except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                    failures.append(f"{case.name} {dtype} (shape {fmt_shape(shape)}): {type(e).__name__}: {e}")
                    log.error("correctness: %s", failures[-1])
                    new = []
                rows += new
                for r in new:
                    if not r.ok:
                        failures.append("MISMATCH " + r.describe())
                        log.error("correctness: %s", failures[-1])
                free_memory(device)
    return rows, failures, skipped


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
