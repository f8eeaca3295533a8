"""Which library holds the frozen base of a QLoRA run: bitsandbytes or torchao, measured on this machine.

Run (CPU; a few minutes on 2 cores)::

    python benchmarks/quant_backends.py --out benchmarks/results/quant-backends-cpu.md

The ``small`` decoder (8 blocks, hidden 256) with LoRA r=8 on all seven projections; every block linear holds its
weight as

* ``fp32``: a plain fp32 tensor (plain LoRA, the reference);
* ``torchao-nf4``: torchao's ``NF4Tensor`` (``to_nf4``, block 64, double quantization of the scalers, block 256,
  64 where 256 does not divide the blocks: small's MLP);
* ``bnb-nf4``: bitsandbytes' ``Linear4bit`` (``quant_type=nf4``, ``compress_statistics=True``, block 64);
* ``torchao-int8``: torchao's int8 weight-only ``Int8Tensor`` (per row);
* ``bnb-int8``: bitsandbytes' ``Linear8bitLt`` (``has_fp16_weights=False``);

and each variant, in a fresh process, reports: the block linears' weight bytes against bf16, the forward's largest
difference from ``F.linear`` on the library's own dequantized weight (exactness of the layer), whether the LoRA
step gives the adapters and the input a gradient, the median time of a LoRA step (forward + backward + AdamW on
4 x 128 tokens, fp32 compute) and the process's peak resident memory (VmHWM) after 5 steps; then, on 2 ranks,
whether FSDP2's ``fully_shard`` trains a block holding the quantized linear and an adapter (:func:`fsdp2_check`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

VARIANTS = ("fp32", "torchao-nf4", "bnb-nf4", "torchao-int8", "bnb-int8")


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def _quantize(lin: nn.Linear, variant: str) -> tuple[nn.Module, int, Any]:
    """(the layer holding the quantized weight, its weight bytes, its dequantized weight)."""
    w = lin.weight.detach()
    if variant == "torchao-nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        n_blocks = w.numel() // 64  # torchao needs the scaler block to divide the blocks (small's MLP: 2752 = 64 * 43)
        q = to_nf4(w, block_size=64, scaler_block_size=256 if n_blocks % 256 == 0 else 64)
        lin.weight = nn.Parameter(q, requires_grad=False)
        nbytes = sum(t.numel() * t.element_size() for t in (q.quantized_data, q.quantized_scalers,
                                                             q.quantization_factor, q.scaler_mean))
        return lin, nbytes, q.get_original_weight()
    if variant == "torchao-int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(lin, Int8WeightOnlyConfig())
        q = lin.weight
        nbytes = sum(getattr(q, a).numel() * getattr(q, a).element_size() for a in q.tensor_data_names)
        return lin, nbytes, q.dequantize()
    import bitsandbytes as bnb

    if variant == "bnb-nf4":
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                                compress_statistics=True, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, compress_statistics=True,
                                       quant_type="nf4", blocksize=64, module=new)._quantize("cpu")
        qs = new.weight.quant_state
        nbytes = new.weight.numel() * new.weight.element_size() + qs.absmax.numel() * qs.absmax.element_size()
        if qs.state2 is not None:
            nbytes += qs.state2.absmax.numel() * 4 + qs.state2.code.numel() * 4
        return new, nbytes, bnb.functional.dequantize_4bit(new.weight.data, qs)
    new = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=False, has_fp16_weights=False)
    new.weight = bnb.nn.Int8Params(w.clone(), requires_grad=False, has_fp16_weights=False)
    new.cpu()  # Int8Params quantize on the move to a device
    nbytes = new.weight.numel() * new.weight.element_size() + new.weight.SCB.numel() * 4
    return new, nbytes, new.weight.data.float() * new.weight.SCB[:, None] / 127


def worker(variant: str) -> dict[str, Any]:
    from lightning_llm.models import DecoderLM, named_config
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft

    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    bare = _vm_hwm()
    model = DecoderLM(named_config("small", family="decoder"))
    base_bytes = bf16_bytes = 0
    errors: list[float] = []
    if variant != "fp32":
        for name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                if isinstance(child, nn.Linear) and name.startswith("layers."):
                    bf16_bytes += child.weight.numel() * 2
                    new, nbytes, deq = _quantize(child, variant)
                    base_bytes += nbytes
                    setattr(mod, child_name, new)
                    x = torch.randn(3, child.in_features)
                    with torch.no_grad():
                        errors.append(float((new(x) - torch.nn.functional.linear(x, deq.float())).abs().max()))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = apply_peft(model, PeftConfig(method="lora", lora=LoraArgs(r=8, alpha=16, dropout=0.0,
                                                                      target_modules=targets)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, 8192, (4, 128))
    times, ok = [], True
    for _ in range(5):
        t0 = time.perf_counter()
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        ok = ok and all(p.grad is not None and p.grad.abs().sum() > 0
                        for n, p in model.named_parameters() if "lora_B" in n)  # B starts at 0: A's first gradient is 0
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "base_bytes": base_bytes, "bf16_bytes": bf16_bytes,
            "forward_err": max(errors) if errors else 0.0, "adapters_get_gradients": ok,
            "step_s": statistics.median(times[1:]), "peak_rss": _vm_hwm() - bare}


def fsdp2_check(variant: str) -> str:
    """Under torchrun (2 CPU ranks, gloo): a block of a frozen LayerNorm, the quantized linear (256 x 128) and a
    rank-4 adapter, wrapped by FSDP2's ``fully_shard``: its output and the adapter's gradient against the same block
    unsharded."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    lin = nn.Linear(128, 256, bias=False)
    nn.init.normal_(lin.weight, std=0.02)
    if variant == "torchao-nf4":  # 8 scales per double-quantization block: 512 blocks -> factors split over 2 ranks
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        lin.weight = nn.Parameter(to_nf4(lin.weight.detach(), 64, 8), requires_grad=False)
    else:
        lin = _quantize(lin, variant)[0]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(128).requires_grad_(False), lin
            self.a, self.b = nn.Linear(128, 4, bias=False), nn.Linear(4, 256, bias=False)
            nn.init.normal_(self.b.weight, std=0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return self.lin(h) + self.b(self.a(h))

    block, x = Block(), torch.randn(4, 128)
    held = "scales sharded too" if hasattr(lin.weight, "fsdp_pre_all_gather") else "quant state replicated"
    ref = block(x)
    ref.square().sum().backward()
    ref_grad = block.a.weight.grad.clone()
    block.zero_grad()
    try:
        fully_shard(block, mesh=mesh)
        out = block(x)
        out.square().sum().backward()
        grad = block.a.weight.grad.full_tensor()
        msg = (f"trains: output diff {(out - ref).abs().max().item():.0e}, adapter gradient diff "
               f"{(grad - ref_grad).abs().max().item():.0e} ({held})")
    except Exception as e:  # noqa: BLE001 - what fails is the finding
        msg = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    dist.destroy_process_group()
    return msg


def _fsdp2(variant: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", "--master_port=29731", __file__, "--fsdp2", variant],
                          capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FSDP2 ")]
    return lines[0].removeprefix("FSDP2 ") if lines else f"fails: {proc.stderr.strip().splitlines()[-1][:160]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", choices=VARIANTS, default=None)
    p.add_argument("--fsdp2", choices=VARIANTS[1:], default=None)
    args = p.parse_args()
    if args.fsdp2:
        msg = fsdp2_check(args.fsdp2)
        if os.environ.get("RANK") == "0":
            print(f"FSDP2 {msg}")
        return
    if args.worker:
        torch.set_num_threads(1)
        print(json.dumps(worker(args.worker)))
        return
    rows = []
    for v in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--worker", v], capture_output=True, text=True)
        if proc.returncode:
            rows.append({"variant": v, "error": proc.stderr.strip().splitlines()[-1]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        rows[-1]["fsdp2"] = _fsdp2(v) if v != "fp32" else "(plain)"
        print(rows[-1], flush=True)
    lines = ["| weights of the block linears | bytes vs bf16 | forward vs the library's dequantized weight (max abs) "
             "| adapters get gradients | LoRA step (s, 1 thread) | peak RSS after 5 steps (MB) | FSDP2 x2 (fully_shard, "
             "a LoRA'd block) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['base_bytes'] / r['bf16_bytes']:.3f}" if r["bf16_bytes"] else "1 (fp32: 2.0)"
        lines.append(f"| {r['variant']} | {ratio} | {r['forward_err']:.2e} | {r['adapters_get_gradients']} | "
                     f"{r['step_s']:.3f} | {r['peak_rss'] / 2**20:.0f} | {r['fsdp2']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
