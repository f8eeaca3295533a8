"""``lightning_llm estimate``: per-device training memory of a model under DDP / ZeRO stages, and the largest batch
that fits a given accelerator memory.

Model states per device (Ψ = parameter count, N = data-parallel devices), bytes per parameter by engine/precision:

================  ======  =====  ===============================================================
engine/precision  params  grads  optimizer (Adam)
================  ======  =====  ===============================================================
native, fp32/AMP  4       4      8  (m, v; the fp32 parameters are the master weights)
native, *-true16  2       2      4  (m, v in the parameter dtype)
deepspeed, fp32   4       4      12 (fp32 partition copy the optimizer updates + m + v)
deepspeed, AMP    2       2      12 (fp32 master 4 + m 4 + v 4; + a transient fp32 gradient partition in step)
================  ======  =====  ===============================================================

Stage 1 divides the optimizer column by N, stage 2 also gradients, stage 3 also parameters (DeepSpeed's stage 1
already partitions gradients like its stage 2). E.g. native fp32:
stage 1 = 4Ψ + 4Ψ + 8Ψ/N, stage 2 = 4Ψ + 12Ψ/N, stage 3 = 16Ψ/N; the ZeRO paper's mixed form is 2Ψ + 2Ψ + 12Ψ/N).
Offloaded states are counted in host memory, not on the device. Activations are counted per transformer layer from
the tensors autograd saves (flash/memory-efficient attention: no S x S term), plus embeddings and the LM head/loss.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lightning_llm.data.io import read_json
from lightning_llm.estimate_layout import LayoutShare, layout_share, setup_peak_bytes

log = logging.getLogger(__name__)

GIB = 1024**3
FUSED_CHUNK_FP32_COPIES = 2
"""fp32 ``[chunk, V]`` buffers alive at once in the fused loss's torch path: the chunk's logits (overwritten by their
gradient) and their shifted exponentials (``benchmarks/loss_memory.py``)."""
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _bytes_per_param(engine: str, precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter before sharding."""
    half_true = precision in ("bf16-true", "16-true")
    mixed = precision in ("bf16-mixed", "16-mixed")
    if engine == "native" or engine == "ddp":
        return (2, 2, 4) if half_true else (4, 4, 8)
    if engine == "deepspeed":
        return (2, 2, 12) if (mixed or half_true) else (4, 4, 12)
    raise ValueError(f"engine={engine!r}: must be 'native', 'deepspeed' or 'ddp'")


def model_state_theory(*, numel: int, stage: int, dp: int, precision: str = "32-true", engine: str = "native",
                       offload_optimizer: bool = False, offload_params: bool = False) -> dict[str, int]:
    """Device bytes of ``params``, ``grads`` and ``optim`` per rank for ZeRO ``stage`` (0 = plain DDP) over ``dp``
    ranks. Offloaded parts are 0 here (see :func:`host_state_theory`)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: must be 0 (DDP), 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1")
    p, g, o = _bytes_per_param(engine, precision)
    out = {
        "params": p * numel / (dp if stage >= 3 else 1),
        # DeepSpeed's stage 1 shares stage 2's code path: gradients are reduce-scattered into the fp32 partition and
        # the full ones released, so at the optimizer step it holds stage 2's gradient bytes (measured: 4Ψ/N).
        "grads": g * numel / (dp if stage >= 2 or (engine == "deepspeed" and stage == 1) else 1),
        "optim": o * numel / (dp if stage >= 1 else 1),
    }
    if offload_optimizer:
        out["optim"] = 0
    if offload_params:
        out["params"] = out["grads"] = 0
    return {k: int(round(v)) for k, v in out.items()}


@dataclass
class Estimate:
    numel: int
    params: int
    grads: int
    optim: int
    activations: int
    activations_per_sample: int
    host: int
    loss: int = 0
    """Transient bytes of the LM-head loss and its backward for one micro-batch (:func:`loss_peak_bytes`)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.loss


