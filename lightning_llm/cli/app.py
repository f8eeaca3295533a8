"""``lightning_llm`` command line: a LightningCLI (fit/validate/test/predict) plus a few tool subcommands.

Tasks (``--model``) and datamodules (``--data``) are chosen by class path in subclass mode; strategies by
their registered name (``--trainer.strategy=tp``, which then takes the class's options:
:mod:`lightning_llm.cli.args`) or class path.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

import lightning_llm.strategies  # noqa: F401 - registers our strategies in StrategyRegistry
from lightning_llm.checkpoint import (
    CheckpointError,
    check_strategy_reads,
    check_torch_file,
    loading,
    verify_checkpoint,
)
from lightning_llm.cli.args import expand_config, prepare_argv, register_parser_mode
from lightning_llm.cli.progress import use_steps_progress_bar
from lightning_llm.cli.run_dirs import fresh_run_dirs, remove_unused
from lightning_llm.files import DataError, read_json
from lightning_llm.logs import RankZeroFilter, is_global_zero
from lightning_llm.preemption import Preempted, StoppedEarly, exit_status, install_handler, last_checkpoint
from lightning_llm.reliability import leave_process, shutdown_process_group
from lightning_llm.strategies import check_strategy_name, strategy_class
from lightning_llm.tasks.base import LLMTask
from lightning_llm.tasks.callbacks.guard import NonFiniteLossError
from lightning_llm.vocab import default_tokenizer_dir

log = logging.getLogger("lightning_llm")

# Tool subcommands outside Lightning's four; each maps to "module:function(argv) -> int".
TOOLS: dict[str, str] = {
    "prepare": "lightning_llm.tools.prepare:main",
    "estimate": "lightning_llm.tools.estimate:main",
    "export": "lightning_llm.export.to_hf:main",
    "merge": "lightning_llm.export.merge:main",
    "eval": "lightning_llm.cli.evaluate:main",
    "plot": "lightning_llm.tools.plot:main",
}

# What `lightning_llm --help` says of each subcommand: Lightning's four (LightningCLI.subcommands()), then the tools.
SUBCOMMAND_HELP: dict[str, str] = {
    "fit": "train a task (--config FILE); the layout is --trainer.strategy=ddp|tp|pp|zero1|zero2|zero3|3d|...",
    "validate": "one pass over the validation split (--ckpt_path CKPT: a checkpoint of any layout)",
    "test": "one pass over the test split (--ckpt_path CKPT)",
    "predict": "write the task's predictions (SFT generations, CLUE labels) from --ckpt_path CKPT",
    "prepare": "tokenize a pretraining corpus once into the token store that fit reads",
    "estimate": "memory per device of a model under a layout, and the largest batch that fits",
    "export": "any checkpoint (any layout, LoRA merged or adapter-only) -> a Hugging Face directory",
    "merge": "fold a LoRA/PEFT adapter into full Hugging Face weights",
    "eval": "score a checkpoint (any layout) or HF directory on lm-eval benchmarks (C-Eval, CMMLU, MMLU, your YAML)",
    "plot": "loss and throughput curves of a CSVLogger run to a PNG",
}


def usage() -> str:
    """The top-level help: every subcommand with one line."""
    width = max(map(len, SUBCOMMAND_HELP))
    lines = ["usage: lightning_llm SUBCOMMAND [options]   (lightning_llm SUBCOMMAND --help: its options)", "",
             "Train LLMs on PyTorch Lightning; the parallel layout is one flag (--trainer.strategy).", "",
             "training (LightningCLI):"]
    lines += [f"  {name:<{width}}  {text}" for name, text in SUBCOMMAND_HELP.items() if name not in TOOLS]
    lines += ["", "tools:"] + [f"  {name:<{width}}  {SUBCOMMAND_HELP[name]}" for name in TOOLS]
    return "\n".join(lines) + "\n"


class LLMCLI(LightningCLI):
    """LightningCLI with our tasks/datamodules in subclass mode and our strategies registered."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs) -> None:
        super().__init__(
            LLMTask,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"parser_mode": register_parser_mode("omegaconf" if _has_omegaconf() else "yaml")},
            args=args,
            run=run,
            **kwargs,
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # Registered strategy names become their class + preset (so they take options), strategy options and config
        # files are checked: one line each before jsonargparse's usage dump (lightning_llm.cli.args).
        if isinstance(args, dict):
            args = expand_config(dict(args))
        elif not isinstance(args, Namespace):
            args = prepare_argv(list(sys.argv[1:] if args is None else args))
        self.config = parser.parse_object(args) if isinstance(args, (dict, Namespace)) else parser.parse_args(args)

    def before_instantiate_classes(self) -> None:
        # Lightning rejects an unknown strategy name only once the model and data are built, with a list of a few
        # of its own names: name ours too, before anything is built.

        cfg = self.config[self.subcommand] if self.subcommand else self.config
        strategy = cfg.get("trainer.strategy")
        if isinstance(strategy, str):
            check_strategy_name(strategy)
            cls = strategy_class(strategy)
            if cls is not None:  # a bare class path or name stays a string (Trainer would refuse it): instantiate it
                cfg["trainer.strategy"] = Namespace(class_path=f"{cls.__module__}.{cls.__qualname__}",
                                                    init_args=Namespace())
        _default_tokenizer(cfg)

    def _parse_ckpt_path(self) -> None:
        # LightningCLI torch.loads a --ckpt_path file here (for its hyperparameters), before anything else reads it:
        # a cut or corrupt file must fail here with one line naming it, and a file or directory holding objects that
        # would run code when unpickled is refused here, before anything is built (checkpoint.safe_load). (A private
        # hook of LightningCLI; the tests of a truncated and of a crafted --ckpt_path notice if it stops being called.)

        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return super()._parse_ckpt_path()
        name = f"--ckpt_path={ckpt_path}"
        if Path(ckpt_path).is_file():
            check_torch_file(ckpt_path, name=name)
        verify_checkpoint(ckpt_path, name=name)
        with loading(name):
            return super()._parse_ckpt_path()


    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        trainer = super().instantiate_trainer(**kwargs)
        use_steps_progress_bar(trainer)  # "Epoch 0", not Lightning's "Epoch 0/-2" of a max_steps run
        return trainer

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        # The strategy is built now: a checkpoint directory given to one that reads a single file (ddp, one device)
        # is refused in one line naming the strategies that read it, not left to torch.load's IsADirectoryError.
        # A run refused while it sets up (bad data, read in the datamodule's setup after Lightning made the log
        # directories) leaves no empty runs/NAME/version_N behind (lightning_llm.cli.run_dirs).
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if ckpt_path == "last":
            ckpt_path = self._last_checkpoint(subcommand)
        if ckpt_path:
            check_strategy_reads(ckpt_path, self.trainer.strategy, name=f"--ckpt_path={ckpt_path}")
        fresh = fresh_run_dirs(self.trainer) if is_global_zero() else []
        try:
            super()._run_subcommand(subcommand)
        except BaseException:
            remove_unused(fresh)
            raise


    def _last_checkpoint(self, subcommand: str) -> str | None:
        """``--ckpt_path=last``: the newest checkpoint of this run's earlier attempts (``preemption.last_checkpoint``,
        every logger version included), checked as any ``--ckpt_path``; none yet: ``fit`` starts from scratch (one
        command line serves every attempt of a requeued job), evaluation refuses."""
        found = last_checkpoint(self.trainer)
        if found is None:
            if subcommand != "fit":
                raise FileNotFoundError(f"--ckpt_path=last: this run has no checkpoint yet to {subcommand}")
            log.info("--ckpt_path=last: no checkpoint of this run yet; training starts from scratch")
        else:
            log.info("--ckpt_path=last: resuming %s", found)
            verify_checkpoint(found, name=f"--ckpt_path={found}")
        self.config_init[subcommand]["ckpt_path"] = None if found is None else str(found)
        return self.config_init[subcommand]["ckpt_path"]


