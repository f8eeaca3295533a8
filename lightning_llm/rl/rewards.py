"""Reward sources for RLHF: a Python callable given by import path, or a sequence-classification reward model.

Every source maps decoded texts to one score per sample::

    reward(prompts: list[str], responses: list[str]) -> Tensor [B] | Sequence[float]

Reward models are either a Lightning checkpoint of our :class:`~lightning_llm.tasks.ClassificationTask` (the
classification task makes reward models) or a local HF ``...ForSequenceClassification`` directory. They read text
re-tokenized with THEIR tokenizer (``tokenizer_dir``; the HF directory itself when it holds one), as a
(prompt, response) pair by default, and score with the logit / probability / log-odds of ``label``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_llm.checkpoint import load_file
from lightning_llm.data.base import load_tokenizer
from lightning_llm.models import NAMED_SIZES, build_model, load_hf

log = logging.getLogger(__name__)

__all__ = ["CharShareReward", "RewardConfig", "RewardModel", "build_reward", "load_callable"]

RewardFn = Callable[[list[str], list[str]], "Tensor | Sequence[float]"]


@dataclass
class RewardConfig:
    """Where scores come from: exactly one of ``fn`` and ``model``."""

    fn: str | None = None
    """Import path of a callable ``(prompts, responses) -> scores`` (``pkg.module:name`` or ``pkg.module.name``);
    a class is instantiated with ``kwargs`` first, a function gets ``kwargs`` bound."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``fn``."""
    model: str | None = None
    """Reward model: a ``ClassificationTask`` ``.ckpt`` file or a local HF sequence-classification directory."""
    tokenizer_dir: str | None = None
    """The reward model's tokenizer directory (default: the HF model directory itself)."""
    label: int = 1
    """Class whose score is the reward (ignored for a single-output model: its logit is the reward)."""
    score: Literal["logit", "prob", "log_odds"] = "log_odds"
    """``logit`` of ``label``, its softmax ``prob``, or ``log_odds`` = logit - logsumexp(other logits)."""
    text: Literal["pair", "response"] = "pair"
    """Feed (prompt, response) as a sentence pair, or the response alone."""
    max_length: int = 256
    """Longest reward-model input; longer inputs are truncated (longest first)."""
    batch_size: int = 64
    """Reward-model forward batch size."""

    def __post_init__(self) -> None:
        # jsonargparse (4.53) turns `--model.reward.fn=null` into the string "None" inside a subclass's init args (a
        # config's `fn` switched off on the command line for a reward model): no import path or file is named so.
        for name in ("fn", "model", "tokenizer_dir"):
            if getattr(self, name) in ("None", "null"):
                setattr(self, name, None)


torch.serialization.add_safe_globals([RewardConfig])  # saved in PPO checkpoints' hyper-parameters


# ---------------------------------------------------------------------------------------------------- callables


CHAR_SETS = {"digits": string.digits, "lowercase": string.ascii_lowercase, "uppercase": string.ascii_uppercase,
             "vowels": "aeiou", "whitespace": string.whitespace}


class CharShareReward:
    """Programmatic reward: the share of a response's characters that belong to ``chars`` (0 for an empty
    response). ``chars`` is a named set (``digits``, ``lowercase``, ``uppercase``, ``vowels``) or the characters
    themselves (in YAML prefer a named set: a quoted ``"0123"`` may still be read as a number). Whitespace counts
    unless ``ignore_whitespace``."""

    def __init__(self, chars: str = "digits", *, ignore_whitespace: bool = False) -> None:
        if not isinstance(chars, str) or not chars:
            raise ValueError(f"--model.reward.kwargs.chars must be a non-empty string or one of "
                             f"{sorted(CHAR_SETS)}, got {chars!r}")
        self.chars = frozenset(CHAR_SETS.get(chars, chars))
        self.ignore_whitespace = ignore_whitespace

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        out = []
        for text in responses:
            if self.ignore_whitespace:
                text = "".join(text.split())
            out.append(sum(c in self.chars for c in text) / len(text) if text else 0.0)
        return out


