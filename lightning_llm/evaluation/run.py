"""One lm-evaluation-harness run over a task's model, shared by ``lightning_llm eval`` and :class:`LMEvalCallback`.

* :class:`EvalConfig`: what to score (the options named as lm-eval's own command line names them);
* :func:`load_tasks`: the tasks from lm-eval's registry and the ``include_path`` directories, their data read from
  local files only (Hugging Face's offline modes are switched on first: nothing downloads), each failure one line
  naming the task and what to pass; the generation settings of generation tasks checked against ours;
* :func:`score`: ``lm_eval.simple_evaluate`` with :class:`~lightning_llm.evaluation.harness.HarnessLM`;
* :func:`write_results`: ``results_<date>.json`` and ``samples_<task>_<date>.jsonl`` under the output path, written
  by lm-eval's own ``EvaluationTracker``, and its table printed;
* :func:`metric_values`: the results as flat ``{task/metric: value}`` for Lightning's loggers.
"""

from __future__ import annotations

import difflib
import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_llm.checkpoint import first_line

log = logging.getLogger(__name__)

__all__ = ["EXTRA", "EvalConfig", "load_tasks", "metric_values", "require_lm_eval", "score", "tracker_for",
           "write_results"]

EXTRA = "pip install 'lightning_llm[eval]'"
"""How to install lm-evaluation-harness with the version this package is tested with."""


def require_lm_eval() -> None:
    """One line naming the extra when lm-evaluation-harness is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise ValueError(f"lm-evaluation-harness is not installed ({first_line(e)}): {EXTRA}") from None


@dataclass
class EvalConfig:
    """What to score and how; the names are lm-eval's command line's."""

    tasks: list[str]
    """lm-eval task, group or tag names (registry or ``include_path``), or task YAML files."""
    include_path: list[str] = field(default_factory=list)
    """Directories of the user's own task YAML files (and the Python files they name)."""
    limit: float | None = None
    """Documents per task: a count (>= 1) or a fraction (< 1); None = all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt (None: each task's own default)."""
    batch_size: int = 8
    """Rows per model call."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template."""
    fewshot_as_multiturn: bool | None = None
    """Few-shot examples as a multi-turn conversation (None: with the chat template, as lm-eval does)."""
    system_instruction: str | None = None
    """A system message prepended to every prompt."""
    gen_kwargs: dict[str, Any] | None = None
    """Generation settings overriding every generation task's ``generation_kwargs``."""
    cache_implementation: Literal["dynamic", "static"] = "dynamic"
    """``generate_until``'s KV cache (:class:`~lightning_llm.generation.GenerationConfig`'s): ``static``
    preallocates one per batch size and length bucket."""
    compile: bool = False
    """Compile ``generate_until``'s one-token decoding step (CUDA graphs on CUDA; needs
    ``cache_implementation="static"``)."""
    metadata: dict[str, Any] | None = None
    """Passed to every task (e.g. ``{"data_dir": ...}`` of configs/eval/ceval_format.yaml)."""
    log_samples: bool = False
    """Keep every document's prompt, responses and metrics (written with ``output_path``)."""
    output_path: str | None = None
    """Directory for ``results_*.json`` (and ``samples_<task>_*.jsonl``)."""
    max_length: int | None = None
    """Longest input in tokens (default: the model's ``max_position_embeddings``)."""
    bootstrap_iters: int = 100000
    """Bootstrap iterations of the standard errors (0: none)."""
    seed: int = 1234
    """numpy/torch/few-shot seed (lm-eval's default; Python's ``random`` gets 0, as lm-eval seeds it)."""

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("--tasks: name at least one task")
        if self.log_samples and not self.output_path:
            raise ValueError("--log_samples writes the samples under --output_path: pass --output_path DIR")
        if self.compile and self.cache_implementation != "static":
            raise ValueError("--compile compiles the decoding step of the static cache: pass --cache_implementation "
                             "static as well")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"--limit must be > 0, got {self.limit}")
        for path in self.include_path:
            if not Path(path).is_dir():
                raise FileNotFoundError(f"--include_path={path}: no such directory")

    @property
    def multiturn(self) -> bool:
        return self.apply_chat_template if self.fewshot_as_multiturn is None else self.fewshot_as_multiturn


