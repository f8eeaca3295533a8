"""DeepSpeed optimizers by name for :class:`~.deepspeed.DeepSpeedZeroStrategy`.

Optimizers (``optimizer=``), checked against what this DeepSpeed build provides before training starts:

* ``None`` (default): the task's ``configure_optimizers`` (torch AdamW + its LR schedule), wrapped by ZeRO.
* ``adam`` / ``adamw``: DeepSpeed's ``FusedAdam`` on CUDA; on CPU, torch's Adam/AdamW (DeepSpeed's ``torch_adam``).
* ``cpu_adam``: ``DeepSpeedCPUAdam`` (a C++ op JIT-compiled on first use; the default optimizer with
  ``offload_optimizer``). If it fails to build, the error says so and names ``optimizer=adamw`` as the fallback.
* ``lamb``: ``FusedLamb`` (a CUDA op): rejected on CPU.
* ``onebitadam`` / ``zerooneadam``: DeepSpeed removed 1-bit Adam, 0/1 Adam and their compressed-communication
  backends (NCCL/MPI) before 0.19; with the installed version they are rejected with that message.

All named optimizers take lr/betas/eps/weight decay and the parameter groups from the task's optimizer, and keep the
task's LR schedule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from lightning_llm.strategies.zero.ops import check_build_lock

__all__ = ["OPTIMIZERS", "build_named_optimizer", "check_optimizer", "drop_empty_groups"]

OPTIMIZERS = ("adam", "adamw", "cpu_adam", "lamb", "onebitadam", "zerooneadam")


def check_optimizer(name: str | None, *, on_cuda: bool) -> None:
    """Raise ``ValueError`` naming ``optimizer=`` when it cannot run with this DeepSpeed build and device."""
    if name is None:
        return
    if name not in OPTIMIZERS:
        raise ValueError(f"DeepSpeedZeroStrategy: optimizer={name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if name in ("onebitadam", "zerooneadam"):
        import deepspeed

        raise ValueError(f"DeepSpeedZeroStrategy: optimizer={name!r} is not available: DeepSpeed {deepspeed.__version__}"
                         " no longer ships 1-bit Adam / 0/1 Adam or their NCCL/MPI compressed-communication backends "
                         "(and there is none for gloo/CPU); use optimizer='adamw'")
    if name == "lamb" and not on_cuda:
        raise ValueError("DeepSpeedZeroStrategy: optimizer='lamb' is DeepSpeed's FusedLamb, a CUDA kernel; it cannot "
                         "run on CPU")


def build_named_optimizer(name: str, template: Optimizer, *, on_cuda: bool) -> Optimizer:
    """A DeepSpeed/torch optimizer by name with ``template``'s param groups and hyperparameters."""
    groups = [dict(g) for g in template.param_groups]
    d = template.defaults
    kw = dict(lr=d["lr"], betas=d.get("betas", (0.9, 0.999)), eps=d.get("eps", 1e-8),
              weight_decay=d.get("weight_decay", 0.0))
    if name == "cpu_adam":
        check_build_lock("cpu_adam")
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
        except Exception as e:  # noqa: BLE001 - a JIT build failure has many exception types
            raise RuntimeError(f"DeepSpeedZeroStrategy: optimizer='cpu_adam' needs DeepSpeed's cpu_adam C++ op, which "
                               f"failed to build here ({type(e).__name__}: {e}); use optimizer='adamw' (torch AdamW "
                               "on the offloaded states) instead") from e
    if name in ("adam", "adamw"):
        if on_cuda:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, adam_w_mode=name == "adamw", **kw)
        return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(groups, **kw)
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        kw.pop("betas")
        return FusedLamb(groups, betas=d.get("betas", (0.9, 0.999)), **kw)
    check_optimizer(name, on_cuda=on_cuda)
    raise AssertionError("unreachable")


def drop_empty_groups(optimizer: Optimizer, scheduler: Any) -> None:
    """Remove parameter groups without parameters (e.g. the no-decay group when only LoRA matrices train), as
    DeepSpeed does in ``initialize`` - but together with the scheduler's per-group lists, so they stay aligned."""
    empty = [i for i, g in enumerate(optimizer.param_groups) if not g["params"]]
    for i in reversed(empty):
        del optimizer.param_groups[i]
        if scheduler is None:
            continue
        for attr in ("base_lrs", "lr_lambdas", "_last_lr", "min_lrs", "max_lrs"):
            values = getattr(scheduler, attr, None)
            if isinstance(values, list) and len(values) > i:
                del values[i]
