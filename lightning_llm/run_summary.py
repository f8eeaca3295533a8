"""What will run, said once before step 1: the layout, the batch, the model, memory per rank and FLOPs per step.

:class:`RunSummary` (a callback every task installs) logs one block on global rank 0 when the first training batch
arrives (its shape is the run's):

* layout: ranks and nodes, the degree of every dimension (``pp x dp x tp``, ZeRO stage) and whether each parallel
  dimension stays inside a node (ranks are laid out node by node; the mesh is ``("pp", "dp", "tp")``, tp innermost);
* batch: per data-parallel replica (and pipeline micro-batches), replicas, gradient accumulation, the global batch and,
  for token tasks, tokens per optimizer step;
* parameters (counted when the model was built, before any sharding) and the estimated memory per rank, from the
  same function as ``lightning_llm estimate`` (:func:`lightning_llm.memory.estimate_layout`);
* attention: the kernel padded, packed and plain rows take (``models/layers/attention.py``: the varlen flash path or SDPA
  over a dense mask, and why);
* FLOPs per optimizer step: one forward and backward of a replica's batch counted by ``torch.utils.flop_counter`` on
  a meta-device twin of the model (copied before sharding, so the count is the whole model's under any layout),
  times replicas and accumulation. Tasks log achieved FLOP/s and MFU from it (:func:`throughput`).

Lightning's model summary counts FLOPs only through ``example_input_array`` (a forward the split or sharded model
cannot always run); without it its FLOPs column is all zeros. :func:`replace_model_summary` swaps Lightning's default
summary for the same table without that column.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch import nn
from typing_extensions import override

from lightning_llm.contract import declared_inputs, overrides_compute_loss, overrides_training_step
from lightning_llm.memory import PRECISIONS, Quantized, estimate_layout
from lightning_llm.models import ModelConfig
from lightning_llm.models.layers.attention import describe_attention
from lightning_llm.models.layers.moe import moe_parameters
from lightning_llm.models.quantize import describe, is_quantized, quantized_bytes
from lightning_llm.strategies import DeepSpeedZeroStrategy, ParallelEngine
from lightning_llm.strategies.frozen import frozen_models_of, scoring_models_of
from lightning_llm.strategies.zero.native import model_state_bytes

log = logging.getLogger(__name__)

__all__ = ["Layout", "RunSummary", "layout_of", "replace_model_summary", "throughput"]

MIB = 2**20


@dataclass(frozen=True)
class Layout:
    """The degrees a strategy runs with and what ``lightning_llm estimate`` needs to know of it."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    cp: int = 1
    """Context-parallel degree (ranks sharing each sequence; a replica's batch is theirs together)."""
    engine: str | None = "ddp"
    """``native`` (the parallel engine), ``deepspeed``, ``ddp`` (Lightning's DDP or one device), or ``None`` (a
    strategy the estimate does not model)."""
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_device: str = "cpu"
    """Where the offloaded states are: host memory (``cpu``) or swap files (``nvme``, DeepSpeed's ZeRO-Infinity)."""
    n_microbatches: int = 1
    ep: int = 1
    """Expert-parallel degree (borrowed from ``dp x cp``: each rank holds ``1/ep`` of every MoE layer's experts)."""


def layout_of(trainer: pl.Trainer) -> Layout:
    s = trainer.strategy
    if isinstance(s, ParallelEngine) and s.dims is not None:
        return Layout(dp=s.dims.dp, tp=s.dims.tp, pp=s.dims.pp, cp=s.dims.cp, ep=s.dims.ep, zero_stage=s.zero_stage,
                      engine="native",
                      offload_optimizer=s.offload_optimizer, offload_params=s.offload_params,
                      n_microbatches=s.n_microbatches if s.dims.pp > 1 else 1)
    if isinstance(s, DeepSpeedZeroStrategy):
        return Layout(dp=trainer.world_size, zero_stage=s.stage, engine="deepspeed",
                      offload_optimizer=s.offload_optimizer, offload_params=s.offload_params,
                      offload_device=s.offload_device)
    known = isinstance(s, (DDPStrategy, SingleDeviceStrategy))
    return Layout(dp=trainer.world_size, engine="ddp" if known else None)


