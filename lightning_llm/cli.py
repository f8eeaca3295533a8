"""``lightning_llm`` command line: a LightningCLI (fit/validate/test/predict) plus a few tool subcommands.

Tasks (``--model``) and datamodules (``--data``) are chosen by class path in subclass mode; strategies by
their registered name (``--trainer.strategy=tp``) or class path.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_llm.data.io import DataError
from lightning_llm.reliability import leave_process, shutdown_process_group
from lightning_llm.tasks.base import LLMTask, NonFiniteLossError

log = logging.getLogger("lightning_llm")

# Tool subcommands outside Lightning's four; each maps to "module:function(argv) -> int".
TOOLS: dict[str, str] = {
    "merge": "lightning_llm.peft:merge_main",  # fold a PEFT adapter into full HF weights
    "estimate": "lightning_llm.estimate:main",
    "plot": "lightning_llm.plot:main",  # loss / throughput curves of a CSVLogger run to a PNG
    "export": "lightning_llm.export:main",  # any checkpoint layout -> Hugging Face directory (LoRA merged/adapter)
}


class LLMCLI(LightningCLI):
    """LightningCLI with our tasks/datamodules in subclass mode and our strategies registered."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs) -> None:
        import lightning_llm.strategies  # noqa: F401 - registers our strategies in StrategyRegistry

        super().__init__(
            LLMTask,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"parser_mode": "omegaconf"} if _has_omegaconf() else None,
            args=args,
            run=run,
            **kwargs,
        )


def _has_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True


def _setup_logging() -> None:
    level = os.environ.get("LIGHTNING_LLM_LOG", "INFO").upper()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning_llm").setLevel(level)


def _tool(name: str) -> Callable[[list[str]], int]:
    import importlib

    module, func = TOOLS[name].split(":")
    return getattr(importlib.import_module(module), func)


_USER_ERRORS = (DataError, FileNotFoundError, ValueError, NonFiniteLossError, MisconfigurationException)


def _user_error(e: BaseException) -> BaseException:
    """The error to show: jsonargparse wraps errors raised while instantiating ``--model``/``--data`` in a
    multi-line "Does not validate against any of the Union subtypes" ValueError; show the original instead."""
    while isinstance(e.__cause__, _USER_ERRORS) and e.__traceback__ is not None:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if not tb.tb_frame.f_globals.get("__name__", "").startswith("jsonargparse"):
            break
        e = e.__cause__
    return e


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    from jsonargparse import set_parsing_settings

    _setup_logging()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in TOOLS:
        return _tool(args[0])(args[1:])
    try:
        LLMCLI(args=argv)  # None: LightningCLI reads sys.argv itself
        if shutdown_process_group() and argv is None:
            leave_process(0)  # a torchrun worker: no SIGABRT in interpreter teardown (see leave_process)
    except _USER_ERRORS as e:
        # Bad input or configuration: one clear line instead of a traceback.
        if os.environ.get("LIGHTNING_LLM_DEBUG"):
            raise
        print(f"lightning_llm: error: {_user_error(e)}\n(set LIGHTNING_LLM_DEBUG=1 to see the traceback)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
