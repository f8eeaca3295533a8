"""Reward sources for RLHF: a Python callable given by import path (:mod:`lightning_llm.rl.rewards.config`), or a
sequence-classification reward model (here). Every source maps decoded texts to one score per sample::

    reward(prompts: list[str], responses: list[str]) -> Tensor [B] | Sequence[float]

Reward models are a local HF ``...ForSequenceClassification`` directory (an encoder, or a decoder: Llama, Qwen,
Gemma-style reward models, ``lightning_llm export`` of a :class:`~lightning_llm.tasks.RewardTask` run), a Lightning
checkpoint of our :class:`~lightning_llm.tasks.ClassificationTask`, or (built by the RL tasks, which read any
checkpoint layout) a ``RewardTask`` checkpoint. They read text re-tokenized with THEIR tokenizer (``tokenizer_dir``;
the HF directory itself when it holds one):

* an encoder: the (prompt, response) pair by default, scored with the logit / probability / log-odds of ``label``;
* a decoder (a ``score`` head): prompt + response + EOS as :class:`~lightning_llm.data.PreferenceDataModule` makes a
  pair's row (:class:`~lightning_llm.data.preference.ReplyEncoder`; with a chat template, the one it was trained with,
  the response as the assistant turn after the prompt conversation), right-padded with its config's pad id and scored
  at each row's last token that is not padding (transformers' rule).

A model with more than one output is refused unless ``label`` picks one (naming the count).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_llm.checkpoint import load_file
from lightning_llm.data.base import eos_and_pad_ids, load_tokenizer
from lightning_llm.data.chat.encode import ChatEncoder
from lightning_llm.data.chat.messages import Conversation
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.data.preference import ReplyEncoder
from lightning_llm.models import NAMED_SIZES, build_model, load_hf
from lightning_llm.models.scores import sequence_scores
from lightning_llm.rl.rewards.config import RewardConfig, RewardFn, load_callable

log = logging.getLogger(__name__)

__all__ = ["RewardModel", "build_reward"]


# ---------------------------------------------------------------------------------------------------- reward models


def _load_classification_checkpoint(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a ClassificationTask's encoder from its checkpoint (shapes taken from the weights)."""
    ckpt = load_file(path, name=f"--model.reward.model={path}")
    hp = dict(ckpt.get("hyper_parameters") or {})
    state = {k[len("model."):]: v for k, v in ckpt.get("state_dict", {}).items() if k.startswith("model.")}
    if "classifier.weight" not in state or "backbone" not in hp:
        raise ValueError(f"--model.reward.model={path}: not a ClassificationTask checkpoint (no classifier weights "
                         f"or backbone hyper-parameter)")
    overrides = dict(hp.get("model_overrides") or {})
    overrides.update(num_labels=int(state["classifier.weight"].shape[0]), dropout=0.0)
    backbone = str(hp["backbone"])

    if ("encoder", backbone) in NAMED_SIZES:
        overrides["vocab_size"] = int(state["embed_tokens.weight"].shape[0])
    model = build_model(backbone, family="encoder", **overrides)
    model.load_state_dict(state, strict=True)
    return model, {"label_names": ckpt.get("label_names"), "backbone": backbone}


