"""The memory model of a training layout: per-device bytes of a model under DDP / ZeRO stages and tp x pp x dp
layouts, the largest batch that fits a given accelerator memory, and a rank's peak while the model is set up. What
``lightning_llm estimate`` prints (:mod:`lightning_llm.tools.estimate`) and the run summary logs at the start of fit
(:mod:`lightning_llm.run_summary`).

Model states per device (Ψ = parameter count, N = data-parallel devices), bytes per parameter by engine/precision:

================  ======  =====  ===============================================================
engine/precision  params  grads  optimizer (Adam)
================  ======  =====  ===============================================================
native, fp32/AMP  4       4      8  (m, v; the fp32 parameters are the master weights)
native, *-true16  2       2      4  (m, v in the parameter dtype)
deepspeed, fp32   4       4      12 (fp32 partition copy the optimizer updates + m + v)
deepspeed, AMP    2       2      12 (fp32 master 4 + m 4 + v 4; + a transient fp32 gradient partition in step)
================  ======  =====  ===============================================================

The optimizer column is AdamW's (``--model.optim.name=adamw``). With Muon (``muon``) the hidden weight matrices
(:mod:`lightning_llm.optim.roles`: the projections of a family's blocks, each expert's matrices) keep one momentum
buffer in the parameter's dtype instead of AdamW's two (native: 4 bytes in fp32/AMP, 2 in ``*-true16``), the rest
AdamW's (:func:`optimizer_bytes_per_param`, from ``optim.STATE_TENSORS``); a layout's share of those matrices is
counted as its share of the parameters (:func:`layout_share`). Under DeepSpeed the client optimizer's states are fp32
(4 bytes a tensor) beside DeepSpeed's fp32 master partition.

Stage 1 divides the optimizer column by N, stage 2 also gradients, stage 3 also parameters (DeepSpeed's stage 1
already partitions gradients like its stage 2). E.g. native fp32:
stage 1 = 4Ψ + 4Ψ + 8Ψ/N, stage 2 = 4Ψ + 12Ψ/N, stage 3 = 16Ψ/N; the ZeRO paper's mixed form is 2Ψ + 2Ψ + 12Ψ/N).
Offloaded states are counted in host memory, not on the device (with ``offload_device="nvme"`` on disk, and DeepSpeed's
swap buffers in host memory). Activations are counted per transformer layer from
the tensors autograd saves (flash/memory-efficient attention: no S x S term), plus embeddings and the LM head/loss
(:mod:`.activations`).

What one rank holds under a tp x pp x dp layout (:func:`layout_share`): the local element count of every parameter is
derived from the family's own declarations, as the engine applies them: the pipeline split
(:func:`~lightning_llm.strategies.pipeline.split.split_layers`: the first stage keeps the embeddings, the last the
final norm and head, a tied head is a copy there), the tensor-parallel plan (column-parallel: dim 0 sharded,
row-parallel linears: dim 1, vocab-parallel embedding: dim 0, everything else replicated) and FSDP2's dim-0 shards
under ZeRO-3 (``ceil`` chunks, as ``torch.chunk``).

Mixture-of-Experts models (:mod:`lightning_llm.models.layers.moe`): the routed experts (``ParallelSpec.expert_modules``,
``[E, ...]`` tensors) are whole on every tensor-parallel rank, ``E / ep`` of them on each expert-parallel rank, and
under ZeRO-3 sharded on dim 0 over the ``dp x cp / ep`` ranks holding the same experts (everything else over all
``dp x cp``); their activations: :mod:`.activations`.

Set-up peak of a rank (sharded construction, :mod:`lightning_llm.models.init`): its parameters are allocated at
once but become resident as they are filled, in order; the peak is the parameters plus the init generator's
scratch, or, when loading a checkpoint, the most of (parameters filled so far + the slice being copied in from the
file), plus a fixed base (process group, Lightning, data: measured on CPU with the debug model). Measured against
``benchmarks/memory.py`` (``benchmarks/results/memory-cpu.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_llm.models import model_from_config, parallel_spec_of
from lightning_llm.models.init import FILL_SCRATCH_BYTES
from lightning_llm.models.quantize import QuantizationConfig, QuantizeMode, bytes_per_weight, quantized_linears
from lightning_llm.models.tp_plans import HeadSharded
from lightning_llm.optim import STATE_TENSORS, split_parameters
from lightning_llm.strategies.pipeline.split import split_layers
from lightning_llm.strategies.zero.native import module_path_matches
from lightning_llm.strategies.zero.nvme import swap_buffer_bytes
from lightning_llm.memory.activations import (
    FUSED_CHUNK_FP32_COPIES,
    activation_bytes_per_sample,
    attention_elements_per_token,
    attention_width,
    deltanet_bytes,
    deltanet_flops_per_token,
    loss_bytes,
    loss_peak_bytes,
    moe_layer_bytes_per_token,
)

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZERS = ("adamw", "muon")
"""``--model.optim.name``'s choices."""

