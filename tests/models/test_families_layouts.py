"""The new decoder families train under every parallel layout like one device (the parity table of
``tests/models/test_families.py``'s families).

One torchrun launch (2 CPU processes, gloo) fits each family's debug size (:data:`TRAIN_FAMILIES`: Qwen2, Qwen3,
Mistral with a sliding window shorter than the block, Baichuan2 with its head-interleaved W_pack and NormHead, LLaMA
with dynamic rope past max_position_embeddings, YaRN, gelu_pytorch_tanh, DeepSeek-V3 with Multi-head Latent Attention,
GLM-4.5, Phi-3 with LongRoPE past its short range, GLM-4 with its branch output norms and rotary pairs, OLMo 3 with
output norms only, q/k norms over the projection, sliding layers with their own rope, SmolLM3 with a NoPE layer, Gemma
2 with soft-capped scores and logits, Gemma 3 with its local rope, LoRA on a Gemma3ForConditionalGeneration
checkpoint's language model) for ``STEPS`` steps under each layout of :data:`LAYOUTS` (the families after GLM-4.5: at
the layouts of :data:`EXTRA` that exercise what they add, with context parallelism, LoRA under tp, QLoRA under zero3),
after the pytest process ran the same steps on one device. Compared: every parameter's first-step gradient (per
tensor, the harness's check: ``testing.run_layouts_and_reference``), and per step the ``train_loss`` every rank logs
against the one-device loss, bound 1e-5 (fp32, dropout 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 4
TOL = 1e-5
GLOBAL_BATCH = 8
TINY = "tiny_gemma3"
"""A backbone written into the run's folder before the launch: tools/tiny.py's Gemma3ForConditionalGeneration."""
# family -> (backbone, model_overrides): each family's debug size (4 layers, hidden 64, 4 heads; tp=2 divides them)
TRAIN_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("debug-qwen2", {}),  # q/k/v biases, tied head
    "qwen3": ("debug-qwen3", {}),  # q_norm/k_norm, head_dim 32 != 64/4
    "mistral": ("debug-mistral", {}),  # sliding window 8 < block 32
    "baichuan2": ("debug-baichuan2", {}),  # W_pack (head-interleaved, tp shards whole heads), NormHead
    # dynamic rope: the 32-token blocks run past max_position_embeddings=16
    "llama_dynamic": ("debug", {"max_position_embeddings": 16, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama_yarn": ("debug", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 64}}),
    "llama_gelu_tanh": ("debug", {"activation": "geglu_tanh"}),
    # Multi-head Latent Attention (tp: heads split after its up-projections, latents replicated) and DeepSeek-V3's
    # router with a shared expert; GLM-4.5's partial rotary, q/k norms and q/k/v biases with the same router
    "deepseek_v3": ("debug-deepseek-v3", {}),
    "glm4_moe": ("debug-glm4-moe", {}),
}
LAYOUTS = ["tp", "tp_sp", "pp", "zero3"]
DENSE_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi3": ("debug-phi3", {}),  # LongRoPE: the 32-token blocks pass its short range (16); fused projections split
    "glm4": ("debug-glm4", {}),  # norms on both sides of each branch (tp_sp: on sequence shards), rotary pairs
    "olmo3": ("debug-olmo3", {}),  # output norms only, q/k norms over the projection, sliding rope beside YaRN
    "smollm3": ("debug-smollm3", {}),  # layer 3 without rotary embedding, tied head
    # Gemma 2: soft-capped scores (the eager path) and logits (the vocab-parallel fused loss takes the cap per chunk),
    # the scaled embedding sharded by rows, four norms per layer (two more sequence-parallel ones); Gemma 3: q/k
    # norms, the sliding layers' own rope; a Gemma3ForConditionalGeneration directory (tools/tiny.py) with LoRA on
    # its language model, the vision tower never loaded
    "gemma2": ("debug-gemma2", {}),
    "gemma3": ("debug-gemma3", {}),
    "gemma3_vl_lora": (TINY, {}),
    # families added by their family file alone: ERNIE 4.5 (every projection biased: row-parallel o_proj and
    # down_proj biases; rotary pairs over the whole head), Seed-OSS (q/k/v biased, o not)
    "ernie4_5": ("debug-ernie4.5", {}),
    "seed_oss": ("debug-seed-oss", {}),
}
"""The families of models/hf/families/phi3.py, glm4.py, olmo.py, smollm3.py and gemma.py, trained at the layouts of
:data:`EXTRA` that exercise what they add (tp_sp: every plan entry, their norms on sequence shards; pp: layer-indexed
rope on the second stage; cp: rotary pairs, NoPE layers, LongRoPE's choice on slices; zero3: the scaled embedding's
and the tied head's shards)."""
_LORA = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                         "gate_proj", "up_proj", "down_proj"]}}
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # (family, model_overrides, task arguments): LongRoPE with a short range the 32-token rows stay in (context
    # parallelism refuses rows past it: the factors follow the whole row's longest position)
    "phi3_cp": ("phi3", {"rope_scaling": {"rope_type": "longrope",
                                          "original_max_position_embeddings": 32,
                                          "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                          "long_factor": [2.0 + 0.5 * i for i in range(6)]}}, {}),
    "phi3_lora": ("phi3", {}, _LORA),
    # (scaler blocks of 16: a 64 x 64 projection's 64 blocks give 4 double-quantization blocks, split over 2 ranks)
    "phi3_qlora": ("phi3", {}, {**_LORA, "quantize": "nf4", "quantization": {"scaler_block_size": 16}}),
    "gemma3_vl_lora": ("gemma3_vl_lora", {}, _LORA),
}
"""Trainings beyond the families' plain ones (their one-device references run too)."""
EXTRA = {"tp": ["phi3_lora", "gemma3_vl_lora", "ernie4_5", "seed_oss"],
         "tp_sp": ["phi3", "glm4", "olmo3", "smollm3", "gemma2", "gemma3"],
         "pp": ["phi3", "olmo3", "smollm3", "gemma2"], "zero3": ["olmo3", "phi3_qlora", "gemma3"],
         "cp": ["glm4", "smollm3", "phi3_cp"]}
"""Layout -> the trainings (:data:`DENSE_FAMILIES` or :data:`VARIANTS`) it runs beside :data:`TRAIN_FAMILIES`."""


def _trainings(layout: str) -> list[str]:
    return [*(TRAIN_FAMILIES if layout in LAYOUTS else []), *EXTRA.get(layout, [])]


def _layout(name: str) -> tuple[Any, int]:
    """(strategy, per-rank batch size) of a 2-process layout."""
    from lightning_llm.strategies import (
        ContextParallelStrategy,
        HybridParallelStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
        ZeroStrategy,
    )

    return {"tp": (TensorParallelStrategy(), GLOBAL_BATCH),
            "tp_sp": (HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True),
                      GLOBAL_BATCH),
            "pp": (PipelineParallelStrategy(schedule="1f1b", n_microbatches=2), GLOBAL_BATCH),
            "zero3": (ZeroStrategy(stage=3), GLOBAL_BATCH // 2),
            "cp": (ContextParallelStrategy(), GLOBAL_BATCH)}[name]


def _fit(family: str, strategy: Any, devices: int, batch_size: int, out: Path, run: str | None = None) -> list[float]:
    """``STEPS`` steps of ``family``'s debug size; the ``train_loss`` this rank logged per step (the first step's
    gradients recorded as ``run``, else as the one-device ``family``)."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.models.quantize import QuantizationConfig
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    name = family
    family, changes, task_kw = VARIANTS.get(family, (family, {}, {}))
    backbone, overrides = {**TRAIN_FAMILIES, **DENSE_FAMILIES}[family]
    overrides = {**overrides, **changes}
    directory = backbone == TINY
    if "lora" in task_kw:
        task_kw = {**task_kw, "lora": LoraArgs(**task_kw["lora"])}
    if "quantization" in task_kw:
        task_kw = {**task_kw, "quantization": QuantizationConfig(**task_kw["quantization"])}
    pl.seed_everything(3)
    # eps=1e-6: with Adam's 1e-8, fp32 reduction-order noise in gradients near 1e-8 becomes +-lr steps, which moved the
    # next loss by 1.5e-5 for llama_yarn under tp (1e-6 with eps=1e-6; step 0 is bit-identical either way).
    task = CausalLMTask(str(out / backbone) if directory else backbone, dropout=0.0, model_overrides=overrides,
                        optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6), **task_kw)
    dm = TextDataModule(block_size=32, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=100,
                        tokenizer_dir="byte" if directory else None)
    rec = LoggedLoss(grads=run or name, reference=name)
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(task, dm)
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    import time

    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({f: _fit(f, "auto", 1, GLOBAL_BATCH, out)
                                                        for f in dict.fromkeys([*TRAIN_FAMILIES, *DENSE_FAMILIES,
                                                                                *VARIANTS])}))
        return
    results: dict[str, Any] = {}
    for layout in dict.fromkeys([*LAYOUTS, *EXTRA]):
        t0 = time.perf_counter()
        for family in _trainings(layout):
            strategy, batch = _layout(layout)
            results[f"{layout}/{family}"] = gathered(_fit(family, strategy, 2, batch, out, f"{layout}/{family}"))
        results[f"seconds/{layout}"] = round(time.perf_counter() - t0, 1)
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference

    from lightning_llm.tools.tiny import write_tiny

    out = tmp_path_factory.mktemp("families")
    write_tiny("gemma3", out / TINY)
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=1500)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout,family", [(layout, family) for layout in dict.fromkeys([*LAYOUTS, *EXTRA])
                                           for family in _trainings(layout)])
def test_family_trains_under_layout_like_one_device(layout_runs: Path, family: str, layout: str) -> None:
    """Every rank's logged ``train_loss`` equals the one-device run's at each of ``STEPS`` steps (fp32, dropout 0)."""
    from lightning_llm.testing import gradient_summary, max_abs_err

    ref = json.loads((layout_runs / "reference.json").read_text())[family]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05  # it learns
    runs = json.loads((layout_runs / "layouts.json").read_text())
    err = max(max_abs_err(r, ref) for r in runs[f"{layout}/{family}"])
    print(f"{layout} x {family}: max |train_loss - one device| over {STEPS} steps = {err:.2e} "
          f"({runs[f'seconds/{layout}']} s for the layout's {len(_trainings(layout))} families); "
          f"{gradient_summary(layout_runs, f'{layout}/{family}')}")
    assert err <= 1e-5


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
