"""The non-finite guard: a NaN/inf loss or gradient never reaches the weights, and no checkpoint holds one.

A callback that every task installs (``LLMTask.configure_callbacks``), so a subclass overriding the task's own hooks
cannot switch it off. Checked on every layout without knowing it, at four points:

1. **the loss**, on every rank (``LLMTask.training_step`` hands it to :meth:`NonFiniteGuard.note_loss`);
2. **the gradients**, once they are reduced and before clipping and the optimizer step (``on_before_optimizer_step``):
   each rank looks at the gradients it holds (a replica, a tensor shard, a pipeline stage, a ZeRO partition), and
   the flags (gradients, the loss of any micro-batch of the step) are all-reduced, so every rank takes the same
   branch;
3. **engines that step internally** (DeepSpeed keeps its gradients in its own buffers): after the step, whether it
   was applied (DeepSpeed skips a step on overflow) and whether its gradient norm was finite;
4. **every checkpoint save**: weights that are not finite are refused, so the checkpoint a stop message names is
   always a finite one.

Decided on the device, read once per optimizer step (a host read waits for the device and leaves it idle while the
host queues work again): with torch's fused optimizer (``optim.config.build_adamw``) the all-reduced flag is its
``found_inf`` (the kernel skips the update of every weight, moment and step counter on the device, as under a
``GradScaler``), and the host reads a copy of the flag, made before the optimizer's kernels, at the end of the
batch, without waiting for them. Elsewhere (another optimizer, DeepSpeed, an offloaded ZeRO optimizer, or any rank
of the run without the fused kernel) it is read before the step, whose gradients are then dropped.

``policy="stop"`` (default) raises :class:`NonFiniteLossError` naming the step, whose update was not applied;
``"skip"`` drops the step (a non-finite loss of any micro-batch drops its whole optimizer step), logs
``skipped_steps`` and goes on. A dynamic fp16 loss scaler skips overflowing
steps itself (the normal start of an fp16 run), whatever the policy. More than ``max_consecutive_skips`` skipped steps
in a row stop the run: a diverged run must not go on to exit 0 with a flat loss.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning_llm.models.quantize import is_quantized
from lightning_llm.tasks.callbacks.progress import HostCopy, host_copy

log = logging.getLogger(__name__)

Policy = Literal["stop", "skip"]


class NonFiniteLossError(RuntimeError):
    """A NaN/inf training loss, gradient or weight under ``--model.nonfinite_loss=stop``."""


def _local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's shard, DeepSpeed ZeRO-3's partition, or ``t`` itself."""
    if hasattr(t, "to_local"):
        return t.to_local()
    part = getattr(t, "ds_tensor", None)  # DeepSpeed ZeRO-3: the parameter itself is an empty placeholder
    return part if part is not None else t


