"""Reward models from preference pairs: a Bradley-Terry model of chosen over rejected (InstructGPT; trl's
``RewardTrainer``, OpenRLHF's ``train_rm``, LLaMA-Factory's ``stage: rm``), under every layout.

The model is a decoder with a ``score`` head (``ModelConfig.num_labels = 1``: one linear map without bias from the
final hidden state, transformers' ``...ForSequenceClassification``) whose reward for a row is its score at the row's
last token that is not padding (:func:`~lightning_llm.models.scores.score_positions`: transformers' rule, so an
export scores as the run did). The backbone is any decoder: a named size, an HF ``...ForCausalLM`` directory (the head
starts fresh) or an HF ``...ForSequenceClassification`` with one label (its head is loaded).

Data: :class:`~lightning_llm.data.PreferenceDataModule` (2b interleaved rows per b pairs: chosen, rejected, ...; an
optional numeric ``margin`` per record). Both responses of a pair go through the model in one call, so the task uses
the declared contract (``model_inputs`` / ``loss_from_output``; the score head sits on a pipeline's last stage) and
trains under every layout. Loss, with trl's names and definitions, per pair averaged over the batch's pairs::

    loss = -logsigmoid(r_chosen - r_rejected - margin)  +  center_rewards_coefficient * mean((r_chosen + r_rejected)^2)

Under context parallelism each rank holds a slice of every row: the scored token's column is marked before the batch
is cut (the datamodule's ``score_mask``) and each rank's share of the rewards (the score where it holds the token, else 0) is summed
over the context-parallel group by a differentiable all-reduce whose backward sums the gradients too, so every rank
computes the exact loss and the averaged gradient is one device's.

Logged: ``train_loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (share of pairs with
``r_chosen > r_rejected``: ties count as wrong), ``rewards/margins`` (mean ``r_chosen - r_rejected``) per step;
``val_loss``, ``val_accuracy``, ``val_margin`` and the ``val_rewards/*`` per validation. ``predict`` scores
``--data.predict_path`` records ``{"prompt", "response"}`` (one score each) into ``--model.predict_output``.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_reduce as summed_with_gradients
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_llm.contract import PACKED_INPUTS
from lightning_llm.data.base import load_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.export import CHECKPOINT_KEY, export_sources, read_checkpoint, rebuild_model
from lightning_llm.files import write_jsonl_atomic
from lightning_llm.models import backbone_config
from lightning_llm.models.scores import score_mask
from lightning_llm.peft import INJECTED_METHODS, PeftConfig, merge_peft
from lightning_llm.rl.rewards import RewardConfig, RewardModel, build_reward
from lightning_llm.tasks.decoder import DecoderTask

log = logging.getLogger(__name__)

__all__ = ["RewardTask", "build_reward_source", "reward_loss"]

_STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def reward_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | float = 0.0, *,
                center_rewards_coefficient: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """trl's ``RewardTrainer`` loss of rewards [b] per pair: ``-logsigmoid(chosen - rejected - margin)`` averaged over
    the pairs, plus ``center_rewards_coefficient * mean((chosen + rejected)^2)``; and the pairs' statistics (means
    under trl's names)."""
    loss = -F.logsigmoid(chosen - rejected - margin).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    with torch.no_grad():
        stats = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                 "rewards/accuracies": (chosen > rejected).float().mean(), "rewards/margins": (chosen - rejected).mean()}
    return loss, stats


def with_score_trained(peft: PeftConfig | None) -> PeftConfig | None:
    """``peft`` with the ``score`` head trained in full (``modules_to_save``, as peft's SEQ_CLS task type does): the
    backbone's adapters train, and so does the head a reward model starts fresh. Prompt-learning methods refused."""
    if peft is None:
        return None
    if peft.method not in INJECTED_METHODS:
        raise ValueError(f"RewardTask with peft.method={peft.method}: the score head must train in full, which "
                         f"needs an injected method ({', '.join(INJECTED_METHODS)})")
    if peft.method == "lora":
        saved = list(peft.lora.modules_to_save or [])
        lora = dataclasses.replace(peft.lora, modules_to_save=saved if "score" in saved else [*saved, "score"])
        return dataclasses.replace(peft, lora=lora)
    saved = list(peft.options.get("modules_to_save") or [])
    return dataclasses.replace(peft, options={**peft.options, "modules_to_save": saved if "score" in saved else
                                              [*saved, "score"]})


