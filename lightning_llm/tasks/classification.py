"""Sequence(-pair) classification finetuning: AFQMC-style matching with an encoder backbone."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
from typing_extensions import override

from lightning_llm.files import write_jsonl_atomic
from lightning_llm.models import backbone_config
from lightning_llm.tasks.base import LLMTask, OptimConfig

log = logging.getLogger(__name__)


class ClassificationTask(LLMTask):
    """Encoder + pooler + linear head trained with cross-entropy; logs ``val_acc`` and ``val_f1`` (macro).

    ``num_labels``/``label_names`` and the vocabulary size come from the datamodule when not given, and the
    label names are stored in checkpoints so ``predict`` writes the original label strings.
    """

    def __init__(
        self,
        backbone: str = "debug",
        *,
        num_labels: int | None = None,
        label_names: list[str] | None = None,
        dropout: float | None = None,
        model_overrides: dict[str, Any] | None = None,
        predict_output: str | None = None,
        optim: OptimConfig | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        compile: bool = False,  # noqa: A002 - the CLI flag is --model.compile
    ) -> None:
        """
        Args:
            backbone: A named encoder size (``debug``, ``bert-base``, ``erlangshen-1.3b``) or a local HF directory
                (BERT, RoBERTa, XLM-R, MegatronBERT, DeBERTa-v2/v3, ModernBERT).
            num_labels: Classes; default: from the datamodule's label map.
            label_names: Label strings in class order; default: from the datamodule.
            dropout: Override the backbone's dropout (``0`` for exact parity runs).
            model_overrides: Extra ModelConfig fields for a named size (e.g. ``{num_layers: 4}``).
            predict_output: Where ``predict`` writes a CLUE submission (``{"id", "label"}`` per line).
            optim: Optimizer and LR schedule.
            nonfinite_loss: On a NaN/inf training loss or gradients: ``stop`` the run (naming the step) or
                ``skip`` the step.
            compile: Compile each transformer block with ``torch.compile`` (regional, as torchtitan; parameter names
                and checkpoints unchanged; refused under tensor parallelism): see ``LLMTask``.
        """
        super().__init__(optim=optim, nonfinite_loss=nonfinite_loss, compile=compile)
        # the backbone's options (an HF directory's config.json), refused before any data is prepared
        backbone_config(backbone, family="encoder", **({} if dropout is None else {"dropout": dropout}))
        # predict_output is a run-time choice: LightningCLI re-applies checkpoint hparams over the command line.
        self.save_hyperparameters(ignore=["predict_output"])
        self.backbone = backbone
        self.num_labels = num_labels
        self.label_names = list(label_names) if label_names else None
        self.dropout = dropout
        self.model_overrides = dict(model_overrides or {})
        self.predict_output = predict_output
        self._predictions: list[tuple[int, int]] = []

    # ------------------------------------------------------------------------------------------ model
    def _labels_from_datamodule(self) -> int | None:
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is None or not hasattr(dm, "label_names"):
            return None
        if self.label_names is None and getattr(dm, "label_names", None) is None:
            dm.num_labels  # noqa: B018 - builds the label map from the training split
        if self.label_names is None:
            self.label_names = list(dm.label_names)
        return len(dm.label_names)

    @override
    def build_model(self) -> nn.Module:
        dm_labels = self._labels_from_datamodule()
        if self.num_labels is None:
            self.num_labels = len(self.label_names) if self.label_names else dm_labels
        if not self.num_labels or self.num_labels < 2:
            raise ValueError("ClassificationTask: --model.num_labels must be >= 2 (or come from the datamodule)")
        if self.label_names is not None and len(self.label_names) != self.num_labels:
            raise ValueError(f"--model.label_names has {len(self.label_names)} names but num_labels={self.num_labels}")
        model = self.build_backbone(self.backbone, family="encoder", num_labels=self.num_labels, dropout=self.dropout,
                                    **self.model_overrides)
        self._record_label_map(model)
        return model

    def _record_label_map(self, model: nn.Module) -> None:
        """Put the run's label map in the model config (``extra['id2label']``), which the checkpoint stores and
        ``lightning_llm export`` writes as ``id2label``/``label2id``; a backbone's own map (e.g. the generic
        LABEL_0/1 of a ...ForSequenceClassification directory) would name the trained classes wrongly."""
        config = getattr(model, "config", None)
        if config is None or not self.label_names:  # no names of our own: a backbone head's map stays
            return
        config.extra = {**(config.extra or {}), "id2label": {str(i): n for i, n in enumerate(self.label_names)}}

    # ------------------------------------------------------------------------------------------ steps
    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        args, kwargs = self.model_inputs(batch, "predict")
        return self.run_model(*args, **kwargs)  # logits [B, num_labels]

    @override
    def model_inputs(self, batch: dict[str, torch.Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (batch["input_ids"],), {"attention_mask": batch.get("attention_mask"),
                                       "token_type_ids": batch.get("token_type_ids")}

    @override
    def loss_from_output(self, output: Any, batch: dict[str, torch.Tensor],
                         stage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        return F.cross_entropy(output.float(), batch["labels"]), {"logits": output}

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if not hasattr(self, "val_acc"):
            n = self.num_labels
            assert n is not None
            self.val_acc, self.test_acc = MulticlassAccuracy(n, average="micro"), MulticlassAccuracy(n, average="micro")
            self.val_f1, self.test_f1 = MulticlassF1Score(n, average="macro"), MulticlassF1Score(n, average="macro")

    @override
    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, torch.Tensor]) -> None:
        preds = outputs["logits"].argmax(-1)
        for name, metric in self.metric_collection(stage).items():
            metric.update(preds, batch["labels"])

    @override
    def metric_collection(self, stage: str) -> dict[str, Any]:
        return {f"{stage}_acc": getattr(self, f"{stage}_acc"), f"{stage}_f1": getattr(self, f"{stage}_f1")}

    # ------------------------------------------------------------------------------------------ predict
    @override
    def on_predict_epoch_start(self) -> None:
        self._predictions = []

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        preds = self(batch).argmax(-1)
        self._predictions.extend(zip(batch["index"].tolist(), preds.tolist()))
        return preds

    @override
    def on_predict_epoch_end(self) -> None:
        if self.predict_output is None:
            return
        parts = [self._predictions]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            parts = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, self._predictions)
        if self.global_rank != 0:
            return
        by_index = dict(p for part in parts for p in part)  # dedupes samples a sampler repeated
        dm = self.trainer.datamodule
        ids = dm.ids["predict"] if dm is not None and "predict" in getattr(dm, "ids", {}) else list(range(len(by_index)))
        names = self.label_names or [str(i) for i in range(self.num_labels or 0)]
        n = write_jsonl_atomic(self.predict_output, ({"id": ids[i], "label": names[c]} for i, c in sorted(by_index.items())))
        log.info("wrote %d predictions to %s", n, self.predict_output)

    # ------------------------------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # the export metadata (model config with the label map)
        checkpoint["label_names"] = self.label_names

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("label_names")
        if saved and self.label_names and list(saved) != list(self.label_names):
            raise ValueError(f"checkpoint label names {saved} differ from the data's {self.label_names}")
        if saved:
            self.label_names = list(saved)
            if self.model is not None:
                self._record_label_map(self.model)
