"""A GRPO or PPO rollout reads device values back a bounded number of times, whatever the batch: per-row reads (a
boolean-mask index and ``.tolist()`` per prompt and per response, ``int()`` of a row's index, a collective and a
``float()`` per advantage statistic) are what a GPU rollout waits on, B x G times.

A tiny fit of 8 prompts (GRPO: 4 generations each, DAPO's dynamic sampling; PPO) in this process;
:class:`~lightning_llm.testing.HostReadCounter` counts the reads of the project's own code in rollouts 2 and 3.
Measured at 65 (GRPO) and 47 (PPO) a rollout, most of them ``self.log`` of the rollout's ~20 statistics; before the
per-row reads were removed, 281 and 93."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_llm.data import PromptDataModule
from lightning_llm.testing import HostReadCounter
from lightning_llm.testing.rl import build_task, write_rl_prompts

BUDGET = {"grpo": 80, "ppo": 60}
"""Reads of lightning_llm's code per rollout batch: the measured figures above plus some slack, well below the
per-row reads' (which grow with the batch)."""


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_a_rollout_reads_a_bounded_number_of_times(kind: str, tmp_path: Path) -> None:
    pl.seed_everything(0)
    spec = {"generation": {"max_new_tokens": 8, "do_sample": kind == "grpo"},
            "rewards": [{"fn": "lightning_llm.testing.rl:PairedDigits"}]}
    if kind == "grpo":
        spec["grpo"] = {"num_generations": 4, "beta": 0.04, "dynamic_sampling": True, "max_sampling_rounds": 2}
    task = build_task(kind, spec)
    dm = PromptDataModule(str(write_rl_prompts(tmp_path / "p.jsonl")), max_prompt_len=32, batch_size=8)
    counter = HostReadCounter(steps=(2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", max_steps=4 * task.update_schedule.updates_per_rollout, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[counter], limit_val_batches=0, num_sanity_val_steps=0,
                   default_root_dir=str(tmp_path)).fit(task, dm)
    reads = counter.per_batch()
    print(f"{kind}: lightning_llm's host reads per rollout batch {reads}")
    assert len(reads) == 2 and all(0 < n <= BUDGET[kind] for n in reads.values()), reads
