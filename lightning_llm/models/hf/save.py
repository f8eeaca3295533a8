"""Writing a whole :class:`DecoderLM` / :class:`EncoderModel` as a Hugging Face directory (``config.json`` +
``model.safetensors``, or shards with an index) that ``transformers.AutoModel*.from_pretrained`` loads."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from lightning_llm.files import atomic_path

from ..config import ModelConfig
from .architectures import DEFAULT_ARCHITECTURE, SUPPORTED_ARCHITECTURES
from .config import config_to_hf
from .decoders import DECODER_KINDS
from .entries import Entry
from .weights import BASE_PREFIX, save_entries

log = logging.getLogger(__name__)

__all__ = ["save_hf", "default_architecture"]


def default_architecture(config: ModelConfig) -> str:
    """HF architecture a model is saved as by default (from ``extra['hf_model_type']`` or the config's shape)."""
    kind = (config.extra or {}).get("hf_model_type")
    if kind not in DEFAULT_ARCHITECTURE:
        if config.family == "decoder":
            kind = _decoder_kind(config)
        elif config.pre_norm:
            kind = "megatron-bert"
        else:
            kind = "roberta" if config.position_offset > 0 else "bert"
    if config.family == "decoder" or kind in DECODER_KINDS + ("gpt2",):
        return _classifier_architecture(kind) if config.num_labels > 0 else DEFAULT_ARCHITECTURE[kind]
    names = {
        ("bert", False): "BertModel", ("bert", True): "BertForSequenceClassification",
        ("megatron-bert", False): "MegatronBertModel", ("megatron-bert", True): "MegatronBertForSequenceClassification",
        ("roberta", False): "RobertaModel", ("roberta", True): "RobertaForSequenceClassification",
    }
    return names[(kind, config.num_labels > 0)]


def _classifier_architecture(kind: str) -> str:
    """The ``...ForSequenceClassification`` class of a decoder family (a reward model is written as one)."""
    found = [name for name, a in SUPPORTED_ARCHITECTURES.items() if a.kind == kind and a.head == "cls"]
    if not found:
        raise ValueError(f"a {kind} sequence classifier (score head) cannot be saved: transformers has no "
                         f"...ForSequenceClassification class for {kind}")
    return found[0]


def _decoder_kind(config: ModelConfig) -> str:
    """The HF family a decoder of no recorded origin is saved as: the one whose switches it uses."""
    if config.position != "rope":
        return "gpt2"
    if config.mla is not None:
        return "deepseek_v3"
    if config.qkv_packed or config.norm_head:
        return "baichuan"
    if config.attention_sinks:
        return "gpt_oss"
    if config.qk_norm and config.qk_norm_over == "projection":
        return "olmoe"
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias and not config.o_bias:
        return "qwen2"
    if config.sliding_layers:
        return "mistral"
    return "llama"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    with atomic_path(path) as tmp:
        write(tmp)


_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def _size_bytes(size: int | str) -> int:
    """``5GB`` (decimal, as transformers), ``5GiB``, or a byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: expected a byte count or a size such as 500MB / 5GB / 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Keys grouped in file order, each group at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, n in sizes.items():
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups


@torch.no_grad()
def save_hf(model: nn.Module, path: str | os.PathLike[str], *, architecture: str | None = None,
            max_shard_size: int | str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``transformers`` (the model must be whole).

    ``max_shard_size`` (e.g. ``"5GB"``): split the weights into ``model-0000i-of-0000n.safetensors`` files of at most
    that size plus ``model.safetensors.index.json``, as ``save_pretrained`` does; each file is converted and written
    on its own, so saving holds one file's tensors besides the model."""
    from safetensors.torch import save_file

    config: ModelConfig = model.config  # type: ignore[assignment]
    arch = architecture or default_architecture(config)
    a = SUPPORTED_ARCHITECTURES.get(arch)
    if a is None or a.head == "mlm":
        raise ValueError(f"save_hf: cannot save as {arch!r}")
    if (a.kind in DECODER_KINDS + ("gpt2",)) != (config.family == "decoder"):
        raise ValueError(f"save_hf: a {config.family} model cannot be saved as {arch}")
    sd = model.state_dict()
    dtypes = {t.dtype for t in sd.values() if t.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    hf_cfg = config_to_hf(config, arch, dtype=dtype)
    prefix = BASE_PREFIX[a.kind] if a.head != "base" else ""
    plan: dict[str, tuple[Entry, list[Tensor]]] = {}  # HF key -> (entry, our tensors)
    missing: list[str] = []
    for e in save_entries(config, arch, sd):
        if e.group == "lm_head" and config.tie_embeddings:
            continue  # HF re-ties from tie_word_embeddings
        if e.group == "classifier" and a.head != "cls":
            continue
        absent = [n for n in e.ours if n not in sd]
        if absent:
            missing.extend(absent)
            continue
        plan[e.hf if e.top else prefix + e.hf] = (e, [sd[n] for n in e.ours])
    if missing:
        raise ValueError(f"save_hf: model lacks {missing[:20]} (a pipeline stage or sharded model? save the whole model)")

    def converted(keys: list[str]) -> dict[str, Tensor]:
        out = {}
        for key in keys:
            e, ts = plan[key]
            t = e.merge(ts) if e.merge is not None else ts[0]
            out[key] = t.detach().to("cpu").contiguous().clone()
        return out

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sizes = {k: sum(t.numel() * t.element_size() for t in ts) for k, (_, ts) in plan.items()}
    groups = _shards(sizes, _size_bytes(max_shard_size)) if max_shard_size is not None else [list(plan)]
    meta = {"format": "pt"}
    if len(groups) == 1:
        _atomic_write(d / "model.safetensors", lambda p: save_file(converted(groups[0]), p, metadata=meta))
        stale = [d / "model.safetensors.index.json", *d.glob("model-*-of-*.safetensors")]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for name, keys in zip(names, groups):
            _atomic_write(d / name, lambda p, keys=keys: save_file(converted(keys), p, metadata=meta))
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, groups) for k in keys}}
        _atomic_write(d / "model.safetensors.index.json",
                      lambda p: Path(p).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
        stale = [d / "model.safetensors", *(f for f in d.glob("model-*-of-*.safetensors") if f.name not in names)]
    for f in stale:  # a previous save in the other layout would shadow or contradict this one
        f.unlink(missing_ok=True)
    _atomic_write(d / "config.json", lambda p: Path(p).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n"))
    log.info("saved %s (%d tensors in %d file(s)) to %s", arch, len(plan), len(groups), d)
    return d
