"""Tensor-parallel plans as data: module path -> DTensor ``ParallelStyle``, one plan per model family.

Megatron's layout (Shoeybi et al. 2019), expressed with DTensor styles:

* attention q/k/v and MLP gate/up are column-parallel (output features sharded), attention o and MLP down are
  row-parallel (input features sharded). The block input is turned into one replicated DTensor per block half
  (``PrepareModuleInput`` on ``self_attn``/``mlp``), so each half does exactly one collective forward (Megatron's
  *g*: all-reduce after the row-parallel linear) and one backward (Megatron's *f*: all-reduce of the input grad),
  however many column-parallel projections read that input.
* the token embedding is vocab-parallel (``RowwiseParallel`` on ``nn.Embedding``: rows sharded, output all-reduced);
  the LM head is column-parallel over the vocabulary and, with ``loss_parallel``, keeps its logits sharded
  ``[B, S, V/tp]`` so the loss never materialises the full vocabulary.
* sequence parallel (Korthikanti et al. 2022): the residual stream between blocks is a DTensor sharded on the
  sequence dim; norms and dropout run on ``[B, S/tp, H]`` shards, each block half all-gathers its input and
  reduce-scatters its output (same bytes as one all-reduce, 1/tp of the activation memory).
* everything else (position/token-type embeddings, encoder pooler and classifier, norms without SP) is replicated.

Plans are keyed by module path relative to the module handed to ``parallelize_module`` (wildcards allowed, as in
``parallelize_module``). :func:`adapt_plan_for_lora` rewrites entries whose target was wrapped by PEFT LoRA so the
adapters are sharded consistently with their base layer.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_llm.models.config import ModelConfig

log = logging.getLogger(__name__)

__all__ = [
    "ReplicateParallel",
    "TPPlan",
    "adapt_plan_for_lora",
    "decoder_tp_plan",
    "encoder_tp_plan",
    "find_backbone",
    "tp_plan",
    "validate_tp",
]

TPPlan = dict[str, ParallelStyle]
"""Module path (``parallelize_module`` syntax, ``*`` wildcards per path atom) -> parallel style."""


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors and feed it DTensor inputs (local tensors become ``Replicate``).

    Used for LoRA adapters that sit next to a sharded base layer: the rank-``r`` factor that is not sharded must
    still be a DTensor so it composes with the sharded factor (its gradient arrives ``Partial`` and is reduced
    once per optimizer step by the strategy).
    """

    def __init__(self, *, input_layout: Placement | None = None, use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.use_local_output = use_local_output

    def _partition_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                dp = nn.Parameter(DTensor.from_local(p.data, mesh, [Replicate()], run_check=False),
                                  requires_grad=p.requires_grad)
                module.register_parameter(p_name, dp)

    def _input_fn(self, mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
            for x in inputs
        )

    def _output_fn(self, mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        return outputs.to_local() if self.use_local_output and isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_fn, self._input_fn, self._output_fn)

    def __repr__(self) -> str:
        return f"ReplicateParallel(input_layout={self.input_layout}, use_local_output={self.use_local_output})"


# ------------------------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------------------------


def validate_tp(config: ModelConfig, tp_size: int) -> None:
    """Raise ``ValueError`` naming the first model dimension that ``tensor_parallel_size`` does not divide."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size}: must be >= 1")
    if tp_size == 1:
        return
    dims = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    for name, value in dims.items():
        if value is not None and value % tp_size:
            hint = " (pad the vocabulary, e.g. to a multiple of 8)" if name == "vocab_size" else ""
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {name}={value}{hint}")


# ------------------------------------------------------------------------------------------------------------------
# Plans per family
# ------------------------------------------------------------------------------------------------------------------


def _block_plan(prefix: str, *, sequence_parallel: bool, gated: bool) -> TPPlan:
    """Styles of every ``TransformerBlock`` under ``prefix`` (``layers.*``); same for both families.

    Shapes (local, per rank): q/k/v out [B, S, N/tp*D], o in [B, S, N/tp*D]; gate/up out [B, S, I/tp].
    """
    resid: Placement = Shard(1) if sequence_parallel else Replicate()
    # One conversion per block half: SP all-gathers [B, S/tp, H] -> [B, S, H] here; without SP it is free forward
    # and the single all-reduce of the input grad backward.
    half_input = PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),),
                                    use_local_output=False)
    # Row-parallel output: all-reduce (no SP) or reduce-scatter to sequence shards (SP, kept as DTensor so the
    # residual add and the next norm stay sharded).
    row = RowwiseParallel(output_layouts=resid, use_local_output=not sequence_parallel)
    plan: TPPlan = {
        f"{prefix}.self_attn": half_input,
        f"{prefix}.self_attn.q_proj": ColwiseParallel(),
        f"{prefix}.self_attn.k_proj": ColwiseParallel(),
        f"{prefix}.self_attn.v_proj": ColwiseParallel(),
        f"{prefix}.self_attn.o_proj": row,
        f"{prefix}.mlp": half_input,
        f"{prefix}.mlp.up_proj": ColwiseParallel(),
        f"{prefix}.mlp.down_proj": row,
    }
    if gated:
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
    if sequence_parallel:
        plan[f"{prefix}.attn_norm"] = SequenceParallel()
        plan[f"{prefix}.mlp_norm"] = SequenceParallel()
        # The block's residual dropout needs no entry: it receives the reduce-scattered DTensor [B, S/tp, H].
    return plan


def _embedding_plan(*, sequence_parallel: bool, first_layer: str | None) -> TPPlan:
    # Vocab-parallel embedding: rows [V/tp, H] per rank, out-of-shard ids give zeros, one all-reduce sums them.
    # The full [B, S, H] embedding is kept (positions / token types / embedding norm are added replicated, as in
    # Megatron); with SP the first block splits it into sequence shards (a local slice, no communication).
    plan: TPPlan = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if sequence_parallel and first_layer is not None:
        plan[f"layers.{first_layer}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                           desired_input_layouts=(Shard(1),),
                                                           use_local_output=False)
    return plan


def _layer_keys(model: nn.Module) -> list[str]:
    layers = getattr(model, "layers", None)
    return list(layers.keys()) if isinstance(layers, nn.ModuleDict) else []


def decoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """Plan for :class:`~lightning_llm.models.DecoderLM` (tolerates modules removed by a pipeline split)."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    keys = _layer_keys(model)
    plan: TPPlan = {}
    if getattr(model, "embed_tokens", None) is not None:
        plan.update(_embedding_plan(sequence_parallel=sequence_parallel, first_layer=keys[0] if keys else None))
    elif sequence_parallel and keys:
        # A later pipeline stage receives the replicated hidden state; split it like the first stage does.
        plan[f"layers.{keys[0]}"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                       use_local_output=False)
    if keys:
        plan.update(_block_plan("layers.*", sequence_parallel=sequence_parallel, gated=config.gated))
    if sequence_parallel and getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        # [B, S, H] -> logits [B, S, V/tp]; SP all-gathers the sequence shards first.
        plan["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    elif sequence_parallel and keys:
        # Last stage of a pipeline split without the head: hand the next stage a full replicated hidden state.
        plan[f"layers.{keys[-1]}"] = PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def encoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """Plan for :class:`~lightning_llm.models.EncoderModel`; pooler and classifier (tiny) stay replicated.

    ``loss_parallel`` is accepted for symmetry and ignored: the classification logits are not vocab-sized.
    """
    config: ModelConfig = model.config  # type: ignore[assignment]
    keys = _layer_keys(model)
    plan: TPPlan = {}
    if getattr(model, "embed_tokens", None) is not None:
        plan.update(_embedding_plan(sequence_parallel=sequence_parallel, first_layer=keys[0] if keys else None))
    if keys:
        plan.update(_block_plan("layers.*", sequence_parallel=sequence_parallel, gated=config.gated))
        if sequence_parallel:
            # The pooler reads token 0 of the full sequence: gather the shards once after the last block, so the
            # final norm / pooler / classifier run replicated on plain tensors. With a single layer the first layer's
            # PrepareModuleInput and this output hook share the module, hence the combined style.
            gather = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
            last = f"layers.{keys[-1]}"
            if len(keys) == 1 and getattr(model, "embed_tokens", None) is not None:
                plan[last] = PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                      use_local_input=False, **gather)
            else:
                plan[last] = PrepareModuleOutput(**gather)
    return plan


def find_backbone(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path prefix, module)`` of the first of our decoder/encoder backbones inside ``model`` (PEFT wrappers
    put it at ``base_model.model``), or ``None`` for a model that is not one of ours."""
    from lightning_llm.models.decoder import DecoderLM
    from lightning_llm.models.encoder import EncoderModel

    for name, mod in model.named_modules():
        if isinstance(mod, (DecoderLM, EncoderModel)):
            return (f"{name}." if name else ""), mod
    return None


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """The plan for ``model``: our decoder or encoder (possibly inside a PEFT wrapper), paths relative to ``model``.

    LoRA-wrapped projections are adapted (see :func:`adapt_plan_for_lora`). Raises ``ValueError`` for a model
    that is not one of our families: pass ``plan=`` to the strategy for a custom model.
    """
    found = find_backbone(model)
    if found is None:
        raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: it is neither a DecoderLM nor an "
                         "EncoderModel; pass the strategy's `plan` argument (module path -> ParallelStyle)")
    prefix, backbone = found
    family = backbone.config.family  # type: ignore[union-attr]
    build = decoder_tp_plan if family == "decoder" else encoder_tp_plan
    plan = build(backbone, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    plan = {f"{prefix}{k}": v for k, v in plan.items()}
    return adapt_plan_for_lora(model, plan)


# ------------------------------------------------------------------------------------------------------------------
# LoRA (PEFT) adaptation
# ------------------------------------------------------------------------------------------------------------------


def _matches(pattern: str, name: str) -> bool:
    """``parallelize_module`` path semantics: same number of atoms, each matched with fnmatch."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatch(a, b) for a, b in zip(n, p))


def _is_lora_layer(mod: nn.Module) -> bool:
    return hasattr(mod, "base_layer") and isinstance(getattr(mod, "lora_A", None), nn.ModuleDict)


def _lora_entries(path: str, mod: nn.Module, style: ParallelStyle) -> TPPlan:
    """Styles for a PEFT ``lora.Linear`` at ``path`` whose base layer the plan shards with ``style``.

    column-parallel base W [O/tp, I]: lora_A [r, I] replicated, lora_B [O/tp, r] column-parallel; the adapter output
    is sharded exactly like the base output and added locally.
    row-parallel base W [O, I/tp]: lora_A [r, I/tp] row-parallel, lora_B [O, r] replicated; base and adapter both
    produce ``Partial`` sums that are added first and reduced once (one all-reduce / reduce-scatter, as without LoRA).
    """
    adapters = list(mod.lora_A.keys())  # type: ignore[union-attr]
    out: TPPlan = {}
    if isinstance(style, ColwiseParallel):
        in_layout = style.input_layouts[0]
        out[path] = PrepareModuleInput(input_layouts=(in_layout,), desired_input_layouts=(Replicate(),),
                                       use_local_output=False)
        out[f"{path}.base_layer"] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                                   use_local_output=style.use_local_output)
        for a in adapters:
            out[f"{path}.lora_A.{a}"] = ReplicateParallel()
            out[f"{path}.lora_B.{a}"] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                                       use_local_output=style.use_local_output)
    elif isinstance(style, RowwiseParallel):
        in_layout = style.input_layouts[0]
        out[path] = PrepareModuleInputOutput(
            input_layouts=(in_layout,), desired_input_layouts=(Shard(-1),), use_local_input=False,
            output_layouts=(Partial(),), desired_output_layouts=(style.output_layouts[0],),
            use_local_output=style.use_local_output,
        )
        out[f"{path}.base_layer"] = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
        for a in adapters:
            out[f"{path}.lora_A.{a}"] = RowwiseParallel(output_layouts=Partial(), use_local_output=False)
            out[f"{path}.lora_B.{a}"] = ReplicateParallel(input_layout=Partial())
    else:
        raise ValueError(f"{path}: LoRA on a module planned as {type(style).__name__} is not supported "
                         "(only ColwiseParallel / RowwiseParallel base layers)")
    return out


def adapt_plan_for_lora(model: nn.Module, plan: TPPlan) -> TPPlan:
    """Rewrite plan entries whose targets are PEFT LoRA layers (``<path>.base_layer`` + ``lora_A``/``lora_B``).

    Wildcard entries are expanded to concrete paths only where a LoRA layer matches them; other entries are kept.
    """
    lora = {n: m for n, m in model.named_modules() if _is_lora_layer(m)}
    if not lora:
        return plan
    out: TPPlan = {}
    for key, style in plan.items():
        hits = [n for n in lora if _matches(key, n)]
        if not hits:
            out[key] = style
            continue
        others = [n for n, _ in model.named_modules() if _matches(key, n) and n not in lora]
        for n in others:
            out[n] = style
        for n in hits:
            out.update(_lora_entries(n, lora[n], style))
    log.info("tensor-parallel plan adapted for %d LoRA layers", len(lora))
    return out