def _offline() -> None:
    """Hugging Face's offline modes, before lm-eval reads any dataset: a task whose data is not on this machine
    fails instead of downloading it."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    import huggingface_hub

    datasets.config.HF_DATASETS_OFFLINE = True
    huggingface_hub.constants.HF_HUB_OFFLINE = True


def _data_error(name: str, e: BaseException) -> ValueError:
    return ValueError(f"--tasks {name}: its data is not on this machine ({first_line(e)}) and lightning_llm eval "
                      "downloads nothing: write a task YAML whose dataset_path/dataset_kwargs.data_files name local "
                      "files (or a custom_dataset reading them) and pass its directory with --include_path "
                      "(docs/evaluation.md)")


def _spec(name: str) -> str:
    """A task YAML file given by path: its absolute path (lm-eval loads it as a task); anything else: the name."""
    return str(Path(name).absolute()) if name.endswith((".yaml", ".yml")) and Path(name).is_file() else name


def _managers(cfg: EvalConfig) -> Iterator[Any]:
    """Task managers to try, cheapest first: the ``include_path`` directories alone when they hold every asked name
    (indexing lm-eval's registry reads ~14,000 YAML files: seconds), then the registry with them."""
    from lm_eval.tasks import TaskManager

    meta = dict(cfg.metadata or {})
    if cfg.include_path:
        own = TaskManager(include_path=cfg.include_path, include_defaults=False, metadata=meta)
        if all(_spec(n) != n or own.match_tasks([n]) for n in cfg.tasks):
            yield own
    yield TaskManager(include_path=cfg.include_path or None, metadata=meta)


def _build(manager: Any, cfg: EvalConfig) -> list[Any]:
    """The asked tasks built by ``manager`` (their data read), one line per failure."""
    from lm_eval.api.task import Task

    from lightning_llm.evaluation.harness import check_gen_kwargs

    for name in cfg.tasks:  # every name first: an unknown one is refused before any data is read
        if _spec(name) == name and not manager.match_tasks([name]):
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = f" or in --include_path {', '.join(cfg.include_path)}" if cfg.include_path else ""
            raise LookupError(f"--tasks {name}: no such task, group or tag in lm-eval's registry{where}"
                              + (f"; close: {', '.join(close)}" if close else ""))
    built = []
    for name in cfg.tasks:
        spec = _spec(name)
        try:
            loaded = manager.load([spec] if spec != name else manager.match_tasks([name]))  # a glob names several
        except (OSError, ConnectionError) as e:  # datasets: not cached offline, a data file missing
            raise _data_error(name, e) from e
        except KeyError as e:  # a group naming a task this manager does not index
            raise LookupError(f"--tasks {name}: {first_line(e)}") from e
        except (ValueError, TypeError, ImportError) as e:  # a task YAML's own error
            raise ValueError(f"--tasks {name}: {first_line(e)}") from e
        for task_name, task in loaded["tasks"].items():
            if isinstance(task, Task) and task.OUTPUT_TYPE == "generate_until":
                check_gen_kwargs({**(task.config.generation_kwargs or {}), **(cfg.gen_kwargs or {})},
                                 where=f"--tasks {task_name}")
        built += _top_level(loaded)
    return built


def load_tasks(cfg: EvalConfig) -> tuple[Any, list[Any]]:
    """``(TaskManager, built tasks/groups)`` of ``cfg.tasks``, their data read; every rank calls it (the same
    documents everywhere). One line per failure: an unknown name (with the closest known ones), data that is not
    local, a task's own error, generation settings we do not implement."""
    _offline()
    for logger in ("lm_eval", "lm-eval"):  # lm-eval's INFO lines (one per task and setting) stay out of the way
        logging.getLogger(logger).setLevel(max(logging.getLogger(logger).getEffectiveLevel(), logging.WARNING))
    error: LookupError | None = None
    for manager in _managers(cfg):  # the registry is indexed only when the include paths do not suffice
        try:
            return manager, _build(manager, cfg)
        except LookupError as e:
            error = e
    raise ValueError(str(error)) from None


def _top_level(loaded: dict[str, Any]) -> list[Any]:
    """The groups and tasks of a ``TaskManager.load`` result that no loaded group holds (what was asked for, built:
    ``simple_evaluate`` takes them as they are, without reading their data again)."""
    children = {c for kids in loaded["group_map"].values() for c in kids}
    return ([g for name, g in loaded["groups"].items() if name not in children]
            + [t for name, t in loaded["tasks"].items() if name not in children])


@contextmanager
def _rng_kept() -> Iterator[None]:
    """lm-eval seeds Python's, numpy's and torch's generators: put them back afterwards, so a score taken during
    ``fit`` leaves the run's draws (dropout, sampling, data order) as they were."""
    import numpy as np
    import torch

    state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []):
        try:
            yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])


def score(lm: Any, manager: Any, tasks: list[Any], cfg: EvalConfig, *, model_name: str,
          tracker: Any = None) -> dict[str, Any] | None:
    """``lm_eval.simple_evaluate`` of ``tasks`` (from :func:`load_tasks`) with ``lm``; the results on the ranks lm-eval
    returns them on (local rank 0), else None."""
    from lm_eval import simple_evaluate

    with _rng_kept():
        return simple_evaluate(
            model=lm, model_args={"pretrained": model_name}, tasks=tasks, task_manager=manager,
            num_fewshot=cfg.num_fewshot, limit=cfg.limit, log_samples=cfg.log_samples, evaluation_tracker=tracker,
            apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.multiturn,
            system_instruction=cfg.system_instruction, gen_kwargs=cfg.gen_kwargs, bootstrap_iters=cfg.bootstrap_iters,
            random_seed=0, numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)


def tracker_for(cfg: EvalConfig) -> Any:
    """lm-eval's ``EvaluationTracker`` writing under ``cfg.output_path`` (None without one)."""
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=cfg.output_path) if cfg.output_path else None


def write_results(results: dict[str, Any], cfg: EvalConfig, tracker: Any) -> Path | None:
    """Write ``results_<date>.json`` (and with ``log_samples`` a ``samples_<task>_<date>.jsonl`` per task) as lm-eval's
    command line does, and print its table; returns the results file. Global rank 0 only."""
    from lm_eval.utils import make_table

    samples = results.pop("samples", None)
    path = None
    if tracker is not None:
        tracker.save_results_aggregated(results=results, samples=samples if cfg.log_samples else None)
        if cfg.log_samples and samples:
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
        found = sorted(Path(cfg.output_path).rglob(f"results_{getattr(tracker, 'date_id', '?')}.json"))
        if not found:  # the tracker logs a warning and carries on when it cannot write: say so here
            raise OSError(f"--output_path={cfg.output_path}: the results could not be written there")
        path = found[-1]
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if path is not None:
        print(f"results written to {path}" + (" (samples beside it)" if cfg.log_samples else ""))
    return path


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of every task and group (``_<filter>`` after a metric of a filter other than
    ``none``), standard errors left out: what Lightning's loggers record."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # lm-eval's metric keys are "<metric>,<filter>"
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{metric}" if filt == "none" else f"{task}/{metric}_{filt}"] = float(value)
    return out
