"""Decoding speed in one process: our ``generate`` eager (the dynamic cache) and with the static cache + compiled step,
against transformers' ``generate`` on the same weights (its dynamic cache, and its static cache with its own
``torch.compile``); and the GRPO rollout time of ``configs/grpo.yaml`` with each of our settings. Used by
``benchmarks/generation.py --part static`` (CPU rows) and ``--part gpu`` (one command on a CUDA machine).

Every row is guarded: a row that fails or does not fit the time budget writes its reason and the others go on. A
row's first call (compilation, CUDA-graph recording, caches) is timed apart as its warm-up; tokens/s is the median of
the timed calls after it (``torch.cuda.synchronize`` around each). Each of our compiled rows states how many of its
tokens equal our eager decoding's (on the CPU in fp32: all; in bf16 on a GPU the compiled kernels round differently,
so a near tie may go the other way and the rest of that row follows it).
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.testing import HostReadCounter

ROOT = Path(__file__).resolve().parents[1]
COMPILED = dict(cache_implementation="static", compile=True)


@dataclass
class Budget:
    """Seconds left for the rows of one command; a row asks before it starts."""

    seconds: float
    start: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


@dataclass
class Row:
    what: str
    batch: int
    new: int
    seconds: float | None = None
    warmup_s: float | None = None
    same_tokens: str = ""
    note: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.seconds is None else self.batch * self.new / self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def prompts(batch: int, vocab: int, device: torch.device, *, lo: int = 32, hi: int = 64, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of ``lo``..``hi`` tokens, left-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (batch,), generator=g)
    width = int(lengths.max())
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, width - n:] = torch.randint(4, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def build(size: str, device: torch.device, dtype: torch.dtype, **overrides: Any) -> Any:
    """Our decoder of a named size, random weights (seeded), in ``dtype`` on ``device``, in eval mode."""
    from lightning_llm.models import DecoderLM, named_config

    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderLM(named_config(size, family="decoder", **overrides))
    return model.to(dtype).eval()


def transformers_twin(model: Any, work: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The same weights as a transformers model (``save_hf`` -> ``from_pretrained``, SDPA attention)."""
    import transformers

    from lightning_llm.models import save_hf

    path = Path(work) / "hf-twin"
    save_hf(model, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype)
    return hf.to(device).eval()


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> str:
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    same = (got == ref).float().mean().item()
    rows = (got == ref).all(-1).float().mean().item()
    return "all" if same == 1.0 else f"{same:.0%} ({rows:.0%} of rows)"


class _Said(logging.Handler):
    """What our generation logged while a row ran (a fallback, a step compiled in pieces)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:300])


@dataclass
class _Variant:
    """One row's calls: ``call`` timed ``wanted`` times after ``warmup`` (default: ``call``)."""

    row: Row
    call: Callable[[], Any]
    wanted: int
    need_s: float
    warmup: Callable[[], Any] | None = None
    times: list[float] = field(default_factory=list)
    out: Any = None
    ok: bool = False


def _attempt(v: _Variant, fn: Callable[[], Any], device: torch.device) -> float | None:
    """``fn`` timed; a failure becomes the row's note (and the row stops); what our generation logs is noted."""
    said = _Said()
    logging.getLogger("lightning_llm.generation").addHandler(said)
    try:
        t, v.out = timed(fn, device)
        return t
    except Exception as e:  # noqa: BLE001 - a row's failure is its result; the other rows go on
        v.row.note += f" failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        v.ok = False
        traceback.print_exc()
        return None
    finally:
        logging.getLogger("lightning_llm.generation").removeHandler(said)
        v.row.note += "".join(f" [logged: {m}]" for m in said.messages)


def _run_variants(variants: list[_Variant], device: torch.device, budget: Budget) -> None:
    """Every row's warm-up (in order, each if the budget has its ``need_s``), then the timed calls in rounds, one
    call of each row per round (so a drift of a shared machine hits every row alike)."""
    for v in variants:
        if budget.left() < v.need_s:
            v.row.note = f"skipped: {budget.left():.0f} s of the budget left, the row needs about {v.need_s:.0f} s"
        else:
            v.ok = True
            v.row.warmup_s = _attempt(v, v.warmup or v.call, device)
        print(f"[decode] {v.row.what} batch {v.row.batch}: warm-up {v.row.warmup_s or 0:.1f} s{v.row.note} "
              f"({budget.left():.0f} s left)", flush=True)
    for _ in range(max((v.wanted for v in variants), default=0)):
        for v in variants:
            if not v.ok or len(v.times) >= v.wanted:
                continue
            if v.times and budget.left() < 2 * max(v.times):
                v.row.note += f" {len(v.times)} of {v.wanted} timed calls (budget)"
                v.wanted = len(v.times)
                continue
            t = _attempt(v, v.call, device)
            if t is not None:
                v.times.append(t)
                v.row.seconds = statistics.median(v.times)
    for v in variants:
        print(f"[decode] {v.row.what} batch {v.row.batch}: {v.row.tokens_per_s or 0:.1f} tokens/s over "
              f"{len(v.times)} calls{v.row.note}", flush=True)


