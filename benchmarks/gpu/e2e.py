"""End-to-end training runs for ``benchmarks/gpu/suite.py``: ``lightning_llm fit`` in fresh processes, measured by
:class:`GpuMeter` (loaded in the child as ``--trainer.callbacks=[{"class_path": "e2e.GpuMeter", ...}]``).

* encoder: ``ClassificationTask`` (``configs/afqmc.yaml``) on generated AFQMC-style pairs whose every pair fills
  ``--data.max_length`` tokens, bf16-mixed, under 1 device, ``zero1``, ``zero2`` at batch 4 and at the largest batch
  that fits (doubling until CUDA OOM), and ``zero3_offload`` / ``deepspeed_zero3_offload`` at batch 1;
* decoder: ``CausalLMTask`` (``configs/pretrain_debug.yaml``, generated corpus) with ``{kernels: torch}`` and
  ``{kernels: triton}``, and compiled blocks (``--model.compile=true``, row ``auto+compile``);
* moe: the same task on a Mixture-of-Experts model (``qwen3-30b-a3b`` with fewer layers through
  ``--model.model_overrides``), its experts' GEMMs grouped (``experts_impl: grouped``).

Step time: median interval between consecutive ``on_train_batch_end`` calls (CUDA synchronised) after the warm-up
steps. MFU: (6 N + 12 L A S) FLOPs per token (N the parameters a token uses, without embedding tables: of an MoE
layer's routed experts only its top-k; L layers, A the attention width heads x head dim, S sequence length;
:func:`lightning_llm.tools.estimate.train_flops_per_token`) x tokens/s / the device's dense bf16 peak
(:data:`PEAK_BF16_TFLOPS`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from typing_extensions import override

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                                                   ("A100", 312.0))
"""Dense bf16 peak by device-name substring (first match wins; H100 SXM/HBM3 989, H100 PCIe 756)."""
OOM_MARKERS = ("CUDA out of memory", "OutOfMemoryError", "out of memory")


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS if k.lower() in device_name.lower()), None)


# ------------------------------------------------------------------------------------ in the benchmarked process


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())  # DeepSpeed ZeRO-3 leaves 1-element placeholders


def _peak_rss_kib() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class GpuMeter(pl.Callback):
    """Writes step end times, tokens per step, parameter counts and peak memory of a run to ``output`` (JSON)."""

    def __init__(self, output: str) -> None:
        """
        Args:
            output: JSON file written by rank 0 at the end of ``fit``.
        """
        self.output = output
        self.step_ends: list[float] = []
        self.tokens_per_step = 0
        self.params: dict[str, int] = {}

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_llm.models.layers.moe import moe_parameters

        model = getattr(pl_module, "model", pl_module)
        emb = sum(_numel(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(False))
        cfg = getattr(model, "config", None)
        total = sum(_numel(p) for p in model.parameters())
        experts, routed = moe_parameters(cfg) if getattr(cfg, "moe", None) is not None else (0, 0)
        self.params = {"total": total, "active": total - experts + routed, "embedding": emb,
                       "layers": int(getattr(cfg, "num_layers", 0)), "hidden": int(getattr(cfg, "hidden_size", 0)),
                       "attention": int(getattr(cfg, "num_heads", 0)) * int(getattr(cfg, "head_dim", 0) or 0)}
        self._sync(trainer)
        self.step_ends = [time.perf_counter()]

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(trainer)
        self.step_ends.append(time.perf_counter())
        self.tokens_per_step = int(batch["input_ids"].numel())

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        cuda = torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda"
        record = {"step_ends": self.step_ends, "tokens_per_step": self.tokens_per_step, **self.params,
                  "peak_alloc": torch.cuda.max_memory_allocated() if cuda else None,
                  "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None, "rss_kib": _peak_rss_kib()}
        tmp = Path(self.output + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.output)


# ------------------------------------------------------------------------------------------------- the driver


@dataclass
class E2EConfig:
    work: Path
    accelerator: str = "gpu"
    precision: str = "bf16-mixed"
    encoder_backbone: str = "erlangshen-1.3b"
    decoder_backbone: str = "llama-1b"
    seq: int = 512
    decoder_seq: int = 2048
    decoder_batch: int = 4
    steps: int = 20
    warmup: int = 5
    offload_steps: int = 6
    offload_warmup: int = 2
    max_batch: int = 256
    run_timeout_s: float = 420.0
    peak_tflops: float | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RunResult:
    model: str
    strategy: str
    kernels: str
    batch: int
    role: str
    status: str = "ok"  # ok | oom | error | skipped
    step_ms: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_alloc_gib: float | None = None
    peak_reserved_gib: float | None = None
    rss_gib: float | None = None
    wall_s: float = 0.0
    note: str = ""


def _vocab_override(family: str, backbone: str, tokenizer_rows: int) -> dict[str, Any]:
    """Keep a named size's own vocabulary (``build_backbone`` would otherwise size it to the small generated
    tokenizer's), or the tokenizer's padded size when that is larger."""
    from lightning_llm.models import NAMED_SIZES
    from lightning_llm.tasks.base import padded_vocab_size

    size = NAMED_SIZES.get((family, backbone))
    return {"vocab_size": max(size["vocab_size"], padded_vocab_size(tokenizer_rows))} if size else {}


def prepare_pair_data(cfg: E2EConfig, n_train: int) -> Path:
    """Generated AFQMC-format pairs of two ``(seq - 1) // 2``-character sentences: every pair is cut to ``seq``."""
    from lightning_llm.data import generate_pair_dataset

    half = (cfg.seq - 1) // 2
    out = cfg.work / f"pairs-seq{cfg.seq}-n{n_train}"
    if not (out / "tokenizer" / "vocab.txt").is_file():
        generate_pair_dataset(out, n_train=n_train, n_val=8, n_test=8, min_len=half, max_len=half)
    return out


