"""``lightning_llm estimate``: per-device training memory of a model under a layout (DDP, ZeRO stages, tp x pp x dp,
expert parallelism), the largest batch that fits a given accelerator memory, and the model's parameters (total and,
for a Mixture-of-Experts model, those a token uses) with the training FLOPs per token they imply. The memory numbers
are :mod:`lightning_llm.memory`'s (the same the run summary logs at the start of fit); this module reads the command
line and prints them.

FLOPs per token of a training step (forward + backward), the convention of PaLM's MFU that ``benchmarks/gpu/suite.py``
reports: ``6 N + 12 L A S``, with ``N`` the parameters a token's matmuls use (no embedding tables; of an MoE layer's
routed experts only its ``top_k``: :func:`~lightning_llm.models.layers.moe.moe_parameters`), ``L`` layers, ``A`` the
attention width (heads x head dim) and ``S`` the sequence length; Gated DeltaNet layers (Qwen3.5, Qwen3-Next) count
their chunked delta rule instead of ``12 A S`` (:func:`~lightning_llm.memory.deltanet_flops_per_token`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_llm.files import read_json
from lightning_llm.memory import (
    OPTIMIZERS,
    PRECISIONS,
    Quantized,
    attention_width,
    bytes_per_param,
    deltanet_flops_per_token,
    estimate_layout,
    loss_bytes,
    max_batch_size,
    quantized_setup_peak_bytes,
    setup_peak_bytes,
)
from lightning_llm.models import NAMED_SIZES, config_from_hf, model_from_config, named_config
from lightning_llm.models.hf.convert.architectures import SUPPORTED_ARCHITECTURES, architecture_name
from lightning_llm.models.hf.convert.multimodal import outside_keys
from lightning_llm.models.hf.source import CheckpointFiles
from lightning_llm.models.layers.moe import moe_parameters
from lightning_llm.models.quantize import QUANTIZE_MODES, QuantizationConfig
from lightning_llm.strategies.presets import ZERO_PRESETS

__all__ = ["ParameterCounts", "count_parameters", "load_config", "main", "parameter_counts", "strategy_args",
           "train_flops_per_token"]

GIB = 1024**3


def load_config(model: str, family: str) -> Any:
    """ModelConfig of a named size or of a local HF directory's ``config.json``."""
    if (family, model) in NAMED_SIZES:
        return named_config(model, family=family)
    p = Path(model).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"--model={model}: no config.json in that directory")
        return config_from_hf(read_json(cfg), where=str(cfg))
    known = sorted(n for f, n in NAMED_SIZES if f == family)
    raise ValueError(f"--model={model}: neither a named {family} size ({', '.join(known)}) nor a local HF directory")


def count_parameters(config: Any) -> int:
    """Exact parameter count (tied weights once), from a model built on the meta device."""
    return parameter_counts(config).total


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    """Every parameter (tied weights once)."""
    embedding: int
    """Those in embedding tables (a tied head's weight among them)."""
    experts: int
    """The routed experts' (0 without MoE layers)."""
    active: int
    """Those a token uses: the total less the routed experts it is not sent to."""


def parameter_counts(config: Any) -> ParameterCounts:
    """:class:`ParameterCounts` of ``config``'s model, built on the meta device (torch's generator left as it was)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = model_from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(False))
    experts, routed = moe_parameters(config) if getattr(config, "moe", None) is not None else (0, 0)
    return ParameterCounts(total, embedding, experts, total - experts + routed)


def train_flops_per_token(*, params: int, layers: int, attention_width: int, seq_len: int) -> int:
    """``6 N + 12 L A S``: a training step's FLOPs per token (see the module docstring); ``params``: ``N``, the
    non-embedding parameters a token uses."""
    return 6 * params + 12 * layers * attention_width * seq_len


ENGINE_PRESETS = ("tp", "pp", "cp", "ep", "3d")
"""The native engine's presets with a parallel degree of their own (``--zero-stage`` applies to them)."""


