"""The one table of Hugging Face classes this package loads and writes, read from the family records
(:mod:`.registry`).

Every ``architectures[0]`` of a ``config.json`` that :func:`~lightning_llm.models.hf.load_hf` accepts is a key of
:data:`SUPPORTED_ARCHITECTURES`; a checkpoint without ``architectures`` is read by its ``model_type`` as
:data:`DEFAULT_ARCHITECTURE` names it. The docs' family list (``docs/models.md``, between the ``families`` markers) is
generated from the records by :func:`families_markdown` (``python -m lightning_llm.models.hf.convert.architectures
--write docs/models.md``); ``tests/house/test_readme.py`` fails when the two differ.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from ..record.family import GROUPS, Arch
from ..record.readers import num_labels_of
from .registry import FAMILIES

__all__ = ["Arch", "SUPPORTED_ARCHITECTURES", "DEFAULT_ARCHITECTURE", "architecture_name", "families_markdown",
           "layout_kind", "num_labels_of"]

SUPPORTED_ARCHITECTURES: dict[str, Arch] = {name: a for record in FAMILIES.values()
                                            for name, a in record.arches().items()}
"""HF class name -> :class:`Arch`."""

DEFAULT_ARCHITECTURE: dict[str, str] = {kind: record.architecture() for kind, record in FAMILIES.items()}
"""``model_type`` -> the class a checkpoint without ``architectures`` is read as (and a model of that type is
written as by default)."""


def layout_kind(architecture: str) -> str:
    """The model type whose weight layout and config conversion a class's (language) model has."""
    a = SUPPORTED_ARCHITECTURES[architecture]
    return a.nested or a.kind


def architecture_name(hf: dict[str, Any], where: str = "config") -> str:
    """The supported class a ``config.json`` dict names (``architectures[0]``, else by its ``model_type``); a
    one-line ``ValueError`` naming ``where`` otherwise."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        mt = hf.get("model_type")
        if mt not in DEFAULT_ARCHITECTURE:
            raise ValueError(f"{where}: unsupported model_type {mt!r} and no 'architectures'; supported model types: "
                             f"{', '.join(sorted(DEFAULT_ARCHITECTURE))}")
        arch = DEFAULT_ARCHITECTURE[mt]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def families_markdown() -> str:
    """The docs' family list: per group, each model type with its classes (written by ``--write``)."""
    lines = []
    for group, title in GROUPS.items():
        lines.append(f"- **{title}**:")
        for record in sorted((r for r in FAMILIES.values() if r.group == group), key=lambda r: r.label.lower()):
            names = [f"`{n}`" + (" (load only)" if head == "mlm" else "") for n, head in record.classes.items()]
            chat = f"; chat template `{record.chat_template}`" if record.chat_template else ""
            lines.append(f"  - {record.label} (`{record.model_type}`): {', '.join(names)}{chat}")
    return "\n".join(lines) + "\n"


BEGIN, END = ("<!-- families:begin (generated: python -m lightning_llm.models.hf.convert.architectures --write "
              "docs/models.md) -->", "<!-- families:end -->")


def replace_block(text: str) -> str:
    """``text`` with the block between the family markers replaced by :func:`families_markdown`."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no family block ({BEGIN} ... {END}) found")
    return pattern.sub(lambda _: f"{BEGIN}\n{families_markdown()}{END}", text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print the supported HF families, or rewrite a doc's family block.")
    p.add_argument("--write", metavar="MARKDOWN", help="rewrite the block between the family markers of this file")
    a = p.parse_args(argv)
    if a.write is None:
        print(families_markdown(), end="")
        return
    path = Path(a.write)
    path.write_text(replace_block(path.read_text()))


if __name__ == "__main__":
    main()
