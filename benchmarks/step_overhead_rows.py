"""What runs in one row's process of ``benchmarks/step_overhead.py`` (see its docstring): ``fit``, the plain
loop or transformers' model on one case, timed by :class:`Clock`; the kernel rows."""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


@dataclass(frozen=True)
class Case:
    backbone: str
    batch: int
    seq: int
    precision: str
    moe_layers: int | None = None  # MoE: the named size cut to this many layers, experts grouped
    accumulate: tuple[int, ...] = (1,)  # each measured in turn in the same process (one start-up, one model)
    compile: bool = False
    peer: str = "llama"  # transformers' model: llama | moe


CASES: dict[str, Case] = {
    "debug": Case("debug", 8, 64, "32-true"),
    "small-moe": Case("small-moe", 8, 64, "32-true", moe_layers=8, peer="moe"),
    "moe-bf16": Case("qwen3-30b-a3b", 4, 2048, "bf16-true", moe_layers=4, accumulate=(1, 4), peer="moe"),
    "llama-1b": Case("llama-1b", 4, 2048, "bf16-mixed", compile=True),
}
SMOKE = {"qwen3-30b-a3b": "debug-moe", "llama-1b": "debug"}
"""``--smoke``: the GPU cases' code paths on the CPU with tiny models (these backbones), rows of 64 tokens, no
compilation."""


def smoke_case(case: Case) -> Case:
    from dataclasses import replace

    return replace(case, backbone=SMOKE.get(case.backbone, case.backbone), batch=2, seq=64, compile=False,
                   moe_layers=2 if case.moe_layers else None)

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
        self._filters = warnings.filters[:]
        warnings.simplefilter("always")
        shown = self._shown = warnings.showwarning

        def count(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
            if "synchronizing" not in str(message):
                return shown(message, category, filename, lineno, *args)
            if self.syncs:
                self.syncs[-1].append(_origin())
            return None

        warnings.showwarning = count

    def result(self, steps: int) -> dict[str, Any]:
        if self.cuda:
            self.torch.cuda.synchronize()
            if hasattr(self, "_shown"):  # counting off again (a later variant in this process starts its own)
                import warnings

                self.torch.cuda.set_sync_debug_mode(0)
                warnings.showwarning, warnings.filters[:] = self._shown, self._filters
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

    docs = max(200, int(1.3 * steps * max(case.accumulate) * case.batch * (case.seq + 1) / 140))
    dm = TextDataModule(block_size=case.seq, batch_size=case.batch, generated_docs=docs, cache_dir=str(work / "cache"))
    return dm, docs


def _fit(case: Case, acc: int, work: Path, device: Any, total: int, clock: Clock) -> None:
    import lightning.pytorch as pl

    from lightning_llm.cli.app import LLMCLI

    _, docs = _data(case, work, total)

    class Steps(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            clock.step_end()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % acc == 0:
                clock.step_end()
                if len(clock.ends) - 1 >= clock.timed_end:
                    clock.syncs.append([])
                    if len(clock.ends) - 1 == clock.timed_end:
                        clock.start_counting()

    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), f"--model.backbone={case.backbone}",
            f"--model.model_overrides={json.dumps(_overrides(case))}", f"--model.compile={str(case.compile).lower()}",
            f"--data.block_size={case.seq}", f"--data.batch_size={case.batch}", f"--data.generated_docs={docs}",
            f"--data.cache_dir={work / 'cache'}", f"--trainer.max_steps={total}",
            f"--trainer.accumulate_grad_batches={acc}", f"--trainer.precision={case.precision}",
            f"--trainer.accelerator={'gpu' if device.type == 'cuda' else 'cpu'}", "--trainer.devices=1",
            "--trainer.log_every_n_steps=1000", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={work / 'root'}"]
    LLMCLI(args=args, trainer_defaults={"callbacks": [Steps()]})


def _loop(case: Case, acc: int, work: Path, device: Any, total: int, clock: Clock, model: Any, loss_of: Any) -> None:
    """forward, backward, fused AdamW step (over ``acc`` micro-batches), the batches ``fit`` trains on."""
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
        for _ in range(acc):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
            with autocast:
                loss = loss_of(batch)
            (loss / acc).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.step_end()


def _plain(case: Case, device: Any) -> tuple[Any, Any, str]:
    """Our model as ``fit`` builds it (and compiles its blocks), and its loss."""
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
    return model, lambda b: model(b["input_ids"], labels=b["labels"]), ""


def _transformers(case: Case, device: Any) -> tuple[Any, Any, str]:
    """transformers' model of the same shape (the peer a user would pick), and its loss."""
    import torch
    import transformers

    from lightning_llm.models import NAMED_SIZES
    from lightning_llm.models.config import ModelConfig
    from lightning_llm.models.hf import config_to_hf

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
    return model, lambda b: model(input_ids=b["input_ids"], labels=b["input_ids"]).loss, note


def _active_flops_per_token(case: Case) -> tuple[int, dict[str, int]]:
    """Training FLOPs per token on the parameters a token uses (built on the meta device), and the counts."""
    import torch

    from lightning_llm.models import build_model
    from lightning_llm.models.layers.moe import moe_parameters
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

    from lightning_llm.kernels.loss.cross_entropy import chunk_size_for, fused_linear_cross_entropy
    from lightning_llm.models.layers.moe import _TokensByExpert

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
    """One row's measurements: ``{"kernels": ...}``, or ``{"variants": [...]}``, one per accumulation of the case
    (``fit`` runs once per accumulation; the plain loop and transformers' model are built once and stepped with
    each)."""
    import torch

    device = torch.device(device_name)
    if case_name == "kernels":
        return {"kernels": _kernels(device)}
    case = smoke_case(CASES[case_name]) if smoke else CASES[case_name]
    count_steps = 2 if device.type == "cuda" else 0
    total = warmup + steps + count_steps
    note = ""
    if path != "fit":
        model, loss_of, note = (_plain if path == "plain" else _transformers)(case, device)
    flops, params = _active_flops_per_token(case)
    variants = []
    for acc in case.accumulate:
        clock = Clock(device, warmup)
        clock.timed_end = warmup + steps
        if path == "fit":
            _fit(case, acc, work, device, total, clock)
        else:
            _loop(case, acc, work, device, total, clock, model, loss_of)
        res = clock.result(steps)
        res["syncs"] = res["syncs"][:count_steps]
        res.update(accumulate=acc, tokens_per_step=case.batch * case.seq * acc, flops_per_token=flops, params=params,
                   note=note, peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
        variants.append(res)
    return {"variants": variants}
