"""The task <-> strategy contract, declared in one place (``docs/architecture.md`` explains it).

What a task may rely on, under every layout:

* **Plain tensors.** Task code (``compute_loss``, ``loss_from_output``, ``predict_step``, metrics, extra modules)
  sees ordinary local tensors holding the *full* values: full-vocabulary logits, a plain scalar loss. A task opts
  in to a sharded fast path only by marking its loss with :func:`accepts_sharded_logits` (the built-in causal-LM
  loss does: under tensor parallelism its logits stay vocab-sharded DTensors and the cross-entropy runs on the
  shards). An override that is not marked gets gathered logits, at the cost of one all-gather.
* **One model call per step, declared.** A task says what the model is called with (:meth:`model_inputs`) and how
  the loss follows from the one output (:meth:`loss_from_output`); the default ``compute_loss`` composes the two.
  A pipeline runs exactly that, micro-batch by micro-batch. A task that overrides ``compute_loss`` itself (it may
  call the model twice, as DPO, consistency or contrastive losses do) trains under every layout whose ranks hold
  the whole model, and is refused before the first step under pipeline parallelism, naming the class and the rule.
* **Model calls go through** ``task.run_model(...)`` outside the loss (prediction, generation): under a pipeline the
  split model cannot be called directly, and such a call fails with a message naming ``run_model``.
* **Capabilities, not internals.** A task asks ``capabilities_of(trainer.strategy)`` (what :class:`Capabilities`
  lists) instead of reading another class's attributes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

log = logging.getLogger(__name__)

__all__ = [
    "Capabilities",
    "PipelineRunner",
    "accepts_sharded_logits",
    "capabilities_of",
    "task_accepts_sharded_logits",
    "check_pipelinable",
    "declared_inputs",
    "declared_loss",
    "declared_step",
    "decoding_copy",
    "decoding_session",
    "PACKED_INPUTS",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_SHARDED_OK = "_lightning_llm_accepts_sharded_logits"
_DECLARED_LOSS = "_lightning_llm_declared_loss"
_DECLARED_STEP = "_lightning_llm_declared_step"


def accepts_sharded_logits(fn: _F) -> _F:
    """Mark a task's ``compute_loss`` or ``loss_from_output`` as correct on vocab-sharded DTensor logits (it only
    uses ops with a DTensor rule inside ``loss_parallel``, e.g. ``F.cross_entropy``). An unmarked method, including
    any override of a marked one, receives full plain logits."""
    setattr(fn, _SHARDED_OK, True)
    return fn


def declared_loss(fn: _F) -> _F:
    """Mark the base ``compute_loss`` that only composes the declared hooks (``model_inputs`` -> one model call ->
    ``loss_from_output``): the one a pipeline can run. ``LLMTask.compute_loss`` carries it; any override does not,
    so this module decides without importing the tasks above it."""
    setattr(fn, _DECLARED_LOSS, True)
    return fn


def declared_step(fn: _F) -> _F:
    """Mark the base ``training_step`` that runs ``compute_loss`` on the batch as the dataloader gave it. An override
    (DPO adds reference log-probs to the batch first) does not carry it: what one step computes is then the task's."""
    setattr(fn, _DECLARED_STEP, True)
    return fn


def overrides_training_step(task: Any) -> bool:
    """Whether the task's class replaces the base ``training_step`` marked :func:`declared_step`."""
    return not getattr(_resolved(task, "training_step"), _DECLARED_STEP, False)


def _resolved(task: Any, name: str) -> Callable[..., Any] | None:
    return getattr(type(task), name, None)


def user_task(task: Any) -> bool:
    """Whether ``task`` is a user's class rather than one of the library's own tasks: messages about the contract
    (what an override costs) speak to user subclasses only."""
    return not type(task).__module__.startswith("lightning_llm.")


def task_accepts_sharded_logits(task: Any) -> bool:
    """Whether every method between the model output and the loss is marked with :func:`accepts_sharded_logits`."""
    return all(getattr(_resolved(task, n), _SHARDED_OK, False) for n in ("compute_loss", "loss_from_output"))


