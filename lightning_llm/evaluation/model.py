"""What ``lightning_llm eval PATH`` scores: PATH read (:func:`read_source`), its model rebuilt inside a Trainer at the
chosen layout (:class:`EvalTask`) and the checkpoint's weights loaded into each rank's shards
(:meth:`EvalTask.load_weights`).

PATH is a Hugging Face directory (the engine builds it lazily and every rank reads only its shards, as ``fit`` does)
or a training checkpoint: a ``.ckpt`` file (one device, DDP, consolidated), the engine's layout-free DCP directory
(tp, pp, zero1/2/3, 3d, cp: each rank reads its shards) or a DeepSpeed / pre-engine directory (consolidated in memory
first by :func:`lightning_llm.export.read_checkpoint`). The model is built from the config the checkpoint stores, the
same module tree the run trained (PEFT adapters applied, not merged: a LoRA run is scored with its adapters as
trained, its frozen base read from the run's backbone directory), so the checkpoint's names load as they are; a
checkpoint whose weights do not fit that tree (another task's model, other PEFT settings) is refused before anything
is scored. Tokenizer, chat template and stop ids are the ones ``lightning_llm export`` would write beside the weights.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from lightning_llm.checkpoint import first_line, load_file, read_dcp_metadata, verify_checkpoint
from lightning_llm.data.base import load_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.export import (
    CHECKPOINT_KEY,
    export_sources,
    generation_config_dict,
    peft_config_of,
    read_checkpoint,
)
from lightning_llm.files import read_json
from lightning_llm.models import ModelConfig, config_from_hf, model_from_config
from lightning_llm.models.quantize import QuantizationConfig
from lightning_llm.strategies.engine import hybrid_checkpoint as hckpt
from lightning_llm.tasks.causal_lm import CausalLMTask

log = logging.getLogger(__name__)

__all__ = ["EvalTask", "ModelSource", "read_source"]

SourceKind = Literal["hf", "file", "dcp", "consolidated"]


@dataclass
class ModelSource:
    """PATH, read: how to build its model and where its weights, tokenizer and stop ids come from."""

    path: Path
    kind: SourceKind
    """``hf``: a Hugging Face directory; ``file``: a checkpoint file; ``dcp``: the engine's DCP directory;
    ``consolidated``: a DeepSpeed / pre-engine directory read whole."""
    tokenizer: Any
    max_length: int
    """The model's ``max_position_embeddings``."""
    task_kwargs: dict[str, Any]
    """:class:`EvalTask`'s arguments (backbone, stored model config, PEFT and quantization settings)."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Where generation stops besides the tokenizer's EOS (the export's ``generation_config.json``)."""
    checkpoint: dict[str, Any] | None = None
    """The checkpoint's entries (``file``: tensors memory-mapped; ``dcp``: everything but the tensors)."""

    @property
    def name(self) -> str:
        return f"PATH={self.path}"

    def saved_keys(self) -> set[str]:
        """The LightningModule names of the model's weights the checkpoint holds (``model.*``; a task's own modules
        beside its model are not scored)."""
        if self.kind == "dcp":
            meta = read_dcp_metadata(self.path, name=f"{self.name}: .metadata").state_dict_metadata
            keys = {k[len("model."):] for k in meta if k.startswith("model.")}
        else:
            keys = set((self.checkpoint or {}).get("state_dict", {}))
        return {k for k in keys if k.startswith("model.")}


def _eos_ids(gen: dict[str, Any] | None) -> list[int]:
    eos = (gen or {}).get("eos_token_id")
    return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def _read_hf(p: Path, tokenizer_dir: str | None) -> ModelSource:
    config = config_from_hf(read_json(p / "config.json"))
    if config.family != "decoder":
        raise ValueError(f"PATH={p}: an encoder ({config.family}) checkpoint; lm-eval scores decoders")
    gen_file = p / "generation_config.json"
    tokenizer = load_tokenizer(tokenizer_dir or str(p), param="--tokenizer" if tokenizer_dir else "PATH")
    return ModelSource(path=p, kind="hf", tokenizer=tokenizer, max_length=config.max_position_embeddings,
                       task_kwargs={"backbone": str(p)},
                       eos_token_ids=_eos_ids(read_json(gen_file) if gen_file.is_file() else None))


def _read_checkpoint_entries(p: Path) -> tuple[SourceKind, dict[str, Any]]:
    name = f"PATH={p}"
    verify_checkpoint(p, name=name)  # before anything is unpickled: a crafted file never runs code
    if p.is_file():
        return "file", load_file(p, name=name, mmap=True)
    if hckpt.is_hybrid_checkpoint(p):
        return "dcp", load_file(p / hckpt.META_FILE, name=f"{name}: {hckpt.META_FILE}")
    log.warning("%s: not a directory of the parallel engine; its weights are consolidated in memory on every rank "
                "(lightning_llm export reads it once)", name)
    return "consolidated", read_checkpoint(p)


def _tokenizer(checkpoint: dict[str, Any], tokenizer_dir: str | None, name: str) -> tuple[Any, Any]:
    """The run's tokenizer (``--tokenizer`` overrides it) with the chat template it rendered with, and the export's
    sources (generation config, stop ids)."""
    sources = export_sources(checkpoint, tokenizer=tokenizer_dir)
    if isinstance(sources.tokenizer, ByteTokenizer):
        tokenizer = sources.tokenizer
    elif sources.tokenizer is not None:
        tokenizer = load_tokenizer(str(sources.tokenizer), param="--tokenizer" if tokenizer_dir else name)
    else:
        raise ValueError(f"{name}: {sources.no_tokenizer_reason}")
    if sources.chat_template:  # a named or the user's template, not the tokenizer's own
        tokenizer.chat_template = sources.chat_template
    return tokenizer, sources


