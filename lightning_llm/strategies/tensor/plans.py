"""Applying tensor-parallel plans: the generic pieces around the per-family plans.

The plans themselves are data next to the models (:mod:`lightning_llm.models.parallel_spec`: Megatron column/row,
vocab-parallel embedding and head, sequence parallel); this module finds a model's plan (:func:`tp_plan`), checks the
degree divides the model (:func:`validate_tp`), shards LoRA adapters consistently with their base layer
(:func:`adapt_plan_for_lora`, :class:`ReplicateParallel`). Plans are keyed by module path relative to the module handed
to ``parallelize_module`` (wildcards allowed, as in ``parallelize_module``).
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
    RowwiseParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from lightning_llm.models.config import ModelConfig
from lightning_llm.models.parallel_spec import _TP_DIVIDES, parallel_spec_of
from lightning_llm.models.tp_plans import TPPlan

log = logging.getLogger(__name__)

__all__ = [
    "ReplicateParallel",
    "adapt_plan_for_lora",
    "find_backbone",
    "tp_plan",
    "validate_tp",
    "validate_tp_for",
]



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


def validate_tp(config: ModelConfig, tp_size: int, *, divides: tuple[str, ...] = _TP_DIVIDES) -> None:
    """Raise ``ValueError`` naming the first model dimension (of ``divides``, the family's
    :attr:`~lightning_llm.models.parallel_spec.ParallelSpec.tp_divides`) that ``tensor_parallel_size`` does not
    divide."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size}: must be >= 1")
    if tp_size == 1:
        return
    for name in divides:
        value = getattr(config, name, None)
        if value is not None and value % tp_size:
            hint = " (pad the vocabulary, e.g. to a multiple of 8)" if name == "vocab_size" else ""
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {name}={value}{hint}")


def validate_tp_for(model: nn.Module, tp_size: int) -> None:
    """:func:`validate_tp` for the registered family inside ``model``; nothing to check for other models."""
    found = parallel_spec_of(model)
    if found is not None:
        validate_tp(found[1].config, tp_size, divides=found[2].tp_divides)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------------------
# Plans per family: declared in lightning_llm/models/parallel_spec.py
# ------------------------------------------------------------------------------------------------------------------


def find_backbone(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(path prefix, module)`` of the first backbone of a registered family inside ``model`` (PEFT wrappers put it
    at ``base_model.model``), or ``None`` for a model of no registered family."""
    found = parallel_spec_of(model)
    return None if found is None else found[:2]


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """The plan for ``model``: its family's plan (:class:`~lightning_llm.models.parallel_spec.ParallelSpec`), found
    also inside a PEFT wrapper, with paths relative to ``model``.

    LoRA-wrapped projections are adapted (see :func:`adapt_plan_for_lora`). Raises ``ValueError`` for a model of no
    registered family: pass ``plan=`` to the strategy for a custom model.
    """
    found = parallel_spec_of(model)
    if found is None:
        raise ValueError(f"no tensor-parallel plan for {type(model).__name__}: it is no registered model family "
                         "(lightning_llm.models.PARALLEL_SPECS); pass the strategy's `plan` argument (module path -> "
                         "ParallelStyle)")
    prefix, backbone, spec = found
    plan = spec.tp_plan(backbone, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
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
