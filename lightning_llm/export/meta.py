"""What ``lightning_llm export`` needs besides the weights, stored in every checkpoint under ``checkpoint["export"]``.

* ``model_config``: the whole model's :class:`~lightning_llm.models.ModelConfig` as a dict, so a full fine-tune is
  rebuilt from the checkpoint alone (the backbone directory may be gone); a PEFT run still needs the frozen base
  weights from the backbone (or ``--base``) unless the checkpoint holds them (``strategy=3d``).
* ``tokenizer``: the run's tokenizer directory (absolute), ``"byte"`` for the built-in byte tokenizer (exported as
  files ``AutoTokenizer`` loads), or ``None`` when the datamodule has no tokenizer we can name.
* ``byte_tokenizer``: with ``"byte"``, the byte tokenizer's ``settings()``: ``added_tokens`` (a chat template's
  control tokens, ids 259, ...) and ``split_special_tokens`` (whether a special token written in a text is read as
  bytes); :func:`recorded_byte_tokenizer` rebuilds it. ``None`` otherwise (and in older checkpoints).
* ``generation_config``: the backbone's ``generation_config.json`` as read at save time (decoders), or ``None``.
* ``chat_template``: the Jinja source of the chat template the datamodule rendered with, when it is not the
  tokenizer's own (a named or the user's template: the export writes it beside the tokenizer), else ``None``.
* ``stop_token_ids``: the ids generation stopped at (the template's end-of-turn token and EOS), or ``None``; the
  export's ``generation_config.json`` ends generation at them too.

Written by :class:`ExportMetadata`, a callback every task installs (``LLMTask.configure_callbacks``), so a task that
overrides ``on_save_checkpoint`` without calling ``super()`` still stores it; ``LLMTask.on_save_checkpoint`` writes the
same through :func:`export_metadata`, for ``save_weights_only`` checkpoints, where Lightning skips the callbacks' hook.
Plain data only (dicts, strings, numbers): Lightning resumes with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.models import ModelConfig

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_KEY", "ExportMetadata", "chat_template_source", "export_metadata", "recorded_byte_tokenizer"]

CHECKPOINT_KEY = "export"


def _tokenizer_source(datamodule: Any) -> str | None:
    """The directory the run's tokenizer was loaded from, ``"byte"`` for our byte tokenizer, else ``None``."""
    if datamodule is None:
        return None
    tok = getattr(datamodule, "tokenizer", None)
    if isinstance(tok, ByteTokenizer):
        return "byte"
    for candidate in (getattr(datamodule, "tokenizer_dir", None), getattr(tok, "name_or_path", None)):
        if candidate and Path(str(candidate)).is_dir():
            return str(Path(str(candidate)).resolve())
    return None


def recorded_byte_tokenizer(meta: dict[str, Any]) -> ByteTokenizer:
    """The byte tokenizer a run recorded in ``checkpoint["export"]``, with the tokens it gained."""
    return ByteTokenizer(**(meta.get("byte_tokenizer") or {}))


def chat_template_source(datamodule: Any) -> str | None:
    """The Jinja source of the datamodule's chat template when the tokenizer does not carry it itself (a named or
    the user's template), else ``None``."""
    template = getattr(getattr(datamodule, "chat", None), "template", None)
    return None if template is None or template.own else template.source


def _stop_token_ids(datamodule: Any) -> list[int] | None:
    if getattr(datamodule, "chat", None) is None:
        return None
    return [int(i) for i in datamodule.stop_token_ids]


def _generation_config(backbone: Any) -> dict[str, Any] | None:
    path = Path(str(backbone)) / "generation_config.json" if backbone else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # a damaged file must not fail a training save: export falls back
        log.warning("%s: not stored in the checkpoint (%s)", path, e)
        return None


def export_metadata(pl_module: pl.LightningModule) -> dict[str, Any] | None:
    """The ``checkpoint["export"]`` entry for ``pl_module`` (``None`` before its model is built)."""
    model = getattr(pl_module, "model", None)
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        return None
    trainer = pl_module._trainer  # None outside a Trainer (`.trainer` would raise)
    datamodule = trainer.datamodule if trainer is not None else None
    tok = getattr(datamodule, "tokenizer", None)
    return {
        "model_config": config.to_dict(),
        "tokenizer": _tokenizer_source(datamodule),
        "byte_tokenizer": tok.settings() if isinstance(tok, ByteTokenizer) else None,
        "generation_config": _generation_config(getattr(pl_module, "backbone", None)),
        "chat_template": chat_template_source(datamodule),
        "stop_token_ids": _stop_token_ids(datamodule),
    }


class ExportMetadata(pl.Callback):
    """Adds ``checkpoint["export"]`` (:func:`export_metadata`) to every checkpoint the task saves."""

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        meta = export_metadata(pl_module)
        if meta is not None:
            checkpoint[CHECKPOINT_KEY] = meta
