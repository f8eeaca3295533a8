"""Options of an HF family's ``config.json`` that this package does not build: refused in one line naming the file and
the option (when the config is read: ``load_hf``, ``estimate``, and a decoder task's constructor through
``models.backbone_config``, before any data is prepared), never loaded into a model that computes something else.

A family lists its own in its record (``Family.unbuilt``: :class:`Unbuilt` entries); ``config_from_hf`` calls
:func:`refuse_unbuilt` with them before the family reads anything else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PLAIN_WEIGHTS", "Unbuilt", "one_of", "refuse_unbuilt"]


@dataclass(frozen=True)
class Unbuilt:
    """``key`` of a config.json is refused unless absent or ``built(value)``; ``what`` says what is built instead."""

    key: str
    built: Callable[[Any], bool]
    what: str


def one_of(*values: Any) -> Callable[[Any], bool]:
    """``built`` of an option whose only built values are ``values``."""
    return lambda v: v in values


PLAIN_WEIGHTS = Unbuilt("quantization_config", lambda v: not v, "bf16/fp16/fp32 weights; a block-quantized FP8 "
                        "checkpoint (weight_scale_inv tensors) must be dequantized to bf16 first")
"""A quantized checkpoint is refused (the families whose published checkpoints are plain)."""


def refuse_unbuilt(hf: dict[str, Any], kind: str, options: tuple[Unbuilt, ...], where: str) -> None:
    """Raise ``ValueError`` (one line: ``where``, the option, its value, what is built) for the first of ``options``
    that ``hf`` sets to a value that is not built (``kind``: the family's model type, named in the message)."""
    for option in options:
        if option.key in hf and not option.built(hf[option.key]):
            raise ValueError(f"{where}: {option.key}={hf[option.key]!r} is not supported for {kind} (built: "
                             f"{option.what})")
