"""Distillation from a frozen teacher (GKD, Agarwal et al. 2024; on-policy distillation as Qwen3 trains its small
models): the student learns to match the teacher's next-token distribution on responses it samples itself, or on the
dataset's.

Per training step, with probability ``lmbda`` (GKD's name; 1 = fully on-policy) the student samples responses to the
batch's prompts, else it keeps the dataset's responses. The draw depends on (seed, step, batch index) only, so every
rank and layout makes the same one. A row's prompt is its conversation up to its last learned reply (what the dataset
response continues; :func:`last_reply_prompts`), so SFT and chat files serve as they are
(:class:`~lightning_llm.data.InstructionDataModule`); a sampled row's draws depend on (seed, step, its prompt tokens),
so a prompt gets the same response at any layout and batch size.

The loss is a per-token divergence over the response tokens (:mod:`lightning_llm.kernels.loss.divergence`: ``reverse_kl``,
``forward_kl`` or trl's generalized ``jsd`` with ``beta``, at a ``temperature``), the token mean over the global
batch, computed inside the student's forward from its last hidden states and head and the teacher's, in chunks: neither
``[B, S, V]`` logits tensor is ever whole (``--model.fused_loss=false``: whole logits). The teacher runs first, without
gradient, to its last hidden states (:func:`final_hidden`), which reach the student's forward with the batch's rows
(:class:`DistillLoss`, split by a pipeline with the micro-batches).

The teacher (``--model.teacher``: a Hugging Face directory, a named size or a checkpoint of this package) is a frozen
model of the task (``frozen_models()``), so every layout places it like the student: its pipeline stages (it must
then have the student's number of blocks), its tensor-parallel plan (the heads' vocabulary shards line up), ZeRO-3
shards; it is never trained and has no optimizer state. Logged: ``train_loss`` (the divergence before the step's
update), ``train_on_policy`` (1 on a sampled step), ``val_loss`` (the divergence on the validation set's own responses:
deterministic).
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._pytree import register_pytree_node
from typing_extensions import override

from lightning_llm.contract import PACKED_INPUTS
from lightning_llm.export.checkpoint import read_checkpoint
from lightning_llm.export.model import rebuild_model
from lightning_llm.generation import GenerationConfig, for_datamodule, generate
from lightning_llm.kernels.loss.divergence import DIVERGENCES, Divergence
from lightning_llm.kernels.loss.head_divergence import TeacherOutput, head_divergence
from lightning_llm.models import backbone_config
from lightning_llm.peft import PROMPT_METHODS
from lightning_llm.rl.rollouts.policy import pack_responses
from lightning_llm.tasks.decoder import DecoderTask

log = logging.getLogger(__name__)

__all__ = ["DistillLoss", "DistillTask", "TEACHER", "final_hidden", "last_reply_prompts"]

TEACHER = "teacher_model"
"""Where the task holds its teacher (``task.teacher_model``), as :meth:`DistillTask.frozen_models` names it."""

ROW_KEYS = ("input_ids", "attention_mask", "labels", *PACKED_INPUTS)
"""The keys of a batch's model rows (right-padded ``[B, S]``; packed rows also carry their positions and segments)."""


def final_hidden(hidden: Tensor, head: nn.Module, labels: Tensor, *, softcap: float | None) -> Tensor:
    """A model's ``head_loss`` that returns its last hidden states ``[B, S, H]`` (what its head reads), whole: under
    sequence parallelism they are gathered from the ranks' sequence shards."""
    return (hidden.full_tensor() if hasattr(hidden, "full_tensor") else hidden).detach()