class RewardTask(DecoderTask):
    """A reward model trained on preference pairs (see the module docstring). The backbone and PEFT arguments are
    :class:`~lightning_llm.tasks.decoder.DecoderTask`'s; with an injected PEFT method (LoRA, QLoRA, ...) the
    backbone's adapters and the whole score head train."""

    context_parallel = True  # exact: the rewards' slices are summed over the context-parallel group (module doc)
    scores_sequences = True

    def __init__(self, backbone: str = "debug", *, dropout: float | None = 0.0,
                 center_rewards_coefficient: float | None = None, predict_output: str | None = None,
                 **kwargs: Any) -> None:
        """
        Args:
            backbone: A named decoder size, an HF ``...ForCausalLM`` directory (e.g. an SFT export; the score head
                starts fresh) or an HF ``...ForSequenceClassification`` directory with ``num_labels=1`` (a reward
                model to train on; its score head is loaded).
            dropout: Dropout of the backbone in training (0 by default, as trl's reward models).
            center_rewards_coefficient: trl's ``center_rewards_coefficient``: adds it times ``mean((r_chosen +
                r_rejected)^2)`` to the loss, keeping rewards centred on 0 (Eisenstein et al. 2023); off by default.
            predict_output: Where ``predict`` writes the scored records (JSONL: each ``--data.predict_path`` record
                with its ``score``).
        """
        if center_rewards_coefficient is not None and center_rewards_coefficient < 0:
            raise ValueError(f"--model.center_rewards_coefficient={center_rewards_coefficient}: must be >= 0")
        super().__init__(backbone, dropout=dropout, **kwargs)
        # predict_output is a run-time choice: LightningCLI re-applies checkpoint hparams over the command line.
        self.save_hyperparameters(ignore=["predict_output"])
        self.peft_config = with_score_trained(self.peft_config)
        config = backbone_config(backbone, family="decoder")
        if config is not None and config.num_labels > 1:
            raise ValueError(f"--model.backbone={backbone}: a sequence classifier with num_labels={config.num_labels}; "
                             "a reward model has one score (num_labels=1): start from its ...ForCausalLM or a "
                             "one-label classifier")
        self.model_overrides = {**self.model_overrides, "num_labels": 1}
        self.center_rewards_coefficient = center_rewards_coefficient
        self.predict_output = predict_output
        self.pad_token_id: int | None = None
        """The pad id the rows are padded with and the model's config carries (its last non-padding token is
        scored), set when the model is built."""
        self.val_stats = nn.ModuleDict({n.replace("/", "_"): MeanMetric() for n in ("accuracy", "margin", *_STAT_NAMES)})
        self._predictions: list[tuple[int, float]] = []

    # ------------------------------------------------------------------------------------------ model
    @override
    def build_model(self) -> nn.Module:
        dm = self.trainer.datamodule if self._trainer is not None else None
        pad = getattr(dm, "pad_token_id", None)
        if pad is not None:  # the data's pad id: what the export's config.json and transformers' rule then read
            self.model_overrides = {**self.model_overrides, "pad_token_id": int(pad)}
        model = super().build_model()
        self.pad_token_id = int(model.config.pad_token_id)
        return model

    @override
    def uses_fused_loss(self) -> bool:
        return False  # no LM head: the score head's output is [B, S, 1]

    @override
    def model_inputs(self, batch: dict[str, Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {"attention_mask": batch.get("attention_mask")}
        kwargs.update({key: batch[key] for key in PACKED_INPUTS if key in batch})  # a cp slice's global positions
        return (batch["input_ids"],), kwargs

    def rewards(self, output: Tensor, batch: dict[str, Tensor]) -> Tensor:
        """Each row's reward [B] (fp32) from the model's per-position scores [B, S, 1]: the score at the row's marked
        token (``score_mask``), summed over the context-parallel group when the rows are cut."""
        mask = batch.get("score_mask")  # marked on the whole rows by the datamodule (PreferenceDataModule)
        if mask is None and self.capabilities.context_parallel_size > 1:
            raise ValueError("RewardTask under context parallelism needs batches with `score_mask` (each row's scored "
                             "token, marked before the rows are cut into slices), as PreferenceDataModule gives")
        if mask is None:
            mask = self.score_mask(batch["input_ids"])
        scores = output[..., 0].float()
        rewards = (scores * mask.to(scores.dtype)).sum(-1)  # exact: the one marked score plus zeros
        caps = self.capabilities
        if caps.context_parallel_size > 1 and not rewards.is_meta:  # (the run summary counts FLOPs on meta tensors)
            # backward all-reduces the gradients too: every rank's loss is the whole loss, and each rank's share of a
            # reward gets the gradient of all of them (the engine then averages over the dp x cp ranks)
            rewards = summed_with_gradients(rewards, op=dist.ReduceOp.SUM, group=caps.context_parallel_group)
        return rewards

    def score_mask(self, input_ids: Tensor) -> Tensor:
        """[B, S] True at each row's scored token (its last that is not padding)."""
        if self.pad_token_id is None:
            raise RuntimeError("RewardTask: configure_model() must run first (it sets the pad id)")
        return score_mask(input_ids, self.pad_token_id)

    @override
    def loss_from_output(self, output: Any, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, dict[str, Any]]:
        if output.shape[0] % 2:
            raise ValueError(f"RewardTask: a batch (or pipeline micro-batch) of {output.shape[0]} rows holds a half "
                             "pair; rows are (chosen, rejected) pairs: use an even number of rows per micro-batch")
        r = self.rewards(output, batch)
        margin = batch.get("margin")
        margin = margin[0::2].to(r) if margin is not None else 0.0
        loss, _ = reward_loss(r[0::2], r[1::2], margin, center_rewards_coefficient=self.center_rewards_coefficient)
        return loss, {"chosen_rewards": r[0::2].detach(), "rejected_rewards": r[1::2].detach()}

    @override
    def loss_weight(self, batch: dict[str, Tensor]) -> float:
        return float(batch["input_ids"].shape[0] // 2)  # the loss is a mean over pairs

    # ------------------------------------------------------------------------------------------ metrics
    @staticmethod
    def _stats(outputs: dict[str, Any]) -> dict[str, Tensor]:
        return reward_loss(outputs["chosen_rewards"], outputs["rejected_rewards"])[1]

    @override
    def log_train_outputs(self, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        self.log_pair_means(self._stats(outputs), self.loss_weight(batch))

    @override
    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, Tensor]) -> None:
        if stage != "val":
            return
        pairs = self.loss_weight(batch)
        stats = self._stats(outputs)
        stats.update(accuracy=stats["rewards/accuracies"], margin=stats["rewards/margins"])
        for name, value in stats.items():
            self.val_stats[name.replace("/", "_")].update(value, pairs)

    @override
    def metric_collection(self, stage: str) -> dict[str, Any]:
        if stage != "val":
            return {}
        return {f"val_{name}": self.val_stats[name.replace("/", "_")] for name in ("accuracy", "margin", *_STAT_NAMES)}

    # ------------------------------------------------------------------------------------------ predict
    @override
    def on_predict_epoch_start(self) -> None:
        self._predictions = []

    @override
    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        args, kwargs = self.model_inputs(batch, "predict")
        scores = self.rewards(self.run_model(*args, **kwargs), batch)
        self._predictions.extend(zip(batch["index"].tolist(), scores.tolist()))
        return scores

    @override
    def on_predict_epoch_end(self) -> None:
        parts = [self._predictions]
        if dist.is_available() and dist.is_initialized():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, self._predictions)
        if self.global_rank != 0 or self.predict_output is None:
            return
        by_index = dict(p for part in parts for p in part)  # dedupes records a sampler repeated
        records = getattr(self.trainer.datamodule, "predict_records", None) or [{} for _ in by_index]
        n = write_jsonl_atomic(self.predict_output, ({**records[i], "score": s} for i, s in sorted(by_index.items())))
        log.info("wrote %d scores to %s", n, self.predict_output)


# ---------------------------------------------------------------------------------------------------- RL rewards
def build_reward_source(cfg: RewardConfig) -> Any:
    """The RL tasks' reward source: :func:`~lightning_llm.rl.rewards.build_reward` (a callable, an HF directory, a
    ``ClassificationTask`` file), or a ``RewardTask`` checkpoint of any layout (a decoder with a score head, merged
    with its adapters), with the tokenizer it recorded and the chat template it was trained with."""
    path = Path(str(cfg.model)) if cfg.fn is None and cfg.model else None
    if path is not None and path.exists() and not (path / "config.json").is_file():
        checkpoint = read_checkpoint(path)
        stored = (checkpoint.get(CHECKPOINT_KEY) or {}).get("model_config") or {}
        if stored.get("family") == "decoder":
            return _checkpoint_reward_model(cfg, checkpoint)
    return build_reward(cfg)


def _checkpoint_reward_model(cfg: RewardConfig, checkpoint: dict[str, Any]) -> RewardModel:
    model, peft = rebuild_model(checkpoint)
    model = merge_peft(model) if peft is not None else model
    if getattr(model, "score", None) is None:
        raise ValueError(f"--model.reward.model={cfg.model}: a decoder checkpoint without a score head is not a reward "
                         "model (RewardTask trains one)")
    sources = export_sources(checkpoint, tokenizer=cfg.tokenizer_dir)
    tok = sources.tokenizer
    if tok is None:
        raise ValueError(f"--model.reward.model={cfg.model}: {sources.no_tokenizer_reason} (--model.reward."
                         "tokenizer_dir)")
    tokenizer = tok if isinstance(tok, ByteTokenizer) else load_tokenizer(str(tok), param="--model.reward.tokenizer_dir")
    meta = checkpoint.get(CHECKPOINT_KEY) or {}
    # the run's chat template: none when its data had none (no stop ids recorded), else its own or the tokenizer's
    template = "none" if meta.get("stop_token_ids") is None else (meta.get("chat_template") or "tokenizer")
    return RewardModel(cfg, model=model, tokenizer=tokenizer, template=template)
