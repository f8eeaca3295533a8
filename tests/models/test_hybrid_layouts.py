"""The hybrid decoders (Gated DeltaNet + gated attention: ``debug-qwen3.5``, ``debug-qwen3-next``) train under the
parallel layouts like one device.

One launch of 2 CPU processes (gloo) fits, for ``STEPS`` steps each: Qwen3.5 (split projections, dense MLPs) under tp
(its key heads, their value heads and convolution channels split; ``A_log``, ``dt_bias`` with the heads) and QLoRA
(nf4, LoRA on every projection) under pp (1f1b); Qwen3-Next (fused projections, MoE with a sigmoid-gated shared expert)
under tp, ep (its experts over both ranks; the replicated rest, the shared expert's gate among it, averaged by the
bucketed reduction), ep with ZeRO-3 (the DeltaNet layers' parameters sharded) and pp (gpipe, full fine-tuning through
the stages). Before it the pytest process runs each variant on one device. Compared: every
parameter's first-step gradient (the harness's check, ``testing.run_layouts_and_reference``: per tensor within 1e-5 of
its largest entry, or of fp32's floor: a Gated DeltaNet's ``A_log`` and ``dt_bias`` gradients are 1e-5 of the rest,
and one device's own fp32 gradient is 8e-5 of their size from float64's), and per step every rank's logged
``train_loss`` against one device's, bound 1e-5 (fp32, dropout 0). Context parallelism is refused in one line before
anything is built.

Each run adds a hybrid case no other run has; left out as covered: tp with sequence parallelism (a DeltaNet block is
planned by the same ``_block_plan`` as an attention block, whose sequence-parallel wrapping and (1 + weight) norms on
sequence shards ``test_families_layouts.py``'s Gemma 3 tp_sp run checks), Qwen3.5 under zero3 (the same FSDP2 sharding
of the DeltaNet parameters as ep_zero3's; Qwen3.5's split projections are plain linears), Qwen3.5 full fine-tuning
under pp (the stages of hybrid layers: Qwen3-Next's gpipe run; Qwen3.5's layers through 1f1b: the QLoRA run), LoRA
under tp (column-/row-parallel LoRA of any linear: ``test_families_layouts.py``'s LoRA runs; LoRA on every DeltaNet
projection: the QLoRA run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 3
TOL = 1e-5
GLOBAL_BATCH = 4
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
            "gate_proj", "up_proj", "down_proj"]
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3.5": ("debug-qwen3.5", {}),
    "qwen3.5_qlora": ("debug-qwen3.5", {"lora": True, "quantize": "nf4"}),
    "qwen3_next": ("debug-qwen3-next", {}),
}
RUNS = {"tp/qwen3.5": "qwen3.5", "pp/qwen3.5_qlora": "qwen3.5_qlora", "tp/qwen3_next": "qwen3_next",
        "ep/qwen3_next": "qwen3_next", "ep_zero3/qwen3_next": "qwen3_next", "pp_gpipe/qwen3_next": "qwen3_next"}
"""layout/variant -> the variant its curve is compared with."""


def _strategy(layout: str) -> tuple[Any, int]:
    """(strategy, per-rank batch size) of a 2-process layout."""
    from lightning_llm.strategies import ExpertParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy

    return {"tp": (TensorParallelStrategy(), GLOBAL_BATCH),
            "pp": (PipelineParallelStrategy(schedule="1f1b", n_microbatches=2), GLOBAL_BATCH),
            # MoE: the load-balancing loss needs every micro-batch's routing before the first backward
            "pp_gpipe": (PipelineParallelStrategy(schedule="gpipe", n_microbatches=2), GLOBAL_BATCH),
            "ep": (ExpertParallelStrategy(), GLOBAL_BATCH // 2),
            "ep_zero3": (ExpertParallelStrategy(zero_stage=3), GLOBAL_BATCH // 2)}[layout]


def _task(variant: str) -> Any:
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    backbone, kw = VARIANTS[variant]
    lora = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=ALL_PROJ) if kw.get("lora") else None
    extra = {"quantize": kw["quantize"]} if "quantize" in kw else {}
    return CausalLMTask(backbone, dropout=0.0, lora=lora, optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6),
                        **extra)


def _fit(variant: str, strategy: Any, devices: int, batch_size: int, out: Path, run: str | None = None) -> list[float]:
    """``STEPS`` steps of ``variant``; the ``train_loss`` this rank logged per step (and the first step's gradients,
    as ``run``, else as the one-device ``variant``)."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(3)
    task = _task(variant)
    dm = TextDataModule(block_size=32, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=60)
    rec = LoggedLoss(grads=run or variant, reference=variant)
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    import time

    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({v: _fit(v, "auto", 1, GLOBAL_BATCH, out) for v in VARIANTS}))
        return
    results: dict[str, Any] = {}
    for run, variant in RUNS.items():
        t0 = time.perf_counter()
        strategy, batch = _strategy(run.split("/")[0])
        results[run] = gathered(_fit(variant, strategy, 2, batch, out, run))
        results[f"seconds/{run}"] = round(time.perf_counter() - t0, 1)
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("hybrid")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", list(RUNS))
def test_hybrid_trains_under_layout_like_one_device(layout_runs: Path, run: str) -> None:
    """Every rank's logged ``train_loss`` equals the one-device run's at each of ``STEPS`` steps (fp32, dropout 0)."""
    from lightning_llm.testing import gradient_summary, max_abs_err

    ref = json.loads((layout_runs / "reference.json").read_text())[RUNS[run]]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05  # it learns
    runs = json.loads((layout_runs / "layouts.json").read_text())
    err = max(max_abs_err(r, ref) for r in runs[run])
    print(f"{run}: max |train_loss - one device| over {STEPS} steps = {err:.2e} ({runs[f'seconds/{run}']} s); "
          f"{gradient_summary(layout_runs, run)}")
    assert err <= TOL


def test_context_parallelism_is_refused_in_one_line() -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.parallel_spec import parallel_spec_of

    model = build_model("debug-qwen3.5", family="decoder")
    _, backbone, spec = parallel_spec_of(model)  # type: ignore[misc]
    why = spec.context_parallel_blocker(backbone)
    assert why is not None and "Gated DeltaNet" in why and "\n" not in why


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