@dataclass
class DistillLoss:
    """The student's ``head_loss`` (:class:`~lightning_llm.models.decoder.HeadLoss`): the summed divergence of its
    response tokens from the teacher's distribution. A pytree whose one leaf is the teacher's hidden states, so a
    pipeline hands each micro-batch its rows' (the rest is replicated)."""

    teacher_hidden: Tensor
    """``[B, S, Ht]`` the teacher's last hidden states of the rows (no gradient)."""
    teacher: nn.Module
    """The teacher (its ``lm_head`` is read where the student's head runs: a pipeline's last stage)."""
    kind: Divergence = "reverse_kl"
    beta: float = 0.5
    temperature: float = 1.0
    fused: bool = True

    def __call__(self, hidden: Tensor, head: nn.Module, labels: Tensor, *, softcap: float | None) -> Tensor:
        teacher = TeacherOutput(self.teacher_hidden, self.teacher.lm_head,
                                getattr(self.teacher.config, "final_logit_softcap", None))
        # Per-row outputs (a pipeline's schedule concatenates its micro-batches' along dim 0). Training: the rows'
        # sum in the first row, zeros after (the chunks compute the sum's gradient with it); evaluation: [B, S].
        args = dict(kind=self.kind, beta=self.beta, temperature=self.temperature, fused=self.fused, softcap=softcap)
        if not torch.is_grad_enabled():
            return head_divergence(hidden, head, labels, teacher, reduction="none", **args)
        total = head_divergence(hidden, head, labels, teacher, reduction="sum", **args)
        return F.pad(total.reshape(1), (0, labels.shape[0] - 1))


register_pytree_node(
    DistillLoss,
    lambda d: ([d.teacher_hidden], (d.teacher, d.kind, d.beta, d.temperature, d.fused)),
    lambda leaves, ctx: DistillLoss(next(iter(leaves)), *ctx),
    serialized_type_name="lightning_llm.tasks.distill.DistillLoss",
)


def last_reply_prompts(input_ids: Tensor, labels: Tensor, attention_mask: Tensor, *, pad_id: int
                       ) -> tuple[Tensor, Tensor]:
    """Each row's prompt for sampling: its tokens before its last learned reply (``labels`` pre-shifted: the first
    label of the last run of labelled positions is the reply's first token, predicted at the last prompt token), a
    row without one whole; LEFT-padded to the rows' width ``[B, S]`` with its mask, by tensor ops only (no read of
    the device)."""
    b, s = input_ids.shape
    learned = labels != -100
    starts = learned & ~F.pad(learned, (1, 0))[:, :-1]  # the first position of each run of labelled positions
    columns = torch.arange(s, device=input_ids.device)
    length = torch.where(learned.any(-1), (starts * columns).amax(-1) + 1, attention_mask.sum(-1))
    src = columns.unsqueeze(0) - (s - length).unsqueeze(1)  # [B, S]: the token each column takes, < 0 for padding
    keep = src >= 0
    prompt = input_ids.gather(1, src.clamp(min=0)).masked_fill(~keep, pad_id)
    return prompt, keep.long()


def _prompt_keys(prompt: Tensor, mask: Tensor) -> list[int]:
    """A number per row from its prompt tokens alone (left-padded: counted from the right end, so not from the
    padding width), read on the host: what a row's sampling draws are seeded by."""
    prime = 2_147_483_647
    weights = [1]
    for _ in range(prompt.shape[1] - 1):
        weights.append(weights[-1] * 1_000_003 % prime)
    w = torch.tensor(weights[::-1], device=prompt.device)  # the last column weighs 1
    terms = ((prompt.long() + 1) * mask * w).remainder(prime)  # < 2^31 each: the sum cannot overflow int64
    return terms.sum(-1).remainder(prime).tolist()


def _mix(*parts: int) -> int:
    """One 63-bit seed from several integers (the same on every rank: no hash randomization)."""
    x = 0
    for p in parts:
        x = (x * 1_000_000_007 + int(p) + 0x9E3779B9) % (2**63)
    return x