def _act_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def activation_bytes_per_sample(config: Any, *, seq_len: int, precision: str, fused_loss: bool = False
                                ) -> tuple[int, int]:
    """(per transformer layer, whole model) activation bytes autograd keeps for one sample of ``seq_len`` tokens;
    with ``fused_loss`` no logits are kept (:func:`loss_peak_bytes` counts what the loss needs instead)."""
    b = _act_bytes(precision)
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim
    # Per token and layer: norm input + output (2H), q/k/v (q + 2kv), rotated q/k (q + kv), attention output (q),
    # MLP norm input + output (2H), MLP: gate/up (+ activation and product for gated MLPs) or up + activation.
    mlp = 4 * i if config.gated else 2 * i
    per_token_layer = b * (4 * h + 3 * q + 3 * kv + mlp)
    if config.dropout > 0:
        per_token_layer += 3 * h  # 1-byte dropout masks on attention/residual paths (probabilities not counted)
    per_layer = per_token_layer * seq_len
    vocab = config.vocab_size
    # Embedding output, final norm (2H), logits in the compute dtype + their fp32 copy for the loss.
    head = seq_len * (b * 3 * h + (0 if fused_loss else (b + 4) * vocab))
    return per_layer, per_layer * config.num_layers + head


def loss_peak_bytes(*, tokens: int, vocab: int, hidden: int, precision: str, fused: bool, tp: int = 1) -> int:
    """Peak transient memory of the LM-head loss and its backward for ``tokens`` tokens, above the hidden states, the
    head's weight and its gradient buffer (as ``benchmarks/loss_memory.py`` measures it).

    Full logits: the peak is in the backward of the log-softmax, where its fp32 output (saved), the NLL gradient and
    the log-softmax gradient ``[N, V/tp]`` coexist (bf16 logits add their own copy and the gradient cast back); the
    weight's and hidden states' gradients come after those are freed. Fused: ``dW [V, H]`` fp32 and ``dhidden
    [N, H]`` are allocated in the forward and live until the backward, beside one token chunk's logits (which
    become its gradient in place) and their shifted exponentials (:func:`~lightning_llm.kernels.cross_entropy.
    default_chunk_size` tokens)."""
    from lightning_llm.kernels.cross_entropy import default_chunk_size

    b = _act_bytes(precision)
    v = -(-vocab // tp)
    if fused:
        chunk = default_chunk_size(tokens, v, hidden)
        return 4 * v * hidden + b * tokens * hidden + FUSED_CHUNK_FP32_COPIES * 4 * chunk * v
    return (3 * 4 + (2 * b if b != 4 else 0)) * tokens * v


def estimate(config: Any, *, numel: int, batch_size: int, seq_len: int, precision: str, devices: int, stage: int,
             engine: str, offload_optimizer: bool = False, offload_params: bool = False, fused_loss: bool = False,
             tp: int = 1) -> Estimate:
    """Per-device memory; ``fused_loss``: the loss path the run takes (the fused LM-head loss keeps no logits)."""
    states = model_state_theory(numel=numel, stage=stage, dp=devices, precision=precision, engine=engine,
                                offload_optimizer=offload_optimizer, offload_params=offload_params)
    full = model_state_theory(numel=numel, stage=stage, dp=devices, precision=precision, engine=engine)
    host = sum(full.values()) - sum(states.values())
    _, per_sample = activation_bytes_per_sample(config, seq_len=seq_len, precision=precision, fused_loss=fused_loss)
    loss = _loss_bytes(config, tokens=batch_size * seq_len, precision=precision, fused=fused_loss, tp=tp)
    return Estimate(numel=numel, activations=per_sample * batch_size, activations_per_sample=per_sample, host=host,
                    loss=loss, **states)


def _loss_bytes(config: Any, *, tokens: int, precision: str, fused: bool, tp: int) -> int:
    if getattr(config, "family", "decoder") != "decoder":
        return 0  # classification heads: [B, num_labels] logits
    return loss_peak_bytes(tokens=tokens, vocab=config.vocab_size, hidden=config.hidden_size, precision=precision,
                           fused=fused, tp=tp)


def estimate_layout(config: Any, *, tp: int, pp: int, dp: int, stage: int, engine: str, batch_size: int,
                    seq_len: int, precision: str, fused_loss: bool, offload_optimizer: bool = False,
                    offload_params: bool = False) -> tuple[Estimate, LayoutShare]:
    """Per-rank memory of ``config`` under a ``tp x pp x dp`` layout with ZeRO ``stage`` (``engine``: native,
    deepspeed or ddp): what the ``estimate`` tool prints and the run summary logs at the start of fit. Model states
    follow what a rank of the fullest stage holds after tp/pp (ZeRO then divides over dp)."""
    share = layout_share(config, tp=tp, pp=pp, dp=dp, zero3=stage == 3)
    local = share.numel * dp if stage == 3 else share.numel
    est = estimate(config, numel=local, batch_size=batch_size, seq_len=seq_len, precision=precision, devices=dp,
                   stage=stage, engine=engine, offload_optimizer=offload_optimizer, offload_params=offload_params,
                   fused_loss=fused_loss, tp=tp)
    return est, share


def max_batch_size(est: Estimate, *, memory_bytes: float, reserve_bytes: float,
                   loss: Callable[[int], int] = lambda batch: 0) -> int:
    """Largest per-device batch whose model states + activations + the loss's transient (``loss(batch)``, bytes)
    fit ``memory_bytes - reserve_bytes`` (0: none)."""
    free = memory_bytes - reserve_bytes - est.model_states
    if not est.activations_per_sample:
        return 0
    lo, hi = 0, max(0, int(free // est.activations_per_sample))  # the loss only adds: hi is an upper bound
    while lo < hi:  # largest batch that fits (the need grows with the batch)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid * est.activations_per_sample + loss(mid) <= free else (lo, mid - 1)
    return lo


def load_config(model: str, family: str) -> Any:
    """ModelConfig of a named size or of a local HF directory's ``config.json``."""
    from lightning_llm.models import NAMED_SIZES, config_from_hf, named_config

    if (family, model) in NAMED_SIZES:
        return named_config(model, family=family)
    p = Path(model).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"--model={model}: no config.json in that directory")
        return config_from_hf(read_json(cfg))
    known = sorted(n for f, n in NAMED_SIZES if f == family)
    raise ValueError(f"--model={model}: neither a named {family} size ({', '.join(known)}) nor a local HF directory")


def count_parameters(config: Any) -> int:
    """Exact parameter count (tied weights once), from a model built on the meta device."""
    import torch

    from lightning_llm.models import model_from_config

    with torch.device("meta"):
        model = model_from_config(config)
    return sum(p.numel() for p in model.parameters())


def strategy_args(strategy: str) -> dict[str, Any]:
    """``ddp``, ``tp``, ``pp``, ``3d`` or a registered ZeRO preset name -> ``stage``/``engine``/offload args (the
    tensor/pipeline degrees come from ``--tp``/``--pp``)."""
    from lightning_llm.strategies.presets import ZERO_PRESETS as PRESETS

    if strategy == "ddp":
        return {"stage": 0, "engine": "ddp", "offload_optimizer": False, "offload_params": False}
    if strategy in ("tp", "pp", "3d"):
        return {"stage": 0, "engine": "native", "offload_optimizer": False, "offload_params": False}
    if strategy not in PRESETS:
        raise ValueError(f"--strategy={strategy}: choose ddp, tp, pp, 3d or one of {', '.join(PRESETS)}")
    args = {"engine": "native", "offload_optimizer": False, "offload_params": False, **PRESETS[strategy]}
    return args


def _degrees(a: argparse.Namespace) -> tuple[int, int, int]:
    """(tp, pp, dp) from ``--strategy``, ``--devices``, ``--tp``, ``--pp``."""
    tp = a.tp if a.tp is not None else (a.devices if a.strategy == "tp" else 1)
    pp = a.pp if a.pp is not None else (a.devices if a.strategy == "pp" else 1)
    if tp < 1 or pp < 1 or a.devices % (tp * pp):
        raise ValueError(f"--devices={a.devices} must be a multiple of --tp={tp} x --pp={pp}")
    if a.strategy not in ("tp", "pp", "3d") and tp * pp > 1:
        raise ValueError(f"--strategy={a.strategy} is data parallel: --tp/--pp need --strategy=tp, pp or 3d")
    return tp, pp, a.devices // (tp * pp)


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
    parser.add_argument("--strategy", default="zero2", help="ddp, tp, pp, 3d, zero1, zero2, zero3, zero2_offload, "
                        "zero3_offload, deepspeed_zero1/2/3, deepspeed_zero3_offload")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: all devices for "
                        "--strategy=tp, else 1)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline-parallel degree (default: all devices for "
                        "--strategy=pp, else 1)")
    parser.add_argument("--init", choices=["random", "checkpoint"], default=None, help="whether set-up initialises "
                        "randomly or reads a checkpoint (default: checkpoint when --model is a directory)")
    parser.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage over the data-parallel devices of "
                        "--strategy=3d (0-3)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="device memory for the max-batch search")
    parser.add_argument("--reserve-gib", type=float, default=1.0, help="memory kept aside (CUDA context, buffers)")
    parser.add_argument("--fused-loss", choices=["on", "off"], default="on", help="the causal-LM loss path "
                        "(--model.fused_loss): on computes it from the hidden states in chunks, without logits "
                        "(tensor/pipeline layouts compute logits either way)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = parser.parse_args(argv)
    try:
        for name in ("batch_size", "devices"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)}: must be >= 1")
        config = load_config(a.model, a.family)
        seq = a.seq_len or config.max_position_embeddings
        if seq < 1:
            raise ValueError(f"--seq-len={seq}: must be >= 1")
        sargs = strategy_args(a.strategy)
        tp, pp, dp = _degrees(a)
        if a.zero_stage is not None:
            sargs["stage"] = a.zero_stage
        numel = count_parameters(config)
        fused = a.fused_loss == "on"  # tp: the vocab-parallel fused loss on V/tp shards; pp: on the last stage
        est, share = estimate_layout(config, tp=tp, pp=pp, dp=dp, batch_size=a.batch_size, seq_len=seq,
                                     precision=a.precision, fused_loss=fused, **sargs)
        loss_paths = {k: _loss_bytes(config, tokens=a.batch_size * seq, precision=a.precision, fused=k == "fused",
                                     tp=tp) for k in ("fused", "eager")}
        setup = setup_peak_bytes(share, param_bytes=_bytes_per_param(sargs["engine"], a.precision)[0],
                                 from_checkpoint=(a.init or ("checkpoint" if Path(a.model).expanduser().is_dir()
                                                           else "random")) == "checkpoint")
    except (ValueError, FileNotFoundError) as e:
        print(f"lightning_llm estimate: error: {e}", file=sys.stderr)
        return 2
    fit = max_batch_size(est, memory_bytes=a.gpu_memory_gib * GIB, reserve_bytes=a.reserve_gib * GIB,
                         loss=lambda batch: _loss_bytes(config, tokens=batch * seq, precision=a.precision,
                                                        fused=fused, tp=tp))
    report = {
        "model": a.model, "parameters": numel, "strategy": a.strategy, "stage": sargs["stage"],
        "engine": sargs["engine"], "precision": a.precision, "devices": a.devices, "tp": tp, "pp": pp, "dp": dp,
        "batch_size": a.batch_size, "setup_peak_bytes": setup,
        "seq_len": seq, "bytes": {"params": est.params, "grads": est.grads, "optim": est.optim,
                                  "activations": est.activations, "loss": est.loss,
                                  "model_states": est.model_states,
                                  "total": est.total, "host_offloaded": est.host},
        "activations_per_sample": est.activations_per_sample, "gpu_memory_gib": a.gpu_memory_gib,
        "fused_loss": fused, "loss_bytes": loss_paths,
        "max_batch_size": fit,
    }
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"{a.model}: {numel:,} parameters | {a.strategy} (stage {sargs['stage']}, {sargs['engine']}) | "
          f"{a.precision} | {a.devices} device(s): tp {tp} x pp {pp} x dp {dp} | batch {a.batch_size} x {seq} tokens")
    print(f"set-up peak (sharded construction, before the first step): {_gib(setup).strip()}")
    print("per-device memory:")
    for label, v in (("parameters", est.params), ("gradients", est.grads), ("optimizer states", est.optim),
                     ("activations", est.activations), ("loss + backward", est.loss), ("total", est.total)):
        print(f"  {label:18s}{_gib(v)}  ({v:,} B)")
    if est.host:
        print(f"  {'host (offloaded)':18s}{_gib(est.host)}")
    print(f"  loss path: {'fused LM-head loss' if fused else 'full logits'} (fused {_gib(loss_paths['fused']).strip()}"
          f", full logits {_gib(loss_paths['eager']).strip()})")
    verdict = "fits" if est.total + a.reserve_gib * GIB <= a.gpu_memory_gib * GIB else "does NOT fit"
    print(f"largest batch in {a.gpu_memory_gib:g} GiB (reserve {a.reserve_gib:g} GiB): {fit}  "
          f"(batch {a.batch_size} {verdict}; {_gib(est.activations_per_sample).strip()} activations per sample)")
    if fit == 0 and math.isfinite(a.gpu_memory_gib):
        print("  model states alone exceed the memory: use a higher ZeRO stage, more devices or offload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
