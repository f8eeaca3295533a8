"""Gated DeltaNet (Qwen3.5, Qwen3-Next) on the GPU, in one run:

1. ``parity``: the CUDA path of ``kernels/delta_rule.py`` (flash-linear-attention's ``chunk_gated_delta_rule`` and
   ``causal_conv1d``, bf16 inputs) against the chunked torch form in fp32, forward and backward, on plain rows and on
   packed rows (``cu_seqlens``: each document restarts the state); errors relative to the reference's largest value.
2. ``model``: a Qwen3.5-shaped stack (``debug-qwen3.5`` widened: hidden 2048, 8 layers of which 6 Gated DeltaNet, 16
   key / 32 value heads of 128, gated attention with 16 heads of 256 and partial rotary, MLP 6144, vocabulary 151936),
   one training step (AdamW, bf16 autocast over fp32 weights, the fused LM-head loss) on ``--batch`` rows of ``--seq``
   tokens: ours (fla's kernels where installed) against transformers' ``Qwen3_5ForCausalLM`` with the same weights
   (transformers takes flash-linear-attention where it is installed); tokens/s, MFU (``6 N + 12 L A S`` over the
   attention layers plus the delta rule's FLOPs: ``tools/estimate``) and peak memory, after ``--warmup`` steps.

    python benchmarks/gpu/hybrid.py --budget-s 300 --out hybrid.md
    python benchmarks/gpu/hybrid.py --device cpu --smoke --out /tmp/hybrid.md    # the CPU paths, tiny sizes

Every row that cannot run writes its reason; the others go on (``--only parity`` / ``--only model``). Prints
progress.
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
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import peak_tflops  # noqa: E402

from lightning_llm.kernels.delta_rule import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_torch,
    chunk_gated_delta_rule_torch,
    fla_available,
    gated_delta_rule,
    sequence_starts,
)
from lightning_llm.models import DecoderLM, named_config, save_hf  # noqa: E402
from lightning_llm.tools.estimate import parameter_counts, train_flops_per_token  # noqa: E402
from lightning_llm.memory import attention_width, deltanet_flops_per_token  # noqa: E402

SHAPE = dict(vocab_size=151936, hidden_size=2048, num_layers=8, num_heads=16, num_kv_heads=2, head_dim=256,
             intermediate_size=6144, max_position_embeddings=32768,
             layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
             linear_attention=dict(num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128,
                                   fused_projections=False))
"""The model rows' stack: Qwen3.5's layer shapes (its 2B-class widths) with 8 layers."""


def _err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().float() - ref.detach()).abs().max() / ref.detach().abs().max().clamp(min=1e-12))


def parity_rows(device: torch.device, smoke: bool) -> list[str]:
    """The dispatch (fla on CUDA, bf16) against the torch form (fp32): outputs and gradients of q, k, v, g, beta."""
    b, s, hk, hv, dk, dv = (2, 100, 2, 4, 16, 16) if smoke else (2, 2048, 16, 32, 128, 128)
    rows = []
    for kind in ("plain", "packed"):
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(b, s, hk, dk, generator=g) for _ in range(2))
        v = torch.randn(b, s, hv, dv, generator=g)
        gate, beta = -F.softplus(torch.randn(b, s, hv, generator=g)), torch.rand(b, s, hv, generator=g)
        seg = None
        if kind == "packed":
            seg = torch.ones(b, s, dtype=torch.long)
            seg[:, s // 3:] = 2
            seg[:, s - s // 7:] = 0  # a padding run: its own sequence
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)] + [
            gate.to(device).requires_grad_(), beta.to(device, dtype).requires_grad_()]
        cu = sequence_starts(seg.to(device), b, s) if seg is not None else None
        try:
            t0 = time.perf_counter()
            out, _ = gated_delta_rule(*leaves, segment_ids=None if seg is None else seg.to(device), cu_seqlens=cu)
            grad = torch.randn(out.shape, generator=g).to(device)
            grads = torch.autograd.grad((out.float() * grad).sum(), leaves)
            path = "fla" if fla_available() and device.type == "cuda" else "torch"
            ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
            ref, _ = chunk_gated_delta_rule_torch(*ref_leaves, segment_ids=None if seg is None else seg.to(device))
            ref_grads = torch.autograd.grad((ref * grad).sum(), ref_leaves)
            x, w = torch.randn(b, hk * 2 * dk + hv * dv, s, generator=g), torch.randn(hk * 2 * dk + hv * dv, 1, 4,
                                                                                       generator=g) * 0.5
            conv, _ = causal_conv1d(x.to(device, dtype), w.to(device, dtype), cu_seqlens=cu,
                                    segment_ids=None if seg is None else seg.to(device))
            conv_ref, _ = causal_conv1d_torch(x.to(device), w.to(device),
                                              segment_ids=None if seg is None else seg.to(device))
            rows.append(f"| {kind} | {path} | {_err(out, ref):.2e} | "
                        f"{', '.join(f'{_err(a, r):.1e}' for a, r in zip(grads, ref_grads))} | {_err(conv, conv_ref):.2e} "
                        f"| {time.perf_counter() - t0:.2f} |")
        except Exception as e:  # noqa: BLE001 - the row says why, the others go on
            rows.append(f"| {kind} | - | {type(e).__name__}: {str(e).splitlines()[0][:120]} | | | |")
        print(rows[-1], flush=True)
    return rows


def _hf_model(config: Any, ours: DecoderLM, work: Path) -> torch.nn.Module:
    """transformers' Qwen3_5ForCausalLM with our model's weights (through an HF export)."""
    from transformers import Qwen3_5ForCausalLM

    save_hf(ours, work / "hf")
    return Qwen3_5ForCausalLM.from_pretrained(str(work / "hf"), dtype=torch.float32)


def _time_steps(model: torch.nn.Module, step: Callable[[], torch.Tensor], device: torch.device, steps: int,
                warmup: int) -> tuple[float, float]:
    """(best seconds per training step after ``warmup``, peak GiB)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        step().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return min(times[warmup:]), peak