def decode_rows(model: Any, hf: Any | None, *, batches: list[int], new: int, device: torch.device, budget: Budget,
                repeats: int, static_eager: bool = False) -> list[Row]:
    """Rows per batch size (in the order given): ours eager, (ours static eagerly,) ours static + compiled,
    transformers dynamic, transformers static + compile. Greedy, no EOS: every row generates ``new`` tokens. The
    eager rows (one kernel launch after another: slow calls) are timed half as often."""
    from torch._dynamo.utils import counters

    rows: list[Row] = []
    vocab = model.config.vocab_size
    eager_s = 4.0 * new / 32  # a rough bound of an eager row (0.1 s per token, few calls)
    slow = max(1, repeats // 2)
    for b in batches:
        ids, mask = prompts(b, vocab, device, seed=b)

        def ours(n: int = new, **settings: Any) -> Callable[[], torch.Tensor]:
            cfg = GenerationConfig(max_new_tokens=n, eos_token_id=None, **settings)
            return lambda: generate(model, ids, mask, config=cfg)

        variants = [_Variant(Row("ours, dynamic cache (eager)", b, new), ours(), slow, eager_s, warmup=ours(4))]
        if static_eager:
            variants.append(_Variant(Row("ours, static cache (eager steps)", b, new),
                                     ours(cache_implementation="static"), slow, eager_s))
        variants.append(_Variant(Row("ours, static cache + compiled step", b, new), ours(**COMPILED), repeats, 60.0))
        if hf is not None:
            def theirs(n: int = new, **extra: Any) -> Callable[[], torch.Tensor]:
                def call() -> torch.Tensor:
                    with torch.no_grad():
                        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                          do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None, **extra)
                    return out[:, ids.shape[1]:]
                return call

            variants.append(_Variant(Row("transformers, dynamic cache", b, new), theirs(), slow, 2 * eager_s,
                                     warmup=theirs(4)))
            variants.append(_Variant(Row("transformers, static cache + torch.compile", b, new),
                                     theirs(cache_implementation="static"), repeats, 60.0))
        graphs = counters["stats"].get("unique_graphs", 0)
        _run_variants(variants, device, budget)
        eager = variants[0].out if variants[0].times else None
        for v in variants[1:]:
            if eager is not None and v.out is not None and v.times:
                v.row.same_tokens = _agreement(v.out, eager)
        compiled = next(v for v in variants if v.row.what.startswith("ours, static cache + compiled"))
        if compiled.ok:
            compiled.row.note += f" (graphs: {counters['stats'].get('unique_graphs', 0) - graphs} new)"
        if hf is not None and device.type != "cuda":
            variants[-1].row.note += " (transformers compiles on CUDA only: its static cache ran eagerly here)"
        rows += [v.row for v in variants]
    return rows