def load_callable(path: str, kwargs: dict[str, Any] | None = None, *, param: str = "--model.reward.fn") -> RewardFn:
    """Import ``pkg.module:name`` / ``pkg.module.name``; instantiate classes with ``kwargs``, bind them to functions."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{param}={path!r}: expected an import path like 'my_pkg.rewards:score'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{param}={path!r}: cannot import it ({e})") from e
    kwargs = dict(kwargs or {})
    if isinstance(target, type):
        target = target(**kwargs)
    elif kwargs:
        target = functools.partial(target, **kwargs)
    if not callable(target):
        raise ValueError(f"{param}={path!r} is not callable")  # noqa: TRY004 - the CLI reports ValueErrors
    return target


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
    """A frozen sequence classifier scoring decoded (prompt, response) texts. Not an ``nn.Module`` on purpose: it
    stays out of the policy's state dict, optimizer and DDP wrapper; call :meth:`to` to move it. The RL tasks declare
    its ``model`` as a scoring model (``task.scoring_models()``), which a layout shards with the family's
    tensor-parallel plan and ZeRO-3; under ZeRO-3 every rank of ``lockstep`` (the data-parallel group, set by the
    task) then runs the same number of forwards per call (one chunk more than it needs runs on a dummy row)."""

    lockstep: Any = None

    def __init__(self, cfg: RewardConfig) -> None:
        assert cfg.model is not None

        path = Path(cfg.model)
        if path.is_file():
            self.model, meta = _load_classification_checkpoint(path)
            tok_dir = cfg.tokenizer_dir
            if tok_dir is None:
                raise ValueError(f"--model.reward.tokenizer_dir is required with a checkpoint reward model "
                                 f"({path}): the tokenizer the classifier was trained with")
        elif path.is_dir():
            self.model, _ = load_hf(path, family="encoder", dropout=0.0)
            meta = {}
            tok_dir = cfg.tokenizer_dir or str(path)
        else:
            raise FileNotFoundError(f"--model.reward.model={cfg.model}: no such checkpoint file or directory")
        if getattr(self.model, "classifier", None) is None:
            raise ValueError(f"--model.reward.model={cfg.model}: the model has no classification head")
        self.tokenizer = load_tokenizer(tok_dir, param="--model.reward.tokenizer_dir")
        self.cfg = cfg
        self.num_labels = int(self.model.classifier.out_features)
        if self.num_labels > 1 and not 0 <= cfg.label < self.num_labels:
            raise ValueError(f"--model.reward.label={cfg.label} but the reward model has {self.num_labels} classes")
        self.model.eval().requires_grad_(False)
        n = sum(p.numel() for p in self.model.parameters())
        log.info("reward model %s: %s parameters, %d classes %s", cfg.model, f"{n:,}", self.num_labels,
                 meta.get("label_names") or "")

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

    def _forwards(self, n: int) -> int:
        """Forwards a call of ``n`` chunks runs: ``n``, or under ZeRO-3 the most any rank of ``lockstep`` needs
        (each forward all-gathers the shards, which every rank must join)."""
        if self.lockstep is None or not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            return n
        most = torch.tensor([n], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.lockstep)
        return int(most)

    def _logits(self, prompts: list[str], responses: list[str]) -> Tensor:
        enc = self._encode(prompts, responses)
        return self.model(enc["input_ids"], attention_mask=enc.get("attention_mask"),
                          token_type_ids=enc.get("token_type_ids")).float()  # [b, L]

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        bs = self.cfg.batch_size
        starts = range(0, len(responses), bs)
        out = [self._score(self._logits(prompts[i:i + bs], responses[i:i + bs])) for i in starts]
        for _ in range(self._forwards(len(starts)) - len(starts)):
            self._logits([""], [""])  # joins the other ranks' all-gathers; the scores are not used
        return torch.cat(out) if out else torch.zeros(0, device=self.device)

    def _score(self, logits: Tensor) -> Tensor:
        if self.num_labels == 1:
            return logits[:, 0]
        label = self.cfg.label
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
