"""At most one host read of a device value per training step of the project's own code (issue 56), on steps that do
not log, for every task and layout: a read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a value-dependent
shape, a blocking copy of host numbers to the device) waits for the device and leaves it idle while the host queues
work again.

The shipped configs' tasks run through ``lightning_llm fit`` (the real Trainer, callbacks and strategies) for 9
steps with ``log_every_n_steps=50``; :class:`~lightning_llm.testing.HostReadCounter` counts the reads of batches 3-7
and attributes each to its owner. Single-process tasks run in the pytest process; the 2-process layouts share one
launch (each layout a fit of its own), after them. The one read left is the non-finite guard's, of a copy made before
the optimizer's kernels (``tasks.callbacks.guard``). Lightning's own reads (it turns progress-bar values into numbers at every
batch end: host copies here, see ``tasks.callbacks.progress``) are printed, not budgeted: on the CPU they cannot be told from
device reads. One of Lightning's is asserted gone: its per-batch SIGTERM broadcast read on multi-rank runs
(``training_epoch_loop.py``), replaced by the preemption check agreed through the store, which reads nothing
(``lightning_llm.preemption``, issue 66).
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_llm.testing import HostReadCounter, launch, run_worker, wait, write_json_on_rank0

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BUDGET = 1
"""Host reads of the project's own code per training step that does not log."""
MOE_LAYERS = 2
"""MoE layers of the ``pretrain_moe`` runs: under expert parallelism each forward of one reads its all-to-all's split
sizes once (``all_to_all_single`` takes them as host lists), on top of the budget."""

SMALL = {"pretrain_debug": ["--model.model_overrides={num_layers: 2}"],
         "pretrain_moe": ["--model.model_overrides={num_layers: 2}", "--data.batch_size=4"]}
SINGLE = {
    "dense": ("pretrain_debug", []),
    "moe": ("pretrain_moe", []),
    "sft": ("sft_chat", []),
    "dpo": ("dpo", []),
    "kto": ("kto", ["--data.generated_examples=96", "--data.generated_val_examples=8"]),
    "reward": ("reward", []),
    "classification": ("afqmc", ["--trainer.gradient_clip_val=1.0"]),
}
"""One-process runs: layout name -> (config, extra flags)."""
LAYOUTS = {
    "ddp": ("pretrain_debug", ["--trainer.strategy=ddp", "--data.batch_size=4"]),
    "tp": ("pretrain_debug", ["--trainer.strategy=tp", "--trainer.gradient_clip_val=1.0"]),
    "pp": ("pretrain_debug", ["--trainer.strategy=pp"]),
    "zero3": ("pretrain_debug", ["--trainer.strategy=zero3", "--data.batch_size=4"]),
    "cp": ("pretrain_debug", ["--trainer.strategy=cp"]),
    "ep": ("pretrain_moe", ["--trainer.strategy=ep"]),
}
"""2-process runs (one torchrun launch): layout name -> (config, extra flags)."""


def fit_args(config: str, extra: list[str], out: Path, data: Path) -> list[str]:
    """``lightning_llm fit`` of a shipped config for 9 steps that do not log, counting host reads into
    ``out/reads.json``."""
    args = ["fit", "--config", str(CONFIGS / f"{config}.yaml"), "--trainer.max_steps=9",
            "--trainer.log_every_n_steps=50", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={out}", "--trainer.callbacks+=lightning_llm.testing.HostReadCounter",
            f"--trainer.callbacks.output={out / 'reads.json'}", *SMALL.get(config, []), *extra]
    if config.startswith("pretrain"):
        args += [f"--data.cache_dir={data / 'cache'}", "--data.generated_docs=60"]
    if config == "afqmc":
        args.append(f"--data.data_dir={data / 'pairs'}")
    return args


def _fit(config: str, extra: list[str], out: Path, data: Path) -> None:
    from lightning_llm.cli.app import LLMCLI

    # The CLI's class, not main(): main() destroys the process group after a run, and a second init in the same
    # torchrun workers meets the first one's keys in the launcher's store.
    LLMCLI(args=fit_args(config, extra, out, data))