def overrides_compute_loss(task: Any) -> bool:
    """Whether the task's class replaces the base ``compute_loss`` (model inputs -> one call -> loss), marked
    :func:`declared_loss`."""
    return not getattr(_resolved(task, "compute_loss"), _DECLARED_LOSS, False)


def check_pipelinable(task: Any, *, strategy: str) -> None:
    """Raise before training when a pipeline cannot run ``task`` exactly as one device would."""
    name = type(task).__name__
    if not all(callable(_resolved(task, n)) for n in ("model_inputs", "loss_from_output", "compute_loss")):
        raise ValueError(f"--trainer.strategy={strategy}: pipeline parallelism runs an LLMTask through its "
                         f"model_inputs()/loss_from_output() hooks; {name} is not an LLMTask")
    extras = [n for n, p in task.named_parameters() if p.requires_grad and not n.startswith("model.")]
    if extras:
        listed = ", ".join(extras[:4]) + (", ..." if len(extras) > 4 else "")
        raise ValueError(
            f"--trainer.strategy={strategy}: {name} has trainable parameters outside self.model ({listed}). "
            "A pipeline places only the modules of self.model on its stages; "
            "build such a module into the model that build_model() returns, or train this task with a layout whose "
            "ranks hold the whole model (ddp, tp, zero1/2/3, deepspeed_*)")
    if overrides_compute_loss(task):
        raise ValueError(
            f"--trainer.strategy={strategy}: {name} overrides compute_loss(). A pipeline runs the model once per "
            "micro-batch, from model_inputs(batch, stage), and computes the loss from that one output with "
            "loss_from_output(output, batch, stage); a compute_loss that calls the model itself (possibly more than "
            "once) cannot be pipelined. Move the model call into those two hooks, or train this task with a layout "
            "whose ranks hold the whole model (ddp, tp, zero1/2/3, deepspeed_*)")


_TOKEN_LOSS_HOOKS = ("model_inputs", "loss_from_output", "compute_loss", "loss_weight", "step_loss",
                     "training_step")


def check_context_parallel(task: Any, *, cp: int) -> None:
    """Raise before training when context parallelism (``cp`` ranks per sequence, each holding a slice of its
    tokens) cannot run ``task`` exactly: the task must declare ``context_parallel = True`` (its loss is a mean over
    the tokens ``loss_weight`` counts, each token's term from its own output) in a class that also defines every loss
    hook it overrides - a user override of a declared library task could compute a sequence-level loss."""
    name = type(task).__name__
    declared = [c for c in type(task).__mro__ if "context_parallel" in vars(c)]
    if not declared or not getattr(task, "context_parallel", False):
        raise ValueError(f"context_parallel_size={cp}: {name} does not declare context_parallel = True (a per-token "
                         "loss averaged over the tokens it weighs); train it with context_parallel_size=1")
    owner = declared[0]
    mro = type(task).__mro__
    later = [n for n in _TOKEN_LOSS_HOOKS for c in mro[:mro.index(owner)] if n in vars(c)]
    if later:
        raise ValueError(f"context_parallel_size={cp}: {name} overrides {', '.join(sorted(set(later)))} after "
                         f"{owner.__name__} declared context_parallel; set context_parallel = True on {name} if its "
                         "loss is still a per-token mean over the tokens loss_weight counts")


PACKED_INPUTS = ("position_ids", "segment_ids")
"""Batch keys of packed rows (:func:`lightning_llm.data.packing.pack_examples`) the model must receive: each packed
example's positions and its segment, from which the model builds a block-diagonal attention mask."""