def _default_tokenizer(cfg: Any) -> None:
    """An HF ``--model.backbone`` directory's own tokenizer is the datamodule's default ``--data.tokenizer_dir``
    (:func:`lightning_llm.vocab.default_tokenizer_dir`): set here, where the parsed model and data arguments meet
    before either is built, so the saved config.yaml names it. Datamodules without ``tokenizer_dir`` are left alone.
    The backbone's ``config.json`` is parsed here first (one line naming file and line if it is malformed)."""
    model, data = cfg.get("model"), cfg.get("data")
    model_args = getattr(model, "init_args", None)
    data_args = getattr(data, "init_args", None)
    backbone = model_args.get("backbone") if model_args is not None else None
    if isinstance(backbone, str) and (Path(backbone).expanduser() / "config.json").is_file():
        # Read first: the tokenizer (loaded before the model) reads it too, and its error would name the tokenizer.
        read_json(Path(backbone).expanduser() / "config.json")
    if model_args is None or data_args is None or "tokenizer_dir" not in data_args:
        return
    data_args["tokenizer_dir"] = default_tokenizer_dir(backbone, data_args.get("tokenizer_dir"))


def _has_omegaconf() -> bool:
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return False
    return True


LIGHTNING_PYTREE_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
"""Raised by Lightning 2.6's own ``utilities/_pytree.py`` under torch 2.13, once per process and run: nothing a user
can act on, so the command line hides it."""


def _setup_logging() -> None:
    warnings.filterwarnings("ignore", message=LIGHTNING_PYTREE_WARNING)
    level = os.environ.get("LIGHTNING_LLM_LOG", "INFO").upper()
    root = logging.getLogger()
    if not root.handlers:  # as logging.basicConfig, plus: facts about the whole run printed by global rank 0 only
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        handler.addFilter(RankZeroFilter())
        root.addHandler(handler)
        root.setLevel(logging.WARNING)
    logging.getLogger("lightning_llm").setLevel(level)


