"""How a run names a reward source (``--model.reward`` / ``--model.rewards``): :class:`RewardConfig`, and the callables
its ``fn`` names (:func:`import_path`, :func:`load_callable`). The sources built from it: a callable, or a reward
model (:mod:`lightning_llm.rl.rewards.model`); several named and weighted: :mod:`lightning_llm.rl.rewards.sources`."""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["RewardConfig", "RewardFn", "import_path", "load_callable"]

RewardFn = Callable[[list[str], list[str]], "Tensor | Sequence[float]"]


@dataclass
class RewardConfig:
    """A reward source: exactly one of ``fn`` and ``model``, its ``name`` and ``weight`` (a run takes one as
    ``--model.reward`` or several as ``--model.rewards``: :mod:`lightning_llm.rl.rewards.sources`)."""

    fn: str | None = None
    """Import path of a callable ``(prompts, responses, **columns) -> scores`` (``pkg.module:name`` or
    ``pkg.module.name``); a class is instantiated with ``kwargs`` first, a function gets ``kwargs`` bound. Built in:
    ``lightning_llm.rl.rewards:MathAccuracy``, ``FormatReward``, ``SoftOverlong``, ``CharShareReward``."""
    name: str | None = None
    """Name in the logs (``rewards/<name>/mean``) and in ``rollouts.jsonl`` (default: the callable's name after the
    import path's last ``:`` or ``.``; ``reward_model`` for a model)."""
    weight: float = 1.0
    """Weight of this source in the score: the weighted sum over the sources that scored a response."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``fn``."""
    model: str | None = None
    """Reward model: a local HF ``...ForSequenceClassification`` directory (encoder or decoder), a ``RewardTask``
    checkpoint (any layout) or a ``ClassificationTask`` ``.ckpt`` file."""
    tokenizer_dir: str | None = None
    """The reward model's tokenizer directory (default: the HF model directory itself; a ``RewardTask`` checkpoint's
    recorded tokenizer)."""
    label: int | None = None
    """Class whose score is the reward: required for a model with more than one output (refused without it); a
    one-output model's score is the reward."""
    score: Literal["logit", "prob", "log_odds"] = "log_odds"
    """``logit`` of ``label``, its softmax ``prob``, or ``log_odds`` = logit - logsumexp(other logits)."""
    text: Literal["pair", "response"] = "pair"
    """Encoders: feed (prompt, response) as a sentence pair, or the response alone."""
    template: str = "auto"
    """Decoder reward models: the chat template the (prompt, response) is rendered with: ``auto`` (the one it was
    trained with: a ``RewardTask`` checkpoint's, or the tokenizer's own; none: raw prompt + response + EOS),
    ``none``, ``tokenizer``, a named one or a Jinja string / file."""
    max_length: int = 256
    """Longest reward-model input; longer inputs are truncated (encoders: longest first; decoders: the row cut to
    it, the prompt first kept to ``max_prompt_length``, as ``PreferenceDataModule``'s ``cutoff_len``)."""
    max_prompt_length: int = 128
    """Decoder reward models: most prompt tokens (its end is kept), as ``PreferenceDataModule``'s ``max_prompt_len``."""
    batch_size: int = 64
    """Reward-model forward batch size."""

    def __post_init__(self) -> None:
        # jsonargparse (4.53) turns `--model.reward.fn=null` into the string "None" inside a subclass's init args (a
        # config's `fn` switched off on the command line for a reward model): no import path or file is named so.
        for name in ("fn", "model", "tokenizer_dir"):
            if getattr(self, name) in ("None", "null"):
                setattr(self, name, None)
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"the weight of reward {self.source_name} is {w!r}: a reward source's weight must be a "
                             "finite number (--model.reward.weight / --model.rewards[i].weight)")

    @property
    def source_name(self) -> str:
        """``name``, or the callable's name in its import path (``reward_model`` for a model)."""
        if self.name:
            return self.name
        if self.fn:
            return self.fn.replace(":", ".").rsplit(".", 1)[-1]
        return "reward_model"


# Saved in the RL tasks' checkpoints' hyper-parameters; those written while the class lived in
# ``lightning_llm/rl/rewards.py`` name it there and still load weights_only.
torch.serialization.add_safe_globals([RewardConfig, (RewardConfig, "lightning_llm.rl.rewards.RewardConfig")])


def import_path(path: str, *, param: str, example: str = "my_pkg.rewards:score") -> Any:
    """The object ``pkg.module:name`` / ``pkg.module.name`` names; refused in one line naming ``param``."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{param}={path!r}: expected an import path like {example!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{param}={path!r}: cannot import it ({e})") from e


def load_callable(path: str, kwargs: dict[str, Any] | None = None, *, param: str = "--model.reward.fn") -> RewardFn:
    """Import ``pkg.module:name`` / ``pkg.module.name``; instantiate classes with ``kwargs``, bind them to functions."""
    target = import_path(path, param=param)
    kwargs = dict(kwargs or {})
    if isinstance(target, type):
        target = target(**kwargs)
    elif kwargs:
        target = functools.partial(target, **kwargs)
    if not callable(target):
        raise ValueError(f"{param}={path!r} is not callable")  # noqa: TRY004 - the CLI reports ValueErrors
    return target
