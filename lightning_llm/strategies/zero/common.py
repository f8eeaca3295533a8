"""What both ZeRO engines share (the native preset :class:`~lightning_llm.strategies.presets.ZeroStrategy` and
:class:`~lightning_llm.strategies.zero.deepspeed.DeepSpeedZeroStrategy`): the checks on their common arguments, and
the consolidated weights file (``strategy.export_consolidated`` / the :class:`ExportWeights` callback: the full
backbone ``state_dict``, or only the LoRA adapter, as one ``torch.save`` file of full tensors, never shards).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from torch import nn
from typing_extensions import override

from lightning_llm.files import atomic_open

__all__ = ["Engine", "ExportWeights", "check_adapter", "validate_zero_args", "write_export"]

log = logging.getLogger(__name__)

Engine = Literal["native", "deepspeed"]


def validate_zero_args(*, stage: int, offload_optimizer: bool, offload_params: bool, engine: str) -> None:
    """Raise ``ValueError`` naming the parameter for a configuration no engine can run."""
    if engine not in ("native", "deepspeed"):
        raise ValueError(f"ZeroStrategy: engine={engine!r}, must be 'native' or 'deepspeed'")
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeroStrategy: stage={stage!r}, must be 1, 2 or 3")
    if offload_params and stage != 3:
        raise ValueError(f"ZeroStrategy: offload_params=True needs stage=3 (got stage={stage}); parameters are only "
                         "partitioned, hence offloadable, in stage 3")
    if engine == "native" and stage == 3 and offload_optimizer != offload_params:
        raise ValueError("ZeroStrategy(engine='native', stage=3): offload_optimizer and offload_params must be equal - "
                         "FSDP2's CPUOffloadPolicy moves parameter shards, their gradients and hence the optimizer "
                         "states together")


def check_adapter(module: nn.Module, adapter_only: bool) -> None:
    """Raise on every rank (before any collective) when an adapter export is asked of a model without one."""
    if adapter_only and not any("lora_" in n for n, _ in module.named_parameters()):
        raise ValueError("export_consolidated(adapter_only=True): the model has no lora_* parameters")


def write_export(sd: dict[str, torch.Tensor], path: _PATH, *, adapter_only: bool, rank0: bool,
                 barrier: Any) -> Path | None:
    """``torch.save`` ``sd`` (only ``lora_*`` tensors for ``adapter_only``) to ``path`` on rank 0, then a barrier."""
    if adapter_only:
        sd = {k: v for k, v in sd.items() if "lora_" in k}
    out = Path(path)
    if rank0:
        with atomic_open(out, "wb") as f:
            torch.save(sd, f)
        log.info("exported %d tensors (%s elements) to %s", len(sd), f"{sum(v.numel() for v in sd.values()):,}", out)
    barrier()
    return out if rank0 else None


class ExportWeights(pl.Callback):
    """At the end of ``fit``, write the consolidated backbone weights (or only the LoRA adapter) to ``path``."""

    def __init__(self, path: str, adapter_only: bool = False) -> None:
        """
        Args:
            path: Output file (``torch.save`` of a ``state_dict`` with full tensors).
            adapter_only: Only ``lora_*`` tensors.
        """
        self.path = path
        self.adapter_only = adapter_only

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        export = getattr(trainer.strategy, "export_consolidated", None)
        if export is not None:
            export(self.path, adapter_only=self.adapter_only)
            return
        module = getattr(pl_module, "model", None) or pl_module
        check_adapter(module, self.adapter_only)
        sd = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        write_export(sd, self.path, adapter_only=self.adapter_only, rank0=trainer.is_global_zero,
                      barrier=trainer.strategy.barrier)
