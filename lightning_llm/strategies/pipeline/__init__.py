"""The pipeline runtime of the native engine (``pp``, or ``3d`` with ``pipeline_parallel_size > 1``).

* :mod:`.split`: the model split into stages, as each family declares it (names stay global, each rank keeps only
  its stages' modules);
* :mod:`.runner`: :class:`PipelineRunner`, which runs a task's declared hooks through ``torch.distributed.pipelining``
  (``model_inputs`` on the first stage, ``loss_from_output`` per micro-batch on the last);
* :mod:`.runtime`: the schedule table and building blocks (micro-batches, activation checkpointing of the blocks);
* :mod:`.decode`: token-by-token generation, micro-batches in flight (:meth:`PipelineRunner.decoder`);
* :mod:`.stats`: per-step busy/idle time per pipeline rank and live saved-activation bytes.

How a step runs inside Lightning's loop (the task contract of :mod:`lightning_llm.contract`; nothing of the task is
replaced):

* ``configure_model`` builds the full model as usual; the engine splits it (:mod:`.split`): this rank keeps only its
  stages' blocks/embeddings/head and a :class:`PipelineRunner` wraps each stage view in a ``PipelineStage``. The split
  model refuses direct calls (a forward pre-hook names ``run_model``); a task that overrides ``compute_loss`` or has
  trainable modules outside ``self.model`` is refused at set-up, before any step.
* Training: the task's ``step_loss`` asks the runner, which runs the schedule (forward *and* backward of every
  micro-batch) on ``task.model_inputs(batch)``; the last stage computes each micro-batch's loss with
  ``task.loss_from_output``. The mean loss is sent to every pipeline rank, so the task's ``train_loss``, the progress
  bar and checkpoint monitoring see the real value.
* Gradients vs Lightning's closure (training_step -> zero_grad -> backward): the schedule's gradients are moved out
  of ``.grad`` right after the schedule, so Lightning's ``zero_grad`` finds nothing to clear, and are put back in the
  engine's ``backward``, which replaces Lightning's ``loss.backward()`` (it keeps Lightning's hook order).
* Validation/test run forward-only schedules; ``task.run_model`` (predict) gets the last stage's output on every rank;
  generation (``task.decoding()``) keeps one micro-batch per stage in flight, each with the KV cache of every stage's
  layers (:mod:`.decode`); a task's frozen models (``task.frozen_models()``) are split into the same stages and run by
  runners of their own (``runner.frozen(name)``).
* Gradient clipping by norm uses the global norm over all stages; checkpoints are the engine's layout-free format.

Per step the strategy logs each rank's busy time and idle fraction (``pp/idle_frac_rank{r}``) and keeps them in
``step_stats``; with ``measure_activations`` it also counts peak live saved-activation bytes (:mod:`.stats`).
"""

from lightning_llm.strategies.pipeline.runner import PipelineRunner
from lightning_llm.strategies.pipeline.runtime import SCHEDULES, ScheduleName
from lightning_llm.strategies.pipeline.split import StageSpec, split_layers, stage_module
from lightning_llm.strategies.pipeline.stats import ActivationMeter, BusyTimer

__all__ = ["ActivationMeter", "BusyTimer", "PipelineRunner", "SCHEDULES", "ScheduleName", "StageSpec", "split_layers",
           "stage_module"]