def _common(cfg: E2EConfig, steps: int, batch: int, output: Path) -> list[str]:
    meter = json.dumps([{"class_path": "e2e.GpuMeter", "init_args": {"output": str(output)}}])
    return [f"--data.batch_size={batch}", f"--trainer.max_steps={steps}", f"--trainer.accelerator={cfg.accelerator}",
            "--trainer.devices=1", f"--trainer.precision={cfg.precision}", "--trainer.limit_val_batches=0",
            "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={cfg.work / 'root'}",
            f"--trainer.callbacks={meter}"]


def encoder_command(cfg: E2EConfig, data: Path, strategy: str, batch: int, steps: int, output: Path) -> list[str]:
    rows = len((data / "tokenizer" / "vocab.txt").read_text(encoding="utf-8").splitlines())
    overrides = _vocab_override("encoder", cfg.encoder_backbone, rows)
    args = ["fit", "--config", str(REPO / "configs" / "afqmc.yaml"), f"--data.data_dir={data}",
            f"--data.tokenizer_dir={data / 'tokenizer'}", f"--data.max_length={cfg.seq}",
            f"--model.backbone={cfg.encoder_backbone}", f"--model.model_overrides={json.dumps(overrides)}",
            *_common(cfg, steps, batch, output)]
    if strategy != "1 device":
        args.append(f"--trainer.strategy={strategy}")
    return [sys.executable, "-m", "lightning_llm", *args]


def decoder_command(cfg: E2EConfig, kernels: str, batch: int, steps: int, output: Path, *,
                    compile: bool = False, backbone: str | None = None, seq: int | None = None,
                    overrides: dict[str, Any] | None = None) -> list[str]:  # noqa: A002 - --model.compile
    """``lightning_llm fit`` of ``backbone`` (default: the decoder rows') on generated text at ``seq`` tokens per row
    with ``--model.model_overrides`` ``overrides`` besides the kernels and the vocabulary."""
    from lightning_llm.data import ByteTokenizer
    from lightning_llm.data.base import tokenizer_vocab_size

    backbone, seq = backbone or cfg.decoder_backbone, seq or cfg.decoder_seq
    overrides = {"kernels": kernels, **_vocab_override("decoder", backbone, tokenizer_vocab_size(ByteTokenizer())),
                 **(overrides or {})}
    docs = max(400, int(1.3 * (steps + 2) * batch * (seq + 1) / 140))  # ~140 bytes per generated doc
    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"),
            f"--model.backbone={backbone}", f"--model.model_overrides={json.dumps(overrides)}",
            f"--data.block_size={seq}", f"--data.generated_docs={docs}",
            f"--data.cache_dir={cfg.work / 'cache'}", *_common(cfg, steps, batch, output)]
    if compile:
        args.append("--model.compile=true")
    return [sys.executable, "-m", "lightning_llm", *args]


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def summarize(res: RunResult, record: dict[str, Any], *, warmup: int, seq: int, peak: float | None) -> None:
    """Fill the step time, tokens/s, MFU and memory of ``res`` from a :class:`GpuMeter` record."""
    ends = record["step_ends"]
    intervals = [b - a for a, b in itertools.pairwise(ends)][warmup:]
    if not intervals:
        res.status, res.note = "error", f"no timed steps ({len(ends) - 1} steps, {warmup} warm-up)"
        return
    step_s = statistics.median(intervals)
    res.step_ms = step_s * 1e3
    res.tokens_per_s = record["tokens_per_step"] / step_s
    from lightning_llm.tools.estimate import train_flops_per_token

    flops_per_token = train_flops_per_token(params=record.get("active", record["total"]) - record["embedding"],
                                            layers=record["layers"], seq_len=seq,
                                            attention_width=record.get("attention") or record["hidden"])
    if peak:
        res.mfu = flops_per_token * res.tokens_per_s / (peak * 1e12)
    gib = 2.0**30
    res.peak_alloc_gib = record["peak_alloc"] / gib if record.get("peak_alloc") is not None else None
    res.peak_reserved_gib = record["peak_reserved"] / gib if record.get("peak_reserved") is not None else None
    res.rss_gib = record["rss_kib"] * 1024 / gib
    active = record.get("active", record["total"])
    used = f", {_count(active)} active per token" if active != record["total"] else ""
    res.note = (res.note + f" N={_count(record['total'])} ({_count(record['embedding'])} in embeddings{used}), "
                f"{len(ends) - 1} steps").strip()


