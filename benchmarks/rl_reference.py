"""Time per GRPO rollout with the KL term (``beta=0.04``: a frozen reference copy built and run once per rollout) and
without it (``beta=0``: no reference model at all), on the ``small`` decoder on the CPU.

Run::

    python benchmarks/rl_reference.py --out benchmarks/results/rl-reference-cpu.md     # ~3 min on 2 cores

Each fit: ``small`` (8 layers, hidden 256, the byte tokenizer's vocabulary), one process, 1 thread, generated prompts,
``--prompts`` prompts x G=4 responses of ``--new-tokens`` sampled tokens per rollout, one pass and one mini-batch per
rollout (one optimizer step). Logged per rollout: ``time/rollout_s`` (sampling, scoring, the old log-probs and, at
beta > 0, the reference forward) and ``time/update_s`` (the optimizer step's forward and backward). The two settings
alternate within a round (``--rounds``) so the shared machine's noise falls on both; medians over every round's
rollouts after each fit's first (warm-up). Also counted: reference forwards (calls of ``run_reference``) and the
parameters the task holds (the frozen copy doubles them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import warnings
from datetime import date
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_llm.data import PromptDataModule
from lightning_llm.generation import GenerationConfig
from lightning_llm.peft import count_parameters
from lightning_llm.rl import GRPOConfig, RewardConfig
from lightning_llm.tasks import GRPOTask, OptimConfig
from lightning_llm.testing import MetricRows

BETAS = (0.04, 0.0)


def fit(beta: float, *, rollouts: int, prompts: int, new_tokens: int, out: Path) -> dict[str, Any]:
    """One GRPO fit on ``small``: its rollout and update times per rollout, reference forwards, parameters held."""
    pl.seed_everything(0)
    task = GRPOTask("small", generation=GenerationConfig(max_new_tokens=new_tokens, do_sample=True),
                    grpo=GRPOConfig(num_generations=4, beta=beta),
                    reward=RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward"),
                    optim=OptimConfig(lr=1e-4, scheduler="constant"))
    calls = []
    run_reference = task.run_reference
    task.run_reference = lambda *a, **k: calls.append(1) or run_reference(*a, **k)  # type: ignore[method-assign]
    rows = MetricRows()
    dm = PromptDataModule(generated_prompts=256, batch_size=prompts, max_prompt_len=32, tokenizer_dir="byte")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", devices=1, max_steps=rollouts, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                   callbacks=[rows], default_root_dir=str(out)).fit(task, dm)
    return {"rollout_s": [r["time/rollout_s"] for r in rows.rows[1:]],
            "update_s": [r["time/update_s"] for r in rows.rows[1:]], "reference_forwards": len(calls),
            "parameters": count_parameters(task)[1], "kl_logged": "objective/kl" in rows.rows[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs: dict[float, list[dict[str, Any]]] = {b: [] for b in BETAS}
    for r in range(a.rounds):
        for beta in BETAS:
            runs[beta].append(fit(beta, rollouts=a.rollouts, prompts=a.prompts, new_tokens=a.new_tokens,
                                  out=Path("/tmp") / f"rl_reference_{r}_{beta}"))
            print(f"round {r} beta={beta}: rollout {statistics.median(runs[beta][-1]['rollout_s']):.3f} s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    lines = ["# GRPO rollout time with and without the reference (beta 0.04 vs 0), `small`, CPU", "",
             f"{date.today()}, {platform.machine()} ({platform.processor() or 'cpu'}), commit {commit}, 1 thread; "
             f"`python benchmarks/rl_reference.py --rounds {a.rounds} --rollouts {a.rollouts} --prompts {a.prompts} "
             f"--new-tokens {a.new_tokens}`: {a.prompts} prompts x G=4 x {a.new_tokens} new tokens per rollout, "
             f"medians over {a.rounds} interleaved rounds of {a.rollouts - 1} timed rollouts each (the first is "
             "warm-up). A shared 2-core machine: timings are noisy.", "",
             "| beta | reference | time/rollout_s (median) | time/update_s (median) | reference forwards per fit | "
             "parameters held | objective/kl logged |", "|---|---|---|---|---|---|---|"]
    for beta in BETAS:
        rs = [x for run in runs[beta] for x in run["rollout_s"]]
        us = [x for run in runs[beta] for x in run["update_s"]]
        first = runs[beta][0]
        lines.append(f"| {beta} | {'frozen copy' if beta else 'none'} | {statistics.median(rs):.3f} | "
                     f"{statistics.median(us):.3f} | {first['reference_forwards']} | {first['parameters']:,} | "
                     f"{first['kl_logged']} |")
    with_ref = statistics.median(x for run in runs[BETAS[0]] for x in run["rollout_s"])
    without = statistics.median(x for run in runs[BETAS[1]] for x in run["rollout_s"])
    lines += ["", f"beta=0 rollouts take {without / with_ref:.2f}x the time of beta=0.04 ones "
              f"({with_ref - without:+.3f} s per rollout: the reference forward), and the task holds half the "
              "parameters (no frozen copy)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
