"""Causal language-model pretraining / continued pretraining on a decoder backbone, optionally with PEFT (LoRA,
prompt tuning, ...)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_llm.contract import accepts_sharded_logits
from lightning_llm.peft import (
    LoraArgs,
    PeftConfig,
    apply_peft,
    count_parameters,
    enable_gradient_checkpointing,
    export_adapter,
)
from lightning_llm.tasks.base import LLMTask, OptimConfig

log = logging.getLogger(__name__)


class CausalLMTask(LLMTask):
    """Next-token prediction. Batches hold ``input_ids`` [B, S] and already-shifted ``labels`` [B, S]
    (-100 = ignored). Logs ``train_loss``, ``train_tokens_per_s``, ``val_loss`` and ``val_ppl``.

    With ``lora`` (or ``peft``) the backbone is frozen and only the adapter (plus ``modules_to_save``) trains;
    checkpoints then hold only those weights (and the optimizer/loop state resume needs), and the adapter is
    exported in peft's format to ``adapter_dir`` at the end of ``fit``.
    """

    def __init__(
        self,
        backbone: str = "debug",
        *,
        dropout: float | None = None,
        model_overrides: dict[str, Any] | None = None,
        lora: LoraArgs | None = None,
        peft: PeftConfig | None = None,
        gradient_checkpointing: bool = False,
        checkpoint_reentrant: bool = False,
        adapter_dir: str | None = None,
        optim: OptimConfig | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
    ) -> None:
        """
        Args:
            backbone: A named decoder size (``debug``, ``small``, ``gpt2``, ``llama2-7b``) or a local HF directory.
            dropout: Override the backbone's dropout.
            model_overrides: Extra ModelConfig fields for a named size (e.g. ``{num_layers: 2}``).
            lora: LoRA settings (shorthand for ``peft: {method: lora, lora: ...}``).
            peft: Any supported PEFT method (``lora``, ``ia3``, ``loha``, ``lokr``, ``prompt_tuning``).
            gradient_checkpointing: Recompute block activations in backward.
            checkpoint_reentrant: Use torch's reentrant checkpointing (then embedding outputs are made to
                require grad so frozen-embedding adapters still get gradients).
            adapter_dir: Where to export the adapter after ``fit`` (default ``<log_dir>/adapter`` when PEFT is on).
            optim: Optimizer and LR schedule.
            nonfinite_loss: On a NaN/inf training loss or gradients: ``stop`` the run (naming the step) or
                ``skip`` the step.
        """
        super().__init__(optim=optim, nonfinite_loss=nonfinite_loss)
        self.save_hyperparameters()
        if lora is not None and peft is not None:
            raise ValueError("--model.lora and --model.peft are exclusive: use peft.method=lora with peft.lora")
        self.peft_config: PeftConfig | None = PeftConfig(method="lora", lora=lora) if lora is not None else peft
        self.backbone = backbone
        self.dropout = dropout
        self.model_overrides = dict(model_overrides or {})
        self.gradient_checkpointing = gradient_checkpointing
        self.checkpoint_reentrant = checkpoint_reentrant
        self.adapter_dir = adapter_dir
        # Checkpoints of a PEFT run hold only the trainable weights; the frozen base is rebuilt from `backbone`.
        self.strict_loading = self.peft_config is None
        self._step_start: float | None = None

    @override
    def build_model(self) -> nn.Module:
        model = self.build_backbone(self.backbone, family="decoder", dropout=self.dropout, **self.model_overrides)
        if self.peft_config is not None:
            model = apply_peft(model, self.peft_config)
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(model, use_reentrant=self.checkpoint_reentrant)
        trainable, total = count_parameters(model)
        rank_zero_info(f"trainable params: {trainable:,} || all params: {total:,} || "
                       f"trainable%: {100 * trainable / max(total, 1):.4f}")
        return model

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.run_model(input_ids, **kwargs)  # logits [B, S, V]

    @override
    def model_inputs(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (batch["input_ids"],), {"attention_mask": batch.get("attention_mask")}

    @override
    @accepts_sharded_logits  # cross_entropy has a DTensor rule under loss_parallel: [B, S, V/tp] shards suffice
    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor],
                         stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = F.cross_entropy(output.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        return loss, {}

    @override
    def loss_weight(self, batch: dict[str, torch.Tensor]) -> float:
        return float((batch["labels"] != -100).sum())  # the loss is a mean over these tokens

    # ------------------------------------------------------------------------------------------ throughput
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            return
        elapsed = max(time.perf_counter() - self._step_start, 1e-9)
        # Every data-parallel replica processes a batch of the same shape: global rate = local rate x replicas
        # (tensor- and pipeline-parallel ranks of one replica share its batch and must not be counted again).
        tokens = batch["input_ids"].numel() * self.data_parallel_size
        self.log("train_tokens_per_s", tokens / elapsed, on_step=True, on_epoch=False, prog_bar=False)

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        val_loss = self.trainer.callback_metrics.get("val_loss")
        if val_loss is not None:
            # val_loss is already reduced over ranks, so every rank computes the same value; sync_dist only states that.
            self.log("val_ppl", math.exp(min(float(val_loss), 50.0)), prog_bar=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------ PEFT checkpoints
    def _trainable_keys(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.peft_config is None:
            return
        keep = self._trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["peft"] = self.peft_config.to_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.peft_config is None or self.model is None:
            return
        missing = sorted(self._trainable_keys() - set(checkpoint["state_dict"]))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} trainable weights (e.g. {missing[:3]}): it was not "
                             f"saved by a run with the same --model.lora/--model.peft settings")

    @override
    def on_fit_end(self) -> None:
        if self.peft_config is None or self.model is None:
            return
        # trainer.log_dir is a collective (broadcast): evaluate it on every rank, then write on rank 0 only.
        directory = self.adapter_dir or (Path(self.trainer.log_dir or self.trainer.default_root_dir) / "adapter")
        if self.trainer.global_rank != 0:
            return
        try:
            backbone = self.backbone if Path(self.backbone).is_dir() else None
            export_adapter(self.model, self.peft_config, directory, base_model_name_or_path=backbone)
        except ValueError as e:  # e.g. a GPT-2 layout: no HF-named adapter; the checkpoint still has the weights
            log.warning("adapter not exported: %s", e)
