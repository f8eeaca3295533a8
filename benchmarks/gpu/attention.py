"""Attention parts of ``benchmarks/gpu/suite.py``: the varlen path (``models/layers/attention.py``) against the dense-mask path.

Plain training loops on one device (no Lightning: what changes is the attention alone), each model built from the
same seed for both paths, bf16 autocast over fp32 weights, the model's fused loss (``labels=``), AdamW (fused on
CUDA). "before" is ``attention=sdpa`` (SDPA over one additive ``[B, 1, S, S]`` mask per forward: the
memory-efficient kernel), "after" ``attention=auto`` (flash varlen on CUDA; ``varlen``, its CPU reference, in
``--smoke``):

* sft: ``llama-1b``, 4 rows x 4096 tokens of SFT-shaped examples (log-normal lengths, median ~500 tokens, the first
  30% of each a prompt with no labels) packed by ``lightning_llm.data.packing.pack_examples`` (best-fit), each row
  padded to 4096 (segment 0);
* long: one GPU, one row of 32768 tokens (activation checkpointing per block, so the rest fits): packed (examples
  of ~2k tokens) before/after, and a plain row (SDPA ``is_causal`` on both paths: the control);
* gqa: the attention alone, forward + backward at ``llama-1b``'s heads (32 query, 4 kv, head dim 64), 4 x 4096
  causal: kv heads repeated (``repeat_interleave``, what the model did) + SDPA, SDPA ``enable_gqa``, and the varlen
  path (``varlen_attention`` on plain rows).

Per run: median step time after warm-up (synchronised), tokens/s (non-padding tokens), peak allocated memory, the
first step's loss (both paths must agree to bf16 noise).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

FULL = dict(backbone="llama-1b", sft_rows=4, sft_seq=4096, long_seq=32768, long_example=2048, steps=10, warmup=3,
            gqa_batch=4, gqa_seq=4096, gqa_heads=(32, 4, 64), after="auto", dtype=torch.bfloat16)
SMOKE = dict(FULL, backbone="debug", sft_rows=2, sft_seq=128, long_seq=128, long_example=32, steps=2, warmup=1,
             gqa_batch=1, gqa_seq=64, gqa_heads=(4, 2, 16), after="varlen", dtype=torch.float32)


@dataclass
class Row:
    case: str
    path: str
    status: str = "ok"
    step_ms: float | None = None
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    loss: float | None = None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    gqa: list[Row] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ------------------------------------------------------------------------------------------------------ batches
def sft_examples(n_tokens: int, *, median: int, longest: int, seed: int) -> list[dict[str, list[int]]]:
    """Examples of log-normal lengths (sigma 0.8) totalling about ``n_tokens``: random ids, the first 30% of each
    unlabelled (a prompt), labels pre-shifted within the example."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < n_tokens:
        n = int(min(longest, max(16, math.exp(math.log(median) + 0.8 * float(torch.randn(1, generator=g))))))
        ids = torch.randint(3, 30000, (n,), generator=g).tolist()
        labels = ids[1:] + [-100]
        labels[:int(0.3 * n)] = [-100] * int(0.3 * n)
        out.append({"input_ids": ids, "labels": labels})
        total += n
    return out


def packed_batch(examples: list[dict[str, list[int]]], rows: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    """The first ``rows`` rows best-fit packing makes of ``examples``, each padded to ``seq`` (segment 0)."""
    from lightning_llm.data.packing import pack_examples

    packed = pack_examples(examples, seq)[:rows]
    batch = {k: torch.full((rows, seq), -100 if k == "labels" else 0, dtype=torch.long)
             for k in ("input_ids", "labels", "position_ids", "segment_ids")}
    for r, row in enumerate(packed):
        for k, v in row.items():
            batch[k][r, :len(v)] = torch.tensor(v)
    batch["input_ids"] %= vocab
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % vocab, batch["labels"])
    return batch


# ------------------------------------------------------------------------------------------------------ training
def train(build: Callable[[], torch.nn.Module], batch: dict[str, torch.Tensor], *, device: torch.device,
          dtype: torch.dtype, steps: int, warmup: int, case: str) -> Row:
    """Steps of one batch: forward (fused loss) + backward + AdamW; OOM is a row, not a failure of the run."""
    from lightning_llm.models.layers.attention import attention_path

    _free(device)
    row = Row(case=case, path="")
    try:
        model = build()
        path, why = attention_path(model.config, device=device, dtype=dtype)
        row.path = f"{path} ({why})"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        inputs = {k: v.to(device) for k, v in batch.items()}
        kw = {k: inputs[k] for k in ("segment_ids", "position_ids", "attention_mask") if k in inputs}
        times = []
        for i in range(warmup + steps):
            _sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(inputs["input_ids"], labels=inputs["labels"], **kw)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
            if i == 0:
                row.loss = float(loss.detach())
        row.step_ms = 1e3 * statistics.median(times[warmup:])
        tokens = int((inputs["segment_ids"] > 0).sum()) if "segment_ids" in inputs else inputs["input_ids"].numel()
        row.tokens_per_s = tokens / (row.step_ms / 1e3)
        row.peak_gib = _peak_gib(device)
    except torch.OutOfMemoryError as e:
        row.status, row.note = "oom", str(e).splitlines()[0][:120]
    finally:
        model = opt = loss = None  # noqa: F841 - released before the next run
        _free(device)
    return row


