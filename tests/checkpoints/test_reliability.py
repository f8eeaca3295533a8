"""Reliability: exact resume after SIGKILL, kill during checkpoint save, NaN loss, failing rank, bad input fuzz.

Every killed run is a launch of its own (the kill ends its processes); the uninterrupted runs and the resumes of the
2-process cases share one launch after them (:func:`tests.grouped.run_commands`), the one-device ones run in this
process."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import DataError, SentencePairDataModule, read_records
from lightning_llm.export import read_checkpoint
from lightning_llm.reliability import parse_fault
from lightning_llm.testing import cli_process, run_cli
from tests.grouped import run_commands

STEPS, KILL_AT = 12, 5  # 8 batches per epoch (64 samples / batch 8): the kill is mid-epoch 0, the resume crosses an epoch
TWO = ["--trainer.devices=2", "--data.batch_size=4"]
KILLED = {
    "ddp2": (["--trainer.strategy=ddp"], f"kill:step={KILL_AT}", KILL_AT),
    "zero3-all-ranks-after-shards": (["--trainer.strategy=zero3"], "kill:save=4", 1),
    "deepspeed_zero2-rank1-before-writing": (["--trainer.strategy=deepspeed_zero2"], "kill:save=4:rank=1:at=begin", 1),
    "zero3-async-all-ranks-in-the-background-write": (
        ["--trainer.strategy=zero3", "--trainer.strategy.async_save=true"], "kill:save=4", 1),
}
"""The 2-process cases: strategy flags, the fault that kills the run (``LIGHTNING_LLM_FAULT``), the step the resume
starts from. Saves per step: epoch=0-step=N.ckpt then last.ckpt, so save #4 is step 2's last.ckpt (last.ckpt is then
step 1's)."""


def _args(data: Path, out: Path, *, batch: int = 8, extra: list[str] = ()) -> list[str]:
    return [
        "fit", "--seed_everything=3",
        "--model=lightning_llm.tasks.ClassificationTask", "--model.backbone=debug", "--model.dropout=0.1",
        "--model.optim.warmup_steps=3", "--model.optim.lr=0.003",
        "--data=lightning_llm.data.SentencePairDataModule", f"--data.data_dir={data}",
        f"--data.tokenizer_dir={data / 'tokenizer'}", f"--data.batch_size={batch}",
        "--trainer.accelerator=cpu", f"--trainer.max_steps={STEPS}", "--trainer.logger=false",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={out}",
        "--trainer.callbacks+=lightning_llm.testing.StepRecorder", f"--trainer.callbacks.output={out / 'steps.json'}",
        "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={out / 'ckpt'}",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=true",
        *extra,
    ]


def _mean_losses(out: Path) -> list[float]:
    """The recorded loss of every step, averaged over the ranks."""
    return [sum(xs) / len(xs) for xs in zip(*json.loads((out / "steps.json").read_text())["losses"])]


def _killed(data: Path, out: Path, *, extra: list[str], nproc: int, fault: str) -> dict[str, Any]:
    """Run the fit into ``out`` with ``fault``, which kills it: its exit code, the end of its output, whether it
    finished (wrote its losses) and the step of its last.ckpt."""
    proc = cli_process(_args(data, out, extra=extra), nproc=nproc, env={"LIGHTNING_LLM_FAULT": fault})
    last = _last(out)
    return {"returncode": proc.returncode, "output": (proc.stdout + proc.stderr)[-3000:],
            "finished": (out / "steps.json").exists(), "partial": (out / "ckpt" / ".last.ckpt.partial").is_dir(),
            "step": read_checkpoint(last)["global_step"] if last.exists() else None}


def _resume_error(full: Path, broken: Path, start: int) -> float:
    """``max |resumed - uninterrupted|`` over the steps the resume of ``broken`` ran (from ``start``: all of them)."""
    ref, resumed = _mean_losses(full), _mean_losses(broken)
    assert len(ref) == STEPS and len(resumed) == STEPS - start, (len(ref), len(resumed))
    return max(abs(a - b) for a, b in zip(ref[start:], resumed))


def _assert_killed(killed: dict[str, Any]) -> None:
    assert killed["returncode"] != 0 and not killed["finished"], killed["output"]  # it really died before finishing


def _in_process(args: list[str]) -> None:
    assert main(args) == 0


