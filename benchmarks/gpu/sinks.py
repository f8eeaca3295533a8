"""Attention sinks (gpt-oss) on the GPU: the varlen path (flash varlen's output corrected by its log-sum-exp and the
sink, the kernel's backward given the corrected output: ``models/layers/sinks.py``) against an fp32 reference (the scores
materialised with the sink as a column), forward and backward, and the same for flash varlen without sinks (the
kernel's own bf16 error, the baseline the sinks must not exceed); then ``debug-gpt-oss`` trained a step under bf16
autocast on the varlen path and on the mask path (eager scores on CUDA); then time and peak memory of one layer's
attention forward + backward at gpt-oss-20b's heads (64 query, 8 kv, head dim 64) on packed rows, varlen vs eager.

    python benchmarks/gpu/sinks.py --device cuda --budget-s 120 --out sinks.md
    python benchmarks/gpu/sinks.py --device cpu --smoke --out /tmp/sinks.md    # the CPU paths, tiny sizes

Every row that cannot run writes its reason; the others go on. Prints progress.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_llm.models import build_model  # noqa: E402
from lightning_llm.models.layers.attention import DotProductAttention, varlen_layout  # noqa: E402
from lightning_llm.models.layers.masks import additive_mask, causal_padding_mask  # noqa: E402
from lightning_llm.models.layers.sinks import eager_sink_attention, varlen_sinks_supported  # noqa: E402


def _rows(kind: str, b: int, s: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(padding mask, segment ids) of ``kind``: plain, padded (right and left), packed (3 examples + padding)."""
    if kind == "plain":
        return None, None
    if kind == "padded":
        keep = torch.ones(b, s, dtype=torch.bool)
        keep[0, 3 * s // 4:] = False
        keep[-1, : s // 5] = False
        return keep, None
    seg = torch.zeros(b, s, dtype=torch.long)
    cuts = [0, s // 3, s // 2, s - s // 8]
    for i in range(3):
        seg[:, cuts[i]:cuts[i + 1]] = i + 1
    return None, seg


def _reference(q, k, v, sinks, keep, seg, window):  # noqa: ANN001, ANN202 - fp32 scores with the sink column
    b, _, s, _ = q.shape
    mask = keep if keep is not None else torch.ones(b, s, dtype=torch.bool, device=q.device)
    bool_mask = causal_padding_mask(mask.to(q.device), s, window,
                                    segment_ids=None if seg is None else seg.to(q.device))
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1),
            attn_mask=bool_mask)
    return eager_sink_attention(q, k, v, sinks, attn_mask=bool_mask, is_causal=False)


def _kernel_row(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...], kind: str, window: int | None,
                with_sinks: bool) -> str:
    b, n, kh, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (n, kh, kh))
    sinks = torch.randn(n, generator=g) * 2 if with_sinks else None
    grad = torch.randn(b, n, s, d, generator=g)
    keep, seg = _rows(kind, b, s)
    real = (keep if keep is not None else torch.ones(b, s, dtype=torch.bool)) & (seg > 0 if seg is not None else True)
    leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = sinks.to(device).requires_grad_() if sinks is not None else None
    layout = varlen_layout(keep, seg, batch=b, seq=s, device=device).with_window(window)
    kw = {"sinks": sink_leaf} if sink_leaf is not None else {}
    got = DotProductAttention()(*leaves, attn_mask=layout, is_causal=False, dropout_p=0.0, **kw)
    mask4 = real[:, None, :, None].to(device)
    wrt = [*leaves, *([sink_leaf] if sink_leaf is not None else [])]
    got_grads = torch.autograd.grad(got, wrt, grad.to(device, dtype) * mask4)
    ref_leaves = [t.detach().float().requires_grad_() for t in wrt]
    ref = _reference(*ref_leaves[:3], ref_leaves[3] if len(ref_leaves) > 3 else None, keep, seg, window)
    ref_grads = torch.autograd.grad(ref, ref_leaves, grad.to(device) * mask4)
    err = float(((got.float() - ref) * mask4).abs().max() / ref.abs().max())
    gerr = [float((a.float() - r).abs().max() / r.abs().max().clamp(min=1e-12)) for a, r in zip(got_grads, ref_grads)]
    return f"{err:.2e} | {', '.join(f'{e:.1e}' for e in gerr)} |"


def kernel_rows(device: torch.device, sizes: dict[str, int], dtype: torch.dtype) -> list[str]:
    """Our attention core (varlen layout) vs the fp32 reference, with and without sinks."""
    b, n, kh, s, d = sizes["b"], sizes["n"], sizes["kv"], sizes["s"], sizes["d"]
    out = []
    for kind in ("plain", "padded", "packed"):
        for window in (None, sizes["window"]):
            for with_sinks in (False, True):
                try:
                    row = _kernel_row(device, dtype, (b, n, kh, s, d), kind, window, with_sinks)
                except Exception as e:  # noqa: BLE001 - the row says why, the others go on
                    row = f"{type(e).__name__}: {str(e).splitlines()[0][:100]} | |"
                out.append(f"| {kind} | {window or 'full'} | {'sinks' if with_sinks else 'none'} | {row}")
                print(out[-1], flush=True)
    return out


