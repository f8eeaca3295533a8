"""Loading a local Hugging Face checkpoint directory as a :class:`DecoderLM` / :class:`EncoderModel`.

Reads ``config.json`` plus ``model.safetensors`` / sharded safetensors (``model.safetensors.index.json``) /
``pytorch_model.bin`` (optionally sharded) from a LOCAL directory; never downloads. What is supported:
:mod:`.convert.architectures`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_llm.files import read_json

from ..config import ModelConfig
from ..decoder import DecoderLM
from ..encoder import EncoderModel
from ..init import materialize
from .convert.architectures import SUPPORTED_ARCHITECTURES, architecture_name, layout_kind
from .convert.config import config_from_hf
from .convert.multimodal import SOURCE_KEY, lm_keys, outside_keys, source_record
from .convert.registry import family
from .convert.weights import IGNORED, base_prefix, entries
from .record.entries import Fused, Stacked
from .source import CheckpointFiles, HFWeightsSource, Mapped, RowsMapped, StackedMapped

log = logging.getLogger(__name__)

__all__ = ["load_hf"]


# ====================================================================================================================
# Reading checkpoints
# ====================================================================================================================


def _normalized_keys(keys: list[str], kind: str, nested: bool = False) -> dict[str, str]:
    """Checkpoint key -> key without the base-model prefix (``model.``, ``transformer.``, ``bert.``, ``roberta.``;
    a multimodal class's ``model.language_model.``, whose other towers are left out) and old gamma/beta names, as
    ``{normalized: stored}``."""
    if nested:
        return lm_keys(keys)
    prefix = base_prefix(kind)
    out: dict[str, str] = {}
    for k in keys:
        k2 = k[len(prefix):] if k.startswith(prefix) else k
        k2 = re.sub(r"(LayerNorm|\bln(_\w+)?)\.gamma$", r"\1.weight", k2)
        k2 = re.sub(r"(LayerNorm|\bln(_\w+)?)\.beta$", r"\1.bias", k2)
        out[k2] = k
    return out


def _map_to_ours(
    files: CheckpointFiles, config: ModelConfig, architecture: str, where: str
) -> tuple[dict[str, Mapped], dict[str, tuple[int, ...]]]:
    """Where each of our parameters is stored, and its shape after conversion (from the stored shapes, nothing
    read). Raises on missing or unexpected keys; parameters left out are initialised fresh (heads)."""
    kind = layout_kind(architecture)
    stored = _normalized_keys(files.keys(), kind, nested=SUPPORTED_ARCHITECTURES[architecture].nested is not None)
    mapping: dict[str, Mapped | RowsMapped] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    used: set[str] = set()
    missing: list[str] = []
    fresh: list[str] = []
    for e in entries(config, architecture):
        if isinstance(e, Stacked):
            _map_stacked(e, files, stored, mapping, shapes, used, missing)
            continue
        if isinstance(e, Fused):
            found = e.locate(files, stored)
            if found is None:
                missing.append(e.hf)
            else:
                mapping[e.ours], shapes[e.ours], keys = found  # type: ignore[assignment]
                used.update(keys)
            continue
        if e.group == "lm_head" and config.tie_embeddings:
            used.add(e.hf)  # tied: a stored copy (if any) is redundant
            continue
        if e.hf not in stored:
            if e.group in ("lm_head", "pooler", "classifier"):
                fresh.extend(e.ours)  # HF also initialises these freshly (with a warning)
            else:
                missing.append(e.hf)
            continue
        used.add(e.hf)
        meta = files.meta(stored[e.hf])
        parts = e.split(meta) if e.split is not None else (meta,)  # on meta tensors: shapes only
        offset = 0
        for i, (name, part) in enumerate(zip(e.ours, parts)):
            mapping[name] = RowsMapped(stored[e.hf], offset) if e.row_blocks else Mapped(stored[e.hf], i, e.split)
            shapes[name] = tuple(part.shape)
            offset += part.shape[0]
    rest = [k for k in stored if k not in used and not IGNORED.search(k)]
    record = family(kind)
    heads = [k for k in rest if record.head_keys.match(k)]
    mtp = [k for k in rest if record.ignored_key(config, k)]
    if mtp:  # as transformers: DeepSeek-V3's, GLM-4.5's, the hybrids' multi-token-prediction layers are not built
        log.warning("%s: ignoring %d keys of the multi-token-prediction layers (num_nextn_predict_layers, mtp.*), "
                    "which transformers does not build either", where, len(mtp))
    unexpected = [k for k in rest if k not in heads and k not in mtp]
    if missing or unexpected:
        parts_ = []
        if missing:
            parts_.append(f"missing keys ({len(missing)}): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts_.append(f"unexpected keys ({len(unexpected)}): {unexpected[:20]}"
                          f"{' ...' if len(unexpected) > 20 else ''}")
        raise ValueError(f"{where}: checkpoint does not match a {architecture} with this config: " + "; ".join(parts_))
    if heads:
        log.warning("%s: ignoring head weights not used by this model: %s", where, sorted(heads))
    if fresh:
        log.warning("%s: newly initialised (not in checkpoint): %s", where, fresh)
    return mapping, shapes


def _map_stacked(e: Stacked, files: CheckpointFiles, stored: dict[str, str], mapping: dict[str, Mapped],
                 shapes: dict[str, tuple[int, ...]], used: set[str], missing: list[str]) -> None:
    """Where a fused expert tensor is stored: one HF key per expert and part, each read on its own."""
    absent = [k for k in e.keys() if k not in stored]
    used.update(k for k in e.keys() if k in stored)
    if absent:
        missing.extend(absent)
        return
    parts = [[tuple(files.meta(stored[k]).shape) for k in keys] for keys in e.hf]
    rows = tuple(s[0] for s in parts[0])
    if any(tuple(s[0] for s in p) != rows or {s[1:] for s in p} != {parts[0][0][1:]} for p in parts):
        raise ValueError(f"{e.ours}: the experts' stored tensors differ in shape: {parts}")
    mapping[e.ours] = StackedMapped(tuple(tuple(stored[k] for k in keys) for keys in e.hf), rows)
    shapes[e.ours] = (len(e.hf), sum(rows), *parts[0][0][1:])


def _resolve_dtype(dtype: torch.dtype | str | None, hf: dict[str, Any]) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    d = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return d


def _checked_mapping(model: nn.Module, mapping: dict[str, Mapped], shapes: dict[str, tuple[int, ...]],
                     where: str) -> dict[str, Mapped]:
    """Compare the stored shapes with the model's; a classifier of another ``num_labels`` is initialised fresh."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bad: list[str] = []
    out = dict(mapping)
    for k, shape in shapes.items():
        want = expected.get(k)
        if want is None:
            bad.append(f"{k}: in the checkpoint mapping but not in the model")
        elif shape != want:
            if k.startswith("classifier."):
                log.warning("%s: %s has shape %s, model needs %s (num_labels changed): re-initialising",
                            where, k, shape, want)
                del out[k]
            else:
                bad.append(f"{k}: checkpoint {shape} vs model {want}")
    if bad:
        raise ValueError(f"{where}: shape mismatch: " + "; ".join(bad))
    if getattr(model.config, "tie_embeddings", False) and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]  # a pipeline's last stage holds the tied head alone
    return out


