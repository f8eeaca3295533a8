"""Mixture-of-Experts speed on CPU: grouped expert GEMMs vs the loop, our training step vs transformers', ep x2.

    python benchmarks/moe.py --out benchmarks/results/moe-cpu.md            # the three parts (~15 min on 2 cores)
    python benchmarks/moe.py --parts layer --rounds 7 --tokens 2048          # one part

1. ``layer``: one Qwen3-MoE-shaped feed-forward scaled down to the CPU (``--experts`` 64, ``--top-k`` 8, ``--hidden``
   512, ``--expert-width`` 256, ``--tokens`` tokens), forward + backward (a ones gradient), fp32, on the same weights:
   our ``MoEBlock`` with ``experts_impl`` grouped (``torch._grouped_mm``) and loop, transformers'
   ``Qwen3MoeSparseMoeBlock`` with its ``eager`` experts (a loop over the experts hit) and its ``grouped_mm`` ones
   (``transformers.integrations.moe``). Outputs and gradients are compared with ours; bytes saved for
   backward are counted (saved-tensor hooks); one forward + backward of each of ours is profiled by op
   (``torch.profiler``).
2. ``step``: a tiny Qwen3-MoE written by transformers (``Qwen3MoeForCausalLM.save_pretrained``), loaded by
   ``load_hf`` into our ``DecoderLM``; one training step = forward with the fused loss and the load-balancing loss
   (its gradient injected at the routers) + backward + AdamW, vs transformers' model (``output_router_logits=True``,
   experts ``eager`` and ``grouped_mm``) on the same batch, same AdamW. The first step's losses are compared.
3. ``ep``: ``lightning_llm fit`` of the same checkpoint on generated text, one device (a process with one thread:
   one core) vs ``--trainer.strategy=ep`` on 2 gloo processes (one thread each), same global batch: median step time
   and tokens/s.

Every part times its alternatives interleaved (A, B, C, A, B, C, ...; the ``ep`` part alternates whole runs) because
the machine is shared: medians with min-max, and the load average, are in the results file.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PARTS = ("layer", "step", "ep")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", type=Path, help="results markdown (default: print only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the in-process parts (layer, step): 1, "
                   "as on a shared machine more threads than free cores make OpenMP barriers wait for descheduled "
                   "threads (seen here once: 4.9 s with 2 threads for a small layer that takes 8-13 ms with 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each alternative once per round)")
    g = p.add_argument_group("layer")
    g.add_argument("--experts", type=int, default=64)
    g.add_argument("--top-k", type=int, default=8)
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--expert-width", type=int, default=256)
    g.add_argument("--tokens", type=int, default=2048)
    g = p.add_argument_group("step / ep: the tiny Qwen3-MoE")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--model-hidden", type=int, default=256)
    g.add_argument("--model-experts", type=int, default=16)
    g.add_argument("--model-top-k", type=int, default=4)
    g.add_argument("--model-expert-width", type=int, default=128)
    g.add_argument("--batch", type=int, default=4, help="rows per step (ep: the global batch)")
    g.add_argument("--seq", type=int, default=256)
    g.add_argument("--ep-steps", type=int, default=10, help="steps per ep run (2 warm-up intervals left out)")
    g.add_argument("--ep-rounds", type=int, default=3, help="runs of each ep layout, alternating")
    g.add_argument("--work", type=Path, help="scratch directory (default: a temp dir)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ measuring


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each ``fns`` call over ``rounds`` rounds, the alternatives in turn (one untimed warm-up each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def spread(ts: list[float], scale: float = 1e3, fmt: str = ".0f") -> str:
    """``median (min-max)`` of ``ts`` times ``scale``."""
    return f"{statistics.median(ts) * scale:{fmt}} ({min(ts) * scale:{fmt}}-{max(ts) * scale:{fmt}})"


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def hf_config(a: argparse.Namespace, *, layer: bool) -> Any:
    """transformers' ``Qwen3MoeConfig`` of the ``layer`` part's block or of the ``step``/``ep`` model."""
    from transformers import Qwen3MoeConfig

    if layer:
        h, e, k, i, layers = a.hidden, a.experts, a.top_k, a.expert_width, 1
    else:
        h, e, k, i, layers = a.model_hidden, a.model_experts, a.model_top_k, a.model_expert_width, a.layers
    return Qwen3MoeConfig(vocab_size=512, hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=i,
                          num_hidden_layers=layers, num_attention_heads=max(1, h // 32),
                          num_key_value_heads=max(1, h // 64), head_dim=32, num_experts=e, num_experts_per_tok=k,
                          norm_topk_prob=True,
                          router_aux_loss_coef=0.01, output_router_logits=True, max_position_embeddings=4096,
                          pad_token_id=0, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------------ 1. layer


def _layer_blocks(a: argparse.Namespace) -> dict[str, torch.nn.Module]:
    """The alternatives on the same weights: ``x [1, N, H] -> y``."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from lightning_llm.models import config_from_hf
    from lightning_llm.models.layers.moe import MoEBlock

    cfg = hf_config(a, layer=True)
    ours = config_from_hf(cfg.to_dict())
    blocks: dict[str, Any] = {}
    for impl in ("grouped", "loop"):
        blocks[f"ours {impl}"] = MoEBlock(ours.replace(moe={**vars(ours.moe), "experts_impl": impl}), 0).train()
    g = torch.Generator().manual_seed(0)
    for p in blocks["ours grouped"].parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.02
    blocks["ours loop"].load_state_dict(blocks["ours grouped"].state_dict())
    fns: dict[str, torch.nn.Module] = dict(blocks)
    for impl in ("eager", "grouped_mm"):
        c = copy.deepcopy(cfg)
        c._experts_implementation = impl
        hf = Qwen3MoeSparseMoeBlock(c).train()
        hf.load_state_dict(blocks["ours grouped"].state_dict())  # the same names: gate.weight, experts.*
        fns[f"transformers {impl}"] = hf
    return fns