def read_source(path: str | Path, *, tokenizer_dir: str | None = None) -> ModelSource:
    """PATH read: a Hugging Face directory or a checkpoint of any layout (one line naming PATH when it is neither,
    holds no stored model config, or is not a decoder's)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"PATH={path}: no such file or directory")
    if p.is_dir() and (p / "config.json").is_file() and not hckpt.is_hybrid_checkpoint(p):
        return _read_hf(p, tokenizer_dir)
    kind, checkpoint = _read_checkpoint_entries(p)
    stored = (checkpoint.get(CHECKPOINT_KEY) or {}).get("model_config")
    if not stored:
        raise ValueError(f"PATH={p}: the checkpoint stores no model config (written before export metadata existed): "
                         "export it with `lightning_llm export PATH --to DIR` and evaluate DIR")
    config = ModelConfig.from_dict(dict(stored))
    if config.family != "decoder":
        raise ValueError(f"PATH={p}: a checkpoint of an encoder ({config.family}); lm-eval scores decoders")
    tokenizer, sources = _tokenizer(checkpoint, tokenizer_dir, f"PATH={p}")
    hp = dict(checkpoint.get("hyper_parameters") or {})
    quantization = hp.get("quantization")
    task_kwargs = {"backbone": str(hp.get("backbone", "debug")), "model_config": config.to_dict(),
                   "peft": peft_config_of(checkpoint), "quantize": hp.get("quantize"),
                   "quantization": QuantizationConfig(**quantization) if isinstance(quantization, dict)
                   else quantization, "resize_embeddings": bool(hp.get("resize_embeddings", False))}
    return ModelSource(path=p, kind=kind, tokenizer=tokenizer, max_length=config.max_position_embeddings,
                       task_kwargs=task_kwargs, eos_token_ids=_eos_ids(generation_config_dict(config, sources)),
                       checkpoint=checkpoint)


def _union(keys: set[str]) -> set[str]:
    """``keys`` of every rank (a pipeline rank holds only its stages' names)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return keys
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(keys))
    return set().union(*map(set, every))


class EvalTask(CausalLMTask):
    """The model of a checkpoint (or HF directory) at the Trainer's layout, to be scored: built from the checkpoint's
    stored config (or, for a PEFT run, from its backbone directory with the adapters applied), its weights loaded by
    :meth:`load_weights` once the strategy has set it up. Its validation step does nothing: ``lightning_llm eval``
    scores the model in ``on_validation_start``."""

    def __init__(self, backbone: str = "debug", *, model_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """
        Args:
            backbone: An HF directory, or the run's backbone (the frozen base of a PEFT run).
            model_config: The checkpoint's stored ``ModelConfig`` (a full fine-tune is built from it alone).
        """
        super().__init__(backbone, **kwargs)
        self.model_config = model_config

    @property
    def base_from_backbone(self) -> bool:
        """A PEFT run's frozen base is read from its backbone directory (its checkpoint may hold the adapter only)."""
        return self.peft_config is not None and Path(self.backbone).expanduser().is_dir()

    @override
    def datamodule_vocab_size(self) -> int | None:
        # No datamodule here: the run's vocabulary is the stored config's (a base grown to it, as the run grew it).
        return None if self.model_config is None else int(self.model_config["vocab_size"])

    @override
    def build_decoder(self, backbone: str | None = None) -> nn.Module:
        if self.model_config is None or self.base_from_backbone:
            return super().build_decoder(backbone)  # an HF directory, or a PEFT run's frozen base
        lazy = self.capabilities.deferred_init  # the engine materializes it, then load_weights overwrites it
        with torch.device("meta") if lazy else nullcontext():
            return model_from_config(ModelConfig.from_dict(self.model_config))

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        # Our model calls feed whole rows; a context-parallel rank's attention expects its slice of them.
        if self.capabilities.context_parallel_size > 1:
            raise ValueError("lightning_llm eval: context parallelism is not supported (each rank would get whole "
                             "rows); use tp, pp, zero or 3d without context_parallel_size")

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        return None

    def load_weights(self, source: ModelSource) -> None:
        """The checkpoint's weights into this rank's shards (every rank calls it). Refused, the same on every rank,
        when they do not fit the model: a weight it has no place for, or one it lacks (only a PEFT run's frozen base
        may be missing: it came from the backbone)."""
        if source.kind == "hf":
            return
        saved = source.saved_keys()
        have = _union(set(hckpt.saved_model_state(self)))
        trainable = _union({n for n, p in self.named_parameters() if p.requires_grad})
        unexpected = sorted(saved - have)
        missing = sorted(k for k in have - saved if not self.base_from_backbone or k in trainable)
        if unexpected:
            raise ValueError(f"{source.name}: holds {len(unexpected)} weights the model rebuilt from its stored config "
                             f"has no place for, e.g. {unexpected[:3]} (another task's model, e.g. PPO's value head?): "
                             "export it with `lightning_llm export` and evaluate the HF directory")
        if missing:
            raise ValueError(f"{source.name}: lacks {len(missing)} weights of the model, e.g. {missing[:3]}"
                             + (f" (the frozen base: backbone={self.backbone} is not a directory holding it)"
                                if self.peft_config is not None and not self.base_from_backbone else ""))
        try:
            if source.kind == "dcp":
                hckpt.load_hybrid(source.path, module=self, optimizers=[], strict=False)
            else:
                assert source.checkpoint is not None
                hckpt.load_full_weights(self, source.checkpoint["state_dict"], strict=False)
        except RuntimeError as e:  # load_state_dict's size mismatches
            raise ValueError(f"{source.name}: its weights do not fit the model rebuilt from its stored config: "
                             f"{first_line(e)}") from e
        log.info("%s: weights loaded (%d tensors)", source.name, len(saved))
