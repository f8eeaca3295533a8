"""Multi-head Latent Attention (DeepSeek-V2/V3) and GLM-4.5's partial rotary on CUDA: correctness of the device paths
and their cost, one command with a time budget.

Rows (each degrades to its reason and the rest go on):

* ``varlen vs mask``: a DeepSeek-V3-shaped MLA decoder (DeepSeek-V3's head dims: 128 no-rope + 64 rope q/k dims, 128
  value dims, latents of 512 / 1536; fewer heads and layers, no experts) in bf16 on right/left-padded rows: the flash
  varlen path (values zero-padded to the keys' 192, DeepSeek's softmax scale passed to the kernel) against the mask
  path (SDPA), logits and gradients (relative max difference, bf16 noise expected ~1e-2), then each path's step time
  and peak memory;
* ``transformers``: a tiny DeepseekV3ForCausalLM (and Glm4MoeForCausalLM) written by transformers, loaded by us on
  CUDA in fp32 (mask path): logits on padded rows against transformers' own on the same device;
* ``triton kernels``: GLM-4.5's partial rotary with ``kernels=triton`` (fused RMSNorm; rotary on half of each head
  through the torch path) against ``kernels=torch``, bf16;
* ``decode``: greedy decoding of the MLA decoder from its cache of compressed latents against decoding without a
  cache (token-identical), and its tokens/s.

    python benchmarks/gpu/mla.py --out $OUT/gpu-mla.md --budget-s 240      # CUDA, ~1-2 min on an H100/H200
    python benchmarks/gpu/mla.py --smoke --out /tmp/mla-smoke.md           # CPU, tiny shapes (varlen's CPU reference)
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FULL = dict(hidden=2048, heads=16, layers=2, q_rank=1536, kv_rank=512, nope=128, rope=64, v=128, batch=4, seq=2048,
            steps=5, vocab=32000, dtype=torch.bfloat16, decode_tokens=64)
SMOKE = dict(FULL, hidden=64, heads=4, layers=2, q_rank=48, kv_rank=32, nope=16, rope=8, v=16, batch=2, seq=32,
             steps=2, vocab=256, dtype=torch.float32, decode_tokens=4)


def _mla_config(s: dict[str, Any], attention: str) -> Any:
    from lightning_llm.models import ModelConfig

    return ModelConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_layers=s["layers"], num_heads=s["heads"],
                       intermediate_size=4 * s["hidden"], max_position_embeddings=max(4096, 2 * s["seq"]),
                       attention=attention, mla=dict(kv_lora_rank=s["kv_rank"], q_lora_rank=s["q_rank"],
                                                     qk_nope_head_dim=s["nope"], qk_rope_head_dim=s["rope"],
                                                     v_head_dim=s["v"]),
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                     "mscale": 1.0, "mscale_all_dim": 1.0})


def _padded(s: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, s["vocab"], (s["batch"], s["seq"]), generator=g)
    mask = torch.ones_like(ids)
    mask[1, s["seq"] * 3 // 4:] = 0  # right padding
    mask[-1, : s["seq"] // 8] = 0  # left padding
    return ids.to(device), mask.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def row_varlen(s: dict[str, Any], device: torch.device, smoke: bool) -> list[str]:
    from lightning_llm.models import DecoderLM
    from lightning_llm.models.layers.attention import attention_path

    ids, mask = _padded(s, device)
    keep = mask.bool()
    out, models = [], {}
    after = "varlen" if smoke else "auto"
    for attention in ("sdpa", after):
        torch.manual_seed(0)
        config = _mla_config(s, attention)
        model = DecoderLM(config).to(device=device, dtype=s["dtype"])
        path, why = attention_path(config, device=device, dtype=s["dtype"])
        logits = model(ids, attention_mask=mask)
        (logits[keep].float() ** 2).mean().backward()
        models[attention] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()}, f"{path} ({why})")
        times, peak = [], 0.0
        for _ in range(s["steps"]):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            t0 = time.perf_counter()
            model(ids, attention_mask=mask, labels=ids.masked_fill(~keep, -100)).backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        out.append(f"| step ({attention} -> {path}) | {1000 * sorted(times)[len(times) // 2]:.1f} ms | peak "
                   f"{peak:.2f} GiB |")
        del model
    (l0, g0, p0), (l1, g1, p1) = models["sdpa"], models[after]
    grad = max(_rel(g1[n], g) for n, g in g0.items())
    return [f"| varlen vs mask, {s['dtype']} | logits rel {_rel(l1[keep], l0[keep]):.2e}, gradients rel {grad:.2e} "
            f"| {p0} vs {p1} |", *out]


def row_transformers(s: dict[str, Any], device: torch.device, smoke: bool) -> list[str]:
    import warnings

    import transformers

    from lightning_llm.models import load_hf
    from lightning_llm.tools.tiny import FAMILIES, write_tiny

    rows = []
    for kind in ("deepseek_v3", "glm4_moe"):
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = write_tiny(kind, Path(tmp) / kind)
            ref = getattr(transformers, FAMILIES[kind][1]).from_pretrained(str(d)).to(device).eval()
            ours, _ = load_hf(d, attention="sdpa")
            ours = ours.to(device).eval()
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(3, 300, (3, 40), generator=g).to(device)
            mask = torch.ones_like(ids)
            mask[1, 30:] = 0
            mask[2, :6] = 0
            with torch.no_grad():
                err = float((ours(ids, attention_mask=mask) - ref(input_ids=ids, attention_mask=mask).logits)
                            [mask.bool()].abs().max())
        rows.append(f"| transformers {transformers.__version__} {kind}, fp32 | logits max abs {err:.2e} | "
                    f"{'ok' if err < 1e-4 else 'MISMATCH'} |")
    return rows


def row_triton(s: dict[str, Any], device: torch.device, smoke: bool) -> list[str]:
    from lightning_llm.models import build_model

    if device.type != "cuda":
        return ["| triton kernels | skipped: no CUDA |  |"]
    ids, mask = _padded(dict(s, vocab=256, seq=min(s["seq"], 512)), device)
    logits = {}
    for kernels in ("torch", "triton"):
        torch.manual_seed(0)
        model = build_model("debug-glm4-moe", family="decoder", kernels=kernels, attention="sdpa")
        model = model.to(device=device, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[kernels] = model(ids, attention_mask=mask)
    keep = mask.bool()
    return [f"| GLM-4.5 partial rotary, kernels=triton vs torch, bf16 | logits rel "
            f"{_rel(logits['triton'][keep], logits['torch'][keep]):.2e} |  |"]


def row_decode(s: dict[str, Any], device: torch.device, smoke: bool) -> list[str]:
    from lightning_llm.generation import GenerationConfig, generate
    from lightning_llm.models import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(_mla_config(s, "sdpa")).to(device=device, dtype=s["dtype"]).eval()
    ids, mask = _padded(dict(s, seq=min(s["seq"], 256)), device)
    mask[1] = 1  # left padding only (prompts end with their last token)
    n = s["decode_tokens"]
    _sync(device)
    t0 = time.perf_counter()
    got = generate(model, ids, mask, config=GenerationConfig(max_new_tokens=n))
    _sync(device)
    seconds = time.perf_counter() - t0
    seqs, m = ids, mask  # without a cache: the whole rows again each step
    with torch.no_grad():
        for _ in range(n):
            pos = (m.cumsum(-1) - 1).clamp(min=0)
            nxt = model(seqs, attention_mask=m, position_ids=pos)[:, -1].argmax(-1, keepdim=True)
            seqs, m = torch.cat([seqs, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
    same = torch.equal(got, seqs[:, ids.shape[1]:])
    return [f"| decode {n} tokens x {ids.shape[0]} rows from the latent cache | "
            f"{n * ids.shape[0] / seconds:.0f} tokens/s | {'token-identical' if same else 'DIFFERS'} to no cache |"]


ROWS: dict[str, Callable[[dict[str, Any], torch.device, bool], list[str]]] = {
    "varlen": row_varlen, "transformers": row_transformers, "triton": row_triton, "decode": row_decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    a = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    s = SMOKE if a.smoke else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"# MLA on {name}", "", f"torch {torch.__version__}, {'smoke' if a.smoke else 'full'} shapes: {s}", "",
             "| case | result | note |", "|---|---|---|"]
    start, failed = time.perf_counter(), False
    for key, fn in ROWS.items():
        if time.perf_counter() - start > a.budget_s:
            lines.append(f"| {key} | not run: time budget {a.budget_s:.0f} s spent |  |")
            continue
        print(f"mla: {key} ...", flush=True)
        try:
            lines += fn(s, device, a.smoke)
        except Exception as e:  # a row that cannot run says why; the others go on
            failed = True
            traceback.print_exc()
            lines.append(f"| {key} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]} |  |")
        print(lines[-1], flush=True)
    lines += ["", f"{time.perf_counter() - start:.0f} s"]
    out = Path(a.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    print(out.read_text())
    return 1 if failed or any("MISMATCH" in x or "DIFFERS" in x for x in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
