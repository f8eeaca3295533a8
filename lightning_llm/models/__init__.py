"""Model families: causal decoders (LLaMA, GPT-2, ...) and encoders (BERT, RoBERTa, XLM-R, MegatronBERT, DeBERTa-v2/v3,
ModernBERT), plus HF conversion."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_llm.files import read_json

from .config import Family, ModelConfig
from .decoder import DecoderLM
from .encoder import EncoderModel
from .hf import config_from_hf, config_to_hf, load_hf, save_hf
from .parallel_spec import PARALLEL_SPECS, ParallelSpec, family_roots, parallel_spec_of, routing_stats_of
from .sizes import NAMED_SIZES, named_config

log = logging.getLogger(__name__)

__all__ = [
    "ModelConfig",
    "named_config",
    "NAMED_SIZES",
    "DecoderLM",
    "EncoderModel",
    "load_hf",
    "save_hf",
    "config_from_hf",
    "config_to_hf",
    "backbone_config",
    "build_model",
    "model_from_config",
    "ParallelSpec",
    "PARALLEL_SPECS",
    "parallel_spec_of",
    "family_roots",
    "routing_stats_of",
]


def model_from_config(config: ModelConfig) -> nn.Module:
    """``DecoderLM`` or ``EncoderModel`` for ``config.family`` (randomly initialised; honours ``torch.device``)."""
    if config.family == "decoder":
        return DecoderLM(config)
    if config.family == "encoder":
        return EncoderModel(config)
    raise ValueError(f"unknown model family {config.family!r}")


def _looks_like_path(s: str) -> bool:
    return os.sep in s or "/" in s or s.startswith((".", "~")) or Path(s).exists()


def build_model(backbone: str, *, family: Family, lazy: bool = False, **overrides: Any) -> nn.Module:
    """A model from a named size (``debug``, ``llama2-7b``, ...) or a local HF checkpoint directory.

    Named sizes are randomly initialised (:mod:`.init`: the values depend only on the model's ``init_seed``, drawn
    from torch's generator, and the parameter names); directories are loaded with :func:`load_hf` (``overrides`` go
    to the config). ``lazy=True``: nothing is allocated: a named size stays on the meta device, a directory is
    indexed (``weights_source``); :func:`~lightning_llm.models.init.materialize` fills whatever tensors a rank keeps
    after sharding. Either way the model is in train mode (Lightning does not switch modules a task built to train
    mode).
    """
    if (family, backbone) in NAMED_SIZES:
        if lazy:
            with torch.device("meta"):
                return model_from_config(named_config(backbone, family=family, **overrides))
        return model_from_config(named_config(backbone, family=family, **overrides))
    if _looks_like_path(backbone):
        p = Path(backbone).expanduser()
        if not p.exists():
            raise FileNotFoundError(
                f"backbone={backbone!r}: no such local path {str(p)!r} (only named sizes and local HF checkpoint "
                f"directories are supported; nothing is downloaded)"
            )
        dtype = overrides.pop("dtype", None)
        model, _ = load_hf(p, family=family, dtype=dtype, lazy=lazy, **overrides)
        return model.train()  # load_hf returns eval mode (as from_pretrained); this builds models to train
    named_config(backbone, family=family)  # raises the "unknown size; known sizes: ..." error
    raise AssertionError("unreachable")


def backbone_config(backbone: str, *, family: Family, **overrides: Any) -> ModelConfig | None:
    """The config of a named size or of a local HF directory's ``config.json`` with ``overrides``, without building
    anything (what a task checks its options against before data is prepared); None for anything else (left to
    :func:`build_model`). A config this package refuses raises one line naming the file (or the size)."""
    if (family, backbone) in NAMED_SIZES:
        where, read = f"backbone={backbone}", lambda: named_config(backbone, family=family, **overrides)
    else:
        path = Path(backbone).expanduser() / "config.json"
        if not _looks_like_path(backbone) or not path.is_file():
            return None
        where, read = str(path), lambda: config_from_hf(read_json(path), where=str(path)).replace(**overrides)
    try:
        return read()
    except ValueError as e:
        raise ValueError(f"{where}: {e}" if where not in str(e) else str(e)) from None