def model_rows(device: torch.device, a: argparse.Namespace, deadline: float) -> list[str]:
    """One training step of the Qwen3.5-shaped stack: ours vs transformers'."""
    shape = dict(num_layers=2, layer_types=["linear_attention", "full_attention"]) if a.smoke else SHAPE
    config = named_config("debug-qwen3.5", family="decoder", **shape)
    torch.manual_seed(0)
    ours = DecoderLM(config)
    hf = _hf_model(config, ours, Path(a.work))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=g).to(device)
    counts = parameter_counts(config)
    linear = len(config.linear_layers)
    flops = train_flops_per_token(params=counts.active - counts.embedding, layers=config.num_layers - linear,
                                  attention_width=attention_width(config), seq_len=a.seq)
    flops += linear * deltanet_flops_per_token(config)
    peak = peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    amp = dict(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    runs: dict[str, tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]] = {
        "lightning_llm": (ours, lambda m: m(ids, labels=ids)),
        "transformers": (hf, lambda m: m(input_ids=ids, labels=ids).loss),
    }
    rows = []
    for name, (model, fwd) in runs.items():
        if time.perf_counter() > deadline:
            rows.append(f"| {name} | - | - | - | - | out of time budget |")
            continue
        try:
            model = model.to(device).train()

            def step(model: torch.nn.Module = model, fwd: Callable = fwd) -> torch.Tensor:
                with torch.autocast(**amp):
                    return fwd(model)

            seconds, mem = _time_steps(model, step, device, a.steps, a.warmup)
            tps = a.batch * a.seq / seconds
            mfu = f"{flops * tps / (peak * 1e12):.1%}" if peak else "-"
            rows.append(f"| {name} | {seconds * 1e3:.1f} | {tps:,.0f} | {mfu} | {mem:.1f} | |")
            model.to("cpu")
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why
            traceback.print_exc()
            rows.append(f"| {name} | - | - | - | - | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
        print(rows[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (the CPU check)")
    p.add_argument("--only", action="append", choices=["parity", "model"], help="run only these parts")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--work", default="/tmp/hybrid_bench", help="where transformers' copy of the model is written")
    p.add_argument("--out", default="hybrid.md")
    a = p.parse_args(argv)
    a.batch, a.seq = a.batch or (2 if a.smoke else 4), a.seq or (64 if a.smoke else 4096)
    a.steps, a.warmup = a.steps or (1 if a.smoke else 5), a.warmup or (1 if a.smoke else 3)
    device = torch.device(a.device)
    deadline = time.perf_counter() + a.budget_s
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    lines = [f"# Gated DeltaNet (Qwen3.5) on {name}", "",
             f"torch {torch.__version__}; flash-linear-attention installed: {fla_available()}", ""]
    sections = [
        ("parity", "The dispatch (fla on CUDA, bf16) vs the torch form in fp32: max |error| / max |reference|",
         ["| rows | path | output | gradients (q, k, v, g, beta) | convolution | s |", "|---|---|---|---|---|---|"],
         lambda: parity_rows(device, a.smoke)),
        ("model", f"A Qwen3.5-shaped stack, one training step (bf16 autocast, AdamW), {a.batch} x {a.seq} tokens "
         f"(best of {a.steps} after {a.warmup} warm-up)",
         ["| model | ms/step | tokens/s | MFU | peak GiB | note |", "|---|---|---|---|---|---|"],
         lambda: model_rows(device, a, deadline)),
    ]
    for part, title, head, fn in sections:
        if a.only and part not in a.only:
            continue
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
