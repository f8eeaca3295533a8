"""Benchmark scores while ``fit`` runs: :class:`LMEvalCallback` scores the model being trained with
lm-evaluation-harness every N optimizer steps (the same scoring as ``lightning_llm eval``: the same tasks, model class
and results) and logs each metric as ``lm_eval/<task>/<metric>`` in the run's logger, beside ``train_loss`` and
``val_loss``::

    lightning_llm fit --config ... --trainer.callbacks+=lightning_llm.evaluation.LMEvalCallback \\
        --trainer.callbacks.tasks=[ceval_format] --trainer.callbacks.every_n_steps=200 \\
        --trainer.callbacks.include_path=[configs/eval] --trainer.callbacks.metadata='{data_dir: /data/ceval}' \\
        --trainer.callbacks.limit=100

Every rank scores (tensor/pipeline ranks make the same model calls); the model is put in eval mode for it and back,
and the random generators lm-eval seeds are restored, so training goes on exactly as without the callback.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from lightning_llm.data.base import load_tokenizer
from lightning_llm.evaluation.run import EvalConfig, load_tasks, metric_values, require_lm_eval, score

log = logging.getLogger(__name__)

__all__ = ["LMEvalCallback"]


class LMEvalCallback(pl.Callback):
    """lm-eval scores of the model being trained, every ``every_n_steps`` optimizer steps, logged per task and
    metric (``lm_eval/<task>/<metric>``)."""

    def __init__(self, tasks: list[str], every_n_steps: int, *, include_path: list[str] | None = None,
                 limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
                 apply_chat_template: bool = False, metadata: dict[str, Any] | None = None,
                 tokenizer_dir: str | None = None, max_length: int | None = None, bootstrap_iters: int = 0,
                 cache_implementation: Literal["dynamic", "static"] = "dynamic", compile: bool = False,
                 prefix: str = "lm_eval/") -> None:
        """
        Args:
            tasks: lm-eval task names (registry or ``include_path``), as ``lightning_llm eval --tasks``.
            every_n_steps: Score after every this many optimizer steps; ``trainer.log_every_n_steps`` must divide
                it (Lightning writes step metrics to the logger only at those steps).
            include_path: Directories of your own task YAML files.
            limit: Documents per task (a count, or a fraction < 1): a small task keeps training fast.
            num_fewshot: Few-shot examples (default: each task's).
            batch_size: Rows per model call.
            apply_chat_template: Render prompts with the datamodule's chat template.
            metadata: Passed to every task (e.g. ``{data_dir: ...}``).
            tokenizer_dir: The tokenizer (default: the datamodule's).
            max_length: Longest input in tokens (default: the model's ``max_position_embeddings``).
            bootstrap_iters: Bootstrap iterations of the standard errors (0: none, the fast default here).
            cache_implementation: ``generate_until``'s KV cache (``static``: one per batch size and length bucket).
            compile: Compile ``generate_until``'s decoding step (needs ``cache_implementation="static"``).
            prefix: Start of every logged name.
        """
        require_lm_eval()
        if every_n_steps < 1:
            raise ValueError(f"LMEvalCallback: every_n_steps must be >= 1, got {every_n_steps}")
        self.cfg = EvalConfig(tasks=list(tasks), include_path=list(include_path or []), limit=limit,
                              num_fewshot=num_fewshot, batch_size=batch_size, apply_chat_template=apply_chat_template,
                              metadata=metadata, max_length=max_length, bootstrap_iters=bootstrap_iters,
                              cache_implementation=cache_implementation, compile=compile)
        self.every_n_steps, self.tokenizer_dir, self.prefix = every_n_steps, tokenizer_dir, prefix
        self._loaded: tuple[Any, list[Any]] | None = None
        self._last_step = -1
        self.history: list[tuple[int, dict[str, float]]] = []
        """``(global step, metrics)`` of every score taken, on every rank."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        every = trainer.log_every_n_steps
        if every and self.every_n_steps % every:
            raise ValueError(f"LMEvalCallback: every_n_steps={self.every_n_steps} is not a multiple of "
                             f"--trainer.log_every_n_steps={every}: Lightning would not write the scores to the logger")
        self._loaded = load_tasks(self.cfg)  # every rank, before training: a missing task or data stops it here

    def _tokenizer(self, trainer: pl.Trainer) -> Any:
        if self.tokenizer_dir:
            return load_tokenizer(self.tokenizer_dir, param="LMEvalCallback.tokenizer_dir")
        tok = getattr(trainer.datamodule, "tokenizer", None)
        if tok is None:
            raise ValueError("LMEvalCallback: the datamodule has no tokenizer; pass tokenizer_dir")
        return tok

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step or step == 0 or step % self.every_n_steps:
            return  # (also the other micro-batches of an accumulation window)
        self._last_step = step
        values = self.scores(trainer, pl_module)
        self.history.append((step, values))
        for name, value in values.items():
            pl_module.log(self.prefix + name, value, on_step=True, on_epoch=False, sync_dist=False)

    def scores(self, trainer: pl.Trainer, pl_module: Any) -> dict[str, float]:
        """lm-eval's metrics of the model as it is now, on every rank."""
        from lightning_llm.evaluation.harness import HarnessLM  # needs lm-eval (checked in __init__)

        assert self._loaded is not None, "setup() loads the tasks"
        manager, tasks = self._loaded
        dm = trainer.datamodule
        stops = getattr(dm, "stop_token_ids", None) or []
        lm = HarnessLM(pl_module, tokenizer=self._tokenizer(trainer), eos_token_ids=list(stops),
                       max_length=self.cfg.max_length, batch_size=self.cfg.batch_size, seed=self.cfg.seed,
                       show_progress=False, cache_implementation=self.cfg.cache_implementation,
                       compile=self.cfg.compile)
        results = score(lm, manager, tasks, self.cfg, model_name=type(pl_module).__name__)
        values = metric_values(results) if trainer.is_global_zero and results is not None else None
        return trainer.strategy.broadcast(values, src=0)