def declared_inputs(task: Any, batch: Any, stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``task.model_inputs(batch, stage)``, refused when the batch holds packed rows (``segment_ids``) that the
    inputs do not pass on: the model would attend across the packed examples (one causal mask over the row)."""
    args, kwargs = task.model_inputs(batch, stage)
    if isinstance(batch, dict) and "segment_ids" in batch and kwargs.get("segment_ids") is None:
        raise ValueError(f"{type(task).__name__}.model_inputs() drops the batch's segment_ids (packed rows): the "
                         "model would attend across the examples packed into a row. Pass segment_ids= and "
                         "position_ids= to the model, or train with --data.packing=false")
    return args, kwargs


_BUILD_HOOKS = ("configure_model", "build_model", "build_policy", "build_decoder", "build_backbone")


def builds_lazily(task: Any) -> bool:
    """Whether ``task`` may build its backbone on the meta device under a sharding layout: its class sets
    ``deferred_init = True``, or leaves it ``None`` and builds with the library's own hooks only. A subclass whose
    own ``build_model`` (or another build hook) adds modules to the backbone may leave them on the meta device (peft
    moves adapters to their base layer's device), where nothing declares their values: such a task is built whole
    on every rank, as before sharded construction existed, unless it opts in."""
    declared = getattr(task, "deferred_init", None)
    if declared is not None:
        return bool(declared)
    # A hook the task's classes do not have at all (ClassificationTask has no build_policy) is no override.
    own = [n for n in _BUILD_HOOKS if _resolved(task, n) is not None
           and not getattr(_resolved(task, n), "__module__", "").startswith("lightning_llm.")]
    if own:
        log.info("%s overrides %s: its model is built whole on every rank (set deferred_init = True on the class "
                 "if its own modules are real or belong to a model family)", type(task).__name__, ", ".join(own))
    return not own


@dataclass(frozen=True)
class Capabilities:
    """What a strategy offers the task running under it."""

    data_parallel_size: int = 1
    """Replicas that see different batches (tensor/pipeline ranks of one replica share its batch)."""
    batch_shared: bool = False
    """Several ranks compute on the same batch (tensor or pipeline parallelism)."""
    pipelined: bool = False
    """The model is split into pipeline stages: model calls go through :class:`PipelineRunner`."""
    generation: bool = True
    """Token-by-token generation (KV cache) is supported."""
    data_parallel_group: Any = None
    """Process group of this rank's data-parallel replicas (``None``: the default group, or no group)."""
    context_parallel_size: int = 1
    """Ranks sharing each sequence (context parallelism): the task's batch holds this rank's slice of every row's
    tokens (``data_parallel_size`` counts them as replicas); generation is refused."""
    context_parallel_group: Any = None
    """Process group of the ranks sharing this rank's rows (``None`` without context parallelism)."""
    routing_ranks: int = 1
    """Ranks whose tokens and layers together make one global batch for an MoE model's router statistics (data,
    context and pipeline ranks; the ranks of a tensor-parallel group share their tokens and count once)."""
    routing_group: Any = None
    """Process group of those ranks (``None``: the default group)."""
    deferred_init: bool = False
    """The strategy shards the model and materializes meta-device family models after sharding
    (:func:`lightning_llm.models.init.materialize` on each rank's shards): a task builds its backbone on the meta
    device (named sizes) or lazily (HF checkpoints) so no rank ever holds the whole model."""


class PipelineRunner(Protocol):
    """What a pipelined strategy runs for a task (see :meth:`LLMTask.step_loss` and :meth:`LLMTask.run_model`)."""

    def loss(self, task: Any, batch: Any, stage: str) -> tuple[Tensor, dict[str, Any]]:
        """The batch's loss (training: forward and backward of every micro-batch) and metric outputs."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """A forward-only pipeline pass; the last stage's output on every pipeline rank."""

    def decoder(self, **stage_inputs: Any) -> Any:
        """The model protocol of :func:`lightning_llm.generation.generate` across the stages (token-by-token decoding
        with a KV cache, micro-batches in flight; the same tokens on every pipeline rank); ``stage_inputs``: keyword
        inputs every stage receives as well."""

    def frozen(self, name: str) -> PipelineRunner:
        """The runner of the task's frozen model ``name`` (``task.frozen_models()``), split into the same stages."""

    def train_additive(self, loss_fn: Callable[[Any, Tensor], tuple[Tensor, dict[str, Tensor]]], *args: Any,
                       **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward and backward of ``model(*args, **kwargs)`` with ``loss_fn(output, rows) -> (loss, stats)`` per
        micro-batch (losses and statistics that add up over micro-batches); the summed (loss, stats) on every
        pipeline rank, the gradients kept for the strategy's backward (a manual-optimization step)."""


def capabilities_of(strategy: Any) -> Capabilities:
    """The strategy's declared capabilities; Lightning's own strategies (single device, DDP, FSDP, DeepSpeed) are
    pure data parallel: every rank is a replica."""
    caps = getattr(strategy, "capabilities", None)
    if isinstance(caps, Capabilities):
        return caps
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    world = int(getattr(strategy, "world_size", 1) or 1)
    replicas = int(kwargs.get("num_replicas", world))
    return Capabilities(data_parallel_size=replicas, batch_shared=replicas != world, routing_ranks=world)


def pipeline_runner(strategy: Any) -> PipelineRunner | None:
    """The strategy's pipeline runner when the model is split into stages, else ``None``."""
    if not capabilities_of(strategy).pipelined:
        return None
    return getattr(strategy, "pipeline_runner", None)


@contextmanager
def decoding_session(strategy: Any, decoder: Any) -> Iterator[Any]:
    """What one generation decodes with: ``decoder`` inside the strategy's ``decoding_session`` where it has one
    (ZeRO-3 gathers the parameters once for the whole generation), else ``decoder`` itself."""
    session = getattr(strategy, "decoding_session", None)
    if session is None:
        yield decoder
        return
    with session(decoder) as inside:
        yield inside


def decoding_copy(strategy: Any, module: Any) -> Any | None:
    """What to call for ``module`` (the task's model, a frozen model, a submodule such as PPO's policy) inside a
    decoding session that holds whole copies of them (tensor-parallel and pipeline layouts: the same calls as on one
    device, no collective), else ``None``: call ``module`` the layout's way."""
    lookup = getattr(strategy, "decoding_copy", None)
    return lookup(module) if lookup is not None else None


def device_scalar(value: float | Tensor, device: torch.device) -> Tensor:
    """``value`` as an fp64 0-d tensor on ``device`` without a host read or a blocking copy (a number is filled in
    on the device; a tensor is converted where it is)."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=torch.float64).reshape(())
    return torch.full((), float(value), dtype=torch.float64, device=device)


@torch.no_grad()
def replica_mean(group: Any, values: Tensor, weight: float | Tensor, *, dp: int) -> tuple[Tensor, Tensor]:
    """Means over ``dp`` data-parallel replicas of per-replica means ``values`` [k], each averaging over ``weight``
    elements (a number or a 0-d tensor, e.g. a token count left on the device): ``(sum_r values_r * w_r / W, W)``
    with ``W = sum_r w_r`` an fp64 0-d tensor on ``values``' device (one collective when ``dp > 1``; nothing is read
    back to the host)."""
    import torch.distributed as dist

    v = values.detach().to(torch.float64).reshape(-1)
    w = device_scalar(weight, v.device).reshape(1)
    if dp <= 1 or not dist.is_initialized():
        return v.float(), w[0]
    buf = torch.cat([v * w, w])
    dist.all_reduce(buf, group=group)
    total = buf[-1]
    return (buf[:-1] / total.clamp(min=1e-12)).float(), total


def replica_loss(group: Any, loss: Tensor, weight: float | Tensor, *, dp: int) -> tuple[Tensor, Tensor]:
    """The global batch's loss over ``dp`` data-parallel replicas whose mean losses average over ``weight`` elements
    each (tokens, samples): ``(sum_r loss_r * w_r / W, W)`` with ``W = sum_r w_r`` (a collective when ``dp > 1``).

    Scaling a replica's loss by ``w * dp / W`` before backward makes the replica-averaged gradient the gradient of
    that global mean, as on one device, also when replicas hold different numbers of tokens."""
    if hasattr(loss, "full_tensor"):  # a replicated DTensor loss (vocab-parallel cross-entropy)
        loss = loss.full_tensor()
    mean, total = replica_mean(group, loss.reshape(1), weight, dp=dp)
    return mean[0], total
