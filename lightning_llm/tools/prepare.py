"""``lightning_llm prepare``: tokenize a pretraining corpus into its token store before training.

Takes ``TextDataModule``'s arguments under the names ``fit`` uses (``--data.data_path``, ``--data.tokenizer_dir``,
``--data.num_proc``, ...), or a fit config (``--config``: its ``data:`` section, and ``model.backbone`` for the default
tokenizer), so the store it writes is the one that run reads.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from lightning_llm.data.text import TextDataModule
from lightning_llm.files import DataError
from lightning_llm.vocab import default_tokenizer_dir

log = logging.getLogger(__name__)


def _config_defaults(path: str) -> tuple[dict[str, Any], Any]:
    """``(data init args, model backbone)`` of a fit config file (a ``data:`` of another datamodule is refused)."""
    try:
        cfg = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config={path}: cannot read it ({e})") from None
    data = cfg.get("data") or {}
    if "class_path" in data:
        name = str(data["class_path"]).rsplit(".", 1)[-1]
        if name != TextDataModule.__name__:
            raise ValueError(f"--config={path}: data is {data['class_path']}; prepare reads TextDataModule corpora")
        data = data.get("init_args") or {}
    model = cfg.get("model") or {}
    backbone = (model.get("init_args") or model).get("backbone") if isinstance(model, dict) else None
    return dict(data), backbone


def _config_arg(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="lightning_llm prepare", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("--config", type=str, default=None,
                        help="a fit config (YAML): its data: section and model.backbone give the defaults")
    parser.add_class_arguments(TextDataModule, "data", instantiate=False)
    return parser


def main(argv: list[str]) -> int:
    """``lightning_llm prepare [--config FIT.yaml] --data.data_path PATH --data.tokenizer_dir DIR [--data.num_proc N]``.
    Prints each store's path and counts; exit code 2 with one line on bad input."""
    parser = _parser()
    try:
        config, backbone = _config_arg(argv), None
        if config:
            data, backbone = _config_defaults(config)
            parser.set_defaults({f"data.{k}": v for k, v in data.items()})
        args = parser.parse_args(argv)
        kwargs = dict(args.data)
        kwargs["tokenizer_dir"] = default_tokenizer_dir(backbone, kwargs.get("tokenizer_dir"))
        dm = TextDataModule(**kwargs)
        dm.prepare_data()
        dm.setup("fit")  # maps the stores and checks they hold a training block (nothing is tokenized again)
    except (DataError, FileNotFoundError, ValueError) as e:
        print(f"lightning_llm prepare: error: {e}", file=sys.stderr)
        return 2
    for store in dm.stores:
        m = store.manifest
        print(f"{store.path}: {m['documents']:,} documents, {m['tokens']:,} tokens ({m['dtype']}) of {m['corpus']}")
    return 0