def load_hf(
    path: str | os.PathLike[str],
    *,
    family: str | None = None,
    dtype: torch.dtype | str | None = None,
    lazy: bool = False,
    **config_overrides: Any,
) -> tuple[nn.Module, ModelConfig]:
    """Load a local HF checkpoint directory as (DecoderLM | EncoderModel, ModelConfig), in eval mode (as
    transformers' ``from_pretrained``; Lightning switches to train mode in ``fit``).

    ``dtype``: None -> torch's default dtype (float32 unless a precision context set another), ``"auto"`` -> the
    checkpoint's dtype, or a torch dtype / its name. ``config_overrides`` are applied to the converted config (e.g.
    ``num_labels=3`` to add a fresh classifier, ``dropout=0.0``; on a decoder ``num_labels=1`` makes a sequence
    classifier, its ``score`` head loaded from a ``...ForSequenceClassification``, fresh from a ``...ForCausalLM``);
    overrides that change tensor shapes (other than an encoder's ``num_labels``) fail with the mismatching keys. Parameters the checkpoint lacks (a fresh head) get the family's
    init (:mod:`.init`).

    ``lazy=True``: the model stays on the meta device with ``weights_source`` set, names and shapes already checked;
    :func:`~lightning_llm.models.init.materialize` (which a sharding strategy calls after splitting and sharding)
    then reads only the elements each rank holds.
    """
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"load_hf: checkpoint directory {str(d)!r} does not exist")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"load_hf: {str(cfg_file)!r} not found")
    hf = read_json(cfg_file)
    arch = architecture_name(hf, where=str(cfg_file))
    config = config_from_hf(hf, where=str(cfg_file))
    encoder_head = config.family == "encoder" and config_overrides.get("num_labels", 0) > 0
    if encoder_head and "pooler" not in config_overrides:
        config_overrides = {**config_overrides, "pooler": True}  # HF encoders' classification heads sit on the pooler
    if config_overrides:
        config = config.replace(**config_overrides)
    if family is not None and config.family != family:
        raise ValueError(f"load_hf: {str(d)!r} holds a {config.family} ({arch}), but family={family!r} was requested")
    target = _resolve_dtype(dtype, hf)
    files = CheckpointFiles(d)
    mapping, shapes = _map_to_ours(files, config, arch, where=str(d))
    if SUPPORTED_ARCHITECTURES[arch].nested is not None:  # the towers stay on disk: where to copy them from at export
        config.extra = {**config.extra, SOURCE_KEY: source_record(d, list(files.file_of.values()))}
        log.info("%s: %s's language model loaded as text; %d tensors outside it (vision tower, projector) are not "
                 "read and are copied from here at export", d, arch, len(outside_keys(files.keys())))
    cls = DecoderLM if config.family == "decoder" else EncoderModel
    with torch.device("meta"):
        model = cls(config).to(target)
    model.weights_source = HFWeightsSource(files, _checked_mapping(model, mapping, shapes, str(d)), where=str(d))
    if not lazy:
        materialize(model, "cpu")
        model.weights_source = None
    model.eval()  # as transformers' from_pretrained: dropout off until a trainer switches to train mode
    log.info("%s %s from %s (%s, %d layers, dtype %s)", "indexed" if lazy else "loaded", arch, d, config.family,
             config.num_layers, target)
    return model, config
