"""DeBERTa-v2, ModernBERT and XLM-R checkpoints (written by transformers here) under ``ClassificationTask`` on the
layouts encoders run: ddp, native ZeRO-3, tp, tp + sequence parallel, pp; every parameter's first-step gradient
equals one device's (per tensor, the harness's check: ``testing.run_layouts_and_reference``) and every rank's logged
``train_loss`` the one-device run's at each of ``STEPS`` steps within 1e-5 (fp32, dropout 0).

One torchrun launch (2 CPU processes, gloo) runs every layout x family after the pytest process ran the one-device
references. The backbones are loaded lazily under the sharding layouts (tp, pp, zero3: each rank reads only its
shards, ModernBERT's fused ``Wqkv``/``Wi`` by row block), with their tensor-parallel plans (DeBERTa's own
``pos_key_proj``/``pos_query_proj`` column-parallel beside q/k/v; ModernBERT's sliding-window masks and rotary tables
built before the blocks). The rows are right-padded to each batch's longest, with token types for DeBERTa. DeBERTa
under pp is refused in one line (its relative-position table is read by every layer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 3
TOL = 1e-5
GLOBAL_BATCH = 8
FAMILIES = ("deberta_v2", "modernbert", "xlm_roberta")
LAYOUTS = ["ddp", "zero3", "tp", "tp_sp", "pp"]
REFUSED = {("pp", "deberta_v2"): "pipeline parallelism: DeBERTa's relative-position table"}


def _layout(name: str) -> tuple[Any, int]:
    """(strategy, per-rank batch size) of a 2-process layout."""
    from lightning_llm.strategies import (
        HybridParallelStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
        ZeroStrategy,
    )

    return {"ddp": ("ddp", GLOBAL_BATCH // 2), "zero3": (ZeroStrategy(stage=3), GLOBAL_BATCH // 2), "tp": (TensorParallelStrategy(), GLOBAL_BATCH),
            "tp_sp": (HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, sequence_parallel=True),
                      GLOBAL_BATCH),
            "pp": (PipelineParallelStrategy(schedule="1f1b", n_microbatches=2), GLOBAL_BATCH)}[name]


def _write_backbones(out: Path) -> None:
    """Each family's classification checkpoint (2 labels), written by transformers."""
    import torch

    from tests.models.test_encoders import VARIANTS, _perturb, transformers

    for i, name in enumerate(FAMILIES):
        cfg_cls, kw, cls_name, *_ = VARIANTS[name]
        torch.manual_seed(i)
        model = getattr(transformers, cls_name)(getattr(transformers, cfg_cls)(**kw, num_labels=2))
        _perturb(model, i).save_pretrained(out / name)


def _data(name: str, batch_size: int) -> Any:
    """One global batch of random pairs of 6..16 tokens (first token 2), right-padded with the family's padding id
    (DeBERTa-v2's with token types: the second half 1), seen at every step, so the loss falls."""
    import torch

    from lightning_llm.data.base import LLMDataModule
    from lightning_llm.data.pairs import pad_collate
    from tests.models.test_encoders import VARIANTS

    pad, types = VARIANTS[name][4], VARIANTS[name][5]
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(GLOBAL_BATCH):
        n = int(torch.randint(6, 17, (1,), generator=g))
        ids = [2] + torch.randint(4, 96, (n - 1,), generator=g).tolist()
        rows.append({"input_ids": ids, "token_type_ids": [int(types and j >= n // 2) for j in range(n)],
                     "label": int(torch.randint(0, 2, (1,), generator=g)), "index": i})

    class Pairs(LLMDataModule):
        def train_dataloader(self) -> Any:
            return self.make_loader(rows, train=True, collate_fn=lambda ex: pad_collate(ex, pad_id=pad))

    return Pairs(batch_size=batch_size, seed=0)


def _fit(name: str, strategy: Any, devices: int, batch_size: int, out: Path, run: str | None = None) -> list[float]:
    """``STEPS`` steps of the family ``name``; this rank's logged losses (the first step's gradients recorded as
    ``run``, else as the one-device ``name``)."""
    import lightning.pytorch as pl

    from lightning_llm.tasks import ClassificationTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(3)
    task = ClassificationTask(str(out / name), num_labels=2, dropout=0.0,
                              optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    rec = LoggedLoss(grads=run or name, reference=name)
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec]).fit(
        task, _data(name, batch_size))
    return rec.losses


def _worker(mode: str, out: Path) -> None:
    import time

    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({f: _fit(f, "auto", 1, GLOBAL_BATCH, out) for f in FAMILIES}))
        return
    results: dict[str, Any] = {}
    for layout in LAYOUTS:
        t0 = time.perf_counter()
        for family in FAMILIES:
            if (layout, family) in REFUSED:
                continue
            strategy, batch = _layout(layout)
            results[f"{layout}/{family}"] = gathered(_fit(family, strategy, 2, batch, out, f"{layout}/{family}"))
        results[f"seconds/{layout}"] = round(time.perf_counter() - t0, 1)
    for (layout, family), _ in REFUSED.items():  # last: a refused set-up leaves nothing behind for another run
        strategy, batch = _layout(layout)
        try:
            _fit(family, strategy, 2, batch, out)
            results[f"{layout}/{family}"] = "trained"
        except ValueError as e:
            results[f"{layout}/{family}"] = str(e)
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("encoder_layouts")
    _write_backbones(out)
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_trains_under_layout_like_one_device(layout_runs: Path, family: str, layout: str) -> None:
    from lightning_llm.testing import gradient_summary, max_abs_err

    runs = json.loads((layout_runs / "layouts.json").read_text())
    if (layout, family) in REFUSED:
        msg = runs[f"{layout}/{family}"]
        print(f"{layout} x {family}: {msg}")
        assert REFUSED[(layout, family)] in msg and "\n" not in msg
        return
    ref = json.loads((layout_runs / "reference.json").read_text())[family]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.01  # it learns
    err = max(max_abs_err(r, ref) for r in runs[f"{layout}/{family}"])
    print(f"{layout} x {family}: max |train_loss - one device| over {STEPS} steps = {err:.2e} "
          f"({runs[f'seconds/{layout}']} s for the layout's families); "
          f"{gradient_summary(layout_runs, f'{layout}/{family}')}")
    assert err <= TOL


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
