"""The non-finite guard: a NaN/inf loss or gradient never reaches the weights, and no checkpoint holds one.

A callback that every task installs (``LLMTask.configure_callbacks``), so a subclass overriding the task's own hooks
cannot switch it off. Checked on every layout without knowing it, at four points:

1. **the loss**, on every rank before backward (``LLMTask.training_step`` asks the guard);
2. **the gradients**, once they are reduced and before clipping and the optimizer step (``on_before_optimizer_step``):
   each rank looks at the gradients it holds (a replica, a tensor shard, a pipeline stage, a ZeRO partition) and the
   decision is all-reduced, so every rank takes the same branch;
3. **engines that step internally** (DeepSpeed keeps its gradients in its own buffers): after the step, whether it
   was applied (DeepSpeed skips a step on overflow) and whether its gradient norm was finite;
4. **every checkpoint save**: weights that are not finite are refused, so the checkpoint a stop message names is
   always a finite one.

``policy="stop"`` (default) raises :class:`NonFiniteLossError` naming the step, before the optimizer step;
``"skip"`` drops the batch or step, logs ``skipped_steps`` and goes on. A dynamic fp16 loss scaler skips overflowing
steps itself (the normal start of an fp16 run), whatever the policy. More than ``max_consecutive_skips`` skipped steps
in a row stop the run: a diverged run must not go on to exit 0 with a flat loss.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_llm.models.quantize import is_quantized

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


@torch.no_grad()
def all_finite(tensors: Iterable[Tensor | None]) -> bool:
    """Whether every element of every tensor (its local part) is finite, in a number of kernels that does not grow
    with the number of tensors and one host sync: per device and dtype one ``torch._foreach_norm`` for the infinity
    norm (max |x|: an inf is its own maximum, and a finite tensor's never overflows, as an L2 norm could) and one for
    the L1 norm (a sum: NaN propagates through it whatever the device's max reduction does with NaN), then one
    ``isfinite`` over them all. Quantized (frozen) weights are not read."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = _local(t)
        # torchao's quantized weights (frozen, never saved) take no foreach kernels: their plain parts are checked
        if local.numel() and local.is_floating_point() and not is_quantized(local):
            groups.setdefault((local.device, local.dtype), []).append(local)
    if not groups:
        return True
    # A sum of finite |x| is never NaN (it overflows to inf at worst), so only its NaN-ness is read.
    bad = [(~torch.stack(torch._foreach_norm(group, float("inf"))).isfinite()
            | torch.stack(torch._foreach_norm(group, 1.0)).isnan()).any() for group in groups.values()]
    device = bad[0].device
    return not bool(torch.stack([b.to(device) for b in bad]).any())


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

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped, self.in_a_row = int(state_dict["skipped"]), int(state_dict["in_a_row"])

    # ------------------------------------------------------------------------------------------ the loss
    def loss_is_finite(self, task: Any, loss: Tensor) -> bool:
        """Called by the task on every rank before backward; starts a new step's bookkeeping."""
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
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.check_gradients(pl_module, optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.after_step(pl_module)  # Lightning runs checkpoint callbacks last: this precedes any save of the step

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self.check_save(pl_module)

    # ------------------------------------------------------------------------------------------ checks
    def check_gradients(self, task: Any, optimizer: Any) -> None:
        """Before clipping and the optimizer step (grads reduced; unscaled under fp16)."""
        if self.skipping:
            return  # the loss was non-finite: no backward ran, the step is already counted as skipped
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        grads += [p.grad for p in task.parameters()]  # a wrapped optimizer may list flat or local copies instead
        if _everywhere(task, all_finite(grads)):
            if _deepspeed_engine(task) is None:
                self.in_a_row = 0
            return
        what = f"the gradients hold NaN/inf (the loss was finite) at {self.where(task)}"
        if _loss_scaler(task) is not None:
            self._skipped(task, f"{what}; the fp16 loss scaler skips this step and lowers its scale")
            return
        if self.policy == "stop":
            self._stop(task, f"{what}: stopping before the optimizer step")
        for p in task.parameters():
            p.grad = None  # the optimizer step then leaves every weight and moment as it is
        self._skipped(task, what)

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

    def _skipped(self, task: Any, what: str) -> None:
        self.skipped += 1
        self.in_a_row += 1
        log.warning("%s: step skipped (%d so far, %d in a row)", what, self.skipped, self.in_a_row)
        task.log("skipped_steps", float(self.skipped), on_step=True, on_epoch=False, rank_zero_only=True)
        if self.in_a_row > self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{self.in_a_row} optimizer steps in a row were skipped for NaN/inf loss or gradients, the last at "
                f"{self.where(task)} (--model.optim.max_consecutive_skips={self.max_consecutive_skips}): the run has "
                f"diverged. {self._last_good(task, 'a lower --model.optim.lr')}")
