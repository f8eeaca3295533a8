"""CPU benchmark of tensor parallelism: training step time and per-rank parameter bytes, tp=1 vs tp=2.

One training step = forward + vocab-parallel cross-entropy + backward + AdamW step on a named decoder size, with the
plan of :func:`lightning_llm.strategies.tensor.plans.tp_plan` (the one ``TensorParallelStrategy`` applies) and the same
gradient finalisation. tp=1 runs in one process; tp=2 in two gloo processes (launched with torchrun by this script).
Reports the median step time over ``--steps`` after ``--warmup`` steps (max over ranks), and parameter bytes held by
rank 0. Prints a markdown table and writes it to ``--out`` when given.

    python benchmarks/parallel/tp.py --sizes debug small --batch 8 --seq 128 --steps 10 --out benchmarks/results/tp-cpu.md

On CPU the point is correctness of the accounting (bytes halve, communication is per block), not speed: gloo
all-reduces over loopback and 1-2 cores per rank make tp=2 slower than tp=1 here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["debug", "small"], help="named decoder sizes")
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2], help="tensor-parallel degrees")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: JSON result file of one run
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_one(args: argparse.Namespace) -> dict:
    """One (size, tp) measurement in this process (or this torchrun group)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from lightning_llm.models import build_model

    torch.set_num_threads(args.threads)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = build_model(args.size, family="decoder", dropout=0.0)
    vocab = model.config.vocab_size
    loss_ctx = None
    if tp > 1:
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        from lightning_llm.strategies.tensor.plans import tp_plan, validate_tp

        validate_tp(model.config, tp)
        mesh = init_device_mesh("cpu", (tp,))
        parallelize_module(model, mesh, tp_plan(model, sequence_parallel=args.sequence_parallel, loss_parallel=True))
        loss_ctx = loss_parallel
    rank = dist.get_rank() if tp > 1 else 0
    param_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                      for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    def step() -> None:
        import contextlib

        with (loss_ctx() if loss_ctx else contextlib.nullcontext()):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        for p in model.parameters():  # as TensorParallelStrategy.finalize_gradients
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup + args.steps):
        if tp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        if tp > 1:
            dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    res = {"size": args.size, "tp": tp, "median_step_s": statistics.median(times), "param_bytes_rank0": param_bytes,
           "tokens_per_step": args.batch * args.seq}
    if tp > 1:
        all_res: list = [None] * tp
        dist.all_gather_object(all_res, res)
        res["median_step_s"] = max(r["median_step_s"] for r in all_res)
        dist.destroy_process_group()
    if rank == 0 and args.worker:
        Path(args.worker).write_text(json.dumps(res))
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_one(args)
        return 0
    import tempfile

    from lightning_llm.testing import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for tp in args.tp:
                out = Path(tmp) / f"{size}-{tp}.json"
                common = [os.path.abspath(__file__), "--worker", str(out), "--size", size, "--batch", str(args.batch),
                          "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
                          "--threads", str(args.threads)] + (["--sequence-parallel"] if args.sequence_parallel else [])
                cmd = [sys.executable, *common] if tp == 1 else [
                    sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", "--master_addr=127.0.0.1",
                    f"--master_port={free_port()}", *common]
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
                subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
                rows.append(json.loads(out.read_text()))
                print(rows[-1], file=sys.stderr)
    base = {r["size"]: r for r in rows if r["tp"] == 1}
    cmd_line = "python benchmarks/parallel/tp.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "# Tensor parallel on CPU (gloo): step time and per-rank parameter bytes",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}, "
        f"torch {__import__('torch').__version__}, {args.threads} thread(s) per process",
        f"- command: `{cmd_line}`",
        f"- step: forward + vocab-parallel CE + backward + AdamW, batch {args.batch} x seq {args.seq}, fp32, "
        f"sequence_parallel={args.sequence_parallel}; median of {args.steps} steps after {args.warmup} warmup "
        "(slowest rank)",
        "",
        "| size | tp | step time (ms) | tokens/s | param bytes / rank | vs tp=1 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base.get(r["size"])
        ratio = f"{r['param_bytes_rank0'] / b['param_bytes_rank0']:.2f}x bytes, " \
                f"{r['median_step_s'] / b['median_step_s']:.2f}x time" if b else "-"
        lines.append(f"| {r['size']} | {r['tp']} | {r['median_step_s'] * 1e3:.1f} | "
                     f"{r['tokens_per_step'] / r['median_step_s']:.0f} | {r['param_bytes_rank0']:,} | {ratio} |")
    lines += [
        "",
        "Notes: param bytes/rank halve with tp=2 except for replicated vectors (norm weights); the embedding and LM "
        "head are vocab-sharded. On this CPU box tp=2 is slower than tp=1: each rank does half the FLOPs, but the "
        "per-block all-reduces go through gloo over loopback and DTensor dispatch adds per-op CPU overhead, which "
        "dominates at these sizes (the smaller the model, the worse). The 2 cores may be shared with other jobs, so "
        "timings are noisy. Speedups need a GPU interconnect; this table checks the memory accounting.",
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