def placement(layout: Layout, *, per_node: int, nodes: int) -> str:
    """Which parallel dimensions stay inside a node. Global ranks fill a node before the next
    (``node_rank * devices + local_rank``) and the mesh ``("pp", "dp", "cp", "tp")`` is row-major, so a dimension's
    groups are ``stride`` ranks apart: tp 1, cp tp, dp cp * tp, pp dp * cp * tp."""
    tp, cp, dp = layout.tp, layout.cp, layout.dp
    dims = [(n, d, s) for n, d, s in (("tp", tp, 1), ("cp", cp, tp), ("dp", dp, cp * tp),
                                      ("pp", layout.pp, dp * cp * tp)) if d > 1]
    if nodes <= 1:
        return "1 node" + (": every dimension inside it" if dims else "")
    inside, across = [], []
    world = layout.dp * layout.cp * layout.tp * layout.pp
    for name, size, stride in dims:
        # Every group of this dimension: the ranks that differ only in its coordinate.
        starts = [r for r in range(world) if (r // stride) % size == 0]
        one_node = all(len({(r + i * stride) // per_node for i in range(size)}) == 1 for r in starts)
        (inside if one_node else across).append(name)
    parts = [f"{' and '.join(inside)} inside a node" if inside else "",
             f"{' and '.join(across)} across nodes" if across else ""]
    return f"{nodes} nodes x {per_node}: " + ("; ".join(p for p in parts if p) or "no parallel dimension")


# ----------------------------------------------------------------------------------------------------- FLOPs
def meta_twin(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are on the meta device (nothing allocated), for counting
    FLOPs; ``None`` if the model cannot be copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        # a quantized weight's twin is a plain tensor of its shape and compute dtype: the same matmuls
        like = torch.empty(p.shape, dtype=p.dtype, device="meta") if is_quantized(p) else torch.empty_like(
            p, device="meta")
        memo[id(p)] = nn.Parameter(like, requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - a model that cannot be copied has no FLOP count, nothing else
        log.debug("no meta twin of %s for FLOP counting: %s", type(model).__name__, e)
        return None


def count_step_flops(task: Any, twin: nn.Module, batch: dict[str, Any]) -> int:
    """FLOPs of one forward and backward of ``batch`` through the task's declared hooks, on the meta twin (packed rows:
    the block-diagonal mask does not change the matmuls' FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    counter = FlopCounterMode(display=False)
    with counter:
        args, kwargs = declared_inputs(task, meta, "train")
        loss, _ = task.loss_from_output(twin(*args, **kwargs), meta, "train")
        loss.backward()
    return int(counter.get_total_flops())


def _dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") \
        else torch.float32


def throughput(trainer: pl.Trainer, task: Any, elapsed_s: float) -> dict[str, float]:
    """``train_tflops_per_s`` (achieved, all replicas) for one training batch that took ``elapsed_s``, and
    ``train_mfu`` (that over every rank's peak, when Lightning knows the device's peak FLOP/s); empty before the
    step's FLOPs are counted."""
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = getattr(task, "flops_per_batch", None)
    if not flops:
        return {}
    # the FLOPs of a replica's whole batch: context-parallel ranks share one (they count as replicas to the task)
    caps = task.capabilities
    achieved = flops * (caps.data_parallel_size // caps.context_parallel_size) / max(elapsed_s, 1e-9)
    out = {"train_tflops_per_s": achieved / 1e12}
    peak = get_available_flops(trainer.strategy.root_device, _dtype(str(trainer.precision)))
    if peak:
        out["train_mfu"] = achieved / (peak * trainer.world_size)
    return out


# ----------------------------------------------------------------------------------------------------- the block
class RunSummary(pl.Callback):
    """Logs the run's layout, batch, parameters, memory per rank and FLOPs per step once, on global rank 0, when the
    first training batch arrives (see the module doc). ``capture(model)`` keeps a meta twin of the model as built."""

    def __init__(self) -> None:
        self._twin: nn.Module | None = None
        self._done = False

    def capture(self, model: nn.Module) -> None:
        """Called by the task right after it builds its model, before a strategy splits or shards it."""
        self._twin = meta_twin(model)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._done:
            return
        self._done = True
        flops, why = self._flops(pl_module, batch)
        pl_module.flops_per_batch = flops  # type: ignore[attr-defined] - read by throughput()
        self._twin = None
        if trainer.is_global_zero:
            log.info("run summary\n%s", "\n".join(f"  {line}" for line in summary_lines(
                trainer, pl_module, batch, flops=flops, flops_note=why)))

    def _flops(self, task: Any, batch: Any) -> tuple[int | None, str]:
        if self._twin is None:
            return None, "the model could not be copied to the meta device"
        if not one_call_step(task) or overrides_training_step(task) or not isinstance(batch, dict):
            return None, NOT_ONE_CALL
        try:
            return count_step_flops(task, self._twin, batch), ""
        except Exception as e:  # noqa: BLE001 - the count is a report, never a reason to stop the run
            return None, f"counting failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


NOT_ONE_CALL = ("the task's step is not one model call on the batch (its own training_step, compute_loss or "
                "optimization loop)")


def one_call_step(task: Any) -> bool:
    """A training step is one forward and backward of the batch through ``model_inputs``/``loss_from_output``: what
    the FLOP count runs and the memory estimate models (not PPO's rollouts, not a two-call ``compute_loss``)."""
    return bool(task.automatic_optimization) and not overrides_compute_loss(task)


def summary_lines(trainer: pl.Trainer, task: Any, batch: Any, *, flops: int | None, flops_note: str) -> list[str]:
    layout = layout_of(trainer)
    accum = trainer.accumulate_grad_batches
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    per_replica = int(ids.shape[0]) if isinstance(ids, torch.Tensor) else None
    where = placement(layout, per_node=trainer.num_devices, nodes=trainer.num_nodes)
    cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
    ep = f" (experts over ep {layout.ep} of them)" if layout.ep > 1 else ""
    lines = [(f"layout: {trainer.world_size} rank(s) = pp {layout.pp} x dp {layout.dp}{cp}{ep} x tp {layout.tp}, ZeRO "
              f"stage {layout.zero_stage} ({type(trainer.strategy).__name__}); {where}")]
    if per_replica is not None:
        micro = f" in {layout.n_microbatches} pipeline micro-batches" if layout.pp > 1 else ""
        global_batch = per_replica * layout.dp * accum
        line = (f"batch: {per_replica} samples per replica{micro} x {layout.dp} replica(s) x {accum} accumulation = "
                f"global batch {global_batch}")
        if ids.dim() == 2 and _token_task(batch):
            seq = int(ids.shape[1])
            exact = "" if getattr(trainer.datamodule, "block_size", None) == seq else ": the first batch, padded"
            line += f"; {global_batch * seq:,} tokens per optimizer step ({seq} per sample{exact})"
        lines.append(line)
    total, trainable = getattr(task, "parameter_counts", (None, None))
    if total is not None:
        compiled = "; transformer blocks compiled (torch.compile, --model.compile)" if getattr(
            task, "compile_blocks", False) else ""
        lines.append(f"parameters: {total:,} ({trainable:,} trainable){compiled}")
        moe = moe_line(task, total)
        if moe:
            lines.append(moe)
    note = getattr(task, "optimizer_note", None)
    if note:
        lines.append(note)  # Muon's split: which tensors each optimizer takes
    lines.append(_memory_line(trainer, task, layout, per_replica, ids))
    config = getattr(getattr(task, "model", None), "config", None)
    if isinstance(config, ModelConfig) and config.family == "decoder":
        dtype = _dtype(str(trainer.precision))
        lines.append("attention: " + describe_attention(config, device=trainer.strategy.root_device, dtype=dtype,
                                                        context_parallel=layout.cp))
    frozen = _frozen_line(task)
    if frozen:
        lines.append(frozen)
    lines.extend(getattr(task, "run_summary_lines", list)())  # the task's own lines (RL: rewards, reference)
    decoding = getattr(trainer.strategy, "decoding_note", lambda: None)()
    if decoding is not None and getattr(task, "generation", None) is not None:
        lines.append(decoding)  # how a generation gathers ZeRO-3 parameters (once, or the per-layer fallback)
    if flops is not None:
        step = flops * layout.dp * accum
        lines.append(f"FLOPs per optimizer step: {step:,} = {step:.2e} (forward + backward of {per_replica} samples, "
                     f"counted by torch.utils.flop_counter, x {layout.dp} replica(s) x {accum} accumulation)")
    else:
        lines.append(f"FLOPs per optimizer step: not counted ({flops_note})")
    return lines


def moe_line(task: Any, total: int) -> str | None:
    """What a Mixture-of-Experts run does with its experts: their count and top-k, the parameters a token uses (what
    the FLOPs and MFU count), the load-balancing loss and how the experts' GEMMs run."""
    config = getattr(getattr(task, "model", None), "config", None)
    moe = getattr(config, "moe", None)
    if moe is None:
        return None
    experts, active = moe_parameters(config)
    layers = config.moe_layers
    used = total - experts + active
    if not task.automatic_optimization:
        balance = "load-balancing loss: off (manual optimization: several forwards per step)"
    elif moe.aux_loss_coef > 0:
        balance = (f"load-balancing loss: on, transformers' aux loss x {moe.aux_loss_coef:g} over the global batch "
                   "(--model.router_aux_loss_coef=0 turns it off)")
    else:
        balance = "load-balancing loss: off (router_aux_loss_coef=0)"
    if moe.bias_update_rate > 0:
        balance += f"; aux-free bias update rate {moe.bias_update_rate:g} per optimizer step"
    impl = {"auto": "grouped GEMMs where the device has them, else a loop", "grouped": "grouped GEMMs",
            "loop": "a loop over experts"}[moe.experts_impl]
    return (f"mixture of experts: {moe.num_experts} experts, top-{moe.top_k}, on {len(layers)} of {config.num_layers} "
            f"layers; {used:,} parameters active per token ({100 * used / max(total, 1):.1f}%); {balance}; experts "
            f"run as {impl}")


def _token_task(batch: dict[str, Any]) -> bool:
    """Labels per token (language modelling, SFT, preference pairs), not per sample."""
    labels = batch.get("labels")
    return isinstance(labels, torch.Tensor) and labels.shape == batch["input_ids"].shape


def _memory_line(trainer: pl.Trainer, task: Any, layout: Layout, batch: int | None, ids: Any) -> str:
    config = getattr(getattr(task, "model", None), "config", None)
    precision = str(trainer.precision)
    why = ("the model has no ModelConfig" if not isinstance(config, ModelConfig) else
           NOT_ONE_CALL if not one_call_step(task) else
           f"strategy {type(trainer.strategy).__name__} is not modelled" if layout.engine is None else
           f"precision {precision} is not modelled" if precision not in PRECISIONS else
           "no input_ids in the batch" if batch is None or not isinstance(ids, torch.Tensor) else "")
    if why:
        return f"estimated memory per rank: none ({why})"
    fused = bool(getattr(task, "uses_fused_loss", lambda: False)())
    mode = getattr(task, "quantize", None)
    # the estimate models quantized weights over the whole model (ddp, zero); a pipeline stage's share is not
    quantized = Quantized(mode, task.quantization) if mode and layout.pp == 1 else None
    frozen_models = frozen_models_of(task).values()  # a reference copy has the model's config, a teacher its own
    configs = [getattr(m, "config", config) for m in frozen_models]
    optimizer = getattr(getattr(task, "optim", None), "name", "adamw")  # --model.optim.name: its states by role
    est, _ = estimate_layout(config, tp=layout.tp, pp=layout.pp, dp=layout.dp, stage=layout.zero_stage,
                             engine=layout.engine, batch_size=batch, seq_len=int(ids.shape[-1]), precision=precision,
                             fused_loss=fused, offload_optimizer=layout.offload_optimizer,
                             offload_params=layout.offload_params, cp=layout.cp, ep=layout.ep,
                             quantized=quantized, frozen_configs=configs, offload_device=layout.offload_device,
                             optimizer=optimizer)
    frozen = [("frozen models", est.frozen)] if configs else []
    parts = ", ".join(f"{name} {v / MIB:.1f}" for name, v in (
        ("parameters", est.params), ("gradients", est.grads),
        ("optimizer" if optimizer == "adamw" else f"optimizer ({optimizer})", est.optim), *frozen,
        ("activations", est.activations), ("loss", est.loss)))
    host = f"; {est.host / MIB:.1f} MiB offloaded to host" if est.host else ""
    if est.disk:
        nvme = getattr(trainer.strategy, "nvme_path", None)
        host = (f"; {est.host / MIB:.1f} MiB on the host (swap buffers), {est.disk / MIB:.1f} MiB on disk "
                f"(swap files under {nvme})")
    note = "; full fine-tuning figures: frozen weights need less" if getattr(task, "parameter_counts", (0, 0))[1] \
        != getattr(task, "parameter_counts", (0, 0))[0] else ""
    held = "; the estimate counts the quantized weights at full precision (pipeline)" if mode and not quantized else ""
    if mode:  # what this rank holds (its FSDP2 shards under zero3, its stages under pp), measured
        nbytes, numel = quantized_bytes(task.model)
        held += (f"; quantized frozen weights ({describe(mode, task.quantization)}): {numel:,} held in "
                f"{nbytes / MIB:.2f} MiB on this rank = {nbytes / max(2 * numel, 1):.3f}x their bf16 bytes")
    device = " on the device" if est.disk else ""
    return (f"estimated memory per rank (lightning_llm estimate, {precision}): {est.total / MIB:.1f} MiB{device} = "
            f"{parts} MiB{host}{note}{held}")


def _frozen_line(task: Any) -> str | None:
    """What this rank holds of the task's frozen models (placed like the model: ``task.frozen_models()``), measured
    (the memory line's "frozen models" is their estimate)."""
    parts = []
    for models, what in ((frozen_models_of(task), "frozen models placed like the model (forward only, no gradients "
                                                  "or optimizer states)"),
                         (scoring_models_of(task), "scoring models (tensor-parallel and ZeRO-3 shards, whole on a "
                                                   "pipeline rank)")):
        if models:
            held = sum(model_state_bytes(m, [])["params"] for m in models.values())
            parts.append(f"{what}: {', '.join(models)}; {held / MIB:.2f} MiB on this rank")
    return "; ".join(parts) or None


# ----------------------------------------------------------------------------------------------------- model summary
def _without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    return [(name, values) for name, values in summary_data if name != "FLOPs"]


class ModelSummaryNoFlops(ModelSummary):
    """Lightning's :class:`ModelSummary` table without the FLOPs column and total (see the module doc)."""

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import (
            _format_summary_table,
        )

        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *_without_flops(summary_data))
        log_summary = logging.getLogger("lightning.pytorch.callbacks.model_summary")
        log_summary.info("\n" + "\n".join(ln for ln in table.splitlines() if "Total Flops" not in ln))


class RichModelSummaryNoFlops(RichModelSummary):
    """Lightning's :class:`RichModelSummary` without the FLOPs column and total (see the module doc)."""

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        from lightning.pytorch.utilities.model_summary import (
            get_formatted_model_size,
            get_human_readable_count,
        )
        from rich import get_console
        from rich.table import Table

        data = _without_flops(summary_data)
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in data:
            table.add_column(name, justify="right" if name.startswith(("Params", "In sizes", "Out sizes")) else
                             "left", style="dim" if name == " " else None, no_wrap=name == "Name")
        for row in zip(*(values for _, values in data)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
                ("Trainable params", get_human_readable_count(int(trainable_parameters))),
                ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
                ("Total params", get_human_readable_count(int(total_parameters))),
                ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                ("Modules in train mode", total_training_modes["train"]),
                ("Modules in eval mode", total_training_modes["eval"])):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)


def replace_model_summary(trainer: pl.Trainer) -> None:
    """Swap Lightning's own summary callback (``enable_model_summary``) for the same one without FLOPs, keeping its
    depth; a user's own summary subclass is left alone."""
    swaps = {ModelSummary: ModelSummaryNoFlops, RichModelSummary: RichModelSummaryNoFlops}
    for i, cb in enumerate(trainer.callbacks):
        new = swaps.get(type(cb))
        if new is not None:
            replacement = new(max_depth=cb._max_depth, **cb._summarize_kwargs)
            trainer.callbacks[i] = replacement
