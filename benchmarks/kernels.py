"""GPU benchmark of lightning_llm.kernels vs torch eager, torch.compile and liger-kernel (when importable).

For each kernel and provider: median time of forward and of forward+backward (``triton.testing.do_bench``) and
the peak extra memory of one forward+backward. Prints a markdown table (with the device name) and writes it to
``benchmarks/results/kernels-<device>.md``. Not run in CI; ``--help`` works on CPU.

    python benchmarks/kernels.py --tokens 8192 --hidden 4096 --vocab 128256 --dtype bf16
    python benchmarks/kernels.py --kernels cross_entropy fused_linear_cross_entropy --providers triton liger
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable

KERNELS = ["rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy"]
PROVIDERS = ["triton", "eager", "compile", "liger"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    p.add_argument("--providers", nargs="+", default=PROVIDERS, choices=PROVIDERS)
    p.add_argument("--tokens", type=int, default=8192, help="batch * sequence (rows N)")
    p.add_argument("--batch", type=int, default=4, help="batch size for rope (seq = tokens // batch)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336, help="MLP width for swiglu/geglu")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--chunk-size", type=int, default=None, help="fused linear CE tokens per chunk (default: auto)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions (ms)")
    p.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return p.parse_args(argv)


def build_cases(a, torch, K):
    """{kernel: (make_inputs() -> (tensors requiring grad, other args), {provider: fn(*tensors, *args)})}."""
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    dev = "cuda"

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dt).requires_grad_(True)

    try:
        import liger_kernel.transformers.functional as LF
    except Exception:  # noqa: BLE001 - any import problem just disables the provider
        LF = None

    N, H, V, FF = a.tokens, a.hidden, a.vocab, a.intermediate
    B, S = a.batch, a.tokens // a.batch
    HQ, HK, D = a.heads, a.kv_heads, a.head_dim
    target = torch.randint(0, V, (N,), device=dev)
    target[::10] = -100

    def rope_inputs():
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        emb = torch.arange(S, device=dev, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat([emb, emb], -1)
        return [rnd(B, S, HQ, D), rnd(B, S, HK, D)], [emb.cos().to(dt), emb.sin().to(dt)]

    def liger_rope(q, k, cos, sin):  # liger wants [B, H, S, D] and cos [1, S, D]
        qo, ko = LF.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
        return qo.transpose(1, 2), ko.transpose(1, 2)

    eager = {
        "rms_norm": lambda x, w: K.rms_norm(x, w, 1e-6, backend="torch"),
        "layer_norm": lambda x, w, b: K.layer_norm(x, w, b, 1e-5, backend="torch"),
        "rope": lambda q, k, c, s: K.apply_rotary(q, k, c, s, backend="torch"),
        "swiglu": lambda g, u: K.swiglu(g, u, backend="torch"),
        "geglu": lambda g, u: K.geglu(g, u, approximate="tanh", backend="torch"),
        "cross_entropy": lambda x: K.cross_entropy(x, target, backend="torch"),
        "fused_linear_cross_entropy": lambda h, w: K.cross_entropy(h @ w.t(), target, backend="torch"),
    }
    triton_fns = {
        "rms_norm": lambda x, w: K.rms_norm(x, w, 1e-6, backend="triton"),
        "layer_norm": lambda x, w, b: K.layer_norm(x, w, b, 1e-5, backend="triton"),
        "rope": lambda q, k, c, s: K.apply_rotary(q, k, c, s, backend="triton"),
        "swiglu": lambda g, u: K.swiglu(g, u, backend="triton"),
        "geglu": lambda g, u: K.geglu(g, u, approximate="tanh", backend="triton"),
        "cross_entropy": lambda x: K.cross_entropy(x, target, backend="triton"),
        "fused_linear_cross_entropy": lambda h, w: K.fused_linear_cross_entropy(
            h, w, target, chunk_size=a.chunk_size, backend="triton"),
    }
    liger = {}
    if LF is not None:
        liger = {
            "rms_norm": lambda x, w: LF.liger_rms_norm(x, w, 1e-6),
            "layer_norm": lambda x, w, b: LF.liger_layer_norm(x, w, b, 1e-5),
            "rope": liger_rope,
            "swiglu": lambda g, u: LF.liger_swiglu(g, u),
            "geglu": lambda g, u: LF.liger_geglu(g, u),
            "cross_entropy": lambda x: LF.liger_cross_entropy(x, target),
            "fused_linear_cross_entropy": lambda h, w: LF.liger_fused_linear_cross_entropy(h, w, target),
        }
    inputs = {
        "rms_norm": lambda: ([rnd(N, H), rnd(H)], []),
        "layer_norm": lambda: ([rnd(N, H), rnd(H), rnd(H)], []),
        "rope": rope_inputs,
        "swiglu": lambda: ([rnd(N, FF), rnd(N, FF)], []),
        "geglu": lambda: ([rnd(N, FF), rnd(N, FF)], []),
        "cross_entropy": lambda: ([rnd(N, V, scale=2.0)], []),
        "fused_linear_cross_entropy": lambda: ([rnd(N, H), rnd(V, H, scale=H ** -0.5)], []),
    }
    cases = {}
    for k in a.kernels:
        fns = {"triton": triton_fns[k], "eager": eager[k], "compile": torch.compile(eager[k], dynamic=False)}
        if k in liger:
            fns["liger"] = liger[k]
        cases[k] = (inputs[k], {p: f for p, f in fns.items() if p in a.providers})
    return cases


def bench_one(torch, do_bench, make_inputs: Callable, fn: Callable, warmup: int, rep: int):
    """(forward ms, forward+backward ms, peak extra MiB of forward+backward)."""
    tensors, extra = make_inputs()
    outs = fn(*tensors, *extra)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ups = [torch.randn_like(o) for o in outs]

    def fwd():
        return fn(*tensors, *extra)

    def fwd_bwd():
        o = fn(*tensors, *extra)
        o = o if isinstance(o, tuple) else (o,)
        torch.autograd.backward(o, ups)

    with torch.no_grad():
        t_fwd = do_bench(fwd, warmup=warmup, rep=rep, return_mode="median")
    t_fb = do_bench(fwd_bwd, warmup=warmup, rep=rep, grad_to_none=tensors, return_mode="median")
    for t in tensors:
        t.grad = None
    del outs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return t_fwd, t_fb, peak


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (the Triton interpreter is far too slow to time).")
        return 1
    from triton.testing import do_bench

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_llm import kernels as K

    device = torch.cuda.get_device_name()
    cases = build_cases(a, torch, K)
    rows = []
    for kernel, (make_inputs, fns) in cases.items():
        for provider, fn in fns.items():
            try:
                t_f, t_fb, mem = bench_one(torch, do_bench, make_inputs, fn, a.warmup, a.rep)
                rows.append((kernel, provider, f"{t_f:.3f}", f"{t_fb:.3f}", f"{mem:.0f}"))
            except Exception as e:  # noqa: BLE001 - report and keep going (OOM, API mismatch, ...)
                rows.append((kernel, provider, "error", "error", type(e).__name__))
            print(" | ".join(rows[-1]), file=sys.stderr)
            torch.cuda.empty_cache()
    shapes = (f"tokens={a.tokens} hidden={a.hidden} intermediate={a.intermediate} vocab={a.vocab} "
              f"heads={a.heads}/{a.kv_heads}x{a.head_dim} batch={a.batch} dtype={a.dtype}")
    lines = [
        f"# lightning_llm.kernels on {device}",
        "",
        f"torch {torch.__version__}; {shapes}; times are medians of triton.testing.do_bench",
        "",
        "| kernel | provider | fwd (ms) | fwd+bwd (ms) | peak fwd+bwd (MiB) |",
        "|---|---|---:|---:|---:|",
        *[f"| {' | '.join(r)} |" for r in rows],
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"kernels-{re.sub(r'[^A-Za-z0-9_.-]+', '-', device).strip('-')}.md")
    with open(path, "w") as f:
        f.write(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
