"""``lightning_llm eval PATH --tasks A,B [--include_path DIR] [--limit N] [--num_fewshot K] [--output_path DIR]
[--log_samples]`` plus the layout flags ``--trainer.strategy=NAME`` (and its options), ``--trainer.devices``,
``--trainer.num_nodes``, ``--trainer.accelerator``, ``--trainer.precision``: lm-evaluation-harness scores PATH (a
checkpoint of any layout, or a Hugging Face directory) at that layout.

The layout is the engine's, reused as ``fit`` uses it: a Lightning Trainer with the chosen strategy builds the model
(:class:`~lightning_llm.evaluation.model.EvalTask`: lazily, each rank materializing its shards), the checkpoint's
weights are loaded into the shards, and lm-eval runs from the validation loop's start with
:class:`~lightning_llm.evaluation.harness.HarnessLM`, whose model calls are the task's (``run_model``, and
``generate`` over ``decoding_model()``). Without ``--trainer.strategy`` the engine runs on one device (``3d`` with
every degree 1, which reads every checkpoint layout). Launch several processes as for ``fit`` (``torchrun``).
Every rank scores every request (tensor/pipeline ranks share them; data-parallel replicas repeat them); global rank 0
writes the results and prints lm-eval's table. Errors are one line, exit code 2.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from typing import Any

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_llm.cli.app import _USER_ERRORS, _drop_process_group, _report
from lightning_llm.cli.args import prepare_argv
from lightning_llm.evaluation.model import EvalTask, ModelSource, read_source
from lightning_llm.evaluation.run import EvalConfig, load_tasks, require_lm_eval, score, tracker_for, write_results

log = logging.getLogger(__name__)

__all__ = ["main"]

LAYOUT_FLAGS = ("accelerator", "strategy", "devices", "num_nodes", "precision")
"""The Trainer arguments ``eval`` takes (as ``--trainer.NAME``, parsed as ``fit`` parses them)."""


def _parser() -> LightningArgumentParser:
    summary = __doc__.split("\n\n")[0].replace("``", "")
    parser = LightningArgumentParser(prog="lightning_llm eval", description=summary, parser_mode="yaml")
    parser.add_argument("path", help="a checkpoint (file or directory, any layout) or a Hugging Face directory")
    parser.add_argument("--tasks", required=True, help="lm-eval task/group/tag names or task YAML files, comma "
                        "separated (from lm-eval's registry or --include_path)")
    parser.add_argument("--include_path", action="append", default=[], help="a directory of your own task YAML "
                        "files (repeat for several)")
    parser.add_argument("--limit", type=float, default=None, help="documents per task: a count, or a fraction < 1")
    parser.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    parser.add_argument("--batch_size", type=int, default=8, help="rows per model call")
    parser.add_argument("--output_path", default=None, help="directory for results_*.json (and samples_*.jsonl)")
    parser.add_argument("--log_samples", action="store_true", help="write every document's prompt, responses and "
                        "metrics (samples_<task>_*.jsonl under --output_path)")
    parser.add_argument("--apply_chat_template", action="store_true", help="render prompts with the tokenizer's "
                        "chat template (the run's, when it trained with a named one)")
    parser.add_argument("--fewshot_as_multiturn", type=bool, default=None, help="few-shot examples as turns of a "
                        "conversation (default: with --apply_chat_template)")
    parser.add_argument("--system_instruction", default=None, help="a system message before every prompt")
    parser.add_argument("--gen_kwargs", default=None, help="generation settings over every generation task's, as "
                        "lm-eval takes them: 'temperature=0.7,do_sample=True' or JSON")
    parser.add_argument("--cache_implementation", choices=["dynamic", "static"], default="dynamic",
                        help="generate_until's KV cache: static preallocates one per batch size and length bucket")
    parser.add_argument("--compile", type=bool, default=False, help="compile generate_until's one-token decoding "
                        "step (CUDA graphs on CUDA; needs --cache_implementation static)")
    parser.add_argument("--metadata", default=None, help="JSON (or key=value,...) passed to every task, e.g. "
                        "'{\"data_dir\": \"/data/ceval\"}' for configs/eval/ceval_format.yaml")
    parser.add_argument("--max_length", type=int, default=None, help="longest input in tokens (default: the "
                        "model's max_position_embeddings)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory, or byte for the built-in byte "
                        "tokenizer (default: the run's, as export finds it; an HF directory's own)")
    parser.add_argument("--seed", type=int, default=1234, help="numpy/torch/few-shot seed (lm-eval's default)")
    parser.add_argument("--bootstrap_iters", type=int, default=100000, help="bootstrap iterations of the standard "
                        "errors (0: none)")
    skip = {p for p in inspect.signature(pl.Trainer.__init__).parameters if p not in LAYOUT_FLAGS} - {"self"}
    parser.add_class_arguments(pl.Trainer, "trainer", fail_untyped=False, instantiate=False, sub_configs=True,
                               skip=skip)
    return parser


def _settings(value: str | None, *, flag: str) -> dict[str, Any] | None:
    """``--gen_kwargs``/``--metadata``: JSON, or lm-eval's ``key=value,...``."""
    if value is None:
        return None
    if value.lstrip().startswith("{"):
        try:
            return dict(json.loads(value))
        except ValueError as e:
            raise ValueError(f"{flag}: not valid JSON ({e})") from None
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(value)