def _data(root: Path) -> Path:
    from lightning_llm.data import generate_pair_dataset

    if not (root / "pairs").is_dir():
        generate_pair_dataset(root / "pairs", n_train=96, n_val=8, n_test=8, min_len=8, max_len=24)
    return root


def _worker(out: Path, data: Path) -> None:
    for name, (config, extra) in LAYOUTS.items():
        _fit(config, [*extra, "--trainer.devices=2"], out / name, data)
    write_json_on_rank0(out / "done.json", sorted(LAYOUTS))


def _reads(out: Path) -> list[dict[str, list[list[str]]]]:
    return json.loads((out / "reads.json").read_text())["reads"]


LIGHTNING_SIGTERM_READ = "loops/training_epoch_loop.py"
"""Where Lightning 2.6 reads its per-batch SIGTERM broadcast (``_broadcast_sigterm_tensor``)."""


def _reads_at(out: Path, where: str) -> list[str]:
    return [f"rank {rank} {owner} {at} {what}" for rank, reads in enumerate(_reads(out)) for rows in reads.values()
            for owner, at, what in rows if where in at]


def _summary(name: str, out: Path) -> tuple[int, int]:
    """(most reads of ours in a counted step on any rank, counted steps); prints each read and Lightning's."""
    ours, steps, where = 0, 0, collections.Counter()
    for rank, reads in enumerate(_reads(out)):
        steps = max(steps, len(reads))
        for rows in reads.values():
            ours = max(ours, sum(1 for owner, _, _ in rows if owner == "lightning_llm"))
            where.update(f"rank {rank} {owner} {at} {what}" for owner, at, what in rows)
    n = max(steps, 1)
    print(f"{name}: at most {ours} read(s) of ours per step over {steps} steps; per step: "
          + "; ".join(f"{c / n:.1f} {k}" for k, c in sorted(where.items())))
    return ours, steps


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _data(tmp_path_factory.mktemp("host_syncs_data"))


@pytest.fixture(scope="module")
def single_runs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-process runs, in this process."""
    out = tmp_path_factory.mktemp("host_syncs")
    for name, (config, extra) in SINGLE.items():
        _fit(config, extra, out / name, data)
    return out


@pytest.fixture(scope="module")
def layout_runs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-process runs, one launch."""
    out = tmp_path_factory.mktemp("host_syncs_layouts")
    wait(launch(__file__, 2, str(out), str(data)), timeout=900)
    return out


def test_the_counter_counts_a_known_read() -> None:
    """The counter can fail: a read inside its window is counted (with what and where), host-only work is not."""
    counter = HostReadCounter()
    t = torch.arange(4.0)
    with counter.counting() as reads:
        t.sum().item()
        bool(t.max() > 0)
        t.tolist()
        t[t > 1]
        torch.tensor([1.0, 2.0], device="cpu")
        t + 1
    assert [what for _, _, what in reads] == ["item", "__bool__", "tolist", "__getitem__", "tensor"], reads
    assert all(where.startswith("tests/speed/test_host_syncs.py:") for _, where, _ in reads), reads
    t.sum().item()  # outside the window: not counted, and the methods are restored
    assert len(reads) == 5 and torch.Tensor.item is torch._C.TensorBase.item


@pytest.mark.parametrize("name", list(SINGLE))
def test_one_process_tasks_read_at_most_once_per_step(single_runs: Path, name: str) -> None:
    ours, steps = _summary(name, single_runs / name)
    assert steps == 5
    assert ours <= BUDGET


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_read_at_most_once_per_step(layout_runs: Path, name: str) -> None:
    ours, steps = _summary(name, layout_runs / name)
    assert steps == 5
    assert ours <= BUDGET + (MOE_LAYERS if name == "ep" else 0)
    assert not _reads_at(layout_runs / name, LIGHTNING_SIGTERM_READ)  # switched off: the store agrees instead


if __name__ == "__main__":
    run_worker(_worker, Path(sys.argv[1]), Path(sys.argv[2]))
