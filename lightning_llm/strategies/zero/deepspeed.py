"""DeepSpeed ZeRO engine: Lightning's ``DeepSpeedStrategy`` with the config generated from ZeRO init args, on GPUs *and*
on CPU (DeepSpeed's CPU accelerator with gloo, which Lightning's own strategy refuses), and DeepSpeed optimizers by name.

Optimizers by name (``optimizer=``): :mod:`.deepspeed_optimizers`.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import tempfile
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.strategies.deepspeed import remove_module_hooks
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_llm.checkpoint import CheckpointError, check_deepspeed_dir, check_engine_dir, load_file, verify_checkpoint
from lightning_llm.checkpoint.safe_load import DEEPSPEED_GLOBALS
from lightning_llm.reliability import SaveFault, publish, remove_path, staging_path
from lightning_llm.strategies.zero.common import check_adapter, validate_zero_args, write_export
from lightning_llm.strategies.zero.deepspeed_optimizers import build_named_optimizer, check_optimizer, drop_empty_groups
from lightning_llm.strategies.zero.deepspeed_partitions import declare_flat_partitions, refuse_optimizer_override
from lightning_llm.strategies.zero.nvme import AioSettings, check_offload_device, nvme_config, partition_for_nvme
from lightning_llm.strategies.zero.nvme import refuse_nvme_checkpoint
from lightning_llm.strategies.zero.nvme_checkpoint import load_nvme_checkpoint, nvme_checkpoint_state
from lightning_llm.strategies.engine import hybrid_checkpoint as hckpt

log = logging.getLogger(__name__)


def deepspeed_config(*, stage: int, offload_optimizer: bool, offload_params: bool, pin_memory: bool,
                     bucket_size: int = 50_000_000) -> dict[str, Any]:
    """The DeepSpeed config for the ZeRO init args (batch size, accumulation, clipping and precision are filled in
    from the Trainer by Lightning)."""
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": False,  # deterministic order; gloo has no separate comm stream anyway
        "reduce_scatter": True,
        "reduce_bucket_size": bucket_size,
        "allgather_bucket_size": bucket_size,
    }
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=bucket_size, stage3_param_persistence_threshold=0,
                    stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    return {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # Let a torch optimizer run on offloaded states (the CPU fallback when DeepSpeedCPUAdam cannot be built).
        "zero_force_ds_cpu_optimizer": False,
    }


def merge_config(base: dict[str, Any], override_cfg: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: values of ``override_cfg`` win."""
    out = copy.deepcopy(base)
    for k, v in override_cfg.items():
        out[k] = merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class CheckedClipPrecision(DeepSpeedPrecision):
    """DeepSpeed's precision plugin, except that ``clip_gradients`` refuses a norm DeepSpeed would not apply.

    DeepSpeed clips only inside ``engine.step()``, to its config's ``gradient_clipping``; Lightning's
    ``DeepSpeedPrecision.clip_gradients`` does nothing. A manual-optimization task calling ``clip_gradients(x)``
    would silently train unclipped unless ``x`` is what the engine applies (automatic optimization fills the config
    from ``--trainer.gradient_clip_val``; a task declares its own norm with ``manual_clip_norm``)."""

    def __init__(self, precision: Any, *, applied: Any) -> None:
        super().__init__(precision)
        self._applied = applied  # () -> the engine's gradient_clipping (0: none)

    @override
    def clip_gradients(self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        applied = float(self._applied() or 0.0)
        if clip_val and abs(float(clip_val) - applied) > 1e-12:
            raise ValueError(f"clip_gradients({clip_val}) under DeepSpeed: DeepSpeed clips inside engine.step() to "
                             f"gradient_clipping={applied}, so this call would not clip. Declare the norm with the "
                             "task's manual_clip_norm, or set gradient_clipping in the DeepSpeed config")


class DeepSpeedZeroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO stage 1/2/3 (+ CPU offload) configured from the same args as ``ZeroStrategy``; runs on CPU."""

    def __init__(
        self,
        stage: int = 2,
        *,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        optimizer: str | None = None,
        config: str | dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        zero_init: bool = False,
        offload_device: Literal["cpu", "nvme"] = "cpu",
        nvme_path: str | None = None,
        aio: AioSettings | None = None,
        async_save: bool = False,
        **deepspeed_kwargs: Any,
    ) -> None:
        """
        Args:
            stage: ZeRO stage 1, 2 or 3.
            offload_optimizer: Optimizer states (fp32 masters, moments) in CPU memory.
            offload_params: Parameter partitions in CPU memory (stage 3).
            optimizer: A DeepSpeed optimizer by name (:mod:`.deepspeed_optimizers`); default: the task's optimizer.
            config: A DeepSpeed JSON file or dict merged over the generated config (its values win).
            process_group_backend: ``nccl``/``gloo``; default from the device.
            timeout: Collective timeout.
            zero_init: Stage 3: build the model inside ``deepspeed.zero.Init`` (partitioned as it is constructed, for
                models that do not fit one device). Off by default because partitioned placeholders report
                ``p.ndim == 1``, so ``LLMTask``'s decay/no-decay grouping would put every weight in the no-decay group;
                without it DeepSpeed partitions the (CPU-built) model in ``deepspeed.initialize``.
            offload_device: Where ``offload_optimizer``/``offload_params`` put the states: host memory (``cpu``) or
                files under ``nvme_path`` through DeepSpeed's async I/O op (``nvme``: ZeRO-Infinity, stage 3; it
                needs libaio, :mod:`.nvme`).
            nvme_path: The directory of the swap files (``offload_device=nvme``): a fast local disk. Checked writable
                before training; the files stay there after the run.
            aio: DeepSpeed's async I/O settings for the swap files (``--trainer.strategy.aio.queue_depth=16``, ...).
            async_save: Refused: DeepSpeed writes its checkpoint files itself, synchronously (see the error).
            deepspeed_kwargs: Further ``lightning.pytorch.strategies.DeepSpeedStrategy`` arguments.
        """
        if async_save:
            raise ValueError("--trainer.strategy.async_save=true is not available with DeepSpeed: its "
                             "engine.save_checkpoint writes every rank's files synchronously, and its decoupled writer "
                             "(checkpoint.writer.decoupled) only moves the wait into the next engine.step(); use a "
                             "native preset (zero1/2/3, zero*_offload) for background saves")
        validate_zero_args(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                           engine="deepspeed")
        check_optimizer(optimizer, on_cuda=torch.cuda.is_available())
        cfg = deepspeed_config(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                               pin_memory=torch.cuda.is_available())
        self.nvme_path = check_offload_device(offload_device, nvme_path, stage=stage,
                                              offloads=offload_optimizer and offload_params)
        if self.nvme_path is not None:
            cfg = merge_config(cfg, nvme_config(nvme_path=self.nvme_path, pin_memory=torch.cuda.is_available(),
                                                aio=aio or AioSettings()))
        self._user_config: dict[str, Any] = {}
        if config is not None:
            if not isinstance(config, dict):
                path = Path(config)
                if not path.is_file():
                    raise FileNotFoundError(f"DeepSpeedZeroStrategy: config={config}: no such JSON file")
                try:
                    config = json.loads(path.read_text())
                except json.JSONDecodeError as e:
                    raise ValueError(f"DeepSpeedZeroStrategy: config={path}: invalid JSON ({e})") from None
            cfg = merge_config(cfg, config)
            self._user_config = config
        super().__init__(config=cfg, process_group_backend=process_group_backend, timeout=timeout, **deepspeed_kwargs)
        self.stage = int(cfg["zero_optimization"]["stage"])
        self.offload_optimizer = offload_optimizer
        self.offload_params = offload_params
        self.offload_device = offload_device
        self.engine = "deepspeed"
        self.optimizer_name = optimizer
        self.zero_init = zero_init
        self._save_fault = SaveFault()  # fault injection for tests (LIGHTNING_LLM_FAULT=kill:save=N[:at=...])

    @property
    def precision_plugin(self) -> Any:
        return DeepSpeedStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if type(plugin) is DeepSpeedPrecision:  # what Lightning's connector builds for a DeepSpeed strategy
            plugin = CheckedClipPrecision(plugin.precision,
                                          applied=lambda: (self.config or {}).get("gradient_clipping"))
        DeepSpeedStrategy.precision_plugin.fset(self, plugin)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        if self.zero_init:
            with super().model_sharded_context():
                yield
        else:
            self._init_config_if_needed()
            yield

    @override
    def setup_environment(self) -> None:
        # Lightning's DeepSpeedStrategy refuses anything but CUDA here; DeepSpeed itself runs on its CPU accelerator.
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if self.root_device.type == "cuda":
            return super().setup_distributed()
        # CPU devices have no index, which Lightning's device-index check rejects; the rest is unchanged.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        return None

    @override
    def teardown(self) -> None:
        super().teardown()
        # DeepSpeed caches clones of the world process group (deepspeed.utils.groups) and forgets them only when the
        # world is destroyed through deepspeed.comm; Lightning and our CLI destroy it through torch. A second run in
        # this process (a notebook, a test) would then broadcast over a destroyed group ("Group ... is not
        # registered"): drop the references with the engine.
        from deepspeed.utils import groups

        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release()
        else:  # older DeepSpeed: the one cache a data-parallel engine fills
            groups._WORLD_GROUP = None

    @override
    def _auto_select_batch_size(self) -> int:
        # Lightning sizes DeepSpeed's throughput log from the *train* loader, also for validate/test/predict, where a
        # datamodule has not set up its training split (and the value is unused): only ask it while fitting.
        assert self.lightning_module is not None
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return 1
        return super()._auto_select_batch_size()

    def _initialize(self, model: Any, config: dict[str, Any], *, params: Any, optimizer: Optimizer | None = None,
                    lr_scheduler: Any = None) -> tuple[Any, Any]:
        """``deepspeed.initialize`` with a device rank that also exists on CPU (Lightning passes
        ``root_device.index``, which is None for CPU devices)."""
        import deepspeed

        rank = self.root_device.index if self.root_device.type == "cuda" else self.local_rank
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=rank), config=config, model=model, model_parameters=params,
            optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, ds_optimizer

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Optimizer | None, lr_scheduler: Any = None) -> Any:
        # Trainable parameters also when optimizer is None: a user config's "optimizer" section builds it from them.
        params = [p for p in model.parameters() if p.requires_grad]
        self.config = self._with_manual_clipping(self.config)  # CheckedClipPrecision reads what the engine applies
        if self.nvme_path is not None:
            partition_for_nvme(model, self.config, user_config=self._user_config, world_size=self.world_size,
                               checkpoints=bool(self.lightning_module.trainer.checkpoint_callbacks))
        refuse_optimizer_override(named=None, config_section="optimizer" in self.config, optimizer=optimizer,
                                  task=self.lightning_module)
        # An optimizer that asks what DeepSpeed's flat partitions hold (Muon) is told after initialize.
        flat_aware = optimizer is not None and hasattr(optimizer, "hold_flat_partition")
        group_of = {id(p): id(g) for g in optimizer.param_groups for p in g["params"]} if flat_aware else {}
        engine, ds_optimizer = self._initialize(model, self.config, params=params, optimizer=optimizer,
                                                lr_scheduler=lr_scheduler)
        if flat_aware:
            declare_flat_partitions(ds_optimizer, optimizer, group_of)
        return engine, ds_optimizer

    def _with_manual_clipping(self, config: dict[str, Any]) -> dict[str, Any]:
        """The config with ``gradient_clipping`` set to a manual-optimization task's ``manual_clip_norm``: DeepSpeed
        clips inside ``engine.step()`` and Lightning's ``clip_gradients`` is a no-op under it, so without this a
        PPO/GRPO ``max_grad_norm`` would silently not apply."""
        task = self.lightning_module
        norm = task.manual_clip_norm if task is not None and not task.automatic_optimization and hasattr(
            task, "manual_clip_norm") else None
        if not norm:
            return config
        current = float(config.get("gradient_clipping") or 0.0)
        if current and current != norm:
            raise ValueError(f"DeepSpeedZeroStrategy: the DeepSpeed config's gradient_clipping={current} differs "
                             f"from {type(task).__name__}'s max_grad_norm={norm}: set one of them")
        log.info("DeepSpeed clips gradients to %s inside engine.step() (%s's max_grad_norm)", norm,
                 type(task).__name__)
        return {**config, "gradient_clipping": float(norm)}

    @override
    def _initialize_deepspeed_inference(self, model: Any) -> None:
        # validate/test/predict outside fit: no optimizer; the ZeRO-3 partitioning (and precision) of the training
        # config, a micro-batch size for DeepSpeed's throughput timers.
        assert isinstance(self.config, dict)
        keys = ["fp16", "bf16"] + (["zero_allow_untested_optimizer", "zero_optimization"] if self.zero_stage_3 else [])
        config = {"train_micro_batch_size_per_gpu": 1, **{k: self.config[k] for k in keys if k in self.config}}
        remove_module_hooks(model)  # as Lightning does: hooks of an earlier engine must not stay on the module
        self.model, _ = self._initialize(model, config, params=[])

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        """DeepSpeed writes its tag directory into a staging directory beside ``filepath``; once every rank is done,
        rank 0 swaps it in (:func:`~lightning_llm.reliability.publish`), so a crash at any moment leaves the previous
        checkpoint whole (DeepSpeed itself overwrites ``<dir>/checkpoint/`` file by file). ``deepspeed_zero3_nvme``
        writes the engine's layout-free format instead (:mod:`.nvme_checkpoint`), with the same atomic finish."""
        path = Path(self.broadcast(str(filepath)))
        if self.nvme_path is not None:
            self._save_layout_free(checkpoint, path)
            return
        staged = staging_path(path)
        if self.is_global_zero:
            remove_path(staged)  # left by a crashed save
        self.barrier()
        self._save_fault.begin(path)
        super().save_checkpoint(checkpoint, staged, storage_options)
        self._save_fault.shards_written(path)
        self.barrier()  # every rank's files are complete
        if self.is_global_zero:
            publish(staged, path)
        self.barrier()
        self._save_fault.published(path)

    def _save_layout_free(self, checkpoint: dict[str, Any], path: Path) -> None:
        save = self._save_fault.begin(path)
        state, opt_meta = nvme_checkpoint_state(self.deepspeed_engine)
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        layout = {"dp": self.world_size, "tp": 1, "pp": 1, "zero_stage": 3, "engine": "deepspeed_zero3_nvme"}
        data = hckpt.meta_bytes(meta, layout=layout, optimizer_meta=opt_meta) if self.is_global_zero else b""
        hckpt.write_hybrid(path, state, data, is_global_zero=self.is_global_zero,
                           on_shards_written=lambda p: self._save_fault.shards_written(p, save=save))
        self._save_fault.published(path, save=save)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # DeepSpeed unpickles its files in full (weights_only=False): every one is checked first, on every rank.
        verify_checkpoint(checkpoint_path, name=f"--ckpt_path={checkpoint_path}")
        if hckpt.is_hybrid_checkpoint(checkpoint_path):
            if not self.zero_stage_3:
                raise CheckpointError(f"--ckpt_path={checkpoint_path}: a checkpoint in the engine's layout-free format "
                                      "(native layouts, deepspeed_zero3_nvme); DeepSpeed reads it at stage 3 only: "
                                      "resume it with deepspeed_zero3_nvme or a native layout")
            check_engine_dir(checkpoint_path, name=f"--ckpt_path={checkpoint_path}", meta_file=hckpt.META_FILE)
            meta = load_nvme_checkpoint(self.deepspeed_engine, checkpoint_path, optimizer=fitting)
            self._weights_loaded = True  # load_model_state_dict has nothing left to do
            return meta
        refuse_nvme_checkpoint(checkpoint_path, name=f"--ckpt_path={checkpoint_path}")
        if not self.load_full_weights and not self.config.get("checkpoint", {}).get("load_universal"):
            # Every rank checks every file before DeepSpeed reads its own, so all ranks stop with the same error
            # (a rank failing alone left its peers to die in a gloo error). Only a resume loads the per-rank
            # optimizer partitions, which DeepSpeed cannot repartition: weights load at any world size.
            check_deepspeed_dir(checkpoint_path, name=f"--ckpt_path={checkpoint_path}",
                                world_size=self.world_size if fitting else None)
        if self.zero_stage_3 and not fitting and not self.load_full_weights and Path(checkpoint_path).is_dir():
            # DeepSpeed cannot load a ZeRO-3 checkpoint into an optimizer-less (validate/test/predict) engine
            # ("'DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights'"): consolidate the
            # shards and load the full weights through Lightning's gather-and-assign path for ZeRO-3 instead.
            return consolidated_checkpoint(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if getattr(self, "_weights_loaded", False):  # a layout-free checkpoint, loaded whole in load_checkpoint
            self._weights_loaded = False
            return
        if self.zero_stage_3 and not self.load_full_weights and "state_dict" in checkpoint:
            # The consolidated weights from load_checkpoint above (DeepSpeed's own loading already put the weights
            # in place and returns its client state, which never holds a state_dict).
            self.model_to_device()
            self._restore_zero_state(checkpoint, strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def _init_optimizers(self) -> tuple[Optimizer, Any]:
        optimizer, scheduler_config = super()._init_optimizers()
        drop_empty_groups(optimizer, scheduler_config.scheduler if scheduler_config is not None else None)
        if self.optimizer_name is None:
            return optimizer, scheduler_config
        refuse_optimizer_override(named=self.optimizer_name, config_section=False, optimizer=optimizer, task=None)
        named = build_named_optimizer(self.optimizer_name, optimizer, on_cuda=self.root_device.type == "cuda")
        if scheduler_config is not None and getattr(scheduler_config.scheduler, "optimizer", None) is optimizer:
            scheduler_config.scheduler.optimizer = named  # same groups -> the task's LR schedule carries over
        log.info("DeepSpeed ZeRO-%d optimizer: %s", self.stage, type(named).__name__)
        return named, scheduler_config

    def export_consolidated(self, path: _PATH, *, adapter_only: bool = False) -> Path | None:
        """Write the backbone's full ``state_dict`` (or only ``lora_*`` tensors) to one file on rank 0 (a collective
        under stage 3: partitions are gathered). Tensors are in the training dtype of the module (fp32 under
        ``32-true``; for fp32 masters of a 16-bit run use DeepSpeed's ``zero_to_fp32`` on a saved checkpoint)."""
        engine = self.deepspeed_engine
        check_adapter(engine.module, adapter_only)
        if self.stage == 3:
            sd = engine._zero3_consolidated_16bit_state_dict()  # gathers every partition; rank 0 gets the tensors
            sd = {} if sd is None else sd
        else:
            sd = engine.module.state_dict()
        prefix = "model."
        sd = {k[len(prefix):] if k.startswith(prefix) else k: v.detach().cpu() for k, v in sd.items()}
        return write_export(sd, path, adapter_only=adapter_only, rank0=self.is_global_zero, barrier=self.barrier)


def is_deepspeed_checkpoint(path: Path) -> bool:
    """A DeepSpeed checkpoint directory (its ``latest`` tag file, or a tag directory of model-state files)."""
    return (path / "latest").is_file() or any(path.glob("*/mp_rank_*_model_states.pt"))


def consolidated_checkpoint(path: _PATH) -> dict[str, Any]:
    """A DeepSpeed checkpoint directory as one Lightning checkpoint dict with full fp32 weights (Lightning's
    ``convert_zero_checkpoint_to_fp32_state_dict``, through a temporary file; no process group needed)."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    verify_checkpoint(path, name=str(path))  # Lightning's converter and DeepSpeed's reader unpickle in full
    refuse_nvme_checkpoint(path, name=str(path))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "consolidated.ckpt"
        convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out))
        return load_file(out, name=str(path), allowed=DEEPSPEED_GLOBALS)


def deepspeed_model_state_bytes(engine: Any) -> dict[str, int]:
    """This rank's bytes in DeepSpeed's live tensors: ``params`` (module parameters, or their ZeRO-3 partitions),
    ``grads`` (gradient buffers/partitions) and ``optim`` (fp32 partition copies the optimizer updates + its states).
    Storages are counted once; DeepSpeed's flat buffers that the module parameters view are counted as parameters."""
    seen: set[int] = set()

    def size(t: Any) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        st = t.untyped_storage()
        if st.data_ptr() == 0 or st.data_ptr() in seen or st.nbytes() == 0:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    def tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
        if isinstance(obj, torch.Tensor):
            return [obj]
        if depth > 3:
            return []
        if isinstance(obj, dict):
            return [t for v in obj.values() for t in tensors(v, depth + 1)]
        if isinstance(obj, (list, tuple)):
            return [t for v in obj for t in tensors(v, depth + 1)]
        return []

    out = {"params": 0, "grads": 0, "optim": 0}
    params = list(engine.module.parameters())
    for p in params:
        out["params"] += size(getattr(p, "ds_tensor", None)) + size(p)
    opt = engine.optimizer
    for name, value in vars(opt).items():  # DeepSpeed's flat buffers, partitions and gradient buckets
        kind = ("grads" if "grad" in name and "fp32" not in name else
                "optim" if "fp32" in name or "single_partition" in name else
                "params" if "16" in name or "param" in name else None)
        if kind is None:
            continue
        for t in tensors(value):
            out[kind] += size(t)
            if kind == "optim":
                out["optim"] += size(t.grad)  # fp32 gradient partition the optimizer steps on
    for p in params:
        out["grads"] += size(p.grad)
    inner = getattr(opt, "optimizer", None)
    for state in (inner.state.values() if inner is not None else []):
        for v in state.values():
            out["optim"] += size(v)
    return out