def eval_config(cfg: Namespace) -> EvalConfig:
    """The parsed options as :class:`EvalConfig`."""
    return EvalConfig(
        tasks=[t.strip() for t in cfg.tasks.split(",") if t.strip()], include_path=list(cfg.include_path or []),
        limit=cfg.limit, num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size,
        apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        system_instruction=cfg.system_instruction, gen_kwargs=_settings(cfg.gen_kwargs, flag="--gen_kwargs"),
        cache_implementation=cfg.cache_implementation, compile=cfg.compile,
        metadata=_settings(cfg.metadata, flag="--metadata"), log_samples=cfg.log_samples,
        output_path=cfg.output_path, max_length=cfg.max_length, bootstrap_iters=cfg.bootstrap_iters, seed=cfg.seed)


class _ScoreAtStart(pl.Callback):
    """Loads the checkpoint's weights into the set-up model and runs lm-eval, once, when validation starts."""

    def __init__(self, source: ModelSource, cfg: EvalConfig, manager: Any, tasks: list[Any]) -> None:
        self.source, self.cfg, self.manager, self.tasks = source, cfg, manager, tasks

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_llm.evaluation.harness import HarnessLM  # needs lm-eval (checked before the Trainer)

        pl_module.load_weights(self.source)
        lm = HarnessLM(pl_module, tokenizer=self.source.tokenizer, max_length=self.cfg.max_length or
                       self.source.max_length, eos_token_ids=self.source.eos_token_ids,
                       batch_size=self.cfg.batch_size, seed=self.cfg.seed, show_progress=trainer.is_global_zero,
                       cache_implementation=self.cfg.cache_implementation, compile=self.cfg.compile)
        tracker = tracker_for(self.cfg) if trainer.is_global_zero else None
        results = score(lm, self.manager, self.tasks, self.cfg, model_name=str(self.source.path), tracker=tracker)
        error = None
        if trainer.is_global_zero and results is not None:
            try:
                write_results(results, self.cfg, tracker)
            except OSError as e:  # every rank leaves with the error (a rank left waiting at a barrier would hang)
                error = str(e)
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            raise OSError(error)


def _strategy(value: Any) -> Any:
    """The Trainer's strategy: the engine on one device unless one was named (it reads every checkpoint layout)."""
    if value in (None, "auto"):
        from lightning_llm.strategies import HybridParallelStrategy

        return HybridParallelStrategy()
    return value


def run(parser: LightningArgumentParser, cfg: Namespace) -> None:
    """Check everything that can be checked before a model is built, then score at the chosen layout."""
    require_lm_eval()
    eval_cfg = eval_config(cfg)
    source = read_source(cfg.path, tokenizer_dir=cfg.tokenizer)
    if eval_cfg.apply_chat_template and not getattr(source.tokenizer, "chat_template", None):
        raise ValueError(f"--apply_chat_template: the tokenizer of PATH={cfg.path} has no chat template (pass "
                         "--tokenizer DIR with one)")
    manager, tasks = load_tasks(eval_cfg)
    trainer_args = dict(parser.instantiate(cfg).trainer)
    trainer_args["strategy"] = _strategy(trainer_args.get("strategy"))
    trainer = pl.Trainer(**trainer_args, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1,
                         callbacks=[_ScoreAtStart(source, eval_cfg, manager, tasks)])
    trainer.validate(EvalTask(**source.task_kwargs), dataloaders=DataLoader([0]), verbose=False)


def main(argv: list[str]) -> int:
    """``lightning_llm eval``: 0 when scored, 2 with one line on a user error."""
    parser = _parser()
    cfg = parser.parse_args(prepare_argv(list(argv)))
    try:
        run(parser, cfg)
    except (*_USER_ERRORS, OSError) as e:
        if os.environ.get("LIGHTNING_LLM_DEBUG"):
            raise
        code = _report(e)
        _drop_process_group()
        return code
    return 0
