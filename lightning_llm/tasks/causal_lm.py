"""Causal language-model pretraining / continued pretraining on a decoder backbone, optionally with PEFT (LoRA,
prompt tuning, ...)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from lightning_llm.contract import PACKED_INPUTS, accepts_sharded_logits
from lightning_llm.run_summary import throughput
from lightning_llm.tasks.decoder import DecoderTask

log = logging.getLogger(__name__)


class CausalLMTask(DecoderTask):
    """Next-token prediction. Batches hold ``input_ids`` [B, S] and already-shifted ``labels`` [B, S]
    (-100 = ignored); packed rows also ``position_ids`` and ``segment_ids`` [B, S] (attention stays within each
    example). Logs ``train_loss``, ``train_tokens_per_s``, ``val_loss`` and ``val_ppl``.

    The backbone and PEFT arguments are :class:`DecoderTask`'s (``--model.backbone``, ``--model.lora``, ...).
    """

    context_parallel = True  # a token mean: under context parallelism each rank's slice averages its own tokens

    def __init__(self, backbone: str = "debug", **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.save_hyperparameters()
        self._step_start: float | None = None

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.run_model(input_ids, **kwargs)  # logits [B, S, V]

    @override
    def model_inputs(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {"attention_mask": batch.get("attention_mask")}
        # packed rows: keyword inputs, so under a pipeline they reach every stage (each builds its attention mask)
        kwargs.update({key: batch[key] for key in PACKED_INPUTS if key in batch})
        if self.uses_fused_loss():  # the model returns the mean token loss (no logits)
            kwargs["labels"] = batch["labels"]
            # per-token losses [b, S]: a pipeline concatenates micro-batch outputs; a part of the global batch may
            # hold no labelled token (a long prompt), whose mean must be 0 with weight 0, not NaN
            if self._loss_is_a_part():
                kwargs["reduction"] = "none"
        return (batch["input_ids"],), kwargs

    @override
    @accepts_sharded_logits  # cross_entropy has a DTensor rule under loss_parallel: [B, S, V/tp] shards suffice
    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor],
                         stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        if self.uses_fused_loss():
            if output.dim() == 0:
                return output, {}  # already the mean over the tokens whose label is not -100
            # per-token losses (0 where ignored), the mean over the batch's labelled tokens (NaN without any, as
            # the mean cross-entropy gives: the non-finite guard then sees it)
            return output.float().sum() / self._labelled(batch), {}
        if self._loss_is_a_part():
            loss = F.cross_entropy(output.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                                   reduction="sum")
            return loss / self._labelled(batch), {}
        loss = F.cross_entropy(output.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        return loss, {}

    def _labelled(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The labelled tokens a mean divides by; at least 1 where the mean is one part of a weighted mean (a
        context-parallel slice, a data-parallel replica, a pipeline micro-batch): its weight is then 0, so a part of
        prompt tokens only adds nothing, while a global batch without labels stays NaN (``global_train_loss``), as
        one device's is."""
        count = (batch["labels"] != -100).sum()
        return count.clamp(min=1) if self._loss_is_a_part() else count

    def _loss_is_a_part(self) -> bool:
        """Whether this rank's loss is one part of the global batch's weighted mean (a context-parallel slice, a
        data-parallel replica or a pipeline micro-batch) rather than the whole batch's mean."""
        caps = self.capabilities
        return caps.context_parallel_size > 1 or caps.data_parallel_size > 1 or caps.pipelined

    @override
    def loss_weight(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"] != -100).sum()  # the loss is a mean over these tokens (counted on the device)

    # ------------------------------------------------------------------------------------------ throughput
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._step_start = time.perf_counter()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_start is None or not self.logging_step():
            return  # host numbers are logged when the logger records them: each one is a copy the device waits for
        elapsed = max(time.perf_counter() - self._step_start, 1e-9)
        # Every data-parallel replica processes a batch of the same shape: global rate = local rate x replicas
        # (tensor- and pipeline-parallel ranks of one replica share its batch and must not be counted again).
        tokens = batch["input_ids"].numel() * self.data_parallel_size
        self.log("train_tokens_per_s", tokens / elapsed, on_step=True, on_epoch=False, prog_bar=False)
        for name, value in throughput(self.trainer, self, elapsed).items():  # FLOP/s and MFU from counted FLOPs
            self.log(name, value, on_step=True, on_epoch=False, prog_bar=False)

    @override
    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        val_loss = self.trainer.callback_metrics.get("val_loss")
        if val_loss is not None:
            # val_loss is already reduced over ranks, so every rank computes the same value; sync_dist only states that.
            self.log("val_ppl", math.exp(min(float(val_loss), 50.0)), prog_bar=True, sync_dist=True)
