"""The family records, found in ``families/``: every module there is imported once and its ``RECORDS`` collected, so a
family is added by its file alone (:mod:`..record.family` says what a record holds; the tables read them through here).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType
from typing import Any, Mapping

from ...config import ModelConfig
from .. import families
from ..record.family import GROUPS, Family

__all__ = ["FAMILIES", "family", "family_of", "family_of_class", "named_sizes"]


def _discover() -> dict[str, Family]:
    """model type -> record, over every module of ``families/`` (a module without ``RECORDS`` holds none)."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{families.__name__}.{info.name}")  # a plugin folder: no static import
        for record in getattr(module, "RECORDS", ()):
            if record.group not in GROUPS:
                raise ValueError(f"families/{info.name}.py: {record.model_type}'s group {record.group!r} is none of "
                                 f"{', '.join(GROUPS)}")
            if record.model_type in found:
                raise ValueError(f"families/{info.name}.py: model type {record.model_type!r} has a record in another "
                                 "family file too")
            found[record.model_type] = record
    classes: dict[str, str] = {}
    for record in found.values():
        for name in record.classes:
            if name in classes:
                raise ValueError(f"{name} is a class of both {classes[name]} and {record.model_type}")
            classes[name] = record.model_type
    return found


FAMILIES: Mapping[str, Family] = MappingProxyType(_discover())
"""HF model type -> its record."""
_BY_CLASS = {name: record for record in FAMILIES.values() for name in record.classes}
_GUESSED = sorted((r for r in FAMILIES.values() if r.guess_rank is not None), key=lambda r: r.guess_rank or 0)


def family(model_type: str) -> Family:
    """The record of ``model_type`` (a ``KeyError`` naming it and the known ones otherwise)."""
    if model_type not in FAMILIES:
        raise KeyError(f"no family record for model type {model_type!r} (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[model_type]


def family_of_class(architecture: str) -> Family:
    """The record of an HF class name."""
    return _BY_CLASS[architecture]


def family_of(config: ModelConfig) -> Family:
    """The family a model is written as by default: the one it was read from or built as
    (``extra["hf_model_type"]``), else the first family (by ``guess_rank``) whose ``guess`` accepts its config."""
    kind = (config.extra or {}).get("hf_model_type")
    if kind in FAMILIES:
        return FAMILIES[kind]
    for record in _GUESSED:
        if record.family == config.family and record.guess(config):
            return record
    raise ValueError(f"no family writes a {config.family} of this config (model type {kind!r})")


def named_sizes() -> dict[tuple[str, str], dict[str, Any]]:
    """The families' named sizes, ``(family, name)`` -> :class:`ModelConfig` fields with ``extra["hf_model_type"]``
    (a model of that size is written as its family by default)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for record in FAMILIES.values():
        for name, fields in record.sizes.items():
            key = (str(fields.get("family", record.family)), name)
            if key in out:
                raise ValueError(f"named size {name!r} is {out[key]['extra']['hf_model_type']}'s and "
                                 f"{record.model_type}'s")
            out[key] = {**fields, "extra": {**dict(fields.get("extra") or {}), "hf_model_type": record.model_type}}
    return out