def strategy_args(strategy: str) -> dict[str, Any]:
    """``ddp``, ``tp``, ``pp``, ``cp``, ``ep``, ``3d`` or a registered ZeRO preset name -> ``stage``/``engine``/offload
    args (the tensor/pipeline/context/expert degrees come from ``--tp``/``--pp``/``--cp``/``--ep``)."""
    if strategy == "ddp":
        return {"stage": 0, "engine": "ddp", "offload_optimizer": False, "offload_params": False}
    if strategy in ENGINE_PRESETS:
        return {"stage": 0, "engine": "native", "offload_optimizer": False, "offload_params": False}
    if strategy not in ZERO_PRESETS:
        raise ValueError(f"--strategy={strategy}: choose ddp, {', '.join(ENGINE_PRESETS)} or one of "
                         f"{', '.join(ZERO_PRESETS)}")
    return {"engine": "native", "offload_optimizer": False, "offload_params": False, **ZERO_PRESETS[strategy]}


def _degrees(a: argparse.Namespace) -> tuple[int, int, int, int, int]:
    """(tp, pp, cp, dp, ep) from ``--strategy``, ``--devices``, ``--tp``, ``--pp``, ``--cp``, ``--ep``."""
    tp = a.tp if a.tp is not None else (a.devices if a.strategy == "tp" else 1)
    pp = a.pp if a.pp is not None else (a.devices if a.strategy == "pp" else 1)
    cp = a.cp if a.cp is not None else (a.devices if a.strategy == "cp" else 1)
    if tp < 1 or pp < 1 or cp < 1 or a.devices % (tp * pp * cp):
        raise ValueError(f"--devices={a.devices} must be a multiple of --tp={tp} x --pp={pp} x --cp={cp}")
    if a.strategy not in ENGINE_PRESETS and (tp * pp * cp > 1 or a.ep is not None):
        raise ValueError(f"--strategy={a.strategy} is data parallel: --tp/--pp/--cp/--ep need --strategy=tp, pp, cp, "
                         "ep or 3d")
    dp = a.devices // (tp * pp * cp)
    ep = a.ep if a.ep is not None else (dp * cp if a.strategy == "ep" else 1)  # the ep preset: every replica
    return tp, pp, cp, dp, ep


def _flops_line(config: Any, counts: ParameterCounts, flops: int) -> str:
    """The parameters a token uses and the training FLOPs per token they imply."""
    used = (f"{counts.active:,} of them active per token (top-{config.moe.top_k} of {config.moe.num_experts} "
            f"experts on {len(config.moe_layers)} layers: {counts.experts:,} in routed experts); "
            if counts.experts else "")
    linear = config.linear_layers
    rule = (f" (the {config.num_layers - len(linear)} attention layers) + the {len(linear)} Gated DeltaNet layers' "
            "delta rule" if linear else "")
    return (f"{used}training FLOPs per token: {flops:.3e} = 6 x {counts.active - counts.embedding:,} non-embedding "
            f"parameters a token uses + 12 x layers x attention width x sequence{rule}")


