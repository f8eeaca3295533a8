"""Multi-turn rollout speed: tokens per second of 3-turn episodes (an environment's message appended between turns,
the KV cache kept: each turn prefills only what was appended) against 1-turn rollouts of the same length, and against
the same episodes decoded without keeping the cache (each turn ``generate`` on the whole conversation so far), on the
``small`` decoder on the CPU.

Run::

    python benchmarks/rl_multiturn.py --out benchmarks/results/rl-multiturn-cpu.md     # ~2 min on 2 cores

``small`` (8 layers, hidden 256, random weights), the byte tokenizer with the ``chatml`` template, 1 thread, eval mode,
no gradient. ``--batch`` prompts of 32 tokens; each episode: ``--new`` sampled tokens per turn (no stop token: every
turn runs to its length), then a fixed user message rendered by the template (``TurnRenderer.appended``, on the host,
timed) and the next turn, 3 turns. The 1-turn rollout samples as many tokens as an episode holds after its prompt (3 x
``--new`` + 2 x the appended tokens) with ``generate``. Tokens per second: the tokens after the prompt (generated and
appended) of every row over the wall time. The settings alternate within each of ``--rounds`` rounds (medians), so the
shared machine's noise falls on all.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from datetime import date
from pathlib import Path

import torch

from lightning_llm.data import PromptDataModule
from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.generation.turns import TurnDecoder
from lightning_llm.models import build_model
from lightning_llm.rl.multiturn.turns import TurnRenderer

MESSAGE = [{"role": "user", "content": "The tool says 42. Go on, and check it once more."}]


def episodes(model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, renderer: TurnRenderer,
             cfg: GenerationConfig, u: torch.Tensor, *, keep_cache: bool) -> int:
    """3-turn episodes of every row; returns the tokens after the prompts (all rows)."""
    n, b = cfg.max_new_tokens, prompts.shape[0]
    if keep_cache:
        dec = TurnDecoder(model, b, device=prompts.device)
        block, block_mask = prompts, mask
        for turn in range(3):
            dec.turn(block, block_mask, cfg, uniforms=u[:, turn * n:(turn + 1) * n])
            if turn < 2:
                appended = [renderer.appended(MESSAGE, where="bench")[0] for _ in range(b)]
                block, block_mask = torch.tensor(appended), torch.ones(b, len(appended[0]), dtype=torch.long)
        return int(dec.mask.sum() - mask.sum()) + b  # the last token of every row is not fed
    ids, seq_mask = prompts, mask
    for turn in range(3):
        out = generate(model, ids, seq_mask, config=cfg, uniforms=u[:, turn * n:(turn + 1) * n])
        ids, seq_mask = torch.cat([ids, out], 1), torch.cat([seq_mask, torch.ones_like(out)], 1)
        if turn < 2:
            appended = torch.tensor([renderer.appended(MESSAGE, where="bench")[0] for _ in range(b)])
            ids, seq_mask = torch.cat([ids, appended], 1), torch.cat([seq_mask, torch.ones_like(appended)], 1)
    return int(seq_mask.sum() - mask.sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--size", default="small")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dm = PromptDataModule(generated_prompts=a.batch, template="chatml", max_prompt_len=32)
    dm.setup("fit")
    renderer = TurnRenderer(dm.chat, None)
    appended = len(renderer.appended(MESSAGE, where="bench")[0])
    model = build_model(a.size, family="decoder", vocab_size=dm.vocab_size).eval()
    rows = [dm.datasets["fit"][i] for i in range(a.batch)]
    prompts, mask = dm.collate(rows)["input_ids"], dm.collate(rows)["attention_mask"]
    cfg = GenerationConfig(max_new_tokens=a.new, do_sample=True, pad_token_id=dm.pad_token_id)
    length = 3 * a.new + 2 * appended
    one = GenerationConfig(max_new_tokens=length, do_sample=True, pad_token_id=dm.pad_token_id)
    u = torch.rand(a.batch, length, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    times: dict[str, list[float]] = {"1-turn rollout (generate)": [], "3-turn episodes, cache kept": [],
                                     "3-turn episodes, whole conversation re-prefilled each turn": []}
    tokens: dict[str, int] = {}
    with torch.no_grad():
        for r in range(a.rounds + 1):  # the first round warms up
            for name in times:
                start = time.perf_counter()
                if name.startswith("1-turn"):
                    tokens[name] = generate(model, prompts, mask, config=one, uniforms=u).numel()
                else:
                    tokens[name] = episodes(model, prompts, mask, renderer, cfg, u, keep_cache="kept" in name)
                if r:
                    times[name].append(time.perf_counter() - start)
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    rate = {k: tokens[k] / statistics.median(v) for k, v in times.items()}
    base = rate["1-turn rollout (generate)"]
    lines = [f"# Multi-turn rollout speed: 3-turn episodes vs 1-turn rollouts of the same length, `{a.size}`, CPU", "",
             f"{date.today()}, {platform.machine()} ({platform.processor() or 'cpu'}), commit {commit}, 1 thread; "
             f"`python benchmarks/rl_multiturn.py --rounds {a.rounds} --batch {a.batch} --new {a.new}`: {a.batch} "
             f"rows, prompts of {prompts.shape[1]} columns, episodes of 3 turns x {a.new} sampled tokens with "
             f"{appended} appended tokens (a user message and the next generation prompt, rendered by the template) "
             f"between turns = {length} tokens after the prompt, the 1-turn rollout {length} sampled tokens; medians "
             f"of {a.rounds} interleaved rounds after a warm-up round. A shared 2-core machine: timings are noisy.", "",
             "| rollout | tokens after the prompts | time (median, s) | tokens/s | vs 1-turn | sampled tokens/s |",
             "|---|---|---|---|---|---|"]
    for name, v in times.items():
        sampled = tokens[name] if name.startswith("1-turn") else 3 * a.new * a.batch
        lines.append(f"| {name} | {tokens[name]} | {statistics.median(v):.3f} | {rate[name]:.0f} | "
                     f"{rate[name] / base:.2f}x | {sampled / statistics.median(v):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