def decode_table(rows: list[Row], *, title: str, command: str) -> list[str]:
    lines = [f"## {title}", "", f"`{command}`", "",
             "| rows | decoding | tokens/s | vs ours eager | warm-up (s) | median call (s) | tokens equal to ours "
             "eager | note |", "|---|---|---|---|---|---|---|---|"]
    eager = {r.batch: r.tokens_per_s for r in rows if r.what.startswith("ours, dynamic") and r.tokens_per_s}
    for r in rows:
        tps = r.tokens_per_s
        vs = f"{tps / eager[r.batch]:.2f}x" if tps and r.batch in eager else "-"
        lines.append(f"| {r.batch} | {r.what} | {f'{tps:.1f}' if tps else '-'} | {vs} | "
                     f"{f'{r.warmup_s:.1f}' if r.warmup_s is not None else '-'} | "
                     f"{f'{r.seconds:.3f}' if r.seconds is not None else '-'} | {r.same_tokens or '-'} | "
                     f"{r.note.strip() or ''} |")
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------------- parity
def parity_lines(device: torch.device, budget: Budget, *, size: str = "debug") -> list[str]:
    """fp32 tokens of our compiled static decoding against our eager decoding on ``device`` (greedy with EOS ids that
    end rows at different steps, and per-row sampling), and the host reads of a 64-token compiled generation."""
    lines = [f"## fp32 parity on {device.type}: `{size}`, batch 8, 64 new tokens", ""]
    if budget.left() < 60:
        return [*lines, f"skipped: {budget.left():.0f} s of the budget left", ""]
    try:
        model = build(size, device, torch.float32)
        ids, mask = prompts(8, model.config.vocab_size, device, lo=8, hi=24, seed=1)
        first = generate(model, ids, mask, config=GenerationConfig(max_new_tokens=64, eos_token_id=None))
        eos = sorted({int(t) for t in first[:, 20:].flatten().tolist()})[:4]  # tokens the model picks: rows end
        uniforms = torch.rand(8, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
        for name, settings, draws in (("greedy, EOS", dict(eos_token_id=eos), None),
                                      ("sampled (per-row draws), EOS", dict(do_sample=True, top_k=50,
                                                                           eos_token_id=eos), uniforms)):
            eager = generate(model, ids, mask, config=GenerationConfig(max_new_tokens=64, **settings),
                             uniforms=draws)
            cfg = GenerationConfig(max_new_tokens=64, **settings, **COMPILED)
            compiled = generate(model, ids, mask, config=cfg, uniforms=draws)
            lines.append(f"- {name}: compiled static tokens {'equal' if torch.equal(compiled, eager) else 'DIFFER'}"
                         f" to eager ({_agreement(compiled, eager)}; {tuple(eager.shape)})")
        never = GenerationConfig(max_new_tokens=64, eos_token_id=[model.config.vocab_size], **COMPILED)
        generate(model, ids, mask, config=never)
        with HostReadCounter().counting() as reads:
            generate(model, ids, mask, config=never)
        lines.append(f"- host reads of a compiled 64-token generation with EOS ids: {len(reads)} (at most 12 asked)")
    except Exception as e:  # noqa: BLE001 - the rest of the part goes on
        traceback.print_exc()
        lines.append(f"- failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
    print("\n".join(lines), flush=True)
    return [*lines, ""]


# ---------------------------------------------------------------------------------------------------- GRPO rollouts
def grpo_rollouts(*, flags: list[str], settings: dict[str, str], rollouts: int, work: str, timeout_s: float
                  ) -> tuple[list[float], str]:
    """``time/rollout_s`` of every rollout of one ``lightning_llm fit --config configs/grpo.yaml`` with ``flags`` and
    the generation ``settings``, and a note (the first rollout compiles where ``compile`` is on)."""
    with tempfile.TemporaryDirectory(dir=work) as out:
        cli = [sys.executable, "-m", "lightning_llm", "fit", "--config", str(ROOT / "configs" / "grpo.yaml"),
               f"--trainer.max_steps={4 * rollouts}", f"--trainer.logger.init_args.save_dir={out}",
               "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
               "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={out}", *flags,
               *(f"--model.generation.{k}={v}" for k, v in settings.items())]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        if "--trainer.accelerator=cpu" in flags:
            env["OMP_NUM_THREADS"] = "1"  # the shared 2-core machine: more threads than cores stall every matmul
        done = subprocess.run(cli, capture_output=True, text=True, env=env, cwd=work, timeout=timeout_s)
        if done.returncode:
            last = done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else f"exit {done.returncode}"
            return [], f"failed: {last}"
        path = next(Path(out).rglob("metrics.csv"))
        return [float(r["time/rollout_s"]) for r in csv.DictReader(path.open()) if r.get("time/rollout_s")], ""


def grpo_table(runs: dict[str, tuple[list[float], str]], *, title: str, command: str) -> list[str]:
    lines = [f"## {title}", "", f"`{command}`", "",
             "| generation | first rollout (s) | later rollouts, median (s) | speed-up vs dynamic | note |",
             "|---|---|---|---|---|"]
    base = statistics.median(runs["dynamic"][0][1:]) if len(runs.get("dynamic", ([], ""))[0]) > 1 else None
    for name, (times, note) in runs.items():
        later = statistics.median(times[1:]) if len(times) > 1 else None
        vs = f"{base / later:.2f}x" if base and later else "-"
        lines.append(f"| {name} | {f'{times[0]:.3f}' if times else '-'} | {f'{later:.3f}' if later else '-'} | "
                     f"{vs} | {note} |")
    return [*lines, ""]