def _tool(name: str) -> Callable[[list[str]], int]:
    import importlib

    module, func = TOOLS[name].split(":")
    return getattr(importlib.import_module(module), func)


_USER_ERRORS = (CheckpointError, DataError, FileNotFoundError, ValueError, NonFiniteLossError,
                MisconfigurationException)


PEER_EXIT_DELAY_S = 3.0
"""How long a rank other than 0 waits before leaving after a user error: the first rank to exit makes torchrun
terminate the others, which could kill rank 0 before it printed the line (ranks reach the same check together)."""


def _report(e: BaseException) -> int:
    """Print the one-line error on global rank 0 only (every rank of a job hits the same bad input; N copies of the
    line bury it) and return the exit code every rank exits with."""
    if is_global_zero():
        print(f"lightning_llm: error: {_user_error(e)}\n(set LIGHTNING_LLM_DEBUG=1 to see the traceback)",
              file=sys.stderr, flush=True)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(PEER_EXIT_DELAY_S)
    return 2


def _user_error(e: BaseException) -> BaseException:
    """The error to show: jsonargparse wraps errors raised while instantiating ``--model``/``--data`` in a
    multi-line "Does not validate against any of the Union subtypes" ValueError; show the original instead."""
    while isinstance(e.__cause__, _USER_ERRORS) and e.__traceback__ is not None:
        if (branch := _union_branch_error(e)) is not e:
            return branch
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if not tb.tb_frame.f_globals.get("__name__", "").startswith("jsonargparse"):
            break
        e = e.__cause__
    return e


_UNION_ERROR = "Does not validate against any of the Union subtypes"


def _union_branch_error(e: BaseException) -> BaseException:
    """A class given for a ``str | Class`` argument (``--trainer.strategy=zero2 --trainer.strategy.bucket_size_mb=0``)
    whose constructor refused a value fails in jsonargparse as a union error listing one error per branch, the
    constructor's among "Expected a <class 'str'>" lines, and chains only the last branch's error: show the
    constructor's error when it is the only one that is not a type mismatch, naming the class unless it already
    names its parameter (``--data.eval_batch_size must be ...``)."""
    text = str(e)
    if not text.startswith(_UNION_ERROR) or "\nErrors:\n" not in text:
        return e
    listed = text.split("\nErrors:\n", 1)[1].split("\nGiven value", 1)[0]
    branches = [ln.strip()[2:] for ln in listed.splitlines() if ln.strip().startswith("- ")]
    real = [b for b in branches if not b.startswith("Expected a ")]
    if len(real) != 1:
        return e
    cls = text.split("class_path='", 1)[1].split("'", 1)[0] if "class_path='" in text else ""
    return ValueError(f"{cls}: {real[0]}" if cls and not real[0].startswith("--") else real[0])


def _drop_process_group() -> bool:
    """Destroy the process group a failed run leaves behind (Lightning's teardown on an exception keeps it); True if
    there was one. No barrier, unlike after a finished run: a rank that failed alone must not wait for its peers."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    from jsonargparse import set_parsing_settings

    _setup_logging()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args and args[0] in TOOLS:
        code = _tool(args[0])(args[1:])
        if shutdown_process_group() and argv is None:  # `eval` under torchrun: leave as a finished run does
            leave_process(code)
        return code
    restore_handlers = install_handler()  # a SIGTERM from here to the fit's loop: one line naming the phase
    try:
        LLMCLI(args=argv)  # None: LightningCLI reads sys.argv itself
        if shutdown_process_group() and argv is None:
            leave_process(0)  # a torchrun worker: no SIGABRT in interpreter teardown (see leave_process)
    except Preempted as e:  # every rank stopped after the same step, its checkpoint written (lightning_llm.preemption)
        if shutdown_process_group() and argv is None:
            leave_process(e.code)
        return e.code
    except StoppedEarly as e:  # before the loop (set-up, reference precompute) or evaluating: nothing to save
        print(f"lightning_llm: {e}", file=sys.stderr, flush=True)
        if _drop_process_group() and argv is None:
            leave_process(e.code)
        return e.code
    except SIGTERMException:  # Lightning's own (validate/test/predict): stopped, not finished, nothing to save
        if _drop_process_group() and argv is None:
            leave_process(exit_status(signal.SIGTERM))
        return exit_status(signal.SIGTERM)
    except _USER_ERRORS as e:
        # Bad input or configuration: one clear line instead of a traceback.
        if os.environ.get("LIGHTNING_LLM_DEBUG"):
            raise
        code = _report(e)
        if _drop_process_group() and argv is None:
            leave_process(code)  # a torchrun worker: as after a finished run, no abort in interpreter teardown
        return code
    finally:
        restore_handlers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
