"""Peak memory and time of the causal-LM loss + backward: full logits (eager) against the fused LM-head loss.

Run (CPU; at the defaults about 15 minutes on 2 cores and 16 GB of RAM for the eager path)::

    python benchmarks/loss_memory.py --out benchmarks/results/loss-memory-cpu.md

Each path runs in a fresh process on the same inputs (hidden ``[N, H]`` fp32 requiring grad, an LM head ``[V, H]``,
labels with 10% ignored): the eager path is what ``--model.fused_loss=false`` runs, ``F.cross_entropy`` on
``head(hidden).float()``; the fused path is the model's ``labels=`` path,
:func:`lightning_llm.kernels.head_loss.head_cross_entropy`. Measured: the peak resident set of loss + backward above
the inputs (``/proc/self/status`` VmHWM after resetting it through ``/proc/self/clear_refs``), the wall time of
loss + backward (best of ``--repeats``), and, in the eager process after its peak is taken, the loss and gradient
(``dhidden``, ``dW``) errors against the fused process's (saved to a temporary file). ``lightning_llm estimate``'s
loss term (:func:`lightning_llm.estimate.loss_peak_bytes`) is compared with each measured peak.
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


def _inputs(n: int, v: int, h: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g)).requires_grad_(True)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.1] = -100
    return hidden, head, labels


def _loss(path: str, hidden: Any, head: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    from lightning_llm.kernels.head_loss import head_cross_entropy

    if path == "eager":
        return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100)
    return head_cross_entropy(hidden, head, labels)


def worker(path: str, n: int, v: int, h: int, repeats: int, shared: Path) -> dict[str, Any]:
    import torch

    hidden, head, labels = _inputs(n, v, h)
    head.weight.grad = torch.zeros_like(head.weight)  # the parameter's gradient exists in training either way
    hidden.grad = torch.zeros_like(hidden)
    times, peak = [], 0
    for _ in range(repeats):
        head.weight.grad.zero_()
        hidden.grad.zero_()
        _reset_peak()
        base = _status("VmRSS")
        t0 = time.perf_counter()
        loss = _loss(path, hidden, head, labels)
        loss.backward()
        times.append(time.perf_counter() - t0)
        peak = max(peak, _status("VmHWM") - base)
        del loss
    out = {"path": path, "peak_bytes": peak, "seconds": min(times), "all_seconds": times}
    with torch.no_grad():
        result = {"dh": hidden.grad.clone(), "dw": head.weight.grad.clone(), "loss": _loss(path, hidden, head, labels)}
    if path == "fused":
        torch.save(result, shared)
    else:
        ref = torch.load(shared)
        out["errors"] = {k: float((result[k] - ref[k]).abs().max()) for k in result}
    return out


def _run(path: str, args: argparse.Namespace, shared: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", path, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
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
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", choices=["eager", "fused"], default=None)
    p.add_argument("--shared", type=Path, default=None)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.tokens, a.vocab, a.hidden, a.repeats, a.shared)))
        return
    from lightning_llm.estimate import loss_peak_bytes

    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(tmp) / "fused.pt"
        fused = _run("fused", a, shared)
        eager = _run("eager", a, shared)
    est = {k: loss_peak_bytes(tokens=a.tokens, vocab=a.vocab, hidden=a.hidden, precision="32-true", fused=k == "fused")
           for k in ("eager", "fused")}
    gib = 2**30
    lines = [
        f"# Causal-LM loss + backward: {a.tokens} tokens, vocabulary {a.vocab:,}, hidden {a.hidden}, fp32, CPU",
        "",
        f"`python benchmarks/loss_memory.py --tokens {a.tokens} --vocab {a.vocab} --hidden {a.hidden}` "
        f"(best of {a.repeats}; peak = VmHWM above the inputs)",
        "",
        "| path | peak (GiB) | vs eager | time (s) | vs eager | estimate (GiB) | estimate err |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in (eager, fused):
        e = est[r["path"]]
        lines.append(f"| {r['path']} | {r['peak_bytes'] / gib:.3f} | {r['peak_bytes'] / eager['peak_bytes']:.3f} | "
                     f"{r['seconds']:.2f} | {r['seconds'] / eager['seconds']:.3f} | {e / gib:.3f} | "
                     f"{e / r['peak_bytes'] - 1:+.1%} |")
    errs = eager["errors"]
    lines += ["", f"Fused vs eager, max abs error: loss {errs['loss']:.2e}, dhidden {errs['dh']:.2e}, "
                  f"dW {errs['dw']:.2e}.", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