@pytest.mark.multiprocess
def test_sigkill_then_resume_reproduces_losses_on_one_device(pair_data: Path, tmp_path: Path) -> None:
    """Killed (SIGKILL) before step 5 and resumed from last.ckpt: steps 5..11 equal the uninterrupted run within
    1e-6 — data order (mid-epoch skip), dropout RNG, LR schedule and optimizer state all restored (the uninterrupted
    run and the resume in this process, the killed run launched)."""
    full, broken, one = tmp_path / "full", tmp_path / "broken", ["--trainer.devices=1"]
    _in_process(_args(pair_data, full, extra=one))
    _assert_killed(_killed(pair_data, broken, extra=one, nproc=1, fault=f"kill:step={KILL_AT}"))
    _in_process(_args(pair_data, broken, extra=[*one, f"--ckpt_path={_last(broken)}"]))
    err = _resume_error(full, broken, KILL_AT)
    print(f"1 device: resumed steps {KILL_AT}..{STEPS - 1} max abs loss diff = {err:.2e}")
    assert err <= 1e-6


@pytest.fixture(scope="module")
def two_process_runs(pair_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The killed runs of :data:`KILLED` (a launch each), then one launch of the uninterrupted run of each strategy
    and the resume of each killed run from its last.ckpt."""
    root = tmp_path_factory.mktemp("two_process")
    killed = {name: _killed(pair_data, root / name, extra=[*TWO, *flags], nproc=2, fault=fault)
              for name, (flags, fault, _) in KILLED.items()}
    fulls = {_full(root, flags): flags[0] for flags, _, _ in KILLED.values()}  # async saves leave the curve as it is
    commands = [(_args(pair_data, full, extra=[*TWO, flag]), root) for full, flag in fulls.items()]
    commands += [(_args(pair_data, root / name, extra=[*TWO, *flags, f"--ckpt_path={_last(root / name)}"]), root)
                 for name, (flags, _, _) in KILLED.items()]
    run_commands(commands, nproc=2, plan=root / "plan.json")
    return root, killed


def _last(run: Path) -> Path:
    return run / "ckpt" / "last.ckpt"


def _full(root: Path, flags: list[str]) -> Path:
    """The uninterrupted run of the strategy that ``flags`` (``--trainer.strategy=NAME`` first) name."""
    return root / f"full-{flags[0].partition('=')[2]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(KILLED))
def test_two_processes_killed_then_resumed_reproduce_the_losses(two_process_runs: tuple[Path, dict[str, Any]],
                                                                 name: str) -> None:
    """2 processes, a checkpoint every step. ``ddp2``: SIGKILL before step 5 (mid-epoch), resumed from last.ckpt.
    The others: SIGKILL during step 2's last.ckpt: of both ranks after they wrote its shards (zero3), or of rank 1
    alone before it wrote anything while rank 0 goes on writing (DeepSpeed, which used to overwrite
    <dir>/checkpoint/ in place: mixed state), or of both ranks while their worker threads write it in the background
    (``async_save``: the loop has gone on); last.ckpt is step 1's, whole. Every later step of the resume equals the
    uninterrupted run within 1e-6."""
    root, killed = two_process_runs
    flags, fault, start = KILLED[name]
    _assert_killed(killed[name])
    if fault.startswith("kill:save"):
        assert killed[name]["step"] == 1
        if fault.endswith("save=4"):
            assert killed[name]["partial"]  # the kill hit the staged save
    err = _resume_error(_full(root, flags), root / name, start)
    print(f"{name} ({fault}): resumed from step {start}, steps {start}..{STEPS - 1} max abs loss diff = {err:.2e}")
    assert err <= 1e-6


@pytest.mark.multiprocess
def test_kill_during_checkpoint_save_keeps_previous(pair_data: Path, tmp_path: Path) -> None:
    """SIGKILL half-way through writing a checkpoint: last.ckpt is still the previous, complete one."""
    out = tmp_path / "run"
    # Saves per step: epoch=0-step=N.ckpt then last.ckpt; save #4 is step 2's last.ckpt.
    with pytest.raises(RuntimeError, match="command failed"):
        run_cli(_args(pair_data, out, extra=["--trainer.devices=1"]), env={"LIGHTNING_LLM_FAULT": "kill:save=4"})
    last = out / "ckpt" / "last.ckpt"
    ckpt = torch.load(last, weights_only=False)
    assert ckpt["global_step"] == 1
    leftovers = [p.name for p in (out / "ckpt").iterdir() if p.name.startswith(".last.ckpt.tmp")]
    assert leftovers, "the kill should have hit the temp file"
    for p in (out / "ckpt").glob("*.ckpt"):  # every file under a final name is complete
        torch.load(p, weights_only=False)


def test_nan_loss_stops_with_step_and_keeps_checkpoint(pair_data: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(_args(pair_data, out, extra=["--trainer.devices=1", "--model.optim.lr=1e30"])) != 0
    err = capsys.readouterr().err
    assert "train_loss is nan at step" in err or "train_loss is inf at step" in err, err[-3000:]
    last = torch.load(out / "ckpt" / "last.ckpt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point())


@pytest.mark.multiprocess
def test_dead_rank_fails_whole_job_naming_it(pair_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is killed mid-run: the job exits non-zero quickly and the launcher names the failed rank (torchrun, the
    launcher users run, not the tests' zygote)."""
    monkeypatch.setenv("LIGHTNING_LLM_TEST_LAUNCHER", "torchrun")
    with pytest.raises(RuntimeError) as info:
        run_cli(_args(pair_data, tmp_path / "r", batch=4, extra=["--trainer.devices=2", "--trainer.strategy=ddp"]),
                nproc=2, env={"LIGHTNING_LLM_FAULT": "kill:step=2:rank=1"}, timeout=180)
    msg = str(info.value)
    assert "rank" in msg and "1" in msg and "SIGKILL" in msg


def test_fault_spec_parsing() -> None:
    assert parse_fault("kill:step=3:rank=1") == {"action": "kill", "step": 3, "rank": 1}
    with pytest.raises(ValueError, match="step=K"):
        parse_fault("kill:when=3")


def test_fuzzed_pair_files_fail_with_file_and_line(pair_data: Path, tmp_path: Path) -> None:
    """Random corruptions of a valid file: either it still parses, or a DataError names file:line — never a crash."""
    rng = random.Random(0)
    good = (pair_data / "train.json").read_bytes().splitlines()
    mutations = [
        lambda line: line[: rng.randrange(1, len(line))],  # truncated line (may cut UTF-8 in half)
        lambda line: line.replace(b'"sentence1"', b'"sentence_1"'),  # missing field
        lambda line: line.replace(b'"label": "1"', b'"label": 1').replace(b'"sentence2": "', b'"sentence2": ["'),
        lambda line: b"\xff\xfe" + line,  # invalid bytes
        lambda line: b'{"sentence1": "' + b"x" * 200_000 + b'", "sentence2": "y", "label": "0"}',  # huge line
        lambda line: b"[1, 2, 3]",
        lambda line: b"null",
    ]
    for trial in range(14):
        d = tmp_path / f"f{trial}"
        d.mkdir()
        (d / "tokenizer").symlink_to(pair_data / "tokenizer")
        lines = list(good)
        i = rng.randrange(len(lines))
        lines[i] = mutations[trial % len(mutations)](lines[i])
        (d / "train.json").write_bytes(b"\n".join(lines) + b"\n")
        for name in ("dev.json", "test.json"):
            (d / name).write_bytes((pair_data / name).read_bytes())
        dm = SentencePairDataModule(str(d), str(d / "tokenizer"), max_length=32)
        try:
            dm.setup("fit")
        except DataError as e:
            assert re.search(r"train\.json:\d+: ", str(e)), str(e)  # names the file and the line
        else:
            assert len(dm.datasets["fit"]) == len(read_records(d / "train.json"))


def test_layout_free_save_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save of the engine's sharded format that dies after writing its shards (before it is published) leaves the
    previous checkpoint in place, whole; the next save replaces it and leaves no staging directory behind."""
    import torch

    from lightning_llm.strategies.engine import hybrid_checkpoint as hc

    module = torch.nn.Linear(4, 4)
    path = tmp_path / "last.ckpt"

    def save(step: int) -> None:
        module.weight.data.fill_(float(step))
        hc.save_hybrid(path, module=module, optimizers=[], metadata={"global_step": step}, layout={},
                       is_global_zero=True)

    save(1)
    real = hc.dcp.save

    def dies_after_writing(state: Any, checkpoint_id: Any, **kwargs: Any) -> Any:
        real(state, checkpoint_id=checkpoint_id, **kwargs)
        raise RuntimeError("killed during the save")

    monkeypatch.setattr(hc.dcp, "save", dies_after_writing)
    with pytest.raises(RuntimeError, match="killed"):
        save(2)
    loaded = hc.consolidated_state_dict(path)
    assert loaded["global_step"] == 1 and bool((loaded["state_dict"]["weight"] == 1.0).all())
    monkeypatch.setattr(hc.dcp, "save", real)
    save(3)
    loaded = hc.consolidated_state_dict(path)
    assert loaded["global_step"] == 3 and bool((loaded["state_dict"]["weight"] == 3.0).all())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_publish_replaces_a_file_or_directory_in_one_step(tmp_path: Path) -> None:
    from lightning_llm.reliability import publish, staging_path

    target = tmp_path / "last.ckpt"
    target.write_text("old single-file checkpoint")
    staged = staging_path(target)
    staged.mkdir()
    (staged / "meta.pt").write_text("new")
    publish(staged, target)
    assert target.is_dir() and (target / "meta.pt").read_text() == "new" and not staged.exists()
