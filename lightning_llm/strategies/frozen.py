"""A task's frozen models placed like its model (``task.frozen_models()``: the RL and DPO reference of a full
fine-tune), so a layout that splits or shards the policy does not hold a whole second copy on every rank.

Each frozen model (a registered family, frozen) gets, for whichever degrees are > 1, what the model got:

* pipeline: the model's split (the same block keys per stage: :func:`~.pipeline.split.prune_model` with this
  rank's :class:`~.pipeline.split.StageSpec` list), so a rank keeps only its stages' blocks, and the
  :class:`~.pipeline.runtime.PipelineStages` give it a forward-only runner of its own (``runner.frozen(name)``);
* tensor parallelism: its family's plan (vocab-sharded logits exactly where the model's are);
* expert parallelism: a Mixture-of-Experts frozen model (an MoE policy's reference, an MoE teacher) gets its routed
  experts spread over the ``ep`` ranks as the model's are (:func:`~.expert.apply_expert_parallel`: ``E / ep`` of them
  per rank, its tokens dispatched to them by all-to-all in its no-grad forwards, which every rank of an ``ep`` group
  runs as often as the others, as it runs the model's); a frozen model without experts, or whose experts ``ep`` does
  not divide, stays whole there (logged), like the model's dense layers;
* ZeRO-3: FSDP2 over the family's units, resharded after every forward (under expert parallelism its experts first,
  over the ranks holding the same experts, as the model's); it has no gradients and no optimizer
  states (``requires_grad`` stays off, so neither the optimizer nor the gradient reduction ever sees it).

Materialization then fills its shards like the model's (:mod:`.materialize`: the copy carries the family's init
plan and checkpoint source). Names stay global, so checkpoints of any layout reshard into any other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_llm.strategies.expert import apply_expert_parallel, expert_blocker
from lightning_llm.strategies.tensor.parallelize import apply_tensor_parallel
from lightning_llm.strategies.pipeline.split import StageSpec, layout_of, module_at, prune_model
from lightning_llm.strategies.zero.native import apply_fsdp, fsdp_units, shard_experts

log = logging.getLogger(__name__)

__all__ = ["check_frozen_models", "decoding_frozen_models_of", "frozen_models_of", "place_frozen_models",
           "place_scoring_models", "scoring_models_of"]


def frozen_models_of(task: Any) -> dict[str, nn.Module]:
    """``task.frozen_models()`` (path -> module), checked frozen; ``{}`` for a task that declares none."""
    declared = getattr(task, "frozen_models", None)
    models = dict(declared()) if callable(declared) else {}
    for name, module in models.items():
        trained = [n for n, p in module.named_parameters() if p.requires_grad]
        if trained:
            raise ValueError(f"{type(task).__name__}.frozen_models()[{name!r}] has trainable parameters "
                             f"({', '.join(trained[:3])}, ...): a frozen model is placed without gradients or "
                             "optimizer states")
    return models


def decoding_frozen_models_of(task: Any, frozen: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The frozen models (of ``frozen``, the task's) a generation calls inside its decoding session, by the task's
    ``decoding_frozen_models()`` (names; ``{}`` for a task that declares none): what a layout assembles whole copies
    of (tp, pp) or gathers (ZeRO-3) with the model for a session. The others run the layout's way wherever they are
    called (a distillation teacher, after the student sampled)."""
    declared = getattr(task, "decoding_frozen_models", None)
    names = list(declared()) if callable(declared) else []
    unknown = [n for n in names if n not in frozen]
    if unknown:
        raise ValueError(f"{type(task).__name__}.decoding_frozen_models() names {', '.join(map(repr, unknown))}, "
                         f"which frozen_models() does not hold (it holds {', '.join(map(repr, frozen)) or 'none'})")
    return {n: frozen[n] for n in names}


def scoring_models_of(task: Any) -> dict[str, nn.Module]:
    """``task.scoring_models()`` (name -> module: frozen models run on inputs of their own, an RL reward model),
    checked frozen; ``{}`` for a task that declares none."""
    declared = getattr(task, "scoring_models", None)
    models = dict(declared()) if callable(declared) else {}
    for name, module in models.items():
        if any(p.requires_grad for p in module.parameters()):
            raise ValueError(f"{type(task).__name__}.scoring_models()[{name!r}] has trainable parameters: a scoring "
                             "model is placed without gradients or optimizer states")
    return models


