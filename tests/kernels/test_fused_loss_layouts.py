"""The fused-loss flag matrix: ``--model.fused_loss`` on and off under each 2-process layout, against one device with
full logits (the eager reference). Every parameter's first-step gradient (per tensor: the harness's check,
``testing.run_layouts_and_reference``), per step every rank's ``train_loss`` within 1e-5 (fp32, dropout 0), and the path
each layout took: fused under native ZeRO-3 (FSDP2 gathers the head inside the model's forward) and DeepSpeed
ZeRO-2; fused on the vocab shards under tensor parallelism (chunks of ``[C, V/tp]`` logits, the softmax statistics
all-reduced per chunk); fused on a pipeline's last stage (the labels reach every stage as a keyword input; per-token
losses, which the pipeline concatenates over micro-batches). Families: LLaMA (untied head) and Qwen2 (tied). DDP
runs the one-device forward on each replica (the fused path with its gradient hooks unchanged); ZeRO-3 and DeepSpeed
cover the replicated-head layouts here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

STEPS = 3
TOL = 1e-5
GLOBAL_BATCH = 8
FAMILIES = ("debug", "debug-qwen2", "debug-qwen2+lora")
LAYOUTS = {"zero3": GLOBAL_BATCH // 2, "deepspeed_zero2": GLOBAL_BATCH // 2, "tp": GLOBAL_BATCH, "pp": GLOBAL_BATCH}
PATH_TAKEN = {"zero3": "fused", "deepspeed_zero2": "fused", "tp": "fused-vocab-parallel", "pp": "fused"}
# (fused_loss, backbone) runs per layout: the flag on for both families, off for one (the eager path is unchanged);
# "+lora" is Qwen2's tied head with LoRA and modules_to_save [embed_tokens, lm_head] (the Chinese-LLaMA-Alpaca-2
# recipe): the fused path reads the trained head copy, and a pipeline must not sum the frozen tied originals.
# Tensor parallelism refuses modules_to_save (tests/parallel/test_tensor_parallel.py), so "+lora" runs on the other layouts.
RUNS = [(True, "debug"), (True, "debug-qwen2"), (False, "debug"), (True, "debug-qwen2+lora")]
MATRIX = [(layout, fused, b) for layout in LAYOUTS for fused, b in RUNS if not (layout == "tp" and "+lora" in b)]


def _fit(backbone: str, strategy: Any, devices: int, batch_size: int, out: Path, fused: bool,
         run: str | None = None) -> dict[str, Any]:
    """``STEPS`` steps; the first step's gradients recorded as ``run`` (else as the one-device ``backbone``)."""
    import lightning.pytorch as pl

    import lightning_llm.strategies  # noqa: F401 - registers the layouts by name
    from lightning_llm.data import TextDataModule
    from lightning_llm.kernels.loss import head_loss
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.tasks.decoder import fused_loss_blocker
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(3)
    name, _, lora = backbone.partition("+")
    peft = {"lora": LoraArgs(r=4, dropout=0.0, modules_to_save=["embed_tokens", "lm_head"])} if lora else {}
    task = CausalLMTask(name, dropout=0.0, fused_loss=fused, **peft,
                        optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    dm = TextDataModule(block_size=32, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=100)
    rec = LoggedLoss(grads=run or backbone, reference=backbone)
    # Spies on the fused kernels (wrapping: same results) tell which path the model's forward took.
    fused_fn, vp_fn = head_loss.fused_linear_cross_entropy, head_loss.vocab_parallel_fused_linear_cross_entropy
    with mock.patch.object(head_loss, "fused_linear_cross_entropy", wraps=fused_fn) as spy, \
            mock.patch.object(head_loss, "vocab_parallel_fused_linear_cross_entropy", wraps=vp_fn) as vp_spy:
        table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    if fused_loss_blocker(task) is not None:
        path = "logits"
    elif getattr(task.model, "lm_head", None) is None:
        path = "stage without the head"  # a pipeline's first stage: its last stage computes the loss
    elif spy.call_count >= STEPS:
        path = "fused"
    else:
        path = "fused-vocab-parallel" if vp_spy.call_count >= STEPS else "module"
    return {"losses": rec.losses, "path": path}


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        ref = {b: _fit(b, "auto", 1, GLOBAL_BATCH, out, fused=False)["losses"] for b in FAMILIES}
        (out / "reference.json").write_text(json.dumps(ref))
        return
    results = {f"{layout}/{fused}/{b}": gathered(_fit(b, layout, 2, LAYOUTS[layout], out, fused=fused,
                                                      run=f"{layout}/{fused}/{b}"))
               for layout, fused, b in MATRIX}
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("fused_layouts")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("layout", "fused", "backbone"), MATRIX,
                         ids=[f"{layout}-{'fused' if f else 'eager'}-{b}" for layout, f, b in MATRIX])
def test_layout_with_fused_flag_matches_one_device_eager(runs: Path, layout: str, fused: bool, backbone: str) -> None:
    from lightning_llm.testing import gradient_summary, max_abs_err

    ref = json.loads((runs / "reference.json").read_text())[backbone]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05
    ranks = json.loads((runs / "layouts.json").read_text())[f"{layout}/{fused}/{backbone}"]
    err = max(max_abs_err(r["losses"], ref) for r in ranks)
    paths = {r["path"] for r in ranks}
    print(f"{layout} fused_loss={fused} {backbone}: path {paths}, max |train_loss - one device eager| = {err:.2e}; "
          f"{gradient_summary(runs, f'{layout}/{fused}/{backbone}')}")
    want = {PATH_TAKEN[layout] if fused else "logits"}
    if layout == "pp" and fused:
        want.add("stage without the head")
    assert paths == want
    assert err <= TOL


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
