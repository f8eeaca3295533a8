"""Training from prepared token stores (a 2-corpus mixture: a JSONL file of ~2.5 MiB, prepared by 2 worker processes,
and a directory of .txt documents; a BPE tokenizer written by the test).

One torchrun launch (2 CPU processes) trains the debug decoder 6 steps under ddp, zero3, tp and pp in turn, after the
pytest process ran one device: every parameter's first-step gradient equals one device's (per tensor: the harness's
check, ``testing.run_layouts_and_reference``), every rank's ``train_loss`` one device's within 1e-5, and the corpus was
tokenized once, by global rank 0 in the first run's ``prepare_data`` (the other rank and every later run only mapped
the stores). Before the launch a one-device run is SIGKILLed before step 3; the launch resumes it under ddp x2 (another
data-parallel degree): its losses are the uninterrupted run's. A resume with other mixture weights is refused.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 6
KILL_AT = 3
TOL = 1e-5
GLOBAL_BATCH = 8
LAYOUTS = {"ddp": GLOBAL_BATCH // 2, "zero3": GLOBAL_BATCH // 2, "tp": GLOBAL_BATCH, "pp": GLOBAL_BATCH}
WORDS = ["the", "cat", "sees", "a", "tree.", "Moon", "river,", "data", "模型", "训练", "语料", "数据", "并行"]


def write_corpus(root: Path) -> Path:
    """``root/a.jsonl`` (~2.5 MiB: large enough for the worker pool), ``root/b/*.txt`` and ``root/tokenizer``."""
    from lightning_llm.testing import write_bpe_tokenizer

    rng = random.Random(0)

    def doc() -> str:
        return "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(3))

    root.mkdir(parents=True, exist_ok=True)
    with open(root / "a.jsonl", "w", encoding="utf-8") as f:
        while f.tell() < 5 << 19:
            f.write(json.dumps({"text": doc()}, ensure_ascii=False) + "\n")
    (root / "b").mkdir(exist_ok=True)
    for i in range(40):
        (root / "b" / f"{i:02d}.txt").write_text(doc(), encoding="utf-8")
    write_bpe_tokenizer(root / "tokenizer", [doc() for _ in range(300)])
    return root


def data_path(root: Path, weights: tuple[float, float] = (0.4, 0.6)) -> list[Any]:
    return [weights[0], str(root / "a.jsonl"), weights[1], str(root / "b")]


def _fit(root: Path, strategy: Any, devices: int, batch_size: int, out: Path, cache: Path, *,
         weights: tuple[float, float] = (0.4, 0.6), ckpt_path: str | None = None, save_every_step: bool = False,
         grads: str | None = None) -> dict[str, Any]:
    """``STEPS`` steps from the token stores; the first step's gradients recorded as ``grads`` (against the one-device
    ``reference``)."""
    import lightning.pytorch as pl

    import lightning_llm.strategies  # noqa: F401 - registers the layouts by name
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(3)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    dm = TextDataModule(data_path(root, weights), str(root / "tokenizer"), block_size=32, batch_size=batch_size,
                        cache_dir=str(cache), num_proc=2)
    rec = LoggedLoss(grads=grads, reference="reference")
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec],
                            save_every_step=save_every_step)
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    return {"losses": rec.losses, "start": rec.start, "prepared": dm.prepared, "stores": [str(s.path) for s in dm.stores]}


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing import gathered, write_json_on_rank0

    root = out / "corpus"
    if mode == "reference":
        ref = _fit(root, "auto", 1, GLOBAL_BATCH, out / "reference", out / "cache-reference", grads="reference")
        (out / "reference.json").write_text(json.dumps(ref))
    elif mode == "killed":  # killed (LIGHTNING_LLM_FAULT) before step KILL_AT, a checkpoint after every step
        _fit(root, "auto", 1, GLOBAL_BATCH, out / "killed", out / "cache-reference", save_every_step=True)
    else:
        results = {layout: gathered(_fit(root, layout, 2, batch, out / layout, out / "cache", grads=layout))
                   for layout, batch in LAYOUTS.items()}
        results["resumed"] = gathered(_fit(root, "ddp", 2, GLOBAL_BATCH // 2, out / "resumed", out / "cache",
                                           ckpt_path=str(out / "killed" / "ckpt" / "last.ckpt")))
        write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The killed one-device run first (its own process, SIGKILLed before step 3), then the one-device reference, then
    the launch (every layout, and the resume under ddp x2); the layouts' first-step gradients compared with the
    reference's."""
    import os
    import signal
    import subprocess

    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("prepare_layouts")
    write_corpus(out / "corpus")
    killed = subprocess.run([sys.executable, __file__, "killed", str(out)], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_LLM_FAULT": f"kill:step={KILL_AT}"},
                            timeout=600, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_from_the_store_as_one_device(runs: Path, layout: str) -> None:
    from lightning_llm.testing import gradient_summary, max_abs_err

    ref = json.loads((runs / "reference.json").read_text())["losses"]
    assert len(ref) == STEPS and ref[0] - ref[-1] > 0.05  # it learns
    ranks = json.loads((runs / "layouts.json").read_text())[layout]
    err = max(max_abs_err(r["losses"], ref) for r in ranks)
    print(f"{layout}: max |train_loss - one device| over {STEPS} steps = {err:.2e}; {gradient_summary(runs, layout)}")
    assert err <= TOL


@pytest.mark.multiprocess
def test_ddp_tokenizes_once(runs: Path) -> None:
    """Rank 0's prepare_data of the first run tokenized both corpora (2 workers for the JSONL file); rank 1 never
    tokenized (its setup only mapped the stores), and no later run tokenized again."""
    from lightning_llm.data.corpus.token_store import TokenStore

    results = json.loads((runs / "layouts.json").read_text())
    first, *later = LAYOUTS
    assert [r["prepared"] for r in results[first]] == [True, None]
    assert all([r["prepared"] for r in results[layout]] == [False, None] for layout in [*later, "resumed"])
    stores = {s for layout in LAYOUTS for r in results[layout] for s in r["stores"]}
    assert len(stores) == 2 and {p.name for p in (runs / "cache").iterdir() if p.is_dir()} == {Path(s).name for s in
                                                                                                 stores}
    assert TokenStore.open(sorted(stores)[0]).manifest["workers"] == 2  # a.jsonl: the worker pool ran under DDP


@pytest.mark.multiprocess
def test_sigkill_then_resume_at_another_dp_degree(runs: Path) -> None:
    """One device SIGKILLed before step 3, resumed from its last.ckpt under ddp x2 (batch 4 per rank): steps 3..5
    equal the uninterrupted one-device run within 1e-5 (the sampler skips the consumed samples of the mixture)."""
    from lightning_llm.testing import max_abs_err

    ref = json.loads((runs / "reference.json").read_text())["losses"]
    ranks = json.loads((runs / "layouts.json").read_text())["resumed"]
    assert all(r["start"] == KILL_AT and len(r["losses"]) == STEPS - KILL_AT for r in ranks)
    err = max(max_abs_err(r["losses"], ref[KILL_AT:]) for r in ranks)
    print(f"resumed steps {KILL_AT}..{STEPS - 1} under ddp x2 vs the uninterrupted one device: max abs diff {err:.2e}")
    assert err <= TOL


@pytest.mark.multiprocess
def test_resume_with_other_weights_is_refused(runs: Path) -> None:
    """The killed run's checkpoint records its mixture (0.4 / 0.6): resuming it at 0.5 / 0.5 stops before a step."""
    from lightning_llm.data import DataError

    with pytest.raises(DataError, match=r"trained on other data \(corpora .*weight 0\.4.* -> .*weight 0\.5"):
        _fit(runs / "corpus", "auto", 1, GLOBAL_BATCH, runs / "refused", runs / "cache-reference",
             weights=(0.5, 0.5), ckpt_path=str(runs / "killed" / "ckpt" / "last.ckpt"))


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
