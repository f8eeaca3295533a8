"""Multimodal checkpoints fine-tuned as text: an HF class whose language model sits under a prefix
(``model.language_model.*``, its head ``lm_head``; on disk also ``language_model.model.*`` or ``model.*``:
:data:`LAYOUTS`) and whose config nests it under ``text_config``, beside towers that are never built here
(``vision_tower.*``, ``multi_modal_projector.*``, ``visual.*``).

A class is a :class:`~..record.family.Multimodal` record in its language model's family file (``families/gemma.py``'s
``Gemma3``, ``families/qwen3_next.py``'s ``Qwen3_5`` ...): its class, the language model's model type and how its
config nests it (:class:`~..record.family.NestedLM`); another family with this layout adds its record, nothing else.

* **Load.** :func:`text_config_of` turns the outer ``config.json`` into the language model's own config (its text
  config class's defaults for absent keys, the outer ``tie_word_embeddings`` that transformers ties by, Qwen's
  multimodal rope sections dropped: on text, whose three position streams are one, M-RoPE is plain RoPE), which the
  family's conversion reads. The weight mapping reads only the language model's keys (:func:`lm_keys`): the other
  towers are never read, let alone put on a device. ``load_hf`` records where they are
  (``ModelConfig.extra["hf_nested_source"]``, :func:`source_record`: the directory, each weight file's size,
  modification time and safetensors header hash), so the checkpoint of a run carries it to ``export``.
* **Save.** ``save_hf`` as the outer class (the default for such a model) checks the recorded files are unchanged
  (:func:`checked_source`), writes the language model's tensors under the prefix in the dtypes the source stored
  them in and under its key names, copies every other tensor from the source (a safetensors tensor read is its bytes), and copies the
  source's ``config.json`` verbatim after checking it describes the trained language model: the same key set and
  config, so ``AutoModelForImageTextToText`` / the original class loads the export with no missing or unexpected key.

Text only: an image token in a batch is not replaced by image features (no vision tower runs).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any

from ..record.family import Multimodal
from .architectures import DEFAULT_ARCHITECTURE, SUPPORTED_ARCHITECTURES
from .registry import family_of_class

log = logging.getLogger(__name__)

__all__ = ["LAYOUTS", "MODULE_PREFIX", "SOURCE_KEY", "checked_source", "lm_keys", "lm_layout", "outside_keys",
           "source_record", "text_config_of"]

LAYOUTS = (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head."),
           ("model.", "lm_head."))
"""Where a checkpoint holds the language model's base keys and its head, as transformers 5.24 writes and reads the
classes: its module names (``model.language_model.``, Qwen3-VL's files), the llava layout its ``save_pretrained``
writes for Gemma 3 and Mistral 3 (and the Hub's files hold), Qwen2.5-VL's (``model.layers...``, ``visual...``).
An export keeps its source's."""
MODULE_PREFIX = "model.language_model."
"""The language model's place in transformers' module tree (a peft adapter's names)."""
SOURCE_KEY = "hf_nested_source"
"""``ModelConfig.extra`` key of :func:`source_record`."""


_TOP_LEVEL = ("architectures", "model_type", "text_config", "vision_config", "transformers_version", "dtype",
              "torch_dtype", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _without_mrope(params: Any) -> Any:
    """Rope parameters without Qwen's M-RoPE keys (``mrope_section``, ``mrope_interleaved``; type ``mrope`` is
    ``default``): on text the three position streams are equal and M-RoPE is RoPE."""
    if not isinstance(params, dict):
        return params
    out = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved")}
    for key in ("rope_type", "type"):
        if out.get(key) == "mrope":
            out[key] = "default"
    return out


def text_config_of(hf: dict[str, Any], architecture: str, *, where: str = "config") -> dict[str, Any]:
    """The language model's own ``config.json`` dict inside a multimodal one (see the module docstring)."""
    record = family_of_class(architecture)
    assert isinstance(record, Multimodal)
    spec = record.nested
    if hf.get("quantization_config"):
        raise ValueError(f"{where}: quantization_config={hf['quantization_config']!r} is not supported for "
                         f"{architecture} (built: bf16/fp16/fp32 weights)")
    text = hf.get("text_config")
    if text is None and spec.flat:
        text = {k: v for k, v in hf.items() if k not in _TOP_LEVEL}
    if not isinstance(text, dict) or not text:
        raise ValueError(f"{where}: {architecture} without a text_config (the language model's config) is not "
                         "supported")
    kind = text.get("model_type", spec.text_types[0])
    if kind not in spec.text_types:
        raise ValueError(f"{where}: text_config.model_type={kind!r} is not supported for {architecture} (its "
                         f"language model is built as {', '.join(spec.text_types)})")
    tie = hf.get("tie_word_embeddings", spec.tie_default)
    if spec.tie_from_text and not tie and text.get("tie_word_embeddings"):
        tie = True
    out = {**spec.text_defaults, **text, "model_type": record.text_kind,
           "architectures": [DEFAULT_ARCHITECTURE[record.text_kind]], "tie_word_embeddings": bool(tie)}
    for key in ("rope_parameters", "rope_scaling"):
        if key in out:
            out[key] = _without_mrope(out[key])
    if not spec.logit_softcap and out.get("final_logit_softcapping") is not None:
        log.warning("%s: %s does not apply text_config.final_logit_softcapping=%s (transformers 5.24's class caps "
                    "no logits); neither does this model", where, architecture, out["final_logit_softcapping"])
        out["final_logit_softcapping"] = None
    return out


def lm_layout(keys: list[str], where: str = "checkpoint") -> tuple[str, str]:
    """``(base prefix, head prefix)`` of the language model in a multimodal checkpoint's keys (:data:`LAYOUTS`)."""
    have = set(keys)
    for base, head in LAYOUTS:
        if f"{base}embed_tokens.weight" in have:
            return base, head
    raise ValueError(f"{where}: no language model found (no embed_tokens.weight under "
                     f"{', '.join(base for base, _ in LAYOUTS)})")


def outside_keys(keys: list[str], where: str = "checkpoint") -> list[str]:
    """The checkpoint keys outside the language model and its head: the towers copied at export."""
    base, head = lm_layout(keys, where)
    return [k for k in keys if not k.startswith((base, head))]


def lm_keys(keys: list[str], where: str = "checkpoint") -> dict[str, str]:
    """The language model's keys as a causal LM of its family names them (``layers.0...`` without the base prefix,
    ``lm_head.weight``) -> the stored key."""
    base, head = lm_layout(keys, where)
    out = {k[len(base):]: k for k in keys if k.startswith(base)}
    out.update({"lm_head." + k[len(head):]: k for k in keys if k.startswith(head)})
    return out


# ---------------------------------------------------------------------------------------------------- the source


def _fingerprint(path: Path) -> dict[str, Any]:
    """A weight file's size, modification time and (safetensors) the SHA-256 of its header: names, dtypes, shapes
    and offsets of every tensor."""
    stat = path.stat()
    out: dict[str, Any] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if path.suffix == ".safetensors":
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            out["header_sha256"] = hashlib.sha256(f.read(n)).hexdigest()
    return out


def source_record(directory: Path, files: list[Path]) -> dict[str, Any]:
    """What ``extra["hf_nested_source"]`` holds: the checkpoint directory and each weight file's fingerprint."""
    return {"directory": str(directory.resolve()),
            "files": {f.name: _fingerprint(f) for f in sorted(set(files))}}


def checked_source(record: dict[str, Any] | None, architecture: str) -> Path:
    """The recorded source directory, after checking that its weight files are still there and unchanged; a
    one-line ``ValueError`` naming the file otherwise."""
    if not record:
        raise ValueError(f"cannot save as {architecture}: the model records no source checkpoint to copy the towers "
                         "outside its language model from (it was not loaded from one)")
    directory = Path(record["directory"])
    for name, want in record["files"].items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path}: gone; the {architecture} export copies the towers outside the language model "
                             "from it (restore it, or export the language model alone: --architecture "
                             f"{DEFAULT_ARCHITECTURE[SUPPORTED_ARCHITECTURES[architecture].nested or '']})")
        got = _fingerprint(path)
        if got != want:
            changed = ", ".join(k for k in want if got.get(k) != want[k])
            raise ValueError(f"{path}: changed since the run loaded it ({changed}); the {architecture} export copies "
                             "the towers outside the language model from it byte for byte")
    return directory
