"""Checkpoint IO of the native engine, written once for every layout (tp, pp, zero1/2/3, 3d).

Every layout saves the layout-free DCP format of :mod:`.hybrid_checkpoint` (tensors keyed by their global names,
optimizer states included, the layout in the metadata), so a run resumes at any other layout; with
``save_distributed_checkpoint=False`` rank 0 writes one consolidated file of full weights instead (for export and
evaluation, not for resuming). Lightning's own model/optimizer state-dict paths are bypassed: the DCP writer takes the
module's (sharded) state dict itself, and loading happens in :meth:`LayoutFreeCheckpointing.load_checkpoint`. With
``async_save`` a fit's saves are staged in host memory and written in the background (:mod:`.async_save`), in the
same format and with the same atomic finish.
"""

from __future__ import annotations

import copy
import shutil
from functools import partial
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
from lightning_llm.strategies.engine.async_save import BackgroundSaves

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
    async_save: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._save_fault = SaveFault()  # fault injection for tests (LIGHTNING_LLM_FAULT=kill:save=N)
        self._background_saves: BackgroundSaves | None = None  # async_save's writer, from set-up of a fit to teardown

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
        if self.save_distributed_checkpoint:
            self._save_sharded(path, meta)
        else:
            self._save_consolidated(path, meta)

    def _save_sharded(self, path: Path, meta: dict[str, Any]) -> None:
        """The layout-free directory (:func:`.hybrid_checkpoint.write_hybrid`), now or in the background."""
        save = self._save_fault.begin(path)
        state, opt_meta = hckpt.checkpoint_state(self.lightning_module, self.optimizers)
        meta_bytes = hckpt.meta_bytes(meta, layout=self.layout(), optimizer_meta=opt_meta) if self.is_global_zero \
            else b""
        shards_written = partial(self._save_fault.shards_written, save=save)
        background = self._saving_in_background()
        if background is None:
            hckpt.write_hybrid(path, state, meta_bytes, is_global_zero=self.is_global_zero,
                               on_shards_written=shards_written)
            self._save_fault.published(path, save=save)
            return
        staged = background.stage(state, version=self._state_version())

        def write() -> None:
            hckpt.write_hybrid(path, staged, meta_bytes, is_global_zero=self.is_global_zero, group=background.group,
                               on_shards_written=shards_written)
            self._save_fault.published(path, save=save)

        background.submit(path, write)

    def _save_consolidated(self, path: Path, meta: dict[str, Any]) -> None:
        """One file of full weights from rank 0 (``save_distributed_checkpoint=False``), now or in the background."""
        weights = self.full_state_dict()
        background = self._saving_in_background()
        if background is None:
            if self.is_global_zero:
                self.checkpoint_io.save_checkpoint({**meta, "state_dict": weights, "optimizer_states": []}, path)
            self.barrier()
            return
        full = {**copy.deepcopy(meta), "state_dict": background.stage(weights, version=self._state_version()),
                "optimizer_states": []}
        background.submit(path, lambda: hckpt.every_rank_agrees(
            lambda: self.checkpoint_io.save_checkpoint(full, path) if self.is_global_zero else None,
            background.group))

    # ------------------------------------------------------------------------------------------ background saves
    def setup_background_saves(self, trainer: Any) -> None:
        """Start the background writer of ``async_save`` at set-up of a fit (every rank: a collective); refuse what
        it cannot keep, before training."""
        if not self.async_save or self._background_saves is not None:
            return
        for cb in getattr(trainer, "checkpoint_callbacks", []):
            if getattr(cb, "save_last", None) == "link":
                raise ValueError("--trainer.strategy.async_save=true: ModelCheckpoint(save_last='link') would link "
                                 "last.ckpt to a checkpoint still being written in the background; use "
                                 "save_last=true")
        self._background_saves = BackgroundSaves(device=self.root_device, timeout=getattr(self, "_timeout", None))

    def _saving_in_background(self) -> BackgroundSaves | None:
        module = self.lightning_module
        if self._background_saves is None or module is None or module.trainer.state.fn != TrainerFn.FITTING:
            return None
        return self._background_saves

    def _state_version(self) -> tuple[int, int]:
        """What identifies the state a checkpoint holds: two saves of one step and batch hold the same tensors."""
        trainer = self.lightning_module.trainer
        return trainer.global_step, trainer.fit_loop.total_batch_idx

    def wait_for_checkpoints(self) -> None:
        """Wait until every checkpoint saved so far is written (``async_save``: the background writes in flight);
        raises :class:`~.async_save.BackgroundSaveError` for one that failed. A no-op for synchronous saves."""
        if self._background_saves is not None:
            self._background_saves.wait()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._background_saves is not None:
            self._background_saves.raise_if_failed()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        if self._background_saves is not None:  # fit ends once the last checkpoint is written
            self._background_saves.wait()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        saves, self._background_saves = self._background_saves, None
        try:
            if saves is not None:
                saves.close(raise_errors=False)  # a failure not raised by on_train_end is logged, never dropped
        finally:
            super().teardown()

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
        if self._background_saves is not None and self._background_saves.pending(filepath):
            self._background_saves.wait()  # never remove a checkpoint while it is being written
        if self.is_global_zero:
            path = Path(filepath)
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