def place_scoring_models(models: dict[str, nn.Module], *, tp_mesh: DeviceMesh, zero3: dict[str, Any] | None) -> None:
    """Shard each of ``models`` in place as the model is sharded, where its inputs allow: its family's tensor-parallel
    plan over ``tp_mesh`` (the ranks of a tensor-parallel group score the same inputs) and, with ``zero3``
    (:func:`~.zero.native.apply_fsdp`'s keyword arguments but the units), FSDP2 over its units, resharded after every
    forward; never split into pipeline stages (its inputs are not the model's), so whole on a pipeline rank. A model
    the plan cannot split (heads not divisible by tp) stays whole on each rank, logged."""
    if tp_mesh.size() == 1 and zero3 is None:
        return
    for name, module in models.items():
        done = []
        try:
            apply_tensor_parallel(module, tp_mesh, sequence_parallel=False, loss_parallel=False)
            done += ["tensor parallel"] if tp_mesh.size() > 1 else []
        except ValueError as err:
            log.warning("scoring model %s stays whole on every tensor-parallel rank: %s", name, err)
        if zero3 is not None:
            holder = nn.ModuleDict({"model": module})  # apply_fsdp shards units below a root
            apply_fsdp(holder, units=fsdp_units(holder, "model"), **zero3)
            done.append("ZeRO-3 shards")
        log.info("scoring model %s placed like the model (%s)", name, ", ".join(done) or "whole")


def _blocks(model: nn.Module) -> list[str]:
    """The keys of ``model``'s transformer blocks (what a pipeline split assigns to stages)."""
    return list(module_at(model, layout_of(model).layers).keys())


def check_frozen_models(task: nn.Module, models: dict[str, nn.Module], *, model: nn.Module, pp: int,
                        cp: int) -> None:
    """Refuse, before ``model`` is split, frozen models the layout cannot place like it: under a pipeline one
    without the model's blocks (it is split into the model's stages), and any under context parallelism (which
    does not reach them: they would see only a rank's slice of each sequence)."""
    if models and cp > 1:
        raise ValueError(f"context_parallel_size={cp}: the task's frozen models ({', '.join(models)}) would see only "
                         "this rank's slice of each sequence; train with context_parallel_size=1, or with a reference "
                         "that is the policy with its adapters off (LoRA)")
    for name, module in models.items():
        if pp > 1 and _blocks(module) != _blocks(model):
            raise ValueError(f"{type(task).__name__}.frozen_models()[{name!r}] has {len(_blocks(module))} blocks "
                             f"where the model has {len(_blocks(model))}: a frozen model is split into the model's "
                             "pipeline stages, so it must have the same blocks")


def place_frozen_models(task: nn.Module, models: dict[str, nn.Module], *, specs: Sequence[StageSpec] | None,
                        tp_mesh: DeviceMesh, sequence_parallel: bool, sharded_logits: bool,
                        zero3: dict[str, Any] | None, expert_mesh: DeviceMesh | None = None) -> None:
    """Split and shard each of ``models`` (paths relative to ``task``) in place like the model: ``specs`` this
    rank's pipeline stages (``None``: not pipelined), the family's TP plan over ``tp_mesh``, an MoE model's experts
    over ``expert_mesh``'s ``ep`` dim (the engine's ``(pp, edp, ep, tp)`` mesh; ``None``: no expert parallelism), and
    with ``zero3`` (:func:`~.zero.native.apply_fsdp`'s keyword arguments but the units) FSDP2 over its units (checked
    first by :func:`check_frozen_models`)."""
    for name, module in models.items():
        if specs is not None:
            prune_model(module, specs)
        apply_tensor_parallel(module, tp_mesh, sequence_parallel=sequence_parallel, loss_parallel=sharded_logits)
        experts = expert_mesh is not None and _spread_experts(name, module, expert_mesh)
        if zero3 is not None:
            if experts:  # the experts' own units over the ranks holding the same experts, as the model's
                assert expert_mesh is not None
                shard_experts(module, edp_mesh=expert_mesh["edp"], replicas=zero3["dp_mesh"].size(),
                              precision=zero3["precision"], offload=zero3["offload"])
            apply_fsdp(task, units=fsdp_units(task, name), **zero3)
        log.info("frozen model %s placed like the model (%s)", name, ", ".join(
            part for part, on in (("its pipeline stages", specs is not None), ("tensor parallel", tp_mesh.size() > 1),
                                  ("experts over ep", experts), ("ZeRO-3 shards", zero3 is not None)) if on)
            or "whole")


def _spread_experts(name: str, module: nn.Module, expert_mesh: DeviceMesh) -> bool:
    """Spread ``module``'s routed experts over ``expert_mesh["ep"]`` as the model's are; ``False`` (logged) where it
    has none, or ``ep`` does not divide them: then it stays whole on every rank, as a dense model does."""
    ep = expert_mesh["ep"].size()
    blocker = expert_blocker(module, ep)
    if blocker is not None:
        log.info("frozen model %s keeps its layers whole on every expert-parallel rank (%s)", name, blocker)
        return False
    return bool(apply_expert_parallel(module, expert_mesh))