def _gib(n: float) -> str:
    return f"{n / GIB:9.3f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning_llm estimate",
        description="Per-device memory (parameters, gradients, optimizer states, activations) for a model, batch, "
                    "sequence length, precision, device count and strategy; and the largest batch that fits.")
    parser.add_argument("--model", default="debug", help="named size (debug, small, gpt2, llama-1b, llama2-7b, "
                        "bert-base, ...) or a local HF directory")
    parser.add_argument("--family", default="decoder", choices=["decoder", "encoder"])
    parser.add_argument("--batch-size", type=int, default=1, help="per-device micro-batch")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: max positions)")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument("--devices", type=int, default=1, help="all devices; data-parallel = devices / (tp x pp) "
                        "(ZeRO shards over those)")
    parser.add_argument("--strategy", default="zero2", help="ddp, tp, pp, cp, ep, 3d, zero1, zero2, zero3, "
                        "zero2_offload, zero3_offload, deepspeed_zero1/2/3, deepspeed_zero3_offload, "
                        "deepspeed_zero3_nvme")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: all devices for "
                        "--strategy=tp, else 1)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (default: all devices for "
                        "--strategy=pp, else 1)")
    parser.add_argument("--cp", type=int, default=None, help="context-parallel degree: ranks sharing each sequence "
                        "(default: all devices for --strategy=cp, else 1)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel degree of an MoE model: ranks among the "
                        "data x context parallel ones sharing each MoE layer's experts (default: all of them for "
                        "--strategy=ep, else 1)")
    parser.add_argument("--init", choices=["random", "checkpoint"], default=None, help="whether set-up initialises "
                        "randomly or reads a checkpoint (default: checkpoint when --model is a directory)")
    parser.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage over the data-parallel devices of "
                        "--strategy=3d (0-3) or ep (0 or 3)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="device memory for the max-batch search")
    parser.add_argument("--reserve-gib", type=float, default=1.0, help="memory kept aside (CUDA context, buffers)")
    parser.add_argument("--fused-loss", choices=["on", "off"], default="on", help="the causal-LM loss path "
                        "(--model.fused_loss): on computes it from the hidden states in chunks, without logits "
                        "(tensor/pipeline layouts compute logits either way)")
    parser.add_argument("--quantize", choices=QUANTIZE_MODES, default=None, help="the frozen block linears held "
                        "quantized (--model.quantize, default settings): their stored bytes, no gradients or "
                        "optimizer states for them")
    parser.add_argument("--frozen-copies", type=int, default=0, help="frozen copies of the model held beside it and "
                        "placed like it (a full fine-tune's PPO/GRPO reference, DPO's with reference=on_the_fly: 1): "
                        "their parameters, no gradients or optimizer states")
    parser.add_argument("--optim", choices=OPTIMIZERS, default="adamw", help="the optimizer (--model.optim.name): "
                        "adamw keeps m and v per parameter; muon a momentum buffer for the hidden weight matrices "
                        "(AdamW's m and v for the rest)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = parser.parse_args(argv)
    try:
        for name in ("batch_size", "devices"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
        if a.frozen_copies < 0:
            raise ValueError(f"--frozen-copies={a.frozen_copies}: must be >= 0")
        config = load_config(a.model, a.family)
        seq = a.seq_len or config.max_position_embeddings
        if seq < 1:
            raise ValueError(f"--seq-len={seq}: must be >= 1")
        sargs = strategy_args(a.strategy)
        tp, pp, cp, dp, ep = _degrees(a)
        if a.zero_stage is not None:
            sargs["stage"] = a.zero_stage
        if a.quantize and (tp > 1 or pp > 1 or ep > 1):
            raise ValueError(f"--quantize={a.quantize}: modelled for ddp, zero1/2 and zero3 only (tensor parallelism "
                             "refuses quantized weights; a pipeline stage's or an expert-parallel rank's share of "
                             "them is not modelled)")
        counts = parameter_counts(config)
        numel = counts.total
        fused = a.fused_loss == "on"  # tp: the vocab-parallel fused loss on V/tp shards; pp: on the last stage
        est, share = estimate_layout(config, tp=tp, pp=pp, dp=dp, batch_size=a.batch_size, seq_len=seq,
                                     precision=a.precision, fused_loss=fused, cp=cp, ep=ep,
                                     quantized=Quantized(a.quantize, QuantizationConfig()) if a.quantize else None,
                                     frozen_copies=a.frozen_copies, optimizer=a.optim, **sargs)
        loss_paths = {k: loss_bytes(config, tokens=a.batch_size * seq // cp, precision=a.precision, fused=k == "fused",
                                     tp=tp) for k in ("fused", "eager")}
        setup = setup_peak_bytes(share, param_bytes=bytes_per_param(sargs["engine"], a.precision)[0],
                                 from_checkpoint=(a.init or ("checkpoint" if Path(a.model).expanduser().is_dir()
                                                           else "random")) == "checkpoint")
        if a.quantize:  # loaded whole (quantized) on every rank, block by block
            setup = quantized_setup_peak_bytes(config, numel=numel, quantized=Quantized(a.quantize,
                                               QuantizationConfig()), param_bytes=bytes_per_param(
                                               sargs["engine"], a.precision)[0])
        setup += est.frozen  # a frozen copy is materialized beside the model, in the same shards
        towers = _towers(a.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning_llm estimate: error: {e}", file=sys.stderr)
        return 2
    fit = max_batch_size(est, memory_bytes=a.gpu_memory_gib * GIB, reserve_bytes=a.reserve_gib * GIB,
                         loss=lambda batch: loss_bytes(config, tokens=batch * seq // cp, precision=a.precision,
                                                        fused=fused, tp=tp))
    linear = len(config.linear_layers)  # Gated DeltaNet layers: their delta rule instead of the attention's scores
    flops = train_flops_per_token(params=counts.active - counts.embedding, layers=config.num_layers - linear,
                                  attention_width=attention_width(config), seq_len=seq)
    flops += linear * deltanet_flops_per_token(config) if linear else 0
    report = {
        "model": a.model, "parameters": numel, "active_parameters": counts.active,
        "expert_parameters": counts.experts, "embedding_parameters": counts.embedding, "train_flops_per_token": flops,
        "quantize": a.quantize, "optimizer": a.optim, "strategy": a.strategy, "stage": sargs["stage"],
        "engine": sargs["engine"], "precision": a.precision, "devices": a.devices, "tp": tp, "pp": pp, "cp": cp, "dp": dp,
        "ep": ep, "batch_size": a.batch_size, "setup_peak_bytes": setup,
        "seq_len": seq, "frozen_copies": a.frozen_copies,
        "bytes": {"params": est.params, "grads": est.grads, "optim": est.optim, "frozen": est.frozen,
                                  "activations": est.activations, "loss": est.loss,
                                  "model_states": est.model_states,
                                  "total": est.total, "host_offloaded": est.host, "disk": est.disk},
        "activations_per_sample": est.activations_per_sample, "gpu_memory_gib": a.gpu_memory_gib,
        "fused_loss": fused, "loss_bytes": loss_paths,
        "max_batch_size": fit, "not_loaded_bytes": None if towers is None else towers[1],
    }
    if a.json:
        print(json.dumps(report))
        return 0
    experts = f" (experts over ep {ep} of them)" if ep > 1 else ""
    print(f"{a.model}: {numel:,} parameters | {a.strategy} (stage {sargs['stage']}, {sargs['engine']}) | "
          f"{a.precision} | {a.optim} | {a.devices} device(s): tp {tp} x pp {pp} x cp {cp} x dp {dp}{experts} | batch "
          f"{a.batch_size} x {seq} tokens")
    print(_flops_line(config, counts, flops))
    print(f"set-up peak (sharded construction, before the first step): {_gib(setup).strip()}")
    print("per-device memory:")
    frozen = [("frozen copies", est.frozen)] if a.frozen_copies else []
    for label, v in (("parameters", est.params), ("gradients", est.grads), ("optimizer states", est.optim), *frozen,
                     ("activations", est.activations), ("loss + backward", est.loss), ("total", est.total)):
        print(f"  {label:18s}{_gib(v)}  ({v:,} B)")
    if est.disk:
        print(f"  {'host (swap buffers)':18s}{_gib(est.host)}  ({est.host:,} B)")
        print(f"  {'disk (nvme_path)':18s}{_gib(est.disk)}  ({est.disk:,} B)")
    elif est.host:
        print(f"  {'host (offloaded)':18s}{_gib(est.host)}")
    print(f"  loss path: {'fused LM-head loss' if fused else 'full logits'} (fused {_gib(loss_paths['fused']).strip()}"
          f", full logits {_gib(loss_paths['eager']).strip()})")
    verdict = "fits" if est.total + a.reserve_gib * GIB <= a.gpu_memory_gib * GIB else "does NOT fit"
    print(f"largest batch in {a.gpu_memory_gib:g} GiB (reserve {a.reserve_gib:g} GiB): {fit}  "
          f"(batch {a.batch_size} {verdict}; {_gib(est.activations_per_sample).strip()} activations per sample)")
    if fit == 0 and math.isfinite(a.gpu_memory_gib):
        print("  model states alone exceed the memory: use a higher ZeRO stage, more devices or offload")
    if towers is not None:
        print(f"not loaded: {towers[0]} tensors outside the language model ({_gib(towers[1]).strip()} on disk: the "
              "vision tower and projector), copied from the checkpoint at export")
    return 0


def _towers(model: str) -> tuple[int, int] | None:
    """``(tensors, bytes)`` a multimodal checkpoint holds outside its language model (never loaded: not counted
    above), read from the files' headers; None for any other model."""
    directory = Path(model).expanduser()
    if not (directory / "config.json").is_file():
        return None
    arch = architecture_name(read_json(directory / "config.json"), where=str(directory / "config.json"))
    if SUPPORTED_ARCHITECTURES[arch].nested is None:
        return None
    files = CheckpointFiles(directory)
    keys = outside_keys(files.keys(), str(directory))
    return len(keys), sum(files.meta(k).numel() * files.meta(k).element_size() for k in keys)


if __name__ == "__main__":
    sys.exit(main())