class DistillTask(DecoderTask):
    """Distill a frozen teacher into the student decoder (see the module docstring). Batches: those of
    :class:`~lightning_llm.data.InstructionDataModule` (``input_ids``, ``attention_mask`` and pre-shifted ``labels``
    marking the replies)."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        teacher: str,
        divergence: Divergence = "reverse_kl",
        beta: float = 0.5,
        temperature: float = 1.0,
        lmbda: float = 1.0,
        generation: GenerationConfig | None = None,
        seed: int | None = None,
        dropout: float | None = 0.0,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            backbone: The student: a named decoder size or a local HF directory (the other backbone and PEFT
                arguments are :class:`~lightning_llm.tasks.decoder.DecoderTask`'s).
            teacher: The frozen teacher: a local Hugging Face directory, a named size, or a checkpoint of this package
                (a ``.ckpt`` file or a checkpoint directory of any layout: a full fine-tune's). It must have the
                student's vocabulary.
            divergence: ``reverse_kl`` (student to teacher: the on-policy distillation default), ``forward_kl``
                (teacher to student) or ``jsd`` (trl's generalized Jensen-Shannon divergence with ``beta``).
            beta: The JSD's interpolation: ``beta KL(teacher || m) + (1 - beta) KL(student || m)`` with ``m = (1 -
                beta) student + beta teacher`` (0: the forward KL, 1: the reverse KL, as trl).
            temperature: Both distributions are those of ``logits / temperature``.
            lmbda: The probability that a training step samples its responses from the student (on-policy); else it
                uses the dataset's. 1 = fully on-policy, 0 = the dataset's responses only (no generation).
            generation: How the student samples (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
                ``top_p``; EOS/pad ids default to the datamodule's stop tokens). Default: sampling, 64 new tokens.
            seed: Seed of the on-policy draws and of the sampling (default: the global seed,
                ``--seed_everything``).
            dropout: Dropout of the student in training (0 by default: the divergence of a student equal to its
                teacher is then 0).
        """
        super().__init__(backbone, dropout=dropout, **kwargs)
        self.save_hyperparameters()
        if divergence not in DIVERGENCES:
            raise ValueError(f"--model.divergence={divergence!r}: use one of {', '.join(DIVERGENCES)}")
        for name, value, ok in (("beta", beta, 0 <= beta <= 1), ("lmbda", lmbda, 0 <= lmbda <= 1),
                                ("temperature", temperature, temperature > 0)):
            if not ok:
                raise ValueError(f"--model.{name}={value}: must be in {'(0, inf)' if name == 'temperature' else '[0, 1]'}")
        if self.peft_config is not None and self.peft_config.method in PROMPT_METHODS:
            raise ValueError(f"--model.peft.method={self.peft_config.method}: distillation scores the student's head "
                             "on its hidden states, which prompt learning does not hand over; use an injected method "
                             "(lora, ia3, loha, lokr) or a full fine-tune")
        self.teacher_source = teacher
        _check_teacher(teacher)  # its architecture, before any data is prepared
        self.divergence, self.beta, self.temperature, self.lmbda = divergence, beta, temperature, lmbda
        self.generation = generation or GenerationConfig(max_new_tokens=64, do_sample=True)
        if self.generation.num_beams != 1:
            raise ValueError(f"--model.generation.num_beams={self.generation.num_beams}: on-policy responses are "
                             "sampled or greedy (num_beams=1)")
        self.seed = seed
        self.teacher_model: nn.Module | None = None
        self.sampled = False
        """Whether the last training step learned from the student's own samples."""

    # ------------------------------------------------------------------------------------------ models
    @override
    def build_model(self) -> nn.Module:
        policy = self.build_policy()
        teacher = self.build_teacher()
        have, want = teacher.config.vocab_size, policy_vocab(policy)
        if have != want:
            raise ValueError(f"--model.teacher={self.teacher_source} has a vocabulary of {have} rows and the student "
                             f"({self.backbone}) {want}: distillation compares their next-token distributions, which "
                             "needs one vocabulary (the same tokenizer)")
        self.teacher_model = teacher
        return self.checkpointed(policy)

    def build_teacher(self) -> nn.Module:
        """The frozen teacher, without dropout: built lazily where the strategy shards models (a directory is
        indexed and each rank reads its shards), whole from a checkpoint of this package."""
        if _is_checkpoint(self.teacher_source):
            model, peft = rebuild_model(read_checkpoint(self.teacher_source))
            if peft is not None:
                raise ValueError(f"--model.teacher={self.teacher_source} is a {peft.method} checkpoint: merge its "
                                 "adapter first (`lightning_llm merge`) and pass the merged directory")
        else:
            model = self.build_backbone(self.teacher_source, family="decoder", dropout=0.0)
        if getattr(model, "lm_head", None) is None:
            raise ValueError(f"--model.teacher={self.teacher_source} has no LM head (a sequence classifier): the "
                             "teacher must be a causal LM")
        return model.requires_grad_(False).eval()

    @override
    def frozen_models(self) -> dict[str, nn.Module]:
        """The teacher (and a full fine-tune's reference, of which this task has none), placed like the student."""
        out = super().frozen_models()
        if self.teacher_model is not None:
            out[TEACHER] = self.teacher_model
        return out

    @override
    def train(self, mode: bool = True) -> DistillTask:
        super().train(mode)
        if self.teacher_model is not None:
            self.teacher_model.eval()  # frozen: never in training mode
        return self

    # ------------------------------------------------------------------------------------------ loss
    @override
    def model_inputs(self, batch: dict[str, Tensor], stage: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {k: batch[k] for k in ROW_KEYS[1:] if k in batch}
        kwargs["head_loss"] = DistillLoss(batch["teacher_hidden"], self.teacher_model, self.divergence, self.beta,
                                          self.temperature, self.uses_fused_loss())
        return (batch["input_ids"],), kwargs

    @override
    def loss_from_output(self, output: Any, batch: dict[str, Tensor], stage: str) -> tuple[Tensor, dict[str, Any]]:
        count = (batch["labels"] != -100).sum()
        # A part of the global batch (a replica, a micro-batch) without response tokens weighs 0 (its mean is 0, not
        # NaN); a whole batch without any stays NaN, as one device's mean over nothing (the non-finite guard sees it).
        caps = self.capabilities
        if caps.data_parallel_size > 1 or caps.pipelined:
            count = count.clamp(min=1)
        return output.float().sum() / count, {}

    @override
    def uses_fused_loss(self) -> bool:
        """Whether the divergence is chunked (``--model.fused_loss``; a head the chunks cannot read, such as a
        LoRA-wrapped one, still computes whole logits: :mod:`lightning_llm.kernels.loss.head_divergence`)."""
        if not self._loss_path_logged:
            self._loss_path_logged = True
            log.info("loss: %s %s", self.divergence, "in chunks from both models' hidden states and heads (no [B, S, "
                     "V] logits)" if self.fused_loss else "on whole logits (--model.fused_loss=false)")
        return self.fused_loss

    @override
    def loss_weight(self, batch: dict[str, Tensor]) -> Tensor:
        return (batch["labels"] != -100).sum()  # the loss is a mean over the response tokens

    # ------------------------------------------------------------------------------------------ steps
    def draw_seed(self) -> int:
        """The seed of the on-policy draws and the sampling: ``seed``, else the global seed (the same on every rank)."""
        return self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def on_policy(self, batch_idx: int) -> bool:
        """Whether this training step samples its responses: ``lmbda``'s draw from (seed, step, batch index)."""
        if self.lmbda >= 1.0 or self.lmbda <= 0.0:
            return self.lmbda >= 1.0
        return random.Random(_mix(self.draw_seed(), self.global_step, batch_idx)).random() < self.lmbda

    @torch.no_grad()
    def sample_rows(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Rows of the student's own responses to the batch's prompts (:func:`last_reply_prompts`), generated in eval
        mode: left-padded prompt and response ``[B, S + N]``, labels on the response tokens up to the first EOS."""
        cfg = for_datamodule(self.generation, self.trainer.datamodule if self._trainer is not None else None)
        prompt, mask = last_reply_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"],
                                          pad_id=cfg.pad_token_id)
        uniforms = None
        if cfg.do_sample:
            uniforms = torch.cat([torch.rand(1, cfg.max_new_tokens, dtype=torch.float64, generator=torch.Generator()
                                             .manual_seed(_mix(self.draw_seed(), self.global_step, key)))
                                  for key in _prompt_keys(prompt, mask)]).to(prompt.device)
        was_training = self.training
        self.eval()
        try:  # (in eval mode an MoE student records no router statistics: the step's are its training forward's)
            with self.decoding() as decoder:
                responses = generate(decoder, prompt, mask, config=cfg, uniforms=uniforms)  # [B, N]
        finally:
            self.train(was_training)
        ids, attention, positions, response_mask, _ = pack_responses(prompt, mask, responses, cfg.eos_ids)
        labels = torch.full_like(ids, -100)
        labels[:, prompt.shape[1] - 1:-1] = responses.masked_fill(~response_mask, -100)
        return {"input_ids": ids, "attention_mask": attention.long(), "position_ids": positions, "labels": labels}

    def prepared(self, batch: dict[str, Any], *, on_policy: bool) -> dict[str, Tensor]:
        """The rows a step learns from (the student's samples or the dataset's) with the teacher's hidden states."""
        rows = self.sample_rows(batch) if on_policy else {k: batch[k] for k in ROW_KEYS if k in batch}
        kwargs = {k: rows[k] for k in ("attention_mask", "labels", "position_ids", "segment_ids") if k in rows}
        with torch.no_grad():
            hidden = self.run_frozen(TEACHER, rows["input_ids"], head_loss=final_hidden, **kwargs)
        return {**rows, "teacher_hidden": hidden}

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor | None:
        on_policy = self.sampled = self.on_policy(batch_idx)
        if self.logging_step():
            self.log("train_on_policy", float(on_policy), on_step=True, on_epoch=False)
        return super().training_step(self.prepared(batch, on_policy=on_policy), batch_idx)

    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return super().validation_step(self.prepared(batch, on_policy=False), batch_idx)

    @override
    def test_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        return super().test_step(self.prepared(batch, on_policy=False), batch_idx)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        dm = self.trainer.datamodule
        if stage == "fit" and self.lmbda > 0 and getattr(dm, "packing", False):
            raise ValueError(f"--model.lmbda={self.lmbda} samples responses to each row's prompt, which packed rows "
                             "(--data.packing=true) do not have one of: set --data.packing=false, or --model.lmbda=0 "
                             "(the dataset's responses only)")


def policy_vocab(policy: nn.Module) -> int:
    """The student's vocabulary size (its config's; through a PEFT wrapper)."""
    config = getattr(policy, "config", None) or getattr(getattr(policy, "base", None), "config", None)
    return int(config.vocab_size)


def _is_checkpoint(source: str) -> bool:
    """Whether ``--model.teacher`` names a checkpoint of this package (a file, or a directory without config.json)."""
    p = Path(source).expanduser()
    return p.is_file() or (p.is_dir() and not (p / "config.json").is_file())


def _check_teacher(source: str) -> None:
    """Refuse, in one line, a teacher that cannot be built: a directory of an architecture this package does not
    load, a sequence classifier, a path that does not exist."""
    if _is_checkpoint(source):
        return
    config = backbone_config(source, family="decoder")  # raises one line naming the file for a refused config
    if config is None:
        raise ValueError(f"--model.teacher={source}: not a local Hugging Face directory (config.json), a named size "
                         "or a checkpoint of this package")
    if config.num_labels > 0:
        raise ValueError(f"--model.teacher={source} is a sequence classifier (num_labels={config.num_labels}) "
                         "without an LM head: the teacher must be a causal LM")