def _builder(backbone: str, attention: str, device: torch.device, *, recompute: bool) -> Callable[[], Any]:
    def build() -> torch.nn.Module:
        from lightning_llm.models import build_model
        from lightning_llm.peft.apply import enable_gradient_checkpointing

        torch.manual_seed(0)
        with torch.device(device):
            model = build_model(backbone, family="decoder", dropout=0.0, attention=attention)
        if recompute:
            enable_gradient_checkpointing(model)
        return model

    return build


def run_sft(cfg: dict[str, Any], device: torch.device, report: Report) -> None:
    from lightning_llm.models import named_config

    vocab = named_config(cfg["backbone"], family="decoder").vocab_size
    n = cfg["sft_rows"] * cfg["sft_seq"]
    examples = sft_examples(2 * n, median=max(16, cfg["sft_seq"] // 8), longest=cfg["sft_seq"], seed=0)
    batch = packed_batch(examples, cfg["sft_rows"], cfg["sft_seq"], vocab)
    for label, attention in (("before", "sdpa"), ("after", cfg["after"])):
        report.rows.append(train(_builder(cfg["backbone"], attention, device, recompute=False), batch, device=device,
                                 dtype=cfg["dtype"], steps=cfg["steps"], warmup=cfg["warmup"],
                                 case=f"sft packed {cfg['sft_rows']} x {cfg['sft_seq']}, {label}"))


def run_long(cfg: dict[str, Any], device: torch.device, report: Report) -> None:
    from lightning_llm.models import named_config

    vocab = named_config(cfg["backbone"], family="decoder").vocab_size
    seq = cfg["long_seq"]
    examples = sft_examples(2 * seq, median=cfg["long_example"], longest=seq, seed=1)
    packed = packed_batch(examples, 1, seq, vocab)
    plain = {"input_ids": packed["input_ids"], "labels": packed["input_ids"].roll(-1, 1)}
    for rows, batch, runs in (("packed", packed, (("before", "sdpa"), ("after", cfg["after"]))),
                              ("plain", plain, (("sdpa", "sdpa"), ("auto", cfg["after"])))):
        for label, attention in runs:
            report.rows.append(train(_builder(cfg["backbone"], attention, device, recompute=True), batch,
                                     device=device, dtype=cfg["dtype"], steps=max(2, cfg["steps"] // 2),
                                     warmup=cfg["warmup"], case=f"one GPU, {rows} row of {seq}, {label}"))


def run_gqa(cfg: dict[str, Any], device: torch.device, bench: Callable[..., float], report: Report) -> None:
    """The attention alone: repeat_interleave + SDPA vs enable_gqa vs the varlen path, forward + backward."""
    import torch.nn.functional as F

    from lightning_llm.models.layers.attention import varlen_attention, varlen_layout

    n, kv, d = cfg["gqa_heads"]
    b, s, dtype = cfg["gqa_batch"], cfg["gqa_seq"], cfg["dtype"]
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(b, s, n, d, device=device, dtype=dtype, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(b, s, kv, d, device=device, dtype=dtype, generator=g).transpose(1, 2).requires_grad_()
            for _ in range(2))
    go = torch.randn(b, n, s, d, device=device, dtype=dtype, generator=g)
    layout = varlen_layout(None, None, batch=b, seq=s, device=device)
    ways: dict[str, Callable[[], torch.Tensor]] = {
        "repeat_interleave + SDPA": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(n // kv, 1), v.repeat_interleave(n // kv, 1), is_causal=True),
        "SDPA enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "varlen path (enable_gqa)": lambda: varlen_attention(q, k, v, layout)}
    ref = ways["repeat_interleave + SDPA"]().float()
    for name, fn in ways.items():
        err = (fn().float() - ref).abs().max().item()
        _free(device)
        ms = bench(lambda fn=fn: fn().backward(go), grad_to_none=[q, k, v])
        _free(device)
        fn().backward(go)
        report.gqa.append(Row(case=f"{b} x {s}, heads {n}/{kv}, D {d}", path=name, step_ms=ms,
                              peak_gib=_peak_gib(device), note=f"max abs diff vs repeat {err:.1e}"))


def sections(report: Report, cfg: dict[str, Any]) -> list[str]:
    from kernel_bench import md_table

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    train_rows = [[r.case, r.path, r.status, fmt(r.step_ms, ".1f"), fmt(r.tokens_per_s, ",.0f"), fmt(r.peak_gib, ".2f"),
                   fmt(r.loss, ".4f"), r.note] for r in report.rows]
    gqa_rows = [[r.case, r.path, fmt(r.step_ms, ".3f"), fmt(r.peak_gib, ".2f"), r.note] for r in report.gqa]
    out = []
    if train_rows:
        out.append("\n".join([
            "## Attention: varlen path vs dense mask (training steps)", "",
            f"`{cfg['backbone']}`, {cfg['dtype']} autocast, fused loss, AdamW; before = `attention=sdpa` (one "
            f"`[B, 1, S, S]` additive mask per forward), after = `attention={cfg['after']}`. Step = median of "
            f"{cfg['steps']} steps after {cfg['warmup']} warm-up (long rows: half as many, activation checkpointing); "
            "tokens/s over non-padding tokens; peak = torch.cuda.max_memory_allocated; loss = the first step's.", "",
            md_table(["case", "attention", "status", "step ms", "tokens/s", "peak GiB", "first loss", "note"],
                     train_rows)]))
    if gqa_rows:
        out.append("\n".join([
            "## Attention: GQA without repeating keys/values (forward + backward, causal)", "",
            md_table(["shape", "way", "fwd+bwd ms", "peak GiB", "note"], gqa_rows)]))
    return out