def _fwd_bwd(fn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Output, input gradient and the experts' ``gate_up_proj`` gradient of one forward + backward."""
    xx = x.detach().requires_grad_()
    y = fn(xx)
    y.backward(torch.ones_like(y))
    grads = {n: p.grad for n, p in fn.named_parameters()}
    for p in fn.parameters():
        p.grad = None
    (gate_up,) = (g for n, g in grads.items() if n.endswith("experts.gate_up_proj"))
    return y.detach(), xx.grad, gate_up


def _saved_per_token(fn: torch.nn.Module, x: torch.Tensor, amp: bool) -> float:
    """Bytes autograd saves per token in one forward (under bf16 autocast with ``amp``): the slope between the first
    half of ``x``'s tokens and all of them, so what is saved once per layer (cast copies of the weights) drops out."""
    from lightning_llm.testing import saved_tensor_bytes

    def saved(t: torch.Tensor) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return saved_tensor_bytes(lambda: fn(t.detach().requires_grad_()), [t, *fn.parameters()])

    half = x[:, : x.shape[1] // 2].contiguous()
    return (saved(x) - saved(half)) / (x.shape[1] - half.shape[1])


def _profile(fn: torch.nn.Module, x: torch.Tensor) -> list[list[str]]:
    """Share of CPU time by op group in one forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    groups = {"GEMMs (mm, grouped_mm)": ("aten::mm", "aten::_grouped_mm", "aten::bmm", "aten::addmm"),
              "sort, bincount, cumsum": ("aten::sort", "aten::argsort", "aten::bincount", "aten::cumsum",
                                         "aten::histc"),
              "gathers and scatters (index_select, index_add, scatter)": (
                  "aten::index_select", "aten::index_add_", "aten::scatter_add_", "aten::index", "aten::index_put_",
                  "aten::index_copy", "aten::gather", "aten::scatter_", "aten::scatter"),
              "zero-filled gradient buffers (fill_, zeros)": ("aten::fill_", "aten::zero_"),
              "copies (cat, copy_, contiguous)": ("aten::cat", "aten::copy_", "aten::clone")}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _fwd_bwd(fn, x)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows, counted = [], 0.0
    for label, names in groups.items():
        t = sum(e.self_cpu_time_total for e in events if e.key in names)
        counted += t
        rows.append([label, f"{t / 1e3:.0f}", f"{100 * t / total:.1f}%"])
    rows.append(["everything else (elementwise, softmax, top-k, autograd)", f"{(total - counted) / 1e3:.0f}",
                 f"{100 * (total - counted) / total:.1f}%"])
    return rows


def part_layer(a: argparse.Namespace) -> str:
    from kernel_bench import md_table

    fns = _layer_blocks(a)
    x = torch.randn(1, a.tokens, a.hidden, generator=torch.Generator().manual_seed(1))
    ref = _fwd_bwd(fns["ours grouped"], x)
    checks = {name: [float((a - b).abs().max()) for a, b in zip(_fwd_bwd(fn, x), ref)] for name, fn in fns.items()}
    mem = {name: [_saved_per_token(fn, x, amp) for amp in (False, True)] for name, fn in fns.items()}
    load0 = load_average()
    times = interleaved({n: lambda fn=fn: _fwd_bwd(fn, x) for n, fn in fns.items()}, a.rounds)
    loop = statistics.median(times["ours loop"])
    rows = [[n, spread(ts), f"{loop / statistics.median(ts):.2f}x", *(f"{e:.1e}" for e in checks[n]),
             *(f"{b:,.0f}" for b in mem[n])] for n, ts in times.items()]
    prof = _profile(fns["ours grouped"], x)
    prof_loop = _profile(fns["ours loop"], x)
    m = a.tokens * a.top_k
    flops = 3 * 2 * m * 3 * a.expert_width * a.hidden  # forward + backward of the three projections
    return "\n".join([
        f"## 1. One MoE layer, forward + backward: {a.experts} experts, top-{a.top_k}, hidden {a.hidden}, expert width "
        f"{a.expert_width}, {a.tokens} tokens ({m} assignments), fp32, {a.threads} thread(s)", "",
        f"{a.rounds} interleaved rounds after one warm-up each; load average before {load0}, after {load_average()}. "
        f"Expert GEMMs: {flops / 1e9:.1f} GFLOP per forward + backward. `vs ours loop`: the loop's median time over "
        "this one's. Errors: max abs difference from `ours grouped` (output, input gradient, `gate_up_proj` "
        "gradient). Saved: bytes autograd keeps for backward per token, in fp32 and under bf16 autocast (the AMP of "
        "`--trainer.precision=bf16-mixed`; forward only, not timed): the slope between "
        f"{a.tokens // 2} and {a.tokens} tokens, so what is kept once per layer drops out (under autocast ours keeps a "
        f"bf16 copy of the experts' weights, {2 * 3 * a.experts * a.expert_width * a.hidden / 2**20:.0f} MiB; "
        "transformers' grouped experts compute in fp32 there: `grouped_mm` has no autocast rule).", "",
        md_table(["implementation", "ms median (min-max)", "vs ours loop", "output err", "input grad err",
                  "gate_up grad err", "saved B/token", "saved B/token (bf16 autocast)"], rows), "",
        "Where one forward + backward of `ours grouped` spends its CPU time (torch.profiler, self time):", "",
        md_table(["op group", "ms", "share"], prof), "",
        "and `ours loop`:", "",
        md_table(["op group", "ms", "share"], prof_loop)])


# ------------------------------------------------------------------------------------------------ 2. step


def write_checkpoint(a: argparse.Namespace, out: Path) -> Path:
    """The tiny Qwen3-MoE of ``step``/``ep`` written by transformers (random init, seed 0)."""
    from transformers import Qwen3MoeForCausalLM

    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Qwen3MoeForCausalLM(hf_config(a, layer=False)).save_pretrained(str(out))
    return out


def _train_steps(a: argparse.Namespace, path: Path) -> dict[str, Callable[[], float]]:
    """One training step of each alternative on the same batch (each with its own model and AdamW)."""
    from transformers import Qwen3MoeForCausalLM

    from lightning_llm.models import load_hf

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 512, (a.batch, a.seq), generator=g)
    shifted = torch.cat([ids[:, 1:], torch.full((a.batch, 1), -100)], 1)  # our labels are the next tokens
    steps: dict[str, Callable[[], float]] = {}

    ours, _ = load_hf(path)
    ours.train()
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)

    def ours_step(model: Any = ours, opt: Any = opt) -> float:
        model.routing.begin()
        ce = model(ids, labels=shifted)  # fused loss; the aux loss's gradient joins at the routers
        ce.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(ce) + model.config.moe.aux_loss_coef * float(model.routing.aux_loss())

    steps["ours (grouped, fused loss)"] = ours_step
    for impl in ("eager", "grouped_mm"):
        hf = Qwen3MoeForCausalLM.from_pretrained(str(path), experts_implementation=impl).train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)

        def hf_step(model: Any = hf, opt: Any = hf_opt) -> float:
            loss = model(input_ids=ids, labels=ids).loss  # CE + router_aux_loss_coef x aux (output_router_logits)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)

        steps[f"transformers {impl}"] = hf_step
    return steps


def part_step(a: argparse.Namespace, work: Path) -> str:
    from kernel_bench import md_table

    steps = _train_steps(a, write_checkpoint(a, work / "qwen3-moe"))
    first = {name: fn() for name, fn in steps.items()}  # the first step of each: same weights, same batch
    load0 = load_average()
    times = interleaved(steps, a.rounds)
    ref = statistics.median(times["ours (grouped, fused loss)"])
    tokens = a.batch * a.seq
    rows = [[n, spread(ts), f"{tokens / statistics.median(ts):,.0f}", f"{statistics.median(ts) / ref:.2f}x",
             f"{first[n]:.6f}"] for n, ts in times.items()]
    return "\n".join([
        f"## 2. Training step of a tiny Qwen3-MoE: {a.layers} layers, hidden {a.model_hidden}, {a.model_experts} "
        f"experts top-{a.model_top_k} of width {a.model_expert_width}, vocab 512; batch {a.batch} x {a.seq} tokens, "
        f"fp32, {a.threads} thread(s)", "",
        "Forward + backward + AdamW, the load-balancing loss on (coefficient 0.01) in every alternative; "
        f"{a.rounds} interleaved rounds after two steps each; load average before {load0}, after {load_average()}. "
        "`ours speed-up`: the alternative's median step time over ours. `step-1 loss`: CE + 0.01 x aux on the same "
        "batch and weights.", "",
        md_table(["implementation", "step ms median (min-max)", "tokens/s", "ours speed-up", "step-1 loss"], rows)])


# ------------------------------------------------------------------------------------------------ 3. ep


def _fit_args(a: argparse.Namespace, ckpt: Path, out: Path, *, devices: int, work: Path) -> list[str]:
    meter = json.dumps([{"class_path": "e2e.GpuMeter", "init_args": {"output": str(out)}}])
    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), f"--model.backbone={ckpt}",
            f"--data.block_size={a.seq}", f"--data.batch_size={a.batch // devices}", "--data.generated_docs=600",
            "--data.tokenizer_dir=byte", f"--data.cache_dir={work / 'cache'}", f"--trainer.max_steps={a.ep_steps}",
            "--trainer.limit_val_batches=0", "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={work / 'root'}", f"--trainer.callbacks={meter}"]
    if devices > 1:
        args += ["--trainer.strategy=ep", f"--trainer.devices={devices}"]
    return args


def _ep_run(a: argparse.Namespace, ckpt: Path, work: Path, devices: int, i: int) -> list[float]:
    """Step intervals (after 2 warm-up intervals) of one fit on ``devices`` processes."""
    from lightning_llm.testing import run_cli

    out = work / f"ep{devices}-{i}.json"
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "LIGHTNING_LLM_LOG": "WARNING"}
    run_cli(_fit_args(a, ckpt, out, devices=devices, work=work), nproc=devices, env=env, timeout=1200)
    ends = json.loads(out.read_text())["step_ends"]
    return [b - e for e, b in zip(ends, ends[1:])][2:]


def part_ep(a: argparse.Namespace, work: Path) -> str:
    from kernel_bench import md_table

    ckpt = write_checkpoint(a, work / "qwen3-moe")
    load0 = load_average()
    times: dict[int, list[float]] = {1: [], 2: []}
    for i in range(a.ep_rounds):
        for devices in (1, 2):
            times[devices] += _ep_run(a, ckpt, work, devices, i)
    tokens = a.batch * a.seq
    one = statistics.median(times[1])
    rows = [[label, str(len(times[d])), spread(times[d]), f"{tokens / statistics.median(times[d]):,.0f}",
             f"{one / statistics.median(times[d]):.2f}x"]
            for d, label in ((1, "one device (1 process, 1 thread)"), (2, "ep x2 (2 gloo processes, 1 thread each)"))]
    return "\n".join([
        f"## 3. Expert parallelism x2 vs one device: `lightning_llm fit` of the same checkpoint, global batch "
        f"{a.batch} x {a.seq}", "",
        f"`configs/pretrain_debug.yaml` with `--model.backbone=<the checkpoint>`, generated text, fp32, "
        f"{a.ep_steps} steps per run (2 warm-up intervals left out), {a.ep_rounds} runs of each layout alternating; "
        f"load average before {load0}, after {load_average()}. Step = interval between train-batch ends "
        "(`e2e.GpuMeter`), pooled over the runs.", "",
        md_table(["layout", "steps", "step ms median (min-max)", "tokens/s", "vs one device"], rows)])


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    sys.path[:0] = [str(BENCH), str(REPO)]
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    work = (a.work or Path(tempfile.mkdtemp(prefix="lightning_llm_moe_"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import transformers

    head = [f"# Mixture-of-Experts on CPU ({datetime.date.today()})", "",
            f"- machine: {os.cpu_count()} cores shared with other jobs; Python {platform.python_version()}, torch "
            f"{torch.__version__}, transformers {transformers.__version__}",
            f"- command: `python benchmarks/moe.py {' '.join(argv)}`"]
    sections = []
    for part in a.parts:
        t0 = time.perf_counter()
        text = {"layer": lambda: part_layer(a), "step": lambda: part_step(a, work),
                "ep": lambda: part_ep(a, work)}[part]()
        sections.append(text + f"\n\n({part}: {time.perf_counter() - t0:.0f} s)")
        print(sections[-1], flush=True)
    text = "\n".join(head) + "\n\n" + "\n\n".join(sections) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