def model_rows(device: torch.device, dtype: torch.dtype, smoke: bool) -> list[str]:
    """debug-gpt-oss (sinks ~ N(0, 1)): one training step under ``dtype`` autocast on the mask path and on the varlen
    path, each against the mask path in fp32 (the reference): the loss, and the worst parameter's gradient error
    relative to its largest reference gradient."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 64 if smoke else 256), generator=g)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[1, 40:] = False
    keep[2, :9] = False
    labels = ids.roll(-1, 1).masked_fill(~keep, -100)
    res = {}
    for attention, run_dtype in (("sdpa", torch.float32), ("sdpa", dtype), ("varlen", dtype)):
        torch.manual_seed(0)
        model = build_model("debug-gpt-oss", family="decoder", attention=attention)
        with torch.no_grad():
            for layer in model.layers.values():
                layer.self_attn.sinks.weight.normal_(0, 1, generator=torch.Generator().manual_seed(1))
        model = model.to(device)
        with torch.autocast(device.type, dtype=run_dtype, enabled=run_dtype != torch.float32):
            loss = model(ids.to(device), attention_mask=keep.to(device), labels=labels.to(device))
        loss.backward()
        res[attention, run_dtype] = (float(loss), {n: p.grad.float() for n, p in model.named_parameters()})
    ref_loss, ref = res["sdpa", torch.float32]
    rows = []
    for (attention, run_dtype), (loss, grads) in res.items():
        if run_dtype == torch.float32:
            continue
        errs = {n: float((grads[n] - r).abs().max() / r.abs().max().clamp(min=1e-12)) for n, r in ref.items()}
        worst = max(errs, key=errs.get)
        rows.append(f"| {attention}, {str(run_dtype).removeprefix('torch.')} autocast | {loss:.6f} | {ref_loss:.6f} | "
                    f"{errs[worst]:.2e} ({worst}) | {errs['layers.0.self_attn.sinks.weight']:.2e} |")
        print(rows[-1], flush=True)
    return rows


def speed_rows(device: torch.device, dtype: torch.dtype, smoke: bool, budget: float) -> list[str]:
    """One attention layer's forward + backward at gpt-oss-20b's heads on packed rows: varlen with sinks vs eager."""
    n, kh, d = (4, 2, 16) if smoke else (64, 8, 64)
    b, s = (1, 128) if smoke else (2, 4096)
    keep, seg = _rows("packed", b, s)
    rows = []
    for path in ("varlen", "eager"):
        if time.perf_counter() > budget:
            rows.append(f"| {path} | - | - | out of time budget |")
            continue
        try:
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(b, h, s, d, generator=g).to(device, dtype).requires_grad_() for h in (n, kh, kh))
            sinks = torch.randn(n, generator=g).to(device).requires_grad_()
            if path == "varlen":
                layout = varlen_layout(keep, seg, batch=b, seq=s, device=device)
                run: Callable[[], Any] = lambda: DotProductAttention()(  # noqa: E731
                    q, k, v, attn_mask=layout, is_causal=False, dropout_p=0.0, sinks=sinks)
            else:
                mask = additive_mask(causal_padding_mask(torch.ones(b, s, dtype=torch.bool, device=device), s,
                                                         segment_ids=seg.to(device)), dtype)
                run = lambda: eager_sink_attention(q, k, v, sinks, attn_mask=mask, is_causal=False)  # noqa: E731
            times = []
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            for _ in range(2 if smoke else 6):
                t0 = time.perf_counter()
                run().float().square().mean().backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
            rows.append(f"| {path} | {min(times[1:]) * 1e3:.2f} | {peak:.0f} | |")
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why
            rows.append(f"| {path} | - | - | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=120.0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU check)")
    p.add_argument("--out", default="sinks.md")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    deadline = time.perf_counter() + a.budget_s
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = dict(b=2, n=4, kv=2, s=64, d=16, window=8) if a.smoke else dict(b=2, n=16, kv=4, s=1024, d=64, window=128)
    lines = [f"# Attention sinks on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}",
             "", f"torch {torch.__version__}; flash varlen sinks supported: {varlen_sinks_supported()}; "
             f"inputs {str(dtype).removeprefix('torch.')}", ""]
    sections = [
        ("Our core (varlen layout) vs fp32 scores: max |error| / max |reference|",
         ["| rows | window | sinks | output | gradients (q, k, v, sinks) |", "|---|---|---|---|---|"],
         lambda: kernel_rows(device, sizes, dtype)),
        ("debug-gpt-oss, a training step against the mask path in fp32 (gradient errors relative to the largest)",
         ["| path | loss | fp32 loss | worst gradient | sinks (layer 0) |", "|---|---|---|---|---|"],
         lambda: model_rows(device, torch.bfloat16, a.smoke)),
        ("One layer's attention forward + backward, packed rows (best of the timed steps)",
         ["| path | ms | peak MiB | note |", "|---|---|---|---|"],
         lambda: speed_rows(device, dtype, a.smoke, deadline)),
    ]
    for title, head, fn in sections:
        lines += [f"## {title}", "", *head]
        print(title, flush=True)
        if time.perf_counter() > deadline:
            lines += ["| out of time budget |"]
        else:
            try:
                lines += fn()
            except Exception as e:  # noqa: BLE001 - the section says why and the rest go on
                traceback.print_exc()
                lines += [f"| failed: {type(e).__name__}: {str(e).splitlines()[0][:160]} |"]
        lines.append("")
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