def execute(cmd: list[str], res: RunResult, output: Path, *, timeout: float, cfg: E2EConfig, warmup: int,
            seq: int) -> RunResult:
    """Run one ``lightning_llm fit``; sets ``res.status`` to ok / oom / error and the measured figures."""
    output.unlink(missing_ok=True)
    log_file = output.with_suffix(".log")
    env = {**os.environ, **cfg.env,
           "PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cfg.work, env=env, timeout=timeout)
        log_file.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        rc, text = None, ""
    res.wall_s = time.perf_counter() - t0
    if rc is None:
        res.status, res.note = "error", f"timed out after {timeout:.0f} s"
    elif rc != 0 or not output.is_file():
        oom = any(m in text for m in OOM_MARKERS)
        last = [ln for ln in text.splitlines() if "Error" in ln or "error:" in ln]
        res.status = "oom" if oom else "error"
        res.note = "CUDA out of memory" if oom else (last[-1].strip()[:200] if last else f"exit code {rc}")
        res.note += f" (log: {log_file})"
    else:
        summarize(res, json.loads(output.read_text()), warmup=warmup, seq=seq, peak=cfg.peak_tflops)
    log.info("e2e %s %s %s batch %d: %s %s (%.0f s)", res.model, res.strategy, res.kernels, res.batch, res.status,
             f"{res.step_ms:.1f} ms/step" if res.step_ms else "", res.wall_s)
    return res


def search_max_batch(measure: Callable[[int, str], RunResult], start: int, floor: int,
                     cap: int) -> tuple[list[RunResult], RunResult | None]:
    """Largest batch that fits: from ``start`` double until OOM (or ``cap``); if ``start`` itself runs out of
    memory, halve down to ``floor``. ``measure(batch, role)`` runs (or recalls) one batch size."""
    runs: list[RunResult] = []
    best: RunResult | None = None
    b, down = start, False
    while floor <= b <= cap:
        r = measure(b, "search")
        runs.append(r)
        if r.status == "ok":
            best = r
            if down:  # 2b already ran out of memory
                break
            b *= 2
        elif r.status == "oom" and best is None:
            down, b = True, b // 2
        else:  # OOM above a batch that fits, or an error: stop
            break
    return runs, best


@dataclass
class E2EReport:
    rows: list[RunResult] = field(default_factory=list)
    largest: list[tuple[str, RunResult | None, str]] = field(default_factory=list)  # (strategy, best run, note)


def _runner(cfg: E2EConfig, report: E2EReport, deadline: float) -> Callable[..., RunResult]:
    """``run(model, strategy, kernels, batch, role, cmd_fn, steps, warmup, seq)`` with a cache by key and the budget."""
    cache: dict[tuple[str, str, str, int], RunResult] = {}

    def run(model: str, strategy: str, kernels: str, batch: int, role: str, cmd_fn: Callable[..., list[str]],
            steps: int, warmup: int, seq: int) -> RunResult:
        key = (model, strategy, kernels, batch)
        if key in cache:
            return cache[key]
        res = RunResult(model, strategy, kernels, batch, role)
        left = deadline - time.monotonic()
        if left < 30:
            res.status, res.note = "skipped", "time budget spent"
        else:
            slug = f"{model}-{strategy}-{kernels}-b{batch}".replace(" ", "_")
            out = cfg.work / "out" / f"{slug}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            execute(cmd_fn(batch, steps, out), res, out, timeout=min(cfg.run_timeout_s, left), cfg=cfg,
                    warmup=warmup, seq=seq)
        cache[key] = res
        report.rows.append(res)
        return res

    return run


