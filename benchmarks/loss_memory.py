"""Peak memory and time of the causal-LM loss + backward: full logits (eager) against the fused LM-head loss.

Run (CPU; at the defaults about 15 minutes on 2 cores and 16 GB of RAM for the eager path)::

    python benchmarks/loss_memory.py --out benchmarks/results/loss-memory-cpu.md

Each path runs in a fresh process on the same inputs (hidden ``[N, H]`` fp32 requiring grad, an LM head ``[V, H]``,
labels with 10% ignored): the eager path is what ``--model.fused_loss=false`` runs, ``F.cross_entropy`` on
``head(hidden).float()``; the fused path is the model's ``labels=`` path,
:func:`lightning_llm.kernels.loss.head_loss.head_cross_entropy`. Measured: the peak resident set of loss + backward above
the inputs (``/proc/self/status`` VmHWM after resetting it through ``/proc/self/clear_refs``), the wall time of
loss + backward (best of ``--repeats``), and, in the eager process after its peak is taken, the loss and gradient
(``dhidden``, ``dW``) errors against the fused process's (saved to a temporary file). ``lightning_llm estimate``'s
loss term (:func:`lightning_llm.memory.loss_peak_bytes`) is compared with each measured peak.

``--precision bf16`` runs the hidden states and the head in bf16 (``bf16-true`` training); ``bf16-mixed`` keeps an
fp32 head and hidden states and runs the loss under bf16 autocast (Lightning's ``bf16-mixed``)::

    python benchmarks/loss_memory.py --precision bf16 --tokens 2048 --vocab 32000 --hidden 1024

``--objective rl`` measures what a PPO/GRPO update asks of the head instead: token log-probs of ``logits / T``
weighted per token, and the entropies (no gradient) that they log; eager = the logits path, fused =
:func:`lightning_llm.kernels.loss.head_loss.head_token_scores`::

    python benchmarks/loss_memory.py --objective rl --tokens 4096 --out benchmarks/results/rl-logprob-memory-cpu.md

``--objective distill`` measures a whole training step of distillation against an SFT step of the same student
(a 2-layer decoder of hidden ``--hidden``; the teacher: 2 layers, twice as wide; ``--tokens`` in rows of 512): the
``sft`` process runs the student's forward with the fused cross-entropy and its backward, ``fused`` the teacher's
forward to its last hidden states (no gradient) and the student's forward with the chunked divergence
(:class:`lightning_llm.tasks.distill.DistillLoss`, reverse KL) and its backward, ``eager`` the same on whole logits
(``--model.fused_loss=false``). Peak = VmHWM above the resident set before the step (both models' weights, their
gradients' buffers and the inputs are there already), so the ratio is that of the steps' own memory::

    python benchmarks/loss_memory.py --objective distill --tokens 1024 --vocab 151936 --hidden 128 \
        --out benchmarks/results/distill-memory-cpu.md
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _inputs(n: int, v: int, h: int, precision: str) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hidden = (torch.randn(n, h, generator=g)).to(dtype).requires_grad_(True)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=g)
    head.to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, head, labels


TEMPERATURE = 0.7  # --objective rl: PPO/GRPO's log-probs are those of logits / the sampling temperature


def _loss(path: str, objective: str, hidden: Any, head: Any, labels: Any, precision: str = "fp32") -> tuple[Any, Any]:
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        return _objective(path, objective, hidden, head, labels)


def _objective(path: str, objective: str, hidden: Any, head: Any, labels: Any) -> tuple[Any, Any]:
    """(loss, entropy sum or None). ``causal``: the mean token cross-entropy. ``rl``: what a PPO/GRPO update asks of
    the head, token log-probs at a temperature weighted per token (advantage-like weights) and the entropy
    (no gradient), as ``--model.fused_loss=false`` (logits) or the model's token scores (fused) compute them."""
    import torch
    import torch.nn.functional as F

    from lightning_llm.kernels.loss.head_loss import head_cross_entropy, head_token_scores
    from lightning_llm.rl.losses.core import entropy_from_logits, logprobs_from_logits

    if objective == "causal":
        if path == "eager":
            return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100), None
        return head_cross_entropy(hidden, head, labels), None
    mask = labels != -100
    weights = torch.linspace(-1.0, 1.0, labels.shape[0]) * mask / mask.sum()
    if path == "eager":
        rl = head(hidden).float() / TEMPERATURE
        logp = logprobs_from_logits(rl, labels.clamp(min=0))
        with torch.no_grad():
            entropy = (entropy_from_logits(rl) * mask).sum()
        return -(logp * weights).sum(), entropy
    scores = head_token_scores(hidden, head, labels, temperature=TEMPERATURE)
    return (scores.loss * weights).sum(), scores.entropy.sum()


