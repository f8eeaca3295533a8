"""What a task does with an MoE model's router statistics (:mod:`lightning_llm.models.layers.routing`) while it trains.

* :func:`routing_reduction`: the sum over the ranks whose tokens and layers make the global batch
  (``capabilities.routing_group``), asynchronous so a pipeline's stages never wait for each other's forwards.
* :class:`MoEMonitor` (a callback every task installs; idle without MoE layers): opens the statistics before each
  training batch (a pipeline opens them itself, per micro-batch forward); after the batch, logs the load per expert
  summed over the global batch (``train_expert_load_max``/``_min``: the most and least loaded expert of any layer
  as a multiple of the even share, 1.0 when balanced; ``train_dead_experts``: experts of any layer that got no
  token; device tensors, which the logger reads at its logging steps only) and appends every layer's loads to
  ``<log_dir>/expert_load.csv`` every ``log_every_n_steps`` (the one read of them); applies the
  aux-free bias update (DeepSeek-V3) once per optimizer step, from the loads of its whole accumulation window.

The load-balancing loss itself is part of :meth:`LLMTask.training_step`: its value joins ``train_loss`` (logged also
as ``train_aux_loss``), its gradient is injected at the routers with this rank's factor, read from the gradient of
the loss it returns (whatever scaled it: accumulation, an fp16 loss scale, the replicas' weights).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_llm.contract import Capabilities
from lightning_llm.models import parallel_spec_of, routing_stats_of
from lightning_llm.models.layers.routing import RoutingStats

log = logging.getLogger(__name__)

__all__ = ["MoEMonitor", "routing_reduction", "routing_stats"]

LOAD_FILE = "expert_load.csv"


def routing_stats(task: Any) -> RoutingStats | None:
    """The router statistics of the task's model (``None`` before it is built, or without MoE layers)."""
    model = getattr(task, "model", None)
    return None if model is None else routing_stats_of(model)


def routing_reduction(caps: Capabilities) -> Any:
    """``t -> handle``: ``t`` summed in place over ``caps``' routing ranks (asynchronously); ``None`` for one rank."""
    if caps.routing_ranks <= 1 or not dist.is_initialized():
        return None
    group = caps.routing_group

    def reduce(t: Tensor) -> Any:
        return dist.all_reduce(t, group=group, async_op=True)

    return reduce


def _scale_hook(stats: RoutingStats, replicas: int) -> Any:
    """A hook on the loss a training step returns: its gradient is what every term of that loss is multiplied by in
    backward (1 / accumulation, an fp16 loss scale); times the replicas (their gradients are averaged), the factor of
    the load-balancing loss's injected gradient. Autograd reaches the returned loss before the routers."""
    def hook(grad: Tensor) -> None:
        g = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        stats.grad_scale = g.detach().to(torch.float64).reshape(()) * replicas  # stays on the device: no host read
    return hook


def attach_aux_loss(task: Any, loss: Tensor, stats: RoutingStats) -> None:
    """Scale the step's injected load-balancing gradient from ``loss``, the tensor the step returns for backward."""
    if loss.requires_grad and stats.aux_loss_coef > 0:
        loss.register_hook(_scale_hook(stats, task.capabilities.data_parallel_size))


class MoEMonitor(pl.Callback):
    """Opens, logs and applies an MoE model's router statistics around each training step (see the module doc)."""

    def __init__(self) -> None:
        self._csv: Path | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = routing_stats(pl_module)
        if stats is None:
            return
        stats.reduce = routing_reduction(pl_module.capabilities)  # type: ignore[attr-defined]
        root = trainer.log_dir or trainer.default_root_dir  # a collective: on every rank
        self._csv = Path(root) / LOAD_FILE if root else None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        stats = routing_stats(pl_module)
        # A manual-optimization task (PPO, GRPO) runs several forwards per batch: it trains without the statistics
        # (the run summary says so); a pipeline opens them itself, for its micro-batches.
        if stats is not None and pl_module.automatic_optimization and not pl_module.capabilities.pipelined:  # type: ignore[attr-defined]
            stats.begin(forwards=1)  # the scale is read from the returned loss's gradient (attach_aux_loss)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        stats = routing_stats(pl_module)
        if stats is None or not stats.has_step:
            return
        loads = stats.loads()  # [L, E]
        share = loads.sum(-1, keepdim=True) / loads.shape[-1]  # the even share per expert
        ratio = loads / share.clamp(min=1e-12)
        # logged as device tensors: the logger reads them at its logging steps only (log_every_n_steps)
        pl_module.log("train_expert_load_max", ratio.max().float(), on_step=True, on_epoch=False)
        pl_module.log("train_expert_load_min", ratio.min().float(), on_step=True, on_epoch=False)
        pl_module.log("train_dead_experts", (loads == 0).sum().float(), on_step=True, on_epoch=False)
        step = trainer.global_step
        if self._csv is not None and trainer.is_global_zero and step % max(trainer.log_every_n_steps, 1) == 0:
            self._append(step, batch_idx, stats, loads)

    def _append(self, step: int, batch_idx: int, stats: RoutingStats, loads: Tensor) -> None:
        assert self._csv is not None
        new = not self._csv.exists()
        self._csv.parent.mkdir(parents=True, exist_ok=True)
        layers = sorted(stats.index, key=stats.index.__getitem__)
        with self._csv.open("a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(["step", "batch", "layer", *[f"expert_{i}" for i in range(loads.shape[1])]])
            for layer, row in zip(layers, loads.tolist()):
                w.writerow([step, batch_idx, layer, *[int(x) for x in row]])

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        stats = routing_stats(pl_module)
        if stats is None:
            return
        window = stats.take_window()  # the loads of every micro-batch of this optimizer step
        found = parallel_spec_of(pl_module.model)
        if window is not None and stats.bias_update_rate > 0 and found is not None:
            found[1].update_router_biases(window)
