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
from .convert.architectures import DEFAULT_ARCHITECTURE, SUPPORTED_ARCHITECTURES, layout_kind
from .convert.config import architecture_diffs, config_from_hf, config_to_hf
from .convert.multimodal import MODULE_PREFIX, SOURCE_KEY, checked_source, lm_layout, outside_keys
from .convert.registry import family, family_of
from .convert.weights import save_entries
from .record.entries import Entry
from .source import CheckpointFiles

log = logging.getLogger(__name__)

__all__ = ["save_hf", "decoder_module_prefix", "default_architecture"]


def default_architecture(config: ModelConfig) -> str:
    """HF architecture a model is saved as by default: its family's (``extra['hf_model_type']``, else the family its
    config's switches guess: ``registry.family_of``) class with its head."""
    kind = (config.extra or {}).get("hf_model_type")
    outer = (config.extra or {}).get("hf_architecture")
    if (config.extra or {}).get(SOURCE_KEY) and SUPPORTED_ARCHITECTURES.get(outer) is not None \
            and SUPPORTED_ARCHITECTURES[outer].nested == kind:
        return outer  # loaded from a multimodal checkpoint: written as it, its towers copied from there
    record = family_of(config)
    if record.family == "decoder":
        return _classifier_architecture(record.model_type) if config.num_labels > 0 else record.architecture()
    if config.num_labels == 0:
        return record.architecture()
    return next(n for n, head in record.classes.items() if head == "cls")


def decoder_module_prefix(config: ModelConfig) -> str:
    """Where a decoder's base model sits in transformers' module tree of the class it is saved as: ``model.``, or a
    multimodal class's ``model.language_model.`` (the names of a peft adapter on that class)."""
    a = SUPPORTED_ARCHITECTURES.get(default_architecture(config))
    return MODULE_PREFIX if a is not None and a.nested is not None else "model."


def _classifier_architecture(kind: str) -> str:
    """The ``...ForSequenceClassification`` class of a decoder family (a reward model is written as one)."""
    found = [name for name, head in family(kind).classes.items() if head == "cls"]
    if not found:
        raise ValueError(f"a {kind} sequence classifier (score head) cannot be saved: transformers has no "
                         f"...ForSequenceClassification class for {kind}")
    return found[0]


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
    if family(layout_kind(arch)).family != config.family:
        raise ValueError(f"save_hf: a {config.family} model cannot be saved as {arch}")
    sd = model.state_dict()
    dtypes = {t.dtype for t in sd.values() if t.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    nested = _NestedSource(config, arch) if a.nested is not None else None  # a multimodal class: its towers copied
    config_text = nested.config_text if nested is not None else \
        json.dumps(config_to_hf(config, arch, dtype=dtype), indent=2, sort_keys=True) + "\n"
    prefix = nested.base if nested is not None else family(a.kind).base_prefix if a.head != "base" else ""
    plan: dict[str, tuple[Entry, list[Tensor]]] = {}  # HF key -> (entry, our tensors)
    missing: list[str] = []
    tied: set[str] = set()
    for e in save_entries(config, arch, sd):
        if e.group == "lm_head" and config.tie_embeddings:
            tied.update(e.ours)
            continue  # HF re-ties from tie_word_embeddings
        if e.group == "classifier" and a.head != "cls":
            continue
        absent = [n for n in e.ours if n not in sd]
        if absent:
            missing.extend(absent)
            continue
        key = e.hf if e.top else prefix + e.hf
        if nested is not None and e.top:  # the head under the source's name (lm_head, language_model.lm_head)
            key = nested.head + key.removeprefix("lm_head.")
        plan[key] = (e, [sd[n] for n in e.ours])
    if missing:
        raise ValueError(f"save_hf: model lacks {missing[:20]} (a pipeline stage or sharded model? save the whole model)")
    written = tied.union(*(e.ours for e, _ in plan.values()))
    dropped = sorted(n for n in sd if n not in written)
    if dropped:  # a head the class has not, a module a subclass added: refused rather than a model without them
        raise ValueError(f"save_hf: {arch} has no place for {len(dropped)} of the model's tensors ({dropped[:8]}); "
                         "an export would drop them")

    def converted(keys: list[str]) -> dict[str, Tensor]:
        out = {}
        for key in keys:
            if key not in plan:  # a tower outside the language model: its stored bytes
                assert nested is not None
                out[key] = nested.files.read(key)
                continue
            e, ts = plan[key]
            t = e.merge(ts) if e.merge is not None else ts[0]
            t = t.detach().to("cpu")
            out[key] = (t if nested is None else nested.stored_dtype(key, t)).contiguous().clone()
        return out

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sizes = {k: sum(t.numel() * t.element_size() for t in ts) for k, (_, ts) in plan.items()}
    if nested is not None:
        sizes.update(nested.sizes())
    groups = _shards(sizes, _size_bytes(max_shard_size)) if max_shard_size is not None else [list(sizes)]
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
    _atomic_write(d / "config.json", lambda p: Path(p).write_text(config_text))
    log.info("saved %s (%d tensors in %d file(s)) to %s", arch, len(sizes), len(groups), d)
    return d


class _NestedSource:
    """What a multimodal class's save copies from its source checkpoint (:mod:`.convert.multimodal`): the recorded
    files, checked unchanged; its ``config.json``, checked to describe the trained language model; the tensors outside the
    language model; the dtypes the language model's tensors are written in (the source's)."""

    def __init__(self, config: ModelConfig, architecture: str) -> None:
        directory = checked_source((config.extra or {}).get(SOURCE_KEY), architecture)
        self.config_text = (directory / "config.json").read_text(encoding="utf-8")
        source = config_from_hf(json.loads(self.config_text), where=str(directory / "config.json"))
        diffs = architecture_diffs(config, source, "source")
        if diffs:
            raise ValueError(f"save_hf: the trained model is not {directory}'s language model ({'; '.join(diffs[:4])}): "
                             f"a {architecture} export keeps that checkpoint's config.json and towers; export the "
                             f"language model alone (--architecture {DEFAULT_ARCHITECTURE[layout_kind(architecture)]})")
        self.files = CheckpointFiles(directory)
        self.base, self.head = lm_layout(self.files.keys(), str(directory))
        self.copied = outside_keys(self.files.keys())
        self._cast: set[str] = set()

    def sizes(self) -> dict[str, int]:
        """Bytes of each copied tensor, by key (in the source's order)."""
        return {k: self.files.meta(k).numel() * self.files.meta(k).element_size() for k in self.copied}

    def stored_dtype(self, key: str, t: Tensor) -> Tensor:
        """``t`` in the dtype the source stored ``key`` in (its config.json, copied, names that dtype)."""
        if key not in self.files.keys() or self.files.meta(key).dtype == t.dtype:
            return t
        if not self._cast:
            log.info("the language model's tensors are written in the source checkpoint's %s (trained in %s)",
                     self.files.meta(key).dtype, t.dtype)
        self._cast.add(key)
        return t.to(self.files.meta(key).dtype)
