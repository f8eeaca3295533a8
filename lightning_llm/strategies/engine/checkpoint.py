"""Checkpoint IO of the native engine, written once for every layout (tp, pp, zero1/2/3, 3d).

Every layout saves the layout-free DCP format of :mod:`.hybrid_checkpoint` (tensors keyed by their global names,
optimizer states included, the layout in the metadata), so a run resumes at any other layout; with
``save_distributed_checkpoint=False`` rank 0 writes one consolidated file of full weights instead (for export and
evaluation, not for resuming). Lightning's own model/optimizer state-dict paths are bypassed: the DCP writer takes the
module's (sharded) state dict itself, and loading happens in :meth:`LayoutFreeCheckpointing.load_checkpoint`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_llm.checkpoint import check_engine_dir, check_torch_file, loading, verify_checkpoint
from lightning_llm.reliability import SaveFault
from lightning_llm.strategies.engine import hybrid_checkpoint as hckpt

__all__ = ["DefaultGroupCollectives", "LayoutFreeCheckpointing"]


class DefaultGroupCollectives(ParallelStrategy):
    """The Strategy's collective API (barrier, object broadcast, reduce of logged values) over the default group,
    with a replicated DTensor (the loss under ``loss_parallel``) reduced as its full value."""

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, Tensor) else tensor


class LayoutFreeCheckpointing(ParallelStrategy):
    """Save and load of :mod:`.hybrid_checkpoint` checkpoints for a parallel strategy that provides
    :meth:`layout`, :attr:`pipelined` and ``save_distributed_checkpoint`` (``ParallelEngine``)."""

    save_distributed_checkpoint: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._save_fault = SaveFault()  # fault injection for tests (LIGHTNING_LLM_FAULT=kill:save=N)

    @property
    def pipelined(self) -> bool:
        raise NotImplementedError

    def layout(self) -> dict[str, Any]:
        """The layout recorded in the checkpoint's metadata (degrees and ZeRO stage)."""
        raise NotImplementedError

    def _name(self) -> str:
        return getattr(self, "strategy_name", type(self).__name__)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # optimizer states are loaded by parameter name in load_checkpoint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the DCP writer takes the module's (sharded) state dict itself

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def full_state_dict(self) -> dict[str, Tensor]:
        """Consolidated (unsharded) weights of the LightningModule on rank 0, ``{}`` elsewhere (a collective;
        ``pp == 1``)."""
        if self.pipelined:
            raise ValueError("full_state_dict(): a pipeline rank holds only its stages; read the saved checkpoint "
                             "with lightning_llm export instead")
        return hckpt.full_weights(self.lightning_module)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"strategy={self._name()}: save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(str(filepath)))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        if not self.save_distributed_checkpoint:
            weights = self.full_state_dict()
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint({**meta, "state_dict": weights, "optimizer_states": []}, path)
            self.barrier()
            return
        self._save_fault.begin(path)
        hckpt.save_hybrid(path, module=self.lightning_module, optimizers=self.optimizers, metadata=meta,
                          layout=self.layout(), is_global_zero=self.is_global_zero, barrier=self.barrier,
                          on_shards_written=self._save_fault.shards_written)
        self._save_fault.published(path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        verify_checkpoint(path, name=f"--ckpt_path={path}")  # nothing is unpickled before this check
        if path.is_file() and not fitting:
            return self._load_full_weights(path)

        # A missing or cut shard fails in DCP on some ranks only: check the files first, the same on every rank.
        check_engine_dir(path, name=f"--ckpt_path={path}", meta_file=hckpt.META_FILE)
        if not hckpt.is_hybrid_checkpoint(path):
            raise FileNotFoundError(
                f"--ckpt_path={path}: not a checkpoint directory of the parallel engine (tp, pp, zero1/2/3, 3d). "
                "A plain Lightning .ckpt resumes with strategy=auto/ddp; convert it with "
                "lightning_llm.strategies.engine.hybrid_checkpoint.from_lightning_checkpoint (weights and loop state, fresh "
                "optimizer state) to resume it here")
        return hckpt.load_hybrid(path, module=self.lightning_module, optimizers=self.optimizers if fitting else [],
                                 strict=self.lightning_module.strict_loading)

    def _load_full_weights(self, path: Path) -> dict[str, Any]:
        """Evaluation from a consolidated file: full tensors into the (sharded, split) module."""
        check_torch_file(path, name=f"--ckpt_path={path}")
        with loading(f"--ckpt_path={path}"):
            checkpoint = self.checkpoint_io.load_checkpoint(path)
        hckpt.load_full_weights(self.lightning_module, checkpoint["state_dict"], strict=not self.pipelined)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
