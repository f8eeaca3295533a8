"""Benchmark evaluation with lm-evaluation-harness (the ``eval`` extra): ``lightning_llm eval`` and scoring during fit.

* :mod:`.harness`: :class:`HarnessLM`, lm-eval's model class over our decoder at any layout (imports ``lm_eval``);
* :mod:`.run`: :class:`EvalConfig`, loading tasks (local data only), scoring, writing results as lm-eval does;
* :mod:`.model`: what ``eval PATH`` scores: :func:`read_source` and :class:`EvalTask` (the model at the Trainer's
  layout, the checkpoint's weights loaded into its shards);
* :mod:`.callback`: :class:`LMEvalCallback`, the same scoring every N steps of ``fit``.

The command itself is ``lightning_llm.cli.evaluate``.
"""

from lightning_llm.evaluation.callback import LMEvalCallback
from lightning_llm.evaluation.model import EvalTask, ModelSource, read_source
from lightning_llm.evaluation.run import EXTRA, EvalConfig, load_tasks, metric_values, require_lm_eval, score

__all__ = ["EXTRA", "EvalConfig", "EvalTask", "LMEvalCallback", "ModelSource", "load_tasks", "metric_values",
           "read_source", "require_lm_eval", "score"]
