"""The one training loop every task shares: build the model lazily, step, log, optimize.

A task subclass supplies ``build_model``, ``model_inputs`` and ``loss_from_output`` (or its own ``compute_loss``),
and optionally metrics / prediction; the loop, logging names, optimizer and schedule live here once. Models are
built in ``configure_model`` so a parallel strategy can build them on the meta device or shard them before weights
are materialized. What a task may do under each parallel layout is the contract of :mod:`lightning_llm.contract`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.seed import reset_seed
from torch import nn
from typing_extensions import override

from lightning_llm.contract import (
    Capabilities,
    accepts_sharded_logits,
    builds_lazily,
    capabilities_of,
    declared_inputs,
    declared_loss,
    declared_step,
    decoding_copy,
    decoding_session,
    pipeline_runner,
    replica_loss,
)
from lightning_llm.export.meta import CHECKPOINT_KEY, ExportMetadata, export_metadata
from lightning_llm.models import NAMED_SIZES, build_model
from lightning_llm.models.compile import compile_blocks
from lightning_llm.optim import build_muon
from lightning_llm.optim.config import OptimConfig, build_adamw, param_groups
from lightning_llm.optim.qk_clip import QKClip
from lightning_llm.preemption import Preemption
from lightning_llm.reliability import AtomicCheckpointIO, FaultInjector, RNGState
from lightning_llm.run_summary import RunSummary, replace_model_summary
from lightning_llm.tasks.callbacks.guard import NonFiniteGuard
from lightning_llm.tasks.callbacks.moe import MoEMonitor, attach_aux_loss, routing_stats
from lightning_llm.tasks.callbacks.progress import ProgressBar
from lightning_llm.vocab import check_backbone_tokenizer, resize_embeddings

log = logging.getLogger(__name__)


def padded_vocab_size(n: int, multiple: int = 8) -> int:
    """Round a tokenizer's vocabulary up so tensor-parallel degrees up to ``multiple`` divide it (as Megatron)."""
    return -(-n // multiple) * multiple


class LLMTask(pl.LightningModule):
    """Base LightningModule of every task.

    Subclasses implement :meth:`build_model` and either the two declared hooks :meth:`model_inputs` and
    :meth:`loss_from_output` (the default :meth:`compute_loss` composes them; every layout, pipelines included, runs
    them exactly as one device would) or their own :meth:`compute_loss` (free to call ``self.model`` several times;
    refused under pipeline parallelism before the first step). Task code sees plain full tensors under every layout
    unless its loss is marked :func:`~lightning_llm.contract.accepts_sharded_logits`. Outside the loss, call the
    model with :meth:`run_model`. Ask :attr:`capabilities` what the strategy offers.
    """

    context_parallel: bool = False
    """Whether the task trains under context parallelism (``context_parallel_size > 1``: its batches hold a slice of
    each row's tokens): its loss is a mean over the tokens :meth:`loss_weight` counts, each token's term computed from
    its own output (checked by :func:`~lightning_llm.contract.check_context_parallel`)."""

    deferred_init: bool | None = None
    """Build the backbone on the meta device under layouts that shard it (``capabilities.deferred_init``), so each
    rank allocates only its shards. ``None``: when the task builds with the library's hooks only
    (:func:`~lightning_llm.contract.builds_lazily`); a subclass with its own ``build_model`` sets ``True`` to opt in."""

    def __init__(self, *, optim: OptimConfig | None = None, nonfinite_loss: Literal["stop", "skip"] = "stop",
                 compile: bool = False) -> None:  # noqa: A002 - the CLI flag is --model.compile
        """
        Args:
            optim: Optimizer and LR schedule.
            nonfinite_loss: On a NaN/inf training loss or gradients: ``stop`` the run (naming the step) or ``skip``.
            compile: Compile each transformer block with ``torch.compile`` (regional compilation, as torchtitan):
                inductor fuses norms, rotary embeddings and the MLP activation itself (the hand-written Triton
                kernels then stay outside the blocks; the fused loss keeps its own). Traced at the first step
                (minutes on a big model; inductor caches it); parameter names and checkpoints are unchanged. Under
                one device, ddp, pp, zero1/2/3 and deepspeed_*; refused under tensor parallelism (torch compiles the
                blocks around DTensor's hooks wrongly).
        """
        super().__init__()
        self.compile_blocks = compile
        """Whether :meth:`configure_model` compiles the backbone's transformer blocks (``--model.compile``; not named
        ``compile``, which is ``nn.Module.compile``)."""
        self.optim = optim or OptimConfig()
        self.nonfinite_loss = nonfinite_loss
        self.guard = NonFiniteGuard(policy=nonfinite_loss, max_consecutive_skips=self.optim.max_consecutive_skips)
        self.model: nn.Module | None = None
        self.parameter_counts: tuple[int, int] | None = None
        """``(total, trainable)`` parameters of the model as built (before any strategy shards or splits it)."""
        self.optimizer_note: str | None = None
        """What the optimizer does with which parameters (Muon's split), for the run summary."""
        self.flops_per_batch: int | None = None
        """FLOPs of one training batch's forward and backward on one replica (counted by :class:`RunSummary` at the
        first batch; ``None`` when not counted): tasks log FLOP/s and MFU from it."""
        self._run_summary: RunSummary | None = None
        self.progress_bar = ProgressBar()
        """Values shown in the progress bar from host copies (``loss``: the global ``train_loss``)."""

    # ------------------------------------------------------------------------------------------ to implement
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def model_inputs(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of the one model call a step makes; the first positional argument is the per-sample
        input (a pipeline feeds it to the first stage and splits it into micro-batches along dim 0)."""
        raise NotImplementedError(f"{type(self).__name__} must implement model_inputs() and loss_from_output() "
                                  "(or override compute_loss())")

    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor],
                         stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """The batch's mean loss from the model's output (and anything the metric hooks need). Under a pipeline it
        runs on the last stage, once per micro-batch (``batch`` then holds that micro-batch's rows)."""
        raise NotImplementedError(f"{type(self).__name__} must implement model_inputs() and loss_from_output() "
                                  "(or override compute_loss())")

    @declared_loss  # pipelines run exactly this composition (contract.check_pipelinable)
    @accepts_sharded_logits  # transparent: hands the output to loss_from_output, which decides
    def compute_loss(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """Return the mean loss of the batch and anything the metric hooks need: by default the model called once
        on :meth:`model_inputs`, then :meth:`loss_from_output`. Override it for losses that call the model more than
        once (then the task cannot be pipelined)."""
        args, kwargs = declared_inputs(self, batch, stage)
        return self.loss_from_output(self.run_model(*args, **kwargs), batch, stage)

    def loss_weight(self, batch: dict[str, torch.Tensor]) -> float | torch.Tensor:
        """What the batch's mean loss averages over (samples by default; tokens for language modelling): the
        logged ``train_loss`` is the mean over data-parallel replicas weighted by it. A number, or a 0-d tensor
        left on the device (a count of the batch's values: reading it on the host would wait for the device)."""
        return float(self._batch_size(batch))

    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> None:
        """Feed evaluation metrics (``val``/``test``); logged by :meth:`log_metrics` at epoch end."""

    def log_train_outputs(self, outputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> None:
        """Log per-step training statistics from ``loss_from_output``'s outputs (under a pipeline: its micro-batches'
        outputs, tensors concatenated along dim 0, on every pipeline rank). Only tasks that override this hook make
        a pipeline gather them."""

    def wants_train_outputs(self) -> bool:
        """Whether :meth:`log_train_outputs` is overridden (the same answer on every rank)."""
        return type(self).log_train_outputs is not LLMTask.log_train_outputs

    @property
    def manual_clip_norm(self) -> float | None:
        """The global gradient norm a manual-optimization task clips to with ``clip_gradients`` before each
        ``opt.step()`` (None: no clipping). Engines that clip only inside their own optimizer step (DeepSpeed, whose
        ``clip_gradients`` does nothing) read it and clip there."""
        return None

    def metric_collection(self, stage: str) -> dict[str, Any]:
        """torchmetrics objects to log at the end of a ``val``/``test`` epoch, by logged name."""
        return {}

    def datamodule_vocab_size(self) -> int | None:
        """Embedding rows the attached datamodule's tokenizer needs, or None without one."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        return getattr(dm, "vocab_size", None)

    def build_backbone(self, backbone: str, *, family: str, lazy: bool | None = None, resize: bool = False,
                       **overrides: Any) -> nn.Module:
        """Model from a named size (vocabulary sized to the datamodule's tokenizer, padded to a multiple of 8)
        or from a local HF directory (whose vocabulary must cover the tokenizer's, or grow to it with ``resize``:
        :func:`lightning_llm.vocab.resize_embeddings`, built whole then). An HF directory with the byte tokenizer the
        datamodule fell back to is refused (:func:`lightning_llm.vocab.check_backbone_tokenizer`).

        ``lazy`` (default: the strategy's ``capabilities.deferred_init``): build on the meta device / index the
        checkpoint only, for a strategy that materializes each rank's shards after sharding."""
        if self._trainer is not None:
            check_backbone_tokenizer(backbone, self.trainer.datamodule)
        need = self.datamodule_vocab_size()
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if (family, backbone) in NAMED_SIZES and need:
            overrides.setdefault("vocab_size", padded_vocab_size(need))
        if lazy is None:
            lazy = self.capabilities.deferred_init and builds_lazily(self)
        if lazy and resize and need:  # new rows are drawn from all old rows: build whole if it will grow
            with torch.random.fork_rng(devices=[]):  # the probe must not move the seed the real build draws
                probe = build_model(backbone, family=family, lazy=True, **overrides)
            lazy = need <= getattr(probe.config, "vocab_size", need)
        model = build_model(backbone, family=family, lazy=lazy, **overrides)
        have = getattr(getattr(model, "config", None), "vocab_size", None)
        if need and have and need > have:
            if not resize:
                raise ValueError(f"--model.backbone={backbone}: its vocabulary has {have} rows but the tokenizer "
                                 f"needs {need}: pass --model.resize_embeddings=true to grow the embeddings and LM "
                                 "head to the tokenizer (an extended vocabulary), or use the tokenizer the checkpoint "
                                 "was trained with")
            resize_embeddings(model, need)
        return model

    # ------------------------------------------------------------------------------------------ lifecycle
    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        # ExportMetadata: what `lightning_llm export` needs besides the weights (model config, tokenizer), stored by a
        # callback so that tasks overriding on_save_checkpoint without super() store it too.
        # Preemption after FaultInjector: a signal a test injects at a step's start is noted before that step's check.
        self._run_summary = RunSummary()
        own = [] if any(isinstance(c, Preemption) for c in self.trainer.callbacks) else [Preemption()]
        clip = [QKClip(self.optim.qk_clip_tau)] if self.optim.qk_clip_tau is not None else []  # after each step
        return [RNGState(), FaultInjector(), *own, self.guard, ExportMetadata(), self._run_summary, MoEMonitor(),
                *clip]

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning skips the callbacks' hook for save_weights_only checkpoints: store the export metadata here too.

        meta = export_metadata(self)
        if meta is not None:
            checkpoint[CHECKPOINT_KEY] = meta

    @override
    def setup(self, stage: str) -> None:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        # Plain torch.save checkpoints become temp-file + fsync + rename (sharded strategies bring their own IO).
        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        replace_model_summary(self.trainer)  # Lightning's summary without its FLOPs column of zeros

    @override
    def configure_model(self) -> None:
        if self.model is None:  # idempotent: Lightning may call it more than once
            # Build from the seed itself: distributed strategies re-seed each process before this hook, one device
            # does not, so a module a subclass created in __init__ would otherwise shift the model's init there only.
            reset_seed()
            self.model = self.build_model()
            if self.compile_blocks:
                compile_blocks(self.model)  # lazily: the strategy's TP plan, recompute and FSDP units apply after
            total = sum(p.numel() for p in self.model.parameters())
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            self.parameter_counts = (total, trainable)  # the run summary states them once, before step 1
            if self._run_summary is not None:
                self._run_summary.capture(self.model)  # a meta twin for counting FLOPs, before any sharding

    @property
    def capabilities(self) -> Capabilities:
        """What the strategy offers this task (:class:`~lightning_llm.contract.Capabilities`)."""
        return capabilities_of(self.trainer.strategy) if self._trainer is not None else Capabilities()

    @property
    def data_parallel_size(self) -> int:
        """Replicas that see different batches: the world size under DDP, fewer when tensor- or pipeline-parallel
        ranks share a batch; 1 without a distributed strategy."""
        return self.capabilities.data_parallel_size

    def pipeline(self) -> Any:
        """The strategy's pipeline runner when the model is split into stages (``contract.PipelineRunner``), else
        ``None``."""
        return pipeline_runner(self.trainer.strategy) if self._trainer is not None else None

    def whole_copy(self, module: nn.Module) -> Any | None:
        """The whole copy of ``module`` (the model, a frozen model or a submodule of one) that the open decoding
        session holds (tensor-parallel and pipeline layouts, ``contract.decoding_copy``): called as on one device,
        without collectives. ``None`` outside such a session."""
        return decoding_copy(self.trainer.strategy, module) if self._trainer is not None else None

    def run_model(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model: directly, or as a forward-only pass through the pipeline when it is split in stages
        (where ``self.model`` holds only this rank's stages and refuses direct calls); inside a decoding session
        that holds a whole copy of it, the copy."""
        whole = self.whole_copy(self.model) if self.model is not None else None
        if whole is not None:
            return whole(*args, **kwargs)
        runner = self.pipeline()
        if runner is not None:
            return runner.forward(*args, **kwargs)
        assert self.model is not None, "configure_model() must run first"
        return self.model(*args, **kwargs)

    def frozen_models(self) -> dict[str, nn.Module]:
        """Frozen models of a registered family this task holds beside ``self.model`` (path relative to the task ->
        module; e.g. the RL and DPO reference of a full fine-tune), which a layout that splits or shards the model
        places like it: this rank's pipeline stages only (the model's split), the family's tensor-parallel plan,
        ZeRO-3 shards (forward only: no gradients, no optimizer states). Call them with :meth:`run_frozen`."""
        return {}

    def decoding_frozen_models(self) -> tuple[str, ...]:
        """The names of :meth:`frozen_models` a generation calls inside its decoding session (:meth:`decoding`; an
        RL rollout's reference log-probs): a layout that decodes on whole copies (tp, pp) or gathers ZeRO-3 shards
        once per session does so for these beside the model, and for no other (a distillation teacher, which runs
        after the student sampled, is never copied). Default: none."""
        return ()

    def scoring_models(self) -> dict[str, nn.Module]:
        """Frozen models of a registered family the task runs on inputs of their own (name -> module; e.g. an RL
        reward model on decoded texts), which a layout places as far as their inputs allow: the family's
        tensor-parallel plan (the ranks of a tensor-parallel group call them with the same inputs) and ZeRO-3 shards
        (forward only; every data-parallel rank must then call them the same number of times), never pipeline
        stages (whole on a pipeline rank). Call them directly."""
        return {}

    def run_frozen(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the frozen model ``name`` of :meth:`frozen_models`: directly, or as a forward-only pass through its
        pipeline stages (a split frozen model refuses direct calls, as the split model does); inside a decoding
        session that holds a whole copy of it, the copy."""
        whole = self.whole_copy(self.frozen_models()[name])
        if whole is not None:
            return whole(*args, **kwargs)
        runner = self.pipeline()
        if runner is not None:
            return runner.frozen(name).forward(*args, **kwargs)
        return self.frozen_models()[name](*args, **kwargs)

    def decoding_model(self) -> Any:
        """What :func:`lightning_llm.generation.generate` calls to decode: ``self.model``, or under a pipeline the
        stages run token by token (every pipeline rank gets the same logits, so all pick the same token)."""
        runner = self.pipeline()
        if runner is not None:
            return runner.decoder()
        assert self.model is not None, "configure_model() must run first"
        return self.model

    @contextlib.contextmanager
    def decoding(self, decoder: Any = None) -> Iterator[Any]:
        """What one generation passes to :func:`lightning_llm.generation.generate`: ``decoder`` (default
        :meth:`decoding_model`) with the strategy's set-up around the whole generation (ZeRO-3: the parameters
        gathered once, not in every decoding step)."""
        decoder = self.decoding_model() if decoder is None else decoder
        if self._trainer is None:
            yield decoder
            return
        with decoding_session(self.trainer.strategy, decoder) as inside:
            yield inside

    def step_loss(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of a train/val/test step: :meth:`compute_loss`, or the pipeline's run of the declared hooks."""
        runner = self.pipeline()
        if runner is not None:
            return runner.loss(self, batch, stage)
        return self.compute_loss(batch, stage)

    def logging_step(self) -> bool:
        """Whether the logger records this training step (Lightning's rule: every ``log_every_n_steps`` optimizer
        steps). Values computed on the host (rates, timings) are logged then only: ``self.log`` of a number copies
        it to the device, which on a GPU waits for the device (tensors logged every step are read at these steps
        only)."""
        connector = getattr(self.trainer, "_logger_connector", None) if self._trainer is not None else None
        return bool(getattr(connector, "should_update_logs", True))

    def _batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["input_ids"].shape[0])

    @override
    @declared_step  # the run summary counts this step's FLOPs on the batch as given (run_summary.one_call_step)
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        loss, outputs = self.step_loss(batch, "train")
        caps = self.capabilities
        weight = self.loss_weight(batch)
        loss, global_loss, total = self.global_train_loss(loss, weight)
        routing = routing_stats(self)
        if routing is not None and routing.has_step:  # an MoE model: transformers' load-balancing loss joins in
            aux = routing.aux_loss()
            self.log("train_aux_loss", aux.float(), on_step=True, on_epoch=False, batch_size=self._batch_size(batch))
            global_loss = global_loss + routing.aux_loss_coef * aux.to(global_loss)
        if self.guard.steps_inside_engine(self):  # DeepSpeed steps inside its engine: decided before backward
            if not self._loss_is_finite(loss):
                return self._on_nonfinite_loss(loss, batch_idx)
        else:  # decided on the device with the gradients, before the optimizer step (tasks.callbacks.guard)
            self.guard.note_loss(loss)
        self.log("train_loss", global_loss, on_step=True, on_epoch=False, batch_size=self._batch_size(batch))
        self.progress_bar.show(self, "loss", global_loss)  # a host copy: no read of the device per step
        if self.wants_train_outputs():
            self.log_train_outputs(outputs, batch)
        if caps.pipelined:
            return loss  # a pipeline weighs its micro-batch losses itself (the schedule already ran backward)
        out = loss if caps.data_parallel_size == 1 else loss * (weight * caps.data_parallel_size / total).to(loss)
        if routing is not None and routing.has_step:  # its gradient's factor: this loss's, read in backward
            attach_aux_loss(self, out, routing)
        return out

    def global_train_loss(self, loss: torch.Tensor, weight: float | torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss, global_loss, total)``: this rank's loss, the global batch's (the replicas' losses weighted by what
        each averages over, so one run logs the same curve at any data-parallel degree; the same weights make the
        averaged gradient the global mean's) and the summed weight (an fp64 0-d tensor; a collective when data
        parallel, no host read).

        A replica, slice or micro-batch without anything to average over has loss 0 with weight 0; when the whole
        global batch has none, the loss is NaN, as one device's mean over nothing is, so the non-finite guard sees
        the same batch at every layout (not a silent zero-gradient step that still moves Adam's moments)."""
        caps = self.capabilities
        global_loss, total = replica_loss(caps.data_parallel_group, loss, weight, dp=caps.data_parallel_size)
        nothing = torch.where(total == 0, float("nan"), 0.0)  # decided on the device
        return loss + nothing.to(loss), global_loss + nothing.to(global_loss), total

    def _loss_is_finite(self, loss: torch.Tensor) -> bool:
        return self.guard.loss_is_finite(self, loss)  # the same answer on every rank

    def _on_nonfinite_loss(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        """Stop (raises), or skip: ``None`` skips backward and the step; an engine that steps internally and cannot
        skip backward (DeepSpeed) gets the loss itself, whose NaN/inf gradients make it skip the step (checked)."""
        self.guard.on_nonfinite_loss(self, loss, f"step {self.global_step} (batch {batch_idx} of epoch "
                                                 f"{self.current_epoch})")
        return loss if self.guard.steps_inside_engine(self) else None

    def _eval_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        loss, outputs = self.step_loss(batch, stage)
        caps = self.capabilities
        weight = self.loss_weight(batch)
        if caps.context_parallel_size > 1:  # the rows' loss: the slices of the cp group weighted by their tokens
            loss, weight = replica_loss(caps.context_parallel_group, loss, weight, dp=caps.context_parallel_size)
        # Weighted by what the loss averages over (tokens, pairs, samples): Lightning's epoch value, summed over the
        # ranks by sync_dist, is then the mean over the whole split, the same at every layout and batch size.
        self.log(f"{stage}_loss", loss, prog_bar=stage == "val", on_epoch=True, sync_dist=True, batch_size=weight)
        self.update_metrics(stage, outputs, batch)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def _log_epoch_metrics(self, stage: str) -> None:
        for name, metric in self.metric_collection(stage).items():
            # compute() is the global value on every rank (torchmetrics syncs its states), so the mean over ranks
            # that sync_dist takes is that value; it also tells Lightning the value is global (no "use sync_dist" hint)
            self.log(name, metric.compute(), prog_bar=name.startswith("val"), sync_dist=True)
            metric.reset()

    @override
    def on_validation_epoch_end(self) -> None:
        self._log_epoch_metrics("val")

    @override
    def on_test_epoch_end(self) -> None:
        self._log_epoch_metrics("test")

    # ------------------------------------------------------------------------------------------ optimization
    @override
    def configure_optimizers(self) -> Any:
        assert self.model is not None, "configure_model() must run first"
        cfg = self.optim
        # Every trainable parameter of the task: its model and any module a subclass adds (e.g. an auxiliary head).
        if cfg.name == "muon":
            optimizer, split = build_muon(self, cfg, replica_group=self._muon_replica_group(),
                                          strategy=self.trainer.strategy if self._trainer is not None else None)
            self.optimizer_note = split.describe(cfg.muon_adapters, stage=self.capabilities.pipelined)
        else:
            optimizer = build_adamw(param_groups(self, cfg.weight_decay), cfg)
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cfg.lr_lambda(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _muon_replica_group(self) -> Any:
        """The data-parallel replicas that share Muon's Newton-Schulz out (None: one replica)."""
        caps = self.capabilities
        if caps.data_parallel_size <= 1 or not torch.distributed.is_initialized():
            return None
        return caps.data_parallel_group or torch.distributed.group.WORLD  # Lightning's strategies: every rank
