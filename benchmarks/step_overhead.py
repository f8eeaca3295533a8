"""What `lightning_llm fit` adds to the model's own training step (issue 56): the same model, batch, tokens and
precision through ``fit`` (the shipped ``configs/pretrain_debug.yaml`` task and Trainer, steps that do not log) and
through a plain torch loop (forward, backward, fused AdamW step), dense and MoE, with transformers' model of the same
shape in the same run (the peer a user would pick: Liger's kernels for Llama, ``grouped_mm`` experts for Qwen3-MoE).

    python benchmarks/step_overhead.py --device cpu --out benchmarks/results/step-overhead-cpu.md
    python benchmarks/step_overhead.py --device cuda --budget-s 240 --out $OUT/step-overhead.md

Each row runs in its own process with a timeout (a row that fails or runs out of time writes its reason; the rest go
on). Step time: the median interval between optimizer-step ends, taken with CUDA events on a GPU (nothing is
synchronised inside the timed steps: the host may run ahead as in a real run) or the host clock on the CPU, after the
warm-up steps; ``wall``: the timed steps' mean from the host clock, synchronised at both ends. ``syncs/step`` (GPU):
synchronising CUDA calls per step that ``torch.cuda.set_sync_debug_mode`` reports in two extra steps, by where they
come from. TFLOP/s and MFU count ``6 N + 12 L A S`` per token, ``N`` the non-embedding parameters a token uses (an MoE
layer's top-k experts, not all), against the device's dense bf16 peak.

GPU cases: the 4-layer Qwen3-30B-A3B shape in ``bf16-true`` (batch 4 x 2048), the same with gradient accumulation 4,
and ``llama-1b`` with compiled blocks in ``bf16-mixed`` (batch 4 x 2048); two kernel rows time the pieces of the MoE
step this issue changed, old against new in the same process. CPU cases: ``debug`` and ``small-moe`` at the shipped
configs' batch (8 x 64, fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH / "gpu")]


@dataclass(frozen=True)
class Case:
    backbone: str
    batch: int
    seq: int
    precision: str
    moe_layers: int | None = None  # MoE: the named size cut to this many layers, experts grouped
    accumulate: int = 1
    compile: bool = False
    peer: str = "llama"  # transformers' model: llama | moe


CASES: dict[str, Case] = {
    "debug": Case("debug", 8, 64, "32-true"),
    "small-moe": Case("small-moe", 8, 64, "32-true", moe_layers=8, peer="moe"),
    "moe-bf16": Case("qwen3-30b-a3b", 4, 2048, "bf16-true", moe_layers=4, peer="moe"),
    "moe-bf16-accum4": Case("qwen3-30b-a3b", 4, 2048, "bf16-true", moe_layers=4, accumulate=4, peer="moe"),
    "llama-1b": Case("llama-1b", 4, 2048, "bf16-mixed", compile=True),
}
DEFAULT_CASES = {"cpu": ["debug", "small-moe"], "cuda": ["kernels", "moe-bf16", "moe-bf16-accum4", "llama-1b"]}
SMOKE = {"qwen3-30b-a3b": "debug-moe", "llama-1b": "debug"}
"""``--smoke``: the GPU cases' code paths on the CPU with tiny models (these backbones), rows of 64 tokens, no
compilation."""


def smoke_case(case: Case) -> Case:
    from dataclasses import replace

    return replace(case, backbone=SMOKE.get(case.backbone, case.backbone), batch=2, seq=64, compile=False,
                   moe_layers=2 if case.moe_layers else None)
PATHS = ("fit", "plain", "transformers")


@dataclass
class Row:
    case: str
    path: str
    status: str = "ok"
    step_ms: float | None = None
    wall_ms: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    syncs: float | None = None
    peak_gib: float | None = None
    seconds: float = 0.0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ in a row's process
class Clock:
    """Optimizer-step ends: CUDA events on a GPU (no synchronisation), the host clock elsewhere; the timed window's
    wall time synchronised at its two ends; then synchronising calls counted per step."""

    def __init__(self, device: Any, warmup: int) -> None:
        import torch

        self.torch, self.cuda, self.warmup = torch, device.type == "cuda", warmup
        self.ends: list[Any] = []
        self.wall: list[float] = []
        self.syncs: list[list[str]] = []

    def step_end(self) -> None:
        torch = self.torch
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.ends.append(event)
        else:
            self.ends.append(time.perf_counter())
        if len(self.ends) - 1 in (self.warmup, self.timed_end):
            if self.cuda:
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter())

    def start_counting(self) -> None:
        """From now on, count synchronising CUDA calls (one list per step)."""
        import warnings

        if not self.cuda:
            return
        self.torch.cuda.set_sync_debug_mode("warn")
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def count(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
            if "synchronizing" not in str(message):
                return shown(message, category, filename, lineno, *args)
            self.syncs[-1].append(_origin())
            return None

        warnings.showwarning = count

    def result(self, steps: int) -> dict[str, Any]:
        if self.cuda:
            self.torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) for a, b in zip(self.ends, self.ends[1:])]
        else:
            gaps = [(b - a) * 1e3 for a, b in zip(self.ends, self.ends[1:])]
        timed = gaps[self.warmup:self.warmup + steps]
        return {"step_ms": statistics.median(timed), "wall_ms": (self.wall[1] - self.wall[0]) * 1e3 / steps,
                "steps": timed, "syncs": self.syncs}

    timed_end = -1


def _origin() -> str:
    """Where a synchronising call came from: the innermost frame of this project, else of Lightning, else any."""
    frames = traceback.extract_stack()[:-3]
    for marker in ("lightning_llm" + os.sep, "lightning" + os.sep):
        for f in reversed(frames):
            if marker in f.filename and "step_overhead" not in f.filename:
                return f"{f.filename.split(marker)[-1]}:{f.lineno}" if marker.startswith("lightning_llm") \
                    else f"lightning:{Path(f.filename).name}:{f.lineno}"
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _vocab(case: Case) -> int:
    from e2e import _vocab_override

    from lightning_llm.data import ByteTokenizer
    from lightning_llm.data.base import tokenizer_vocab_size

    return _vocab_override("decoder", case.backbone, tokenizer_vocab_size(ByteTokenizer()))["vocab_size"]


def _overrides(case: Case) -> dict[str, Any]:
    from e2e import moe_overrides

    over: dict[str, Any] = {"vocab_size": _vocab(case)}
    if case.moe_layers:
        over.update(moe_overrides(case.backbone, case.moe_layers))
    return over


def _data(case: Case, work: Path, steps: int) -> Any:
    """The batches ``fit`` trains on: its datamodule with the same arguments, set up here."""
    from lightning_llm.data import TextDataModule

    docs = max(200, int(1.3 * steps * case.accumulate * case.batch * (case.seq + 1) / 140))
    dm = TextDataModule(block_size=case.seq, batch_size=case.batch, generated_docs=docs, cache_dir=str(work / "cache"))
    return dm, docs


def _fit(case: Case, work: Path, device: Any, total: int, clock: Clock) -> None:
    import lightning.pytorch as pl

    from lightning_llm.cli.app import LLMCLI

    _, docs = _data(case, work, total)

    class Steps(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            clock.step_end()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % case.accumulate == 0:
                clock.step_end()
                if len(clock.ends) - 1 >= clock.timed_end:
                    clock.syncs.append([])
                    if len(clock.ends) - 1 == clock.timed_end:
                        clock.start_counting()

    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), f"--model.backbone={case.backbone}",
            f"--model.model_overrides={json.dumps(_overrides(case))}", f"--model.compile={str(case.compile).lower()}",
            f"--data.block_size={case.seq}", f"--data.batch_size={case.batch}", f"--data.generated_docs={docs}",
            f"--data.cache_dir={work / 'cache'}", f"--trainer.max_steps={total}",
            f"--trainer.accumulate_grad_batches={case.accumulate}", f"--trainer.precision={case.precision}",
            f"--trainer.accelerator={'gpu' if device.type == 'cuda' else 'cpu'}", "--trainer.devices=1",
            "--trainer.log_every_n_steps=1000", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={work / 'root'}"]
    LLMCLI(args=args, trainer_defaults={"callbacks": [Steps()]})


def _loop(case: Case, work: Path, device: Any, total: int, clock: Clock, model: Any, loss_of: Any) -> None:
    """forward, backward, fused AdamW step (over ``accumulate`` micro-batches), the batches ``fit`` trains on."""
    import torch

    dm, _ = _data(case, work, total)
    dm.prepare_data()
    dm.setup("fit")
    batches = iter(dm.train_dataloader())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=case.precision == "bf16-mixed")
    clock.step_end()
    for step in range(total):
        if step == clock.timed_end:
            clock.start_counting()
        if step >= clock.timed_end:
            clock.syncs.append([])
        for _ in range(case.accumulate):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            with autocast:
                loss = loss_of(batch)
            (loss / case.accumulate).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_end()


def _plain(case: Case, work: Path, device: Any, total: int, clock: Clock) -> None:
    import torch

    from lightning_llm.models import build_model
    from lightning_llm.models.compile import compile_blocks

    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(case.backbone, family="decoder", **_overrides(case))
    if case.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    if case.compile:
        compile_blocks(model)
    _loop(case, work, device, total, clock, model, lambda b: model(b["input_ids"], labels=b["labels"]))


def _transformers(case: Case, work: Path, device: Any, total: int, clock: Clock) -> str:
    import torch
    import transformers

    from lightning_llm.models import NAMED_SIZES
    from lightning_llm.models.config import ModelConfig
    from lightning_llm.models.hf_config import config_to_hf

    note = f"transformers {transformers.__version__}"
    fields = {**NAMED_SIZES[("decoder", case.backbone)], **_overrides(case)}
    fields.pop("family", None)
    cfg = config_to_hf(ModelConfig(**fields), "Qwen3MoeForCausalLM" if case.peer == "moe" else "LlamaForCausalLM")
    kind = cfg.pop("model_type")
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype", "dtype", "transformers_version")}
    extra: dict[str, Any] = {"attn_implementation": "sdpa"}
    if case.peer == "moe":
        extra.update(output_router_logits=True, experts_implementation="grouped_mm")
        note += ", grouped_mm experts, router aux loss on"
    elif device.type == "cuda":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
            note += " + Liger (rope, rms_norm, swiglu, fused linear CE)"
        except ImportError:
            note += " (liger-kernel not installed: sdpa, eager loss)"
    hf_cfg = transformers.CONFIG_MAPPING[kind](**{**cfg, **extra})
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    if case.precision == "bf16-true":
        model = model.to(torch.bfloat16)
    model.train()
    _loop(case, work, device, total, clock, model,
          lambda b: model(input_ids=b["input_ids"], labels=b["input_ids"]).loss)
    return note


def _active_flops_per_token(case: Case) -> tuple[int, dict[str, int]]:
    """Training FLOPs per token on the parameters a token uses (built on the meta device), and the counts."""
    import torch

    from lightning_llm.models import build_model
    from lightning_llm.models.moe import moe_parameters
    from lightning_llm.tools.estimate import train_flops_per_token

    with torch.device("meta"):
        model = build_model(case.backbone, family="decoder", **_overrides(case))
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(False))
    experts, routed = moe_parameters(cfg)
    active = total - experts + routed - emb
    width = cfg.num_heads * (cfg.head_dim or cfg.hidden_size // cfg.num_heads)
    return train_flops_per_token(params=active, layers=cfg.num_layers, attention_width=width,
                                 seq_len=case.seq), {"total": total, "active_non_embedding": active}


def _kernels(device: Any) -> dict[str, Any]:
    """The two pieces of the MoE step changed here, old against new on the 4-layer Qwen3-30B-A3B shape: the fused
    head's loss (256-token chunks, the old default, against the new default) and the gather of each assignment's
    token (``index_select``'s backward, a scatter-add, against the gather + sum)."""
    import torch

    from lightning_llm.kernels.cross_entropy import chunk_size_for, fused_linear_cross_entropy
    from lightning_llm.models.moe import _TokensByExpert

    cuda = device.type == "cuda"

    def timed(fn: Any, reps: int = 10 if cuda else 2) -> float:
        for _ in range(3 if cuda else 1):
            fn()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / reps

    g = torch.Generator(device=device).manual_seed(0)
    n, h, v = (8192, 2048, 151936) if cuda else (512, 64, 4096)  # the CPU: the code path only (--smoke)
    hidden = torch.randn(n, h, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=device, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=g)

    def head(chunk: int | None) -> Any:
        def run() -> None:
            fused_linear_cross_entropy(hidden, weight, target, chunk_size=chunk).backward()
        return run

    out = {"head_old_ms": timed(head(256)), "head_new_ms": timed(head(None)),
           "head_chunk": chunk_size_for(n, v, h, device), "shape": [n, h, v]}
    k = 8
    x = torch.randn(n, h, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
    order = torch.argsort(torch.randint(0, 128, (n * k,), device=device, generator=g), stable=True)
    grad = torch.randn(n * k, h, device=device, generator=g, dtype=torch.bfloat16)
    out["gather_old_ms"] = timed(lambda: x.index_select(0, order // k).backward(grad))
    out["gather_new_ms"] = timed(lambda: _TokensByExpert.apply(x, order, k).backward(grad))
    return out


def run_row(case_name: str, path: str, device_name: str, work: Path, steps: int, warmup: int, *,
            smoke: bool = False) -> dict[str, Any]:
    import torch

    device = torch.device(device_name)
    if case_name == "kernels":
        return {"kernels": _kernels(device)}
    case = smoke_case(CASES[case_name]) if smoke else CASES[case_name]
    count_steps = 2 if device.type == "cuda" else 0
    total = warmup + steps + count_steps
    clock = Clock(device, warmup)
    clock.timed_end = warmup + steps
    note = {"fit": _fit, "plain": _plain, "transformers": _transformers}[path](case, work, device, total, clock)
    res = clock.result(steps)
    res["syncs"] = res["syncs"][:count_steps]
    flops, params = _active_flops_per_token(case)
    res.update(tokens_per_step=case.batch * case.seq * case.accumulate, flops_per_token=flops, params=params,
               note=note or "", peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    return res


# ----------------------------------------------------------------------------------------------------------- driver
def _row(args: argparse.Namespace, case: str, path: str, timeout: float) -> Row:
    row = Row(case, path)
    out = args.work / f"{case}-{path}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--row", case, path, "--device", args.device,
           "--work", str(args.work), "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out),
           *(["--smoke"] if args.smoke else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=args.work)
        (args.work / f"{case}-{path}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
            row.status, row.note = "error", (errors or lines or [f"exit {proc.returncode}"])[-1].strip()[:300]
    except subprocess.TimeoutExpired:
        row.status, row.note = "error", f"timed out after {timeout:.0f} s"
    row.seconds = time.perf_counter() - t0
    if row.status == "ok":
        _fill(row, json.loads(out.read_text()), args.peak)
    print(f"[{row.seconds:5.0f} s] {case} {path}: {row.status} "
          f"{f'{row.step_ms:.1f} ms/step' if row.step_ms else ''} {row.note[:160]}", flush=True)
    return row


def _fill(row: Row, res: dict[str, Any], peak: float | None) -> None:
    if "kernels" in res:
        row.extra = res["kernels"]
        return
    row.step_ms, row.wall_ms, row.peak_gib, row.note = res["step_ms"], res["wall_ms"], res["peak_gib"], res["note"]
    row.tokens_per_s = res["tokens_per_step"] / (row.step_ms / 1e3)
    row.tflops = res["flops_per_token"] * row.tokens_per_s / 1e12
    row.mfu = row.tflops / peak if peak else None
    if res["syncs"]:
        row.syncs = statistics.mean(len(s) for s in res["syncs"])
        where: dict[str, int] = {}
        for step in res["syncs"]:
            for origin in step:
                where[origin] = where.get(origin, 0) + 1
        row.extra["sync_origins"] = {k: v / len(res["syncs"]) for k, v in sorted(where.items())}
    row.extra["params"] = res["params"]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _markdown(args: argparse.Namespace, rows: list[Row], total_s: float, device: str, versions: str) -> str:
    lines = [f"# `lightning_llm fit` against the model's own step on {device}", "",
             f"- date: {time.strftime('%Y-%m-%d %H:%M')}; {versions}; commit {_commit()}",
             f"- command: `python benchmarks/step_overhead.py {' '.join(args.argv)}`",
             f"- {args.warmup} warm-up steps, median of {args.steps}; total {total_s:.0f} s of a {args.budget_s:.0f} s "
             f"budget; peak for MFU: {_fmt(args.peak, '.0f')} TFLOP/s", ""]
    kernels = [r for r in rows if r.case == "kernels"]
    for r in kernels:
        if r.status != "ok":
            lines += [f"Kernel rows: {r.status}: {r.note}", ""]
            continue
        e = r.extra
        n, h, v = e["shape"]
        lines += ["| piece of the MoE step (the Qwen3-30B-A3B shape, bf16) | before | after |", "|---|---|---|",
                  f"| fused head loss fwd+bwd, {n} x {h} x {v} (256-token chunks -> {e['head_chunk']}) | "
                  f"{e['head_old_ms']:.2f} ms | {e['head_new_ms']:.2f} ms |",
                  f"| token gather of {8 * n} assignments x {h}, fwd+bwd (index_select -> gather + sum) | "
                  f"{e['gather_old_ms']:.2f} ms | {e['gather_new_ms']:.2f} ms |", ""]
    lines += ["| case | path | status | step ms | wall ms | tokens/s | TFLOP/s (active) | MFU | vs plain | syncs/step "
              "| peak GiB | s | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.case == "kernels":
            continue
        plain = next((p for p in rows if p.case == r.case and p.path == "plain" and p.step_ms), None)
        ratio = f"{r.step_ms / plain.step_ms:.3f}x" if plain and r.step_ms else "-"
        lines.append(f"| {r.case} | {r.path} | {r.status} | {_fmt(r.step_ms, '.1f')} | {_fmt(r.wall_ms, '.1f')} | "
                     f"{_fmt(r.tokens_per_s, ',.0f')} | {_fmt(r.tflops, '.3g')} | "
                     f"{_fmt(r.mfu * 100 if r.mfu is not None else None, '.1f')}{'%' if r.mfu else ''} | {ratio} | "
                     f"{_fmt(r.syncs, '.1f')} | {_fmt(r.peak_gib, '.1f')} | {r.seconds:.0f} | {r.note} |")
    origins = [(r, r.extra.get("sync_origins")) for r in rows if r.extra.get("sync_origins")]
    if origins:
        lines += ["", "Synchronising CUDA calls per step by origin (`torch.cuda.set_sync_debug_mode`, two steps "
                  "after the timed ones):", ""]
        lines += [f"- {r.case} {r.path}: " + "; ".join(f"{v:g} x {k}" for k, v in o.items()) for r, o in origins]
    lines += ["", *_goals(rows), ""]
    return "\n".join(lines)


def _goals(rows: list[Row]) -> list[str]:
    """The issue's goals, where the rows measured them."""
    get = {(r.case, r.path): r for r in rows if r.step_ms}
    out = ["Goals (issue 56):", ""]
    for case in CASES:
        fit, plain, peer = get.get((case, "fit")), get.get((case, "plain")), get.get((case, "transformers"))
        if fit and plain:
            out.append(f"- {case}: fit / plain loop = {fit.step_ms / plain.step_ms:.3f} (goal <= 1.03)")
        if fit and peer and case.startswith("moe"):
            out.append(f"- {case}: fit is {peer.step_ms / fit.step_ms:.2f}x transformers' speed (goal >= 1.2)")
        if fit and case == "moe-bf16-accum4":
            out.append(f"- {case}: fit {fit.tflops:.0f} TFLOP/s on active parameters (goal >= 250)")
        if fit and case == "llama-1b" and fit.mfu is not None:
            out.append(f"- {case}: fit MFU {fit.mfu:.1%} (goal >= 50%)")
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _device_and_versions(device: str) -> tuple[str, str, float | None]:
    import torch

    from e2e import peak_tflops

    versions = f"torch {torch.__version__}, Python {platform.python_version()}"
    try:
        import transformers

        versions += f", transformers {transformers.__version__}"
    except ImportError:
        pass
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return name, versions, peak_tflops(name)
    return f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)", versions, None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting rows after this (default: cuda 240, "
                   "cpu 900)")
    p.add_argument("--out", type=Path, required=False, help="markdown results file")
    p.add_argument("--cases", nargs="+", default=None, help=f"of {sorted(CASES)} and 'kernels' (cuda)")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default: cuda 8, cpu 6)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: cuda 3, cpu 2)")
    p.add_argument("--row-timeout-s", type=float, default=None, help="per row (default: cuda 150, cpu 300)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="the GPU cases' code paths on the CPU, tiny models "
                   "(checks the benchmark itself, ~2 minutes)")
    p.add_argument("--row", nargs=2, metavar=("CASE", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke and args.device != "cpu":
        p.error("--smoke runs on --device cpu")
    cuda = args.device == "cuda"
    args.steps = args.steps or (8 if cuda else 6)
    args.warmup = args.warmup or (3 if cuda else 2)
    if args.row:
        args.work.mkdir(parents=True, exist_ok=True)
        res = run_row(*args.row, args.device, args.work, args.steps, args.warmup, smoke=args.smoke)
        args.json.write_text(json.dumps(res))
        return 0
    args.argv = argv
    args.budget_s = args.budget_s or (240.0 if cuda else 900.0)
    args.row_timeout_s = args.row_timeout_s or (150.0 if cuda else 300.0)
    if args.work is None:
        import tempfile

        args.work = Path(tempfile.mkdtemp(prefix="step_overhead-"))
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    device, versions, args.peak = _device_and_versions(args.device)
    start = time.monotonic()
    rows: list[Row] = []
    for case in args.cases or DEFAULT_CASES["cuda" if args.smoke else args.device]:
        for path in (["-"] if case == "kernels" else args.paths):
            left = args.budget_s - (time.monotonic() - start)
            if left < 20:
                rows.append(Row(case, path, status="skipped", note="time budget spent"))
                continue
            rows.append(_row(args, case, path, min(args.row_timeout_s, left)))
    text = _markdown(args, rows, time.monotonic() - start, device, versions)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0 if all(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
