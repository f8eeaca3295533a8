"""Host memory of a QLoRA run against plain LoRA: the frozen base's bytes and the peak resident memory of set-up and
of a training step, measured on CPU in fresh processes.

Run (a few minutes on 2 cores)::

    python benchmarks/qlora_memory.py --out benchmarks/results/qlora-memory-cpu.md

For each backbone (``small``; ``llama-1b`` cut to 4 blocks, where the weights dominate the process) and each variant
(plain LoRA on the fp32 base; ``--model.quantize=nf4``; ``--model.quantize=int8``) one process builds a
``CausalLMTask`` with LoRA r=8 on all seven projections and trains 3 steps of 2 x 128 tokens (fp32, byte
tokenizer: the vocabulary is 264 rows, so the block linears are nearly all of the weights). glibc's malloc runs with
a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072``) so that freed large buffers (the per-matmul dequantized
weights) leave the resident set and VmHWM follows the live bytes rather than the heap's high-water mark. It reports

* ``base``: bytes of the frozen block-linear weights as held (``models.quantize.quantized_bytes``; fp32 for plain
  LoRA) and against the same weights in bf16;
* ``setup``/``step``: VmHWM (peak resident set, ``/proc/self/status``) at ``on_train_start`` and after the last step,
  minus VmHWM before the task was built (imports, data).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = {"LoRA (fp32 base)": None, "QLoRA nf4": "nf4", "QLoRA int8": "int8"}
BACKBONES = {"small": {}, "llama-1b, 4 blocks": {"num_layers": 4}}


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def worker(backbone: str, quantize: str | None, work: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_llm.data import TextDataModule
    from lightning_llm.models.quantize import quantized_bytes, quantized_linears
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask, OptimConfig

    torch.set_num_threads(1)
    marks: dict[str, int] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, task: pl.LightningModule) -> None:
            marks["setup"] = _hwm()
            linears = [lin.weight for _, lin in quantized_linears(task.model)]
            numel = sum(w.numel() for w in linears)
            held = quantized_bytes(task.model)[0] if quantize else sum(w.numel() * w.element_size() for w in linears)
            marks.update(base_bytes=held, base_bf16=2 * numel)

        def on_train_end(self, trainer: pl.Trainer, task: pl.LightningModule) -> None:
            marks["step"] = _hwm()

    name, overrides = backbone, BACKBONES[backbone]
    dm = TextDataModule(tokenizer_dir="byte", generated_docs=60, block_size=128, batch_size=2, val_fraction=0.1,
                        cache_dir=str(work / "cache"))
    dm.prepare_data()
    dm.setup("fit")
    lora = LoraArgs(r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"])
    bare = _hwm()
    task = CausalLMTask(name.split(",")[0], lora=lora, quantize=quantize, model_overrides=overrides,
                        optim=OptimConfig(lr=1e-4))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[Probe()], default_root_dir=str(work))
    trainer.fit(task, dm)
    return {"setup": marks["setup"] - bare, "step": marks["step"] - bare, "base_bytes": marks["base_bytes"],
            "base_bf16": marks["base_bf16"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", nargs=2, default=None, metavar=("BACKBONE", "QUANTIZE"))
    args = p.parse_args()
    if args.worker:
        with tempfile.TemporaryDirectory() as tmp:
            q = None if args.worker[1] == "none" else args.worker[1]
            print(json.dumps(worker(args.worker[0], q, Path(tmp))))
        return
    mib = 2**20
    lines = ["| backbone | variant | frozen block linears held (MiB) | vs bf16 | set-up peak (MiB) | step peak (MiB) |",
             "|---|---|---|---|---|---|"]
    for backbone in BACKBONES:
        for label, q in VARIANTS.items():
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
            proc = subprocess.run([sys.executable, __file__, "--worker", backbone, q or "none"], capture_output=True,
                                  text=True, check=False, env=env)
            if proc.returncode:
                raise SystemExit(f"{backbone} {label} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            lines.append(f"| {backbone} | {label} | {r['base_bytes'] / mib:.1f} | {r['base_bytes'] / r['base_bf16']:.3f} "
                         f"| {r['setup'] / mib:.0f} | {r['step'] / mib:.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