def _groups(tensors: Iterable[Tensor | None]) -> list[list[Tensor]]:
    """The local parts of the distinct floating-point tensors with elements, by device and dtype (one foreach call
    each). Quantized (frozen) weights are left out: torchao's tensors take no foreach kernels."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = _local(t)
        if local.numel() and local.is_floating_point() and not is_quantized(local):
            groups.setdefault((local.device, local.dtype), []).append(local)
    return list(groups.values())


def _any(flags: list[Tensor]) -> Tensor:
    device = flags[0].device
    return torch.stack([f.reshape(()).to(device) for f in flags]).any()


@torch.no_grad()
def gradients_nonfinite(grads: Iterable[Tensor | None]) -> Tensor | None:
    """A 0-d bool tensor on the device: whether an element of the gradients (their local parts) is NaN or inf, in one
    pass per device and dtype: torch's fused check of a ``GradScaler`` (``_amp_foreach_non_finite_check_and_unscale_``)
    at scale 1, exact element by element, which writes every gradient back unchanged (x * 1.0). Nothing is read back
    to the host; ``None`` without floating-point elements. (Two read-only norms, as :func:`all_finite` takes, cost 17x
    the time on the CPU: 97 against 5.8 ms over 27M fp32 elements, one thread.)"""
    flags = []
    for group in _groups(grads):
        found = torch.zeros(1, dtype=torch.float32, device=group[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.ones_like(found))
        flags.append(found > 0)
    return _any(flags) if flags else None


@torch.no_grad()
def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every tensor (its local part) is finite, read-only (weights at a save), in a number of
    kernels that does not grow with the number of tensors and one host read: per device and dtype one
    ``torch._foreach_norm`` for the infinity norm (max |x|: an inf is its own maximum, and a finite tensor's never
    overflows, as an L2 norm could) and one for the L1 norm (a sum: NaN propagates through it whatever the device's
    max reduction does with NaN), then one ``isfinite`` over them all."""
    # A sum of finite |x| is never NaN (it overflows to inf at worst), so only its NaN-ness is read.
    bad = [(~torch.stack(torch._foreach_norm(group, float("inf"))).isfinite()
            | torch.stack(torch._foreach_norm(group, 1.0)).isnan()).any() for group in _groups(tensors)]
    return not bad or not bool(_any(bad))


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` honours a ``found_inf`` attribute on the device (skips every update when it is
    1.0): torch's fused optimizers, and wrappers that say so (``skips_on_found_inf``, e.g. ZeRO-1/2's)."""
    declared = getattr(optimizer, "skips_on_found_inf", None)
    if declared is not None:
        return bool(declared)
    return (isinstance(optimizer, torch.optim.Optimizer) and bool(optimizer.param_groups)
            and all(g.get("fused") for g in optimizer.param_groups))


class _Pending(NamedTuple):
    """An optimizer step's all-reduced flags ``[gradients, loss]`` on their way to the host, read at batch end."""

    flags: HostCopy
    where: str


def _everywhere(task: Any, ok: bool) -> bool:
    """``ok`` on every rank (a collective under a distributed strategy, so all ranks branch alike)."""
    trainer = task.trainer
    if trainer.world_size > 1:
        return bool(trainer.strategy.reduce_boolean_decision(ok, all=True))
    return ok


def _loss_scaler(task: Any) -> Any:
    """Lightning's fp16 ``GradScaler``, which skips a step with non-finite gradients and lowers its scale."""
    return getattr(task.trainer.precision_plugin, "scaler", None)


def _deepspeed_engine(task: Any) -> Any:
    engine = getattr(task.trainer.strategy, "deepspeed_engine", None)
    return engine if engine is not None and hasattr(engine, "was_step_applied") else None


class NonFiniteGuard(pl.Callback):
    """The guard's decisions and its counters (kept in checkpoints, so a resumed run counts on)."""

    def __init__(self, *, policy: Policy = "stop", max_consecutive_skips: int = 10) -> None:
        if policy not in ("stop", "skip"):
            raise ValueError(f"--model.nonfinite_loss must be 'stop' or 'skip', got {policy!r}")
        if max_consecutive_skips < 1:
            raise ValueError(f"--model.optim.max_consecutive_skips must be >= 1, got {max_consecutive_skips}")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped = 0
        self.in_a_row = 0
        self.skipping = False  # this step's loss was non-finite and skipped (counted once)
        self.saved_step: int | None = None  # global step of the last checkpoint that passed check_save
        self._loss_bad: Tensor | None = None  # a micro-batch loss since the last check was not finite (device bool)
        self._loss: Tensor | None = None  # the last such loss (for the message)
        self._pending: list[_Pending] = []  # steps decided on the device, read at batch end
        self._on_device: bool | None = None  # every rank skips on the device (decided at the first check)
        self._stepping: Any = None  # the optimizer holding this step's found_inf

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped, self.in_a_row = int(state_dict["skipped"]), int(state_dict["in_a_row"])

    # ------------------------------------------------------------------------------------------ the loss
    def note_loss(self, loss: Tensor) -> None:
        """A training micro-batch's loss, on every rank (automatic optimization): whether it is finite joins the
        step's flags on the device (no host read; backward runs, and a non-finite loss drops the step)."""
        self.skipping = False
        loss = loss.detach().float()
        # A tensor-parallel loss (vocab-parallel head) is a DTensor: its local part's flag is all-reduced in _flags
        # with the rest (a DTensor would take the all-reduce as an op it has no sharding rule for).
        bad = ~torch.isfinite(_local(loss)).all()
        first = self._loss_bad is None
        self._loss_bad = bad if first else self._loss_bad | bad
        self._loss = loss if first else torch.where(bad, loss, self._loss)

    def loss_is_finite(self, task: Any, loss: Tensor) -> bool:
        """Read on the host before backward (an engine that steps itself, a manual-optimization task's mini-batch);
        starts a new step's bookkeeping."""
        self.skipping = False
        ok = bool(torch.isfinite(loss.detach()).all())
        return _everywhere(task, ok) if task._trainer is not None else ok

    def on_nonfinite_loss(self, task: Any, loss: Tensor, where: str) -> None:
        """Stop, or count the skipped batch (which then takes no optimizer step)."""
        what = f"train_loss is {float(loss.detach()):.4g} at {where}"
        if self.policy == "stop":
            self._stop(task, f"{what}: stopping before the optimizer step")
        self.skipping = True
        self._skipped(task, what)

    @staticmethod
    def steps_inside_engine(task: Any) -> bool:
        """Whether the optimizer step happens inside an engine that checks overflow itself (DeepSpeed)."""
        return _deepspeed_engine(task) is not None

    # ------------------------------------------------------------------------------------------ callback hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a fit of its own (the same task fitted again may run under another strategy or optimizer)
        self._loss_bad, self._loss, self._pending, self._on_device, self._stepping = None, None, [], None, None

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.check_gradients(pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning runs checkpoint callbacks last: these precede any save of the step
        self.settle(pl_module)
        self.after_step(pl_module)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.check_save(pl_module)

    # ------------------------------------------------------------------------------------------ checks
    def check_gradients(self, task: Any, optimizer: Any) -> None:
        """Before clipping and the optimizer step (grads reduced; unscaled under fp16): the step's flags, all-reduced
        on the device; skipped there (``found_inf``) and read at batch end, or read now (see the module doc)."""
        if self.skipping:
            return  # the loss was non-finite: no backward ran, the step is already counted as skipped
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        grads += [p.grad for p in task.parameters()]  # a wrapped optimizer may list flat or local copies instead
        flags = self._flags(task, gradients_nonfinite(grads))
        where = self.where(task)
        if self._on_device is None:
            self._on_device = self._skips_on_device(task, optimizer)
        if self._on_device:
            if _loss_scaler(task) is None:  # (a GradScaler skips by itself, from its own found_inf)
                optimizer.found_inf = flags.amax()  # 1.0: the fused kernel leaves every weight, moment and step
                self._stepping = optimizer
            self._pending.append(_Pending(host_copy(flags), where))  # read at batch end (settle)
            return
        grads_bad, loss_bad = (v > 0 for v in flags.tolist())
        if not (grads_bad or loss_bad):
            if _deepspeed_engine(task) is None:
                self.in_a_row = 0
            return
        what = self._what(task, where, grads_bad=grads_bad, loss_bad=loss_bad)
        if _loss_scaler(task) is not None:
            self._skipped(task, f"{what}; the fp16 loss scaler skips this step and lowers its scale")
            return
        if self.policy == "stop":
            self._stop(task, f"{what}: stopping before the optimizer step")
        for p in task.parameters():
            p.grad = None  # the optimizer step then leaves every weight and moment as it is
        self._skipped(task, what)

    def settle(self, task: Any) -> None:
        """At batch end: read the flags of the steps skipped or taken on the device (one read for all of them; their
        copies were made before the optimizer's kernels, so the read does not wait for those), then count, stop or
        go on."""
        if self._stepping is not None:
            del self._stepping.found_inf
            self._stepping = None
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.cat([p.flags.wait() for p in pending]).tolist()
        for i, p in enumerate(pending):
            grads_bad, loss_bad = values[2 * i] > 0, values[2 * i + 1] > 0
            if not (grads_bad or loss_bad):
                self.in_a_row = 0
                continue
            what = self._what(task, p.where, grads_bad=grads_bad, loss_bad=loss_bad)
            if _loss_scaler(task) is not None:
                self._skipped(task, f"{what}; the fp16 loss scaler skipped this step and lowered its scale", p.where)
                continue
            if self.policy == "stop":
                self._stop(task, f"{what}: stopped, the step's update was not applied")
            self._skipped(task, f"{what}; its update was not applied", p.where)

    def _flags(self, task: Any, grads_bad: Tensor | None) -> Tensor:
        """``[gradients, loss]`` float32 flags of this step on the root device, the maximum over every rank (one
        all-reduce on the device, no host read)."""
        device = task.trainer.strategy.root_device if task._trainer is not None else torch.device("cpu")
        none = torch.zeros((), dtype=torch.bool, device=device)
        loss_bad, self._loss_bad = self._loss_bad, None
        flags = torch.stack([(none if f is None else f.to(device)) for f in (grads_bad, loss_bad)]).float()
        if task._trainer is not None and task.trainer.world_size > 1 and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags

    def _skips_on_device(self, task: Any, optimizer: Any) -> bool:
        """Whether every rank's step is skipped on the device (its fused optimizer, or a GradScaler's own skip), so
        the flags can wait for the end of the batch; read once, at the first step."""
        ok = _deepspeed_engine(task) is None and (_loss_scaler(task) is not None or skips_on_device(optimizer))
        if task._trainer is None or task.trainer.world_size == 1 or not dist.is_initialized():
            return ok
        t = torch.full((), float(ok), device=task.trainer.strategy.root_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t)

    def _what(self, task: Any, where: str, *, grads_bad: bool, loss_bad: bool) -> str:
        if loss_bad:
            value = float(self._loss) if self._loss is not None else float("nan")
            return (f"train_loss is {value:.4g} at {where}" if not math.isfinite(value)
                    else f"train_loss is NaN/inf on another rank at {where}")
        return f"the gradients hold NaN/inf (the loss was finite) at {where}"

    def after_step(self, task: Any) -> None:
        """After an optimizer step taken inside an engine (DeepSpeed): its own overflow check decided."""
        engine = _deepspeed_engine(task)
        if engine is None:
            return
        norm = engine.get_global_grad_norm()
        # DeepSpeed's group-norm helpers report a NaN/inf norm as -1
        bad_norm = norm is not None and (norm == -1 or not torch.isfinite(torch.as_tensor(float(norm))).item())
        if engine.was_step_applied():
            if bad_norm:  # applied a non-finite update: the weights are lost, stop before any checkpoint
                self._stop(task, f"DeepSpeed applied a step with gradient norm {norm} at "
                                 f"{self.where(task, stepped=True)}; the weights now hold NaN/inf and were not saved")
            self.in_a_row = 0
            return
        what = f"DeepSpeed skipped the optimizer step at {self.where(task, stepped=True)} (gradient overflow: NaN/inf)"
        fp16 = bool(getattr(engine, "fp16_enabled", lambda: False)())
        if self.skipping:
            return  # a skipped non-finite loss: DeepSpeed skipped its step, as it should (already counted)
        if self.policy == "stop" and not fp16:
            self._stop(task, what)
        self._skipped(task, what)

    def check_save(self, task: Any) -> None:
        """At every checkpoint save: refuse weights that are not finite (nothing is written; the previous stays)."""
        if not _everywhere(task, all_finite(task.parameters())):
            before = (f"the previous one (step {self.saved_step}) holds finite weights (checked at save)"
                      if self.saved_step is not None else "no checkpoint of this run was saved before")
            raise NonFiniteLossError(f"refusing to save a checkpoint at {self.where(task)}: the weights hold NaN/inf; "
                                     f"nothing was written, and {before}")
        self.saved_step = task.global_step

    # ------------------------------------------------------------------------------------------ outcomes
    @staticmethod
    def where(task: Any, *, stepped: bool = False) -> str:
        """The step as the loss messages name it (``global_step`` before it; ``stepped``: counted already)."""
        return f"step {task.global_step - int(stepped)} (epoch {task.current_epoch})"

    @staticmethod
    def _last_good(task: Any, advice: str) -> str:
        """Where to go on from: the last checkpoint (finite: every save checks) and ``advice``."""
        cb = getattr(task.trainer, "checkpoint_callback", None)
        path = (getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")) if cb is not None else ""
        if path:
            return (f"The last checkpoint, {path}, was saved before it and holds finite weights (checked at save); "
                    f"resume from it with --ckpt_path and {advice}")
        return f"No checkpoint of this run was saved; restart with {advice}"

    def _stop(self, task: Any, what: str) -> None:
        advice = "a lower --model.optim.lr (or --model.nonfinite_loss=skip)"
        raise NonFiniteLossError(f"{what}. {self._last_good(task, advice)}")

    def _skipped(self, task: Any, what: str, where: str | None = None) -> None:
        """Count a skipped step (``where``: the step as its check named it; default: now)."""
        self.skipped += 1
        self.in_a_row += 1
        log.warning("%s: step skipped (%d so far, %d in a row)", what, self.skipped, self.in_a_row)
        task.log("skipped_steps", float(self.skipped), on_step=True, on_epoch=False, rank_zero_only=True)
        if self.in_a_row > self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{self.in_a_row} optimizer steps in a row were skipped for NaN/inf loss or gradients, the last at "
                f"{where or self.where(task)} (--model.optim.max_consecutive_skips={self.max_consecutive_skips}): "
                f"the run has diverged. {self._last_good(task, 'a lower --model.optim.lr')}")