DISTILL_ROW = 512  # --objective distill: tokens per row


def _distill_models(n: int, v: int, h: int) -> tuple[Any, Any, Any, Any]:
    """(student, teacher, input ids [n / 512, 512], labels: the second half of each row) for --objective distill."""
    import torch

    from lightning_llm.models import model_from_config, named_config

    torch.manual_seed(0)
    shape = dict(vocab_size=v, num_layers=2, max_position_embeddings=DISTILL_ROW, dropout=0.0)
    student = model_from_config(named_config("debug", family="decoder", hidden_size=h, intermediate_size=2 * h,
                                             **shape))
    teacher = model_from_config(named_config("debug", family="decoder", hidden_size=2 * h,
                                             intermediate_size=4 * h, **shape)).requires_grad_(False).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (max(1, n // DISTILL_ROW), DISTILL_ROW), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, DISTILL_ROW // 2:-1] = ids[:, DISTILL_ROW // 2 + 1:]
    return student, teacher, ids, labels


def _distill_step(path: str, student: Any, teacher: Any, ids: Any, labels: Any) -> Any:
    """One step's loss (backward is the caller's): the SFT loss, or the divergence from the teacher."""
    import torch

    from lightning_llm.tasks.distill import DistillLoss, final_hidden

    if path == "sft":
        return student(ids, labels=labels)
    with torch.no_grad():
        hidden = teacher(ids, labels=labels, head_loss=final_hidden)
    total = student(ids, labels=labels, head_loss=DistillLoss(hidden, teacher, fused=path == "fused"))
    return total.sum() / (labels != -100).sum()


def distill_worker(path: str, n: int, v: int, h: int, repeats: int, shared: Path) -> dict[str, Any]:
    import torch

    student, teacher, ids, labels = _distill_models(n, v, h)
    for p in student.parameters():
        p.grad = torch.zeros_like(p)  # the parameters' gradients exist in training either way
    times, peak = [], 0
    for _ in range(repeats):
        for p in student.parameters():
            p.grad.zero_()
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        loss = _distill_step(path, student, teacher, ids, labels)
        loss.backward()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _status("VmHWM") - base)
        del loss
    out = {"path": path, "peak_bytes": peak, "seconds": min(times), "all_seconds": times}
    if path == "sft":
        return out
    with torch.no_grad():
        result = {"loss": _distill_step(path, student, teacher, ids, labels).float(),
                  "dW": student.lm_head.weight.grad.float(), "dembed": student.embed_tokens.weight.grad.float()}
    return _compared(path, out, result, shared)


def _compared(path: str, out: dict[str, Any], result: dict[str, Any], shared: Path) -> dict[str, Any]:
    """``out``, the fused process's ``result`` saved to ``shared``; the eager one's max abs errors against it added."""
    import torch

    if path == "fused":
        torch.save(result, shared)
    else:
        ref = torch.load(shared)
        out["errors"] = {k: float((result[k] - ref[k]).abs().max()) for k in result}
    return out


def _distill_table(a: argparse.Namespace, shared: Path) -> str:
    runs = {path: _run(path, a, shared) for path in ("sft", "fused", "eager")}
    gib, sft = 2**30, runs["sft"]
    rows = max(1, a.tokens // DISTILL_ROW)
    lines = [
        f"# Distillation step vs SFT step of the same student: {rows} x {DISTILL_ROW} tokens, vocabulary {a.vocab:,}, "
        f"student hidden {a.hidden} (2 layers), teacher hidden {2 * a.hidden} (2 layers), fp32, CPU",
        "",
        f"`python benchmarks/loss_memory.py --objective distill --tokens {a.tokens} --vocab {a.vocab} --hidden "
        f"{a.hidden}` (best of {a.repeats}; peak = VmHWM above the resident set before the step: weights, gradient "
        "buffers and inputs excluded)",
        "",
        "| step | peak (GiB) | vs SFT step | time (s) | vs SFT step |",
        "|---|---|---|---|---|",
    ]
    names = {"sft": "SFT (fused cross-entropy)", "fused": "distillation, chunked divergence",
             "eager": "distillation, whole logits (fused_loss=false)"}
    for path, r in runs.items():
        lines.append(f"| {names[path]} | {r['peak_bytes'] / gib:.3f} | {r['peak_bytes'] / sft['peak_bytes']:.2f} | "
                     f"{r['seconds']:.2f} | {r['seconds'] / sft['seconds']:.2f} |")
    errs = runs["eager"]["errors"]
    lines += ["", "Chunked vs whole logits, max abs error: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) +
              ".", ""]
    return "\n".join(lines)


def worker(path: str, objective: str, n: int, v: int, h: int, repeats: int, shared: Path, precision: str
           ) -> dict[str, Any]:
    import torch

    if objective == "distill":
        return distill_worker(path, n, v, h, repeats, shared)
    hidden, head, labels = _inputs(n, v, h, precision)
    head.weight.grad = torch.zeros_like(head.weight)  # the parameter's gradient exists in training either way
    hidden.grad = torch.zeros_like(hidden)
    times, peak = [], 0
    for _ in range(repeats):
        head.weight.grad.zero_()
        hidden.grad.zero_()
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        loss, _ = _loss(path, objective, hidden, head, labels, precision)
        loss.backward()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _status("VmHWM") - base)
        del loss
    out = {"path": path, "peak_bytes": peak, "seconds": min(times), "all_seconds": times}
    with torch.no_grad():
        loss, entropy = _loss(path, objective, hidden, head, labels, precision)
        result = {"dh": hidden.grad.float(), "dw": head.weight.grad.float(), "loss": loss.float()}
        if entropy is not None:
            result["entropy"] = entropy
    return _compared(path, out, result, shared)


def _run(path: str, args: argparse.Namespace, shared: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", path, "--objective", args.objective, "--precision", args.precision,
           "--tokens", str(args.tokens),
           "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--repeats", str(args.repeats), "--shared", str(shared)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128_000)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--objective", choices=["causal", "rl", "distill"], default="causal",
                   help="causal: the mean token cross-entropy; rl: PPO/GRPO token log-probs at a temperature and "
                        "their entropies; distill: a distillation step against an SFT step of the same student")
    p.add_argument("--precision", choices=["fp32", "bf16", "bf16-mixed"], default="fp32",
                   help="bf16: hidden states and head in bf16; bf16-mixed: fp32 ones under bf16 autocast")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", choices=["eager", "fused", "sft"], default=None)
    p.add_argument("--shared", type=Path, default=None)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.objective, a.tokens, a.vocab, a.hidden, a.repeats, a.shared,
                                a.precision)))
        return
    from lightning_llm.memory import loss_peak_bytes

    if a.objective == "distill":
        with tempfile.TemporaryDirectory() as tmp:
            text = _distill_table(a, Path(tmp) / "fused.pt")
        print(text)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text)
        return
    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(tmp) / "fused.pt"
        fused = _run("fused", a, shared)
        eager = _run("eager", a, shared)
    est = {k: loss_peak_bytes(tokens=a.tokens, vocab=a.vocab, hidden=a.hidden, precision="32-true", fused=k == "fused")
           for k in ("eager", "fused")}
    gib = 2**30
    what = "Causal-LM loss" if a.objective == "causal" else f"PPO/GRPO token log-probs (T={TEMPERATURE}) + entropy"
    lines = [
        f"# {what} + backward: {a.tokens} tokens, vocabulary {a.vocab:,}, hidden {a.hidden}, {a.precision}, CPU",
        "",
        f"`python benchmarks/loss_memory.py --objective {a.objective} --precision {a.precision} --tokens {a.tokens} "
        f"--vocab {a.vocab} --hidden {a.hidden}` "
        f"(best of {a.repeats}; peak = VmHWM above the inputs)",
        "",
        "| path | peak (GiB) | vs eager | time (s) | vs eager | estimate (GiB) | estimate err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (eager, fused):
        e = est[r["path"]]
        # The estimator models the causal loss; the RL objective's extra log-softmax/entropy buffers are not in it.
        modelled = a.objective == "causal" and a.precision == "fp32"
        estimate = f"{e / gib:.3f} | {e / r['peak_bytes'] - 1:+.1%}" if modelled else "- | -"
        lines.append(f"| {r['path']} | {r['peak_bytes'] / gib:.3f} | {r['peak_bytes'] / eager['peak_bytes']:.3f} | "
                     f"{r['seconds']:.2f} | {r['seconds'] / eager['seconds']:.3f} | {estimate} |")
    errs = eager["errors"]
    lines += ["", "Fused vs eager, max abs error: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + ".", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
