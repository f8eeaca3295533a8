"""Causal language-model pretraining / continued pretraining on a decoder backbone."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_llm.tasks.base import LLMTask, OptimConfig

log = logging.getLogger(__name__)


class CausalLMTask(LLMTask):
    """Next-token prediction. Batches hold ``input_ids`` [B, S] and already-shifted ``labels`` [B, S]
    (-100 = ignored). Logs ``train_loss``, ``val_loss`` and ``val_ppl``."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        dropout: float | None = None,
        model_overrides: dict[str, Any] | None = None,
        optim: OptimConfig | None = None,
    ) -> None:
        """
        Args:
            backbone: A named decoder size (``debug``, ``small``, ``gpt2``, ``llama2-7b``) or a local HF directory.
            dropout: Override the backbone's dropout.
            model_overrides: Extra ModelConfig fields for a named size (e.g. ``{num_layers: 2}``).
            optim: Optimizer and LR schedule.
        """
        super().__init__(optim=optim)
        self.save_hyperparameters()
        self.backbone = backbone
        self.dropout = dropout
        self.model_overrides = dict(model_overrides or {})

    @override
    def build_model(self) -> nn.Module:
        return self.build_backbone(self.backbone, family="decoder", dropout=self.dropout, **self.model_overrides)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        assert self.model is not None
        return self.model(input_ids, **kwargs)  # logits [B, S, V]

    @override
    def compute_loss(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        logits = self(batch["input_ids"], attention_mask=batch.get("attention_mask"))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        return loss, {}

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        val_loss = self.trainer.callback_metrics.get("val_loss")
        if val_loss is not None:
            self.log("val_ppl", math.exp(min(float(val_loss), 50.0)), prog_bar=True)