def run_encoder(cfg: E2EConfig, run: Callable[..., RunResult], report: E2EReport) -> None:
    data = prepare_pair_data(cfg, n_train=min(2048, max(64, 8 * cfg.max_batch)))
    model = f"encoder {cfg.encoder_backbone}"
    one_device_best: int | None = None
    for strategy in ("1 device", "zero1", "zero2"):
        def measure(b: int, role: str, strategy: str = strategy) -> RunResult:
            return run(model, strategy, "auto", b, role,
                       lambda bb, steps, out: encoder_command(cfg, data, strategy, bb, steps, out),
                       cfg.steps, cfg.warmup, cfg.seq)

        first = measure(4, "batch 4")
        start = 4 if one_device_best is None else max(4, one_device_best)
        runs, best = search_max_batch(measure, start, 4, cfg.max_batch) if first.status == "ok" else ([], None)
        note = ""
        if best is not None and best.batch * 2 > cfg.max_batch and not any(r.status == "oom" for r in runs):
            note = f"search capped at --e2e-max-batch={cfg.max_batch}"
        elif best is None:
            note = f"batch 4 {first.status}: {first.note}"
        report.largest.append((strategy, best, note))
        if strategy == "1 device" and best is not None:
            one_device_best = best.batch


def run_offload(cfg: E2EConfig, run: Callable[..., RunResult]) -> None:
    data = prepare_pair_data(cfg, n_train=min(2048, max(64, 8 * cfg.max_batch)))
    for strategy in ("zero3_offload", "deepspeed_zero3_offload"):
        run(f"encoder {cfg.encoder_backbone}", strategy, "auto", 1, "offload",
            lambda b, steps, out, s=strategy: encoder_command(cfg, data, s, b, steps, out),
            cfg.offload_steps, cfg.offload_warmup, cfg.seq)


DECODER_ROWS = (("torch", False), ("triton", False), ("auto", True))
"""(kernels, --model.compile) of the decoder rows: compiled blocks take the torch path inside (inductor fuses it),
the fused loss stays Triton; the row is labelled ``auto+compile``."""


def run_decoder(cfg: E2EConfig, run: Callable[..., RunResult]) -> None:
    for kernels, compiled in DECODER_ROWS:
        label = f"{kernels}+compile" if compiled else kernels
        run(f"decoder {cfg.decoder_backbone}", "1 device", label, cfg.decoder_batch, "kernels",
            lambda b, steps, out, k=kernels, c=compiled: decoder_command(cfg, k, b, steps, out, compile=c),
            cfg.steps, cfg.warmup, cfg.decoder_seq)


def moe_overrides(backbone: str, layers: int | None) -> dict[str, Any]:
    """``--model.model_overrides`` of the MoE row: ``layers`` of the named size (``None``: all), its experts' GEMMs
    grouped (the run fails rather than fall back to the loop where the device has no grouped GEMM for the dtype)."""
    from lightning_llm.models import NAMED_SIZES

    moe = {**NAMED_SIZES[("decoder", backbone)]["moe"], "experts_impl": "grouped"}
    return {"moe": moe, **({"num_layers": layers} if layers else {})}


def run_moe(cfg: E2EConfig, deadline: float, *, backbone: str, layers: int | None, batch: int,
            seq: int) -> RunResult:
    """One run of a Mixture-of-Experts decoder (``experts_impl: grouped``), MFU counted on its active parameters."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    run = _runner(cfg, E2EReport(), deadline)
    overrides = moe_overrides(backbone, layers)
    label = f"moe {backbone}" + (f" x{layers} layers" if layers else "")
    return run(label, "1 device", "grouped experts", batch, "moe",
               lambda b, steps, out: decoder_command(cfg, "auto", b, steps, out, backbone=backbone, seq=seq,
                                                     overrides=overrides),
               cfg.steps, cfg.warmup, seq)


def run_e2e(cfg: E2EConfig, groups: set[str], deadline: float) -> E2EReport:
    """Run the selected groups (``encoder``, ``offload``, ``decoder``); every run is a row of the report."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    report = E2EReport()
    run = _runner(cfg, report, deadline)
    if "encoder" in groups:
        run_encoder(cfg, run, report)
    if "offload" in groups:
        run_offload(cfg, run)
    if "decoder" in groups:
        run_decoder(cfg, run)
    return report