__all__ = ["Estimate", "FUSED_CHUNK_FP32_COPIES", "LayoutShare", "OPTIMIZERS", "PRECISIONS", "Quantized", "activation_bytes_per_sample",
           "attention_elements_per_token", "attention_width", "bytes_per_param", "check_expert_parallel",
           "deltanet_bytes", "deltanet_flops_per_token", "estimate", "estimate_layout", "frozen_copy_bytes",
           "layout_share", "loss_bytes", "loss_peak_bytes", "max_batch_size", "model_state_theory",
           "moe_layer_bytes_per_token", "optimizer_bytes_per_param", "quantized_numel", "quantized_setup_peak_bytes", "setup_peak_bytes"]


def bytes_per_param(engine: str, precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes per parameter before sharding."""
    half_true = precision in ("bf16-true", "16-true")
    mixed = precision in ("bf16-mixed", "16-mixed")
    if engine == "native" or engine == "ddp":
        return (2, 2, 4) if half_true else (4, 4, 8)
    if engine == "deepspeed":
        return (2, 2, 12) if (mixed or half_true) else (4, 4, 12)
    raise ValueError(f"engine={engine!r}: must be 'native', 'deepspeed' or 'ddp'")


def optimizer_bytes_per_param(optimizer: str, engine: str, precision: str) -> tuple[int, int]:
    """Optimizer-state bytes per parameter before sharding, ``(on AdamW, a hidden weight matrix's)``: the same under
    ``adamw``; under ``muon`` a matrix keeps Muon's state tensors where AdamW keeps its own, in the same dtype."""
    adam = bytes_per_param(engine, precision)[2]
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    if optimizer == "adamw":
        return adam, adam
    if engine == "deepspeed":  # the client optimizer's states are fp32 beside DeepSpeed's fp32 master partition
        per_tensor = 4
        master = adam - per_tensor * len(STATE_TENSORS["adamw"])
        return adam, master + per_tensor * len(STATE_TENSORS["muon"])
    per_tensor = adam // len(STATE_TENSORS["adamw"])  # m and v, each in the parameter's dtype
    return adam, per_tensor * len(STATE_TENSORS["muon"])


def model_state_theory(*, numel: int, stage: int, dp: int, precision: str = "32-true", engine: str = "native",
                       offload_optimizer: bool = False, offload_params: bool = False, optimizer: str = "adamw",
                       matrices: int = 0) -> dict[str, int]:
    """Device bytes of ``params``, ``grads`` and ``optim`` per rank for ZeRO ``stage`` (0 = plain DDP) over ``dp``
    ranks; ``matrices`` of the ``numel`` parameters are hidden weight matrices, which ``optimizer`` may keep other
    states for (:func:`optimizer_bytes_per_param`). Offloaded parts are 0 here (:func:`estimate` counts them on the host)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: must be 0 (DDP), 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp}: must be >= 1")
    p, g, _ = bytes_per_param(engine, precision)
    adam, matrix = optimizer_bytes_per_param(optimizer, engine, precision)
    o = adam * (numel - matrices) + matrix * matrices  # bytes of the whole optimizer state (before sharding)
    out = {
        "params": p * numel / (dp if stage >= 3 else 1),
        # DeepSpeed's stage 1 shares stage 2's code path: gradients are reduce-scattered into the fp32 partition and
        # the full ones released, so at the optimizer step it holds stage 2's gradient bytes (measured: 4Ψ/N).
        "grads": g * numel / (dp if stage >= 2 or (engine == "deepspeed" and stage == 1) else 1),
        "optim": o / (dp if stage >= 1 else 1),
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
    frozen: int = 0
    """Parameters of frozen models placed like the model (an RL or DPO reference copy, a distillation teacher): no
    gradients or optimizer states (:func:`frozen_copy_bytes`)."""
    disk: int = 0
    """Bytes in swap files under ``nvme_path`` (``offload_device="nvme"``: what host memory holds under CPU offload;
    the host then holds DeepSpeed's swap buffers, :func:`~lightning_llm.strategies.zero.nvme.swap_buffer_bytes`)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim + self.frozen

    @property
    def total(self) -> int:
        return self.model_states + self.activations + self.loss


def estimate(config: Any, *, numel: int, batch_size: int, seq_len: int, precision: str, devices: int, stage: int,
             engine: str, offload_optimizer: bool = False, offload_params: bool = False, fused_loss: bool = False,
             tp: int = 1, cp: int = 1, quantized: Quantized | None = None, offload_device: str = "cpu",
             largest_param: int = 0, optimizer: str = "adamw", matrices: int = 0) -> Estimate:
    """Per-device memory; ``fused_loss``: the loss path the run takes (the fused LM-head loss keeps no logits);
    ``cp``: ranks sharing each sequence (each holds ``seq_len / cp`` of its tokens). ``quantized``: the frozen block
    linears held quantized (``--model.quantize``): their bytes as stored, no gradients or optimizer states (the rest
    still counts as trained: full fine-tuning figures). ``offload_device="nvme"``: the offloaded states in swap
    files, DeepSpeed's swap buffers (sized by ``largest_param``, a rank's largest partition) in host memory.
    ``optimizer`` (``--model.optim.name``) and ``matrices``: the hidden weight matrices' parameters among ``numel``
    (:func:`model_state_theory`; quantized weights are such matrices, frozen)."""
    q = quantized_numel(config) if quantized is not None else 0
    states, full = (model_state_theory(numel=numel - q, stage=stage, dp=devices, precision=precision, engine=engine,
                                       optimizer=optimizer, matrices=max(matrices - q, 0), offload_optimizer=off_o,
                                       offload_params=off_p)
                    for off_o, off_p in ((offload_optimizer, offload_params), (False, False)))
    host = sum(full.values()) - sum(states.values())
    disk = 0
    if offload_device == "nvme":
        disk, host = host, swap_buffer_bytes(largest=largest_param, rank_numel=-(-numel // devices),
                                             param_bytes=bytes_per_param(engine, precision)[0])
    if quantized is not None:  # on the device (no layout that offloads parameters takes quantized weights)
        p_bytes = bytes_per_param(engine, precision)[0]
        per_weight = bytes_per_weight(quantized.mode, quantized.config, dtype_bytes=p_bytes,
                                      row=config.hidden_size)
        states["params"] += int(round(per_weight * q / (devices if stage >= 3 else 1)))
    _, per_sample = activation_bytes_per_sample(config, seq_len=seq_len, precision=precision, fused_loss=fused_loss,
                                                cp=cp)
    loss = loss_bytes(config, tokens=batch_size * seq_len // cp, precision=precision, fused=fused_loss, tp=tp)
    return Estimate(numel=numel, activations=per_sample * batch_size, activations_per_sample=per_sample, host=host,
                    loss=loss, disk=disk, **states)


@dataclass(frozen=True)
class Quantized:
    """``--model.quantize`` of a run, for the estimate."""

    mode: QuantizeMode
    config: QuantizationConfig


def quantized_numel(config: Any) -> int:
    """Weights of ``config``'s model that ``--model.quantize`` holds quantized (the transformer blocks' linears)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # shapes only; the generator stays as it was
        model = model_from_config(config)
    return sum(lin.weight.numel() for _, lin in quantized_linears(model))


SETUP_BASE_BYTES = 20 * 2**20
"""Set-up memory besides the model (gloo process group, Lightning, the data module): 18-22 MB measured on CPU for
the debug model at 1 and 2 ranks (``benchmarks/memory.py``)."""


@dataclass(frozen=True)
class LayoutShare:
    """The parameters one rank of the fullest pipeline stage holds: ``numel`` elements, and ``read_peak``: the most
    elements resident while they are filled from a checkpoint in order (those filled so far plus the slice being
    copied in; untouched allocations are not resident yet)."""

    numel: int
    read_peak: int
    largest: int = 0
    """The most elements of one parameter on the rank (what sizes DeepSpeed's NVMe swap buffers)."""
    matrices: int = 0
    """Of ``numel``, the elements of hidden weight matrices (Muon's role, :mod:`lightning_llm.optim.roles`), where
    asked for (:func:`layout_share`'s ``matrices``)."""


def _tp_dim(style: Any, module: nn.Module, attr: str) -> int | None:
    """The dim a tensor-parallel style shards parameter ``attr`` of ``module`` on (None: replicated)."""
    if isinstance(style, (ColwiseParallel, HeadSharded)):  # HeadSharded: per-head rows (sinks, DeltaNet's conv)
        return 0
    if isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            return 0
        return 1 if attr == "weight" else None
    return None


def _stage_prefixes(model: nn.Module, pp: int) -> list[tuple[str, ...]]:
    """Module-path prefixes each pipeline stage keeps."""
    spec = parallel_spec_of(model)[2]  # type: ignore[index]
    layers = split_layers(model, pp) if pp > 1 else [tuple(getattr(model, spec.layers).keys())]
    return [(*(f"{spec.layers}.{k}." for k in keys), *(f"{m}." for m in spec.first if s == 0),
             *(f"{m}." for m in spec.last if s == len(layers) - 1)) for s, keys in enumerate(layers)]


def layout_share(config: Any, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, zero3: bool = False,
                 matrices: bool = False) -> LayoutShare:
    """:class:`LayoutShare` of the fullest stage of ``config``'s model under the layout (see the module docstring);
    ``dp``: the replicas (``dp x cp``), of which groups of ``ep`` share each MoE layer's experts; ``matrices``: also
    count the hidden weight matrices' elements among them (Muon's role)."""
    # A model built for its shapes only: its init_seed draw must leave torch's generator as it was (the run summary
    # calls this on rank 0 alone before step 1; a resumed run's dropout then differed from the uninterrupted one's).
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = model_from_config(config)
    prefix, _, spec = parallel_spec_of(model)  # type: ignore[misc]
    experts = f"{prefix}{spec.expert_modules}" if spec.expert_modules else None
    plan = spec.tp_plan(model, sequence_parallel=False, loss_parallel=True) if tp > 1 else {}
    modules = dict(model.named_modules())
    styles = {path: style for pattern, style in plan.items() for path in modules
              if module_path_matches(path, pattern)}
    hidden = _hidden_matrices(model) if matrices else set()
    best = LayoutShare(0, 0)
    for prefixes in _stage_prefixes(model, pp):
        numel = read_peak = largest = mats = 0
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):  # the order materialize fills them in
            if id(p) in seen or not name.startswith(prefixes):
                continue
            seen.add(id(p))  # a tied head is a second use here only when the stage lacks the embedding
            mod_name, _, attr = name.rpartition(".")
            shape, shards = list(p.shape), dp  # ZeRO-3 shards dim 0 over `shards` ranks
            if experts is not None and module_path_matches(mod_name, experts):
                shape[0], shards = shape[0] // ep, dp // ep  # [E, ...]: E/ep per ep rank, whole on every tp rank
            else:
                d = _tp_dim(styles.get(mod_name), modules[mod_name], attr)
                if d is not None:
                    shape[d] = math.ceil(shape[d] / tp)
            if zero3 and shards > 1 and shape:
                shape[0] = math.ceil(shape[0] / shards)
            n = math.prod(shape)
            read_peak = max(read_peak, numel + 2 * n)  # filled so far + this one + its slice read from the file
            numel, largest, mats = numel + n, max(largest, n), mats + (n if id(p) in hidden else 0)
        if numel > best.numel:
            best = LayoutShare(numel, read_peak, largest, mats)
    return best


def _hidden_matrices(model: nn.Module) -> set[int]:
    """ids of ``model``'s hidden weight matrices: the parameters Muon takes (by role, :func:`~lightning_llm.optim.roles.
    split_parameters` on a task holding ``model``)."""
    holder = nn.Module()
    holder.model = model
    return {id(p) for p in split_parameters(holder).muon}


def setup_peak_bytes(share: LayoutShare, *, param_bytes: int, from_checkpoint: bool) -> int:
    """Peak memory of a rank while its model is set up (before the first step): see the module docstring."""
    if from_checkpoint:
        return max(share.read_peak * param_bytes, share.numel * param_bytes) + SETUP_BASE_BYTES
    return share.numel * param_bytes + FILL_SCRATCH_BYTES + SETUP_BASE_BYTES


def quantized_setup_peak_bytes(config: Any, *, numel: int, quantized: Quantized, param_bytes: int) -> int:
    """Set-up peak of a rank of a ``--model.quantize`` run: every rank loads the whole model, block by block
    (``models.quantize.load_quantized``), so it holds the plain weights, the quantized ones as stored and one
    block's linears in full precision (plus torchao's transients while quantizing one weight, about its size
    again) before ZeRO-3 shards anything."""
    q = quantized_numel(config)
    per_weight = bytes_per_weight(quantized.mode, quantized.config, dtype_bytes=param_bytes, row=config.hidden_size)
    block = q // max(int(getattr(config, "num_layers", 1)), 1)
    return int((numel - q) * param_bytes + q * per_weight + 2 * block * param_bytes) + SETUP_BASE_BYTES


def check_expert_parallel(config: Any, *, ep: int, replicas: int, stage: int, engine: str) -> None:
    """Raise ``ValueError`` naming the parameter when ``ep`` experts-parallel ranks cannot hold ``config``'s experts
    as the engine would (the same conditions the engine refuses)."""
    if ep < 1 or replicas % ep:
        raise ValueError(f"ep={ep}: must divide the {replicas} data x context parallel ranks (expert parallelism "
                         "borrows its ranks from them)")
    if ep == 1:
        return
    moe = getattr(config, "moe", None)
    if moe is None:
        raise ValueError(f"ep={ep}: the model has no Mixture-of-Experts layers")
    if moe.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {moe.num_experts} experts per layer")
    if engine != "native" or stage not in (0, 3):
        raise ValueError(f"ep={ep} with {engine} ZeRO stage {stage}: expert parallelism runs on the native engine "
                         "with ZeRO stage 0 or 3")


def frozen_copy_bytes(share: LayoutShare, *, engine: str, precision: str, copies: int = 1) -> int:
    """Bytes a rank holds of ``copies`` frozen copies of the model placed like it (``task.frozen_models()``: the
    same stages, tensor-parallel shards and ZeRO-3 shards as the model's ``share``; DeepSpeed's stage 3 partitions
    every parameter of the module it is given, frozen ones included), parameters only."""
    return copies * share.numel * bytes_per_param(engine, precision)[0]


def estimate_layout(config: Any, *, tp: int, pp: int, dp: int, stage: int, engine: str, batch_size: int,
                    seq_len: int, precision: str, fused_loss: bool, offload_optimizer: bool = False,
                    offload_params: bool = False, cp: int = 1, ep: int = 1, quantized: Quantized | None = None,
                    frozen_copies: int = 0, offload_device: str = "cpu", optimizer: str = "adamw",
                    frozen_configs: Sequence[Any] = ()) -> tuple[Estimate, LayoutShare]:
    """Per-rank memory of ``config`` under a ``tp x pp x cp x dp`` layout with ZeRO ``stage`` (``engine``: native,
    deepspeed or ddp) and ``ep`` of the ``dp x cp`` ranks sharing each MoE layer's experts: what the ``estimate``
    tool prints and the run summary logs at the start of fit. Model states follow what a rank of the fullest stage
    holds after tp/pp/ep (ZeRO then divides over the ranks holding the same parameters: dp x cp, the experts
    dp x cp / ep), plus ``frozen_copies`` frozen copies of the model placed like it (the same share: their experts
    over ``ep`` too) and frozen models of ``frozen_configs`` placed the same way (a distillation teacher: its own
    share under the layout); the optimizer's states are ``optimizer``'s (``--model.optim.name``: Muon's for the hidden weight
    matrices of the share); activations follow the ``seq_len / cp`` tokens a rank holds."""
    replicas = dp * cp
    check_expert_parallel(config, ep=ep, replicas=replicas, stage=stage, engine=engine)
    optimizer_bytes_per_param(optimizer, engine, precision)  # refused before a model is built
    share = layout_share(config, tp=tp, pp=pp, dp=replicas, ep=ep, zero3=stage == 3, matrices=optimizer != "adamw")
    # ZeRO-3 divides every column by the replicas: the share is already this rank's (experts over dp x cp / ep)
    local, matrices = (n * replicas if stage == 3 else n for n in (share.numel, share.matrices))
    est = estimate(config, numel=local, batch_size=batch_size, seq_len=seq_len, precision=precision, devices=replicas,
                   stage=stage, engine=engine, offload_optimizer=offload_optimizer, offload_params=offload_params,
                   fused_loss=fused_loss, tp=tp, cp=cp, quantized=quantized, offload_device=offload_device,
                   largest_param=share.largest, optimizer=optimizer, matrices=matrices)
    if frozen_copies or frozen_configs:
        shares = [share] * frozen_copies + [
            share if cfg == config else layout_share(cfg, tp=tp, pp=pp, dp=replicas, ep=ep, zero3=stage == 3)
            for cfg in frozen_configs]
        frozen = sum(frozen_copy_bytes(s, engine=engine, precision=precision) for s in shares)
        if offload_params and offload_device == "nvme":  # swapped like the model's shards
            est.disk += frozen
        elif offload_params:  # ZeRO-3's shards live on the host, the frozen copies' as the model's
            est.host += frozen
        else:
            est.frozen = frozen
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