class RewardModel:
    """A frozen sequence classifier scoring decoded (prompt, response) texts (see the module docstring). Not an
    ``nn.Module`` on purpose: it stays out of the policy's state dict, optimizer and DDP wrapper; call :meth:`to` to
    move it. The RL tasks declare its ``model`` as a scoring model (``task.scoring_models()``), which a layout shards
    with the family's tensor-parallel plan and ZeRO-3; under ZeRO-3 every rank of ``lockstep`` (the data-parallel
    group, set by the task) then runs the same number of forwards per call (one chunk more than it needs runs on a
    dummy row).

    ``model``, ``tokenizer`` and ``template`` (a chat template source: a decoder's, as it was trained) are given by
    a caller that built the model itself (the RL tasks, from a ``RewardTask`` checkpoint); otherwise ``cfg.model`` is
    loaded: an HF directory or a ``ClassificationTask`` file."""

    lockstep: Any = None

    def __init__(self, cfg: RewardConfig, *, model: nn.Module | None = None, tokenizer: Any = None,
                 template: str | None = None) -> None:
        assert cfg.model is not None
        meta: dict[str, Any] = {}
        if model is None:
            model, tokenizer, meta = self._load(cfg)
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        config = getattr(model, "config", None)
        self.decoder = getattr(config, "family", "encoder") == "decoder"
        head = getattr(model, "score" if self.decoder else "classifier", None)
        if head is None:
            raise ValueError(f"--model.reward.model={cfg.model}: the model has no classification head (a decoder "
                             "reward model is a ...ForSequenceClassification, or a RewardTask checkpoint)")
        self.num_labels = int(head.out_features)
        if self.num_labels > 1 and cfg.label is None:
            raise ValueError(f"--model.reward.model={cfg.model} has {self.num_labels} outputs (num_labels="
                             f"{self.num_labels}): pick the one that is the reward with --model.reward.label")
        if self.num_labels > 1 and not 0 <= cfg.label < self.num_labels:
            raise ValueError(f"--model.reward.label={cfg.label} but the reward model has {self.num_labels} classes")
        self.replies = self._reply_encoder(template) if self.decoder else None
        self.model.eval().requires_grad_(False)
        n = sum(p.numel() for p in self.model.parameters())
        log.info("reward model %s: %s parameters, %d output(s) %s", cfg.model, f"{n:,}", self.num_labels,
                 meta.get("label_names") or "")

    @staticmethod
    def _load(cfg: RewardConfig) -> tuple[nn.Module, Any, dict[str, Any]]:
        """``(model, tokenizer, meta)`` of an HF directory or a ``ClassificationTask`` checkpoint file."""
        path = Path(str(cfg.model))
        if path.is_file():
            model, meta = _load_classification_checkpoint(path)
            tok_dir = cfg.tokenizer_dir
            if tok_dir is None:
                raise ValueError(f"--model.reward.tokenizer_dir is required with a checkpoint reward model "
                                 f"({path}): the tokenizer the classifier was trained with")
        elif path.is_dir():
            model, _ = load_hf(path, dropout=0.0)
            meta, tok_dir = {}, cfg.tokenizer_dir or str(path)
        else:
            raise FileNotFoundError(f"--model.reward.model={cfg.model}: no such checkpoint file or directory")
        return model, load_tokenizer(tok_dir, param="--model.reward.tokenizer_dir"), meta

    def _reply_encoder(self, template: str | None) -> ReplyEncoder:
        """How a decoder reward model's rows are made: as its preference data made them."""
        cfg = self.cfg
        if not 1 <= cfg.max_prompt_length < cfg.max_length:
            raise ValueError(f"--model.reward.max_prompt_length={cfg.max_prompt_length} must be >= 1 and below "
                             f"--model.reward.max_length={cfg.max_length}: a response needs room after the prompt")
        spec = cfg.template if cfg.template != "auto" or template is None else template
        chat = None if spec == "none" else resolve_template(spec, self.tokenizer, fallback=None,
                                                            param="--model.reward.template")
        eos, _ = eos_and_pad_ids(self.tokenizer, cfg.tokenizer_dir)
        encoder = None if chat is None else ChatEncoder(self.tokenizer, chat, eos_token_id=eos,
                                                        param="--model.reward.template")
        return ReplyEncoder(encoder.tokenizer if encoder is not None else self.tokenizer, encoder,
                            eos_token_id=eos, max_prompt_len=cfg.max_prompt_length, cutoff_len=cfg.max_length)

    def to(self, device: torch.device | str) -> RewardModel:
        """Move to ``device``; ZeRO-3 shards stay where FSDP2 put them (on the device, or on the host when
        offloaded: moving them would defeat the offload)."""
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _encode(self, prompts: list[str], responses: list[str]) -> dict[str, Tensor]:
        kw: dict[str, Any] = {"truncation": True, "max_length": self.cfg.max_length, "padding": True,
                              "return_tensors": "pt"}
        enc = self.tokenizer(prompts, responses, **kw) if self.cfg.text == "pair" else self.tokenizer(responses, **kw)
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}

    def rows(self, prompts: list[str], responses: list[str],
             conversations: list[Conversation | None] | None = None) -> list[list[int]]:
        """A decoder reward model's token ids of each (prompt, response): the prompt conversation (``conversations``,
        the RL data's, else the prompt as one user message) and the response as its assistant turn under a chat
        template, else prompt + response + EOS."""
        assert self.replies is not None
        out = []
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            if self.replies.chat is None:
                out.append(self.replies.raw(self.replies.prompt_ids(prompt, None), response)[0])
                continue
            conv = conversations[i] if conversations is not None and conversations[i] is not None else \
                Conversation([{"role": "user", "content": prompt}], None, "reward prompt")
            reply = {"role": "assistant", "content": response}
            out.append(self.replies.turn(self.replies.fit(conv), reply)[0])
        return out

    def _decoder_logits(self, rows: list[list[int]]) -> Tensor:
        """Scores [b, L] of right-padded rows at each row's last token that is not padding (the config's pad id)."""
        pad = int(self.model.config.pad_token_id)
        longest = max(len(r) for r in rows)
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return sequence_scores(self.model(ids, attention_mask=mask), ids, pad).float()

    def _forwards(self, n: int) -> int:
        """Forwards a call of ``n`` chunks runs: ``n``, or under ZeRO-3 the most any rank of ``lockstep`` needs
        (each forward all-gathers the shards, which every rank must join)."""
        if self.lockstep is None or not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            return n
        most = torch.tensor([n], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.lockstep)
        return int(most)

    def _logits(self, prompts: list[str], responses: list[str],
                conversations: list[Conversation | None] | None = None) -> Tensor:
        if self.decoder:
            return self._decoder_logits(self.rows(prompts, responses, conversations))
        enc = self._encode(prompts, responses)
        return self.model(enc["input_ids"], attention_mask=enc.get("attention_mask"),
                          token_type_ids=enc.get("token_type_ids")).float()  # [b, L]

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str],
                 conversations: list[Conversation | None] | None = None) -> Tensor:
        """Scores [B] of the (prompt, response) pairs; ``conversations``: the prompts as conversations (a decoder
        reward model with a chat template renders them)."""
        bs = self.cfg.batch_size
        starts = range(0, len(responses), bs)
        out = [self._score(self._logits(prompts[i:i + bs], responses[i:i + bs],
                                        None if conversations is None else conversations[i:i + bs])) for i in starts]
        for _ in range(self._forwards(len(starts)) - len(starts)):
            self._logits(["x"], [""])  # joins the other ranks' all-gathers; the scores are not used
        return torch.cat(out) if out else torch.zeros(0, device=self.device)

    def _score(self, logits: Tensor) -> Tensor:
        if self.num_labels == 1:
            return logits[:, 0]
        label = self.cfg.label
        assert label is not None
        if self.cfg.score == "logit":
            return logits[:, label]
        if self.cfg.score == "prob":
            return logits.softmax(-1)[:, label]
        others = torch.cat([logits[:, :label], logits[:, label + 1:]], dim=1)
        return logits[:, label] - torch.logsumexp(others, dim=-1)


def build_reward(cfg: RewardConfig) -> RewardFn | RewardModel:
    """The reward source ``cfg`` names (one of ``fn`` / ``model``)."""
    if (cfg.fn is None) == (cfg.model is None):
        raise ValueError("--model.reward: set exactly one of reward.fn (an import path) and reward.model "
                         "(a reward-model checkpoint or HF directory)")
    if cfg.fn is not None:
        return load_callable(cfg.fn, cfg.kwargs)
    return RewardModel(cfg)
