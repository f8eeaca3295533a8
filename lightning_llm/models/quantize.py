"""Frozen quantized linear weights for QLoRA-style PEFT (``--model.quantize=nf4|int8``), held by torchao's tensor
subclasses.

The weight of every ``nn.Linear`` inside a transformer block (q/k/v/o, gate/up/down, Baichuan's ``W_pack``) becomes
a frozen ``nn.Parameter`` wrapping

* ``nf4``: torchao's ``NF4Tensor`` (QLoRA's 4-bit NormalFloat: one absmax scale per ``block_size`` weights, the
  scales themselves quantized to int8 per ``scaler_block_size`` scales - double quantization);
* ``int8``: torchao's ``Int8Tensor`` (symmetric, one scale per output row: weight-only int8).

Both dequantize inside ``F.linear`` (their ``__torch_function__``) to their dtype (``compute_dtype``), so the
module, peft's LoRA layer around it and the backward to the input are unchanged; embeddings, norms and the LM head
stay in full precision (as bitsandbytes' ``load_in_4bit`` leaves ``lm_head``). Why torchao rather than
bitsandbytes, measured: ``docs/architecture.md`` (section "Quantized frozen weights").

A model is quantized at load one part at a time (:func:`load_quantized`, on a meta-device / lazily indexed model:
an embedding, then one block after the other, each filled from the checkpoint or the init plan and quantized
before the next), so the whole model never exists in full precision. :func:`dequantize_` and :func:`round_trip_`
turn the quantized weights back into plain ones (merge and export fold adapters into those values).

torchao is an optional dependency (``pip install 'lightning_llm[quant]'``), imported only when quantizing.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .init import is_meta, materialize_in_parts
from .layers.block import TransformerBlock

log = logging.getLogger(__name__)

__all__ = ["QUANTIZE_MODES", "QuantizationConfig", "QuantizeMode", "checkpoint_entry", "dequantize_", "is_quantized", "load_quantized",
           "quantize_", "quantized_bytes", "quantized_linears", "requantize_as_trained", "require_torchao",
           "round_trip_", "shard_problem"]

QuantizeMode = Literal["nf4", "int8"]
QUANTIZE_MODES = ("nf4", "int8")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class QuantizationConfig:
    """How ``--model.quantize`` stores the frozen linear weights (torchao's ``NF4Tensor`` / ``Int8Tensor``)."""

    block_size: int = 64
    """nf4: weights per quantization block, one absmax scale each (QLoRA's and bitsandbytes' 64)."""
    double_quant: bool = True
    """nf4: quantize the block scales too (int8, one fp factor per ``scaler_block_size`` scales; ~0.37 bits per
    weight less). torchao's NF4 always does, so ``false`` is refused."""
    scaler_block_size: int = 256
    """nf4: block scales per double-quantization block. A weight whose block count it does not divide (torchao needs
    whole blocks) uses the largest divisor of that count below it (logged); under zero3 every weight's count of
    these blocks must split evenly over the data-parallel ranks."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype the weights are quantized from and dequantize to (and of their scales); each matmul then runs in
    its input's dtype (bf16 under ``bf16-mixed``). ``auto``: the weight's own dtype as built (float32 for named
    sizes and HF directories without ``--model.model_overrides`` ``dtype``); ``bfloat16`` as QLoRA's recipe."""

    def __post_init__(self) -> None:
        if not self.double_quant:
            raise ValueError("--model.quantization.double_quant=false: torchao's NF4 always quantizes the block "
                             "scales (double quantization); leave it true")
        for name in ("block_size", "scaler_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--model.quantization.{name}={getattr(self, name)}: must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def dtype_for(self, weight: Tensor) -> torch.dtype:
        return weight.dtype if self.compute_dtype == "auto" else _DTYPES[self.compute_dtype]


torch.serialization.add_safe_globals([QuantizationConfig])  # in checkpoints' hyper-parameters (weights_only resume)


def require_torchao(mode: str) -> None:
    """Import torchao, or one line naming the flag and the install command (a ValueError: the CLI prints it as a
    configuration error, without a traceback)."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise ValueError(f"--model.quantize={mode} needs torchao, which is not installed: pip install "
                          "'lightning_llm[quant]' (or: pip install torchao \"torch==<your torch>\")") from None


def _quantized_types() -> tuple[type, ...]:
    if "torchao" not in sys.modules:  # nothing can be quantized before torchao is imported
        return ()
    return _torchao_types()


@functools.cache
def _torchao_types() -> tuple[type, ...]:
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    return NF4Tensor, Int8Tensor


def is_quantized(t: Tensor) -> bool:
    """Whether ``t`` is one of torchao's quantized tensors (a parameter's data included)."""
    types = _quantized_types()
    return bool(types) and isinstance(t, types)


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(path, module)`` of the linear layers :func:`quantize_` converts: every ``nn.Linear`` inside a transformer
    block (a peft-wrapped one's ``base_layer`` included), never the embeddings, the LM head or an adapter's own
    layers (peft keeps those in ``ModuleDict``s keyed by adapter name, which this walk does not enter)."""
    def walk(prefix: str, module: nn.Module) -> list[tuple[str, nn.Linear]]:
        if type(module) is nn.Linear:
            return [(prefix, module)]
        return [hit for n, child in module.named_children() if not isinstance(child, nn.ModuleDict)
                for hit in walk(f"{prefix}.{n}", child)]

    return [hit for name, block in model.named_modules() if isinstance(block, TransformerBlock)
            for hit in walk(name, block)]


def _scaler_block(n_blocks: int, wanted: int) -> int:
    """The largest divisor of ``n_blocks`` not above ``wanted`` (torchao's double quantization needs whole blocks)."""
    return max(d for d in range(1, min(wanted, n_blocks) + 1) if n_blocks % d == 0)


def quantize_weight(weight: Tensor, mode: QuantizeMode, cfg: QuantizationConfig, *, name: str = "") -> Tensor:
    """``weight`` (plain, 2-D) as torchao's quantized tensor in ``cfg``'s compute dtype."""
    w = weight.detach().to(cfg.dtype_for(weight)).contiguous()
    if mode == "int8":
        from torchao.quantization.granularity import PerRow
        from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

        return Int8Tensor.from_hp(w, granularity=PerRow())
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    if w.numel() % cfg.block_size:
        raise ValueError(f"--model.quantization.block_size={cfg.block_size} does not divide {name or 'a weight'} "
                         f"({tuple(w.shape)}, {w.numel()} values): choose a block size that divides every linear")
    n_blocks = w.numel() // cfg.block_size
    scaler = _scaler_block(n_blocks, cfg.scaler_block_size)
    if scaler != cfg.scaler_block_size:
        log.info("%s: %d NF4 blocks; double quantization per %d scales (scaler_block_size=%d does not divide them)",
                 name or "weight", n_blocks, scaler, cfg.scaler_block_size)
    return to_nf4(w, block_size=cfg.block_size, scaler_block_size=scaler)


def dequantize_weight(t: Tensor) -> Tensor:
    """The plain values a quantized tensor computes with (its own dtype); a plain tensor as it is."""
    if not is_quantized(t):
        return t
    return t.get_original_weight() if hasattr(t, "get_original_weight") else t.dequantize()


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``x @ W^T`` with a frozen quantized ``W`` that backward dequantizes again, so autograd keeps only the quantized
    weight: torchao's per-row int8 linear casts the whole int8 matrix to the input's dtype inside an ``mm`` that
    autograd records, which saved a full-precision copy of every weight until backward (a QLoRA int8 step of 4
    llama-1b blocks peaked above plain LoRA's: ``benchmarks/qlora_memory.py``). torchao's NF4 does this itself."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (weight,) = ctx.saved_tensors
        return grad @ dequantize_weight(weight).to(grad.dtype), None


def _int8_linear_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """``nn.Linear.forward`` of an int8-weight linear (installed per instance by :func:`quantize_`)."""
    y = _FrozenQuantizedLinear.apply(x, self.weight)
    return y if self.bias is None else y + self.bias


@torch.no_grad()
def quantize_(model: nn.Module, mode: QuantizeMode, cfg: QuantizationConfig) -> int:
    """Replace the weight of every :func:`quantized_linears` layer of a real (not meta) ``model`` by a frozen
    quantized parameter; returns how many. Biases stay plain (and frozen with the base)."""
    require_torchao(mode)
    count = 0
    for path, lin in quantized_linears(model):
        if is_quantized(lin.weight):
            continue
        lin.weight = nn.Parameter(quantize_weight(lin.weight, mode, cfg, name=f"{path}.weight"), requires_grad=False)
        if mode == "int8":
            lin.forward = types.MethodType(_int8_linear_forward, lin)  # type: ignore[method-assign]
        count += 1
    return count


def load_quantized(model: nn.Module, mode: QuantizeMode, cfg: QuantizationConfig) -> nn.Module:
    """``model`` (a family model, meta-device or lazily indexed) materialized on the CPU part by part, each block's
    linears quantized right after the block is filled; a model already real is quantized in place."""
    require_torchao(mode)
    if not any(is_meta(p) for p in model.parameters()):
        quantize_(model, mode, cfg)
        return model
    materialize_in_parts(model, "cpu", each=lambda _path, part: quantize_(part, mode, cfg))
    if getattr(model, "weights_source", None) is not None:
        model.weights_source = None  # every tensor is real now: nothing reads the checkpoint again
    return model


@torch.no_grad()
def dequantize_(model: nn.Module) -> int:
    """Replace every quantized parameter of ``model`` by a plain one holding its dequantized values (frozen, as it
    was); returns how many."""
    count = 0
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if is_quantized(p):
                setattr(module, name, nn.Parameter(dequantize_weight(p), requires_grad=False))
                module.__dict__.pop("forward", None)  # a plain nn.Linear again (int8's own forward)
                count += 1
    return count


def round_trip_(model: nn.Module, mode: QuantizeMode, cfg: QuantizationConfig) -> int:
    """The weights a quantized run computed with, as plain tensors: quantize then dequantize (export, merge)."""
    count = quantize_(model, mode, cfg)
    dequantize_(model)
    return count


def checkpoint_entry(mode: QuantizeMode, cfg: QuantizationConfig, model: nn.Module) -> dict[str, Any]:
    """What a checkpoint of a quantized run stores under ``checkpoint["quantization"]`` (plain data). ``auto`` is
    stored as the dtype the quantized weights of ``model`` really have: export/merge re-quantize a base they load in
    its own dtype (fp32), which must give the values the run trained against, not those of another dtype."""
    entry = {"quantize": mode, **cfg.to_dict()}
    if cfg.compute_dtype == "auto":
        weights = [lin.weight for _, lin in quantized_linears(model) if is_quantized(lin.weight)]
        if weights:
            entry["compute_dtype"] = next(k for k, v in _DTYPES.items() if v == weights[0].dtype)
    return entry


def requantize_as_trained(model: nn.Module, entry: dict[str, Any] | None, *, where: str) -> int:
    """Give a plain base model the values its quantized run computed with (``entry``: a checkpoint's
    ``"quantization"``, or None: nothing to do), so adapters fold into the weights they were trained against."""
    if not entry:
        return 0
    settings = dict(entry)
    mode = settings.pop("quantize")
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"{where}: unknown quantization {mode!r} in the checkpoint")
    cfg = QuantizationConfig(**settings)
    count = round_trip_(model, mode, cfg)
    log.info("%s: base weights of %d linears re-quantized (%s) and dequantized, as the run computed with them", where,
             count, describe(mode, cfg))
    return count


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes, elements)`` of the quantized weights of ``model`` as stored (packed data and scales, shards as
    held by this rank)."""
    nbytes = numel = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if not is_quantized(local):
            continue
        numel += local.numel()
        names = local.__tensor_flatten__()[0]
        nbytes += sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)
    return nbytes, numel


def shard_problem(model: nn.Module, parts: int) -> str | None:
    """Why FSDP2 cannot split a quantized weight of ``model`` into ``parts`` row blocks (torchao splits an NF4Tensor's
    packed data, block scales and double-quantization factors alike), or ``None``."""
    for name, p in model.named_parameters():
        if not is_quantized(p):
            continue
        if not hasattr(p, "quantization_factor"):
            return f"{name} is {type(p).__name__}, which FSDP2 cannot shard"
        inner = {"rows": p.size(0), "quantized_data": p.quantized_data.numel(),
                 "block scales": p.quantized_scalers.numel(), "double-quantization blocks": p.quantization_factor.numel()}
        odd = [f"{k} {v}" for k, v in inner.items() if v % parts]
        if odd:
            return (f"{name} {tuple(p.shape)} does not split into {parts} shards ({', '.join(odd)} not divisible by "
                    f"{parts}): lower --model.quantization.scaler_block_size")
    return None


def bytes_per_weight(mode: QuantizeMode, cfg: QuantizationConfig, *, dtype_bytes: int, row: int) -> float:
    """Bytes per quantized weight as stored (the memory estimate): nf4 = 4 bits + an int8 scale per block + a
    ``dtype_bytes`` factor per double-quantization block; int8 = 1 byte + a ``dtype_bytes`` scale per ``row``."""
    if mode == "int8":
        return 1 + dtype_bytes / row
    return 0.5 + 1 / cfg.block_size + dtype_bytes / (cfg.block_size * cfg.scaler_block_size)


def _compute(cfg: QuantizationConfig) -> str:
    return "the weights' own dtype" if cfg.compute_dtype == "auto" else cfg.compute_dtype


def describe(mode: QuantizeMode, cfg: QuantizationConfig) -> str:
    """One line for logs and the run summary."""
    if mode == "int8":
        return f"int8 weight-only (per row, dequantized to {_compute(cfg)})"
    return (f"nf4 (block {cfg.block_size}, double quantization per {cfg.scaler_block_size} scales, dequantized "
            f"to {_compute(cfg)})")
