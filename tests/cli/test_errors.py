"""Bad input ends the run with ONE line naming the file or parameter (exit code 2, no traceback), printed once.

Most cases run the CLI in this process (``main([...])`` on one device); two multi-process tests check sharded
checkpoints (native DCP and DeepSpeed) under torchrun, where every rank must stop and only rank 0 prints.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.checkpoint import CheckpointError, check_engine_dir
from lightning_llm.cli import main
from lightning_llm.strategies import (ExpertParallelStrategy, HybridParallelStrategy, TensorParallelStrategy,
                                      ZeroStrategy)
from lightning_llm.testing import one_error_line_from_ranks, run_cli, torchrun_cli_fails

REPO = Path(__file__).resolve().parents[2]
PREFIX = "lightning_llm: error: "


def _fit_args(out: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), "--trainer.max_steps=2",
            "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={out}",
            f"--data.cache_dir={out / 'cache'}", "--data.generated_docs=40", *extra]


def _with_checkpoints(out: Path) -> list[str]:
    return ["--trainer.enable_checkpointing=true", "--trainer.callbacks+=ModelCheckpoint",
            f"--trainer.callbacks.dirpath={out / 'ckpt'}", "--trainer.callbacks.every_n_train_steps=2"]


def _one_line(err: str) -> str:
    """The single error line of a captured stderr (asserting there is exactly one, and no traceback)."""
    lines = [ln for ln in err.splitlines() if PREFIX in ln]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    print(lines[0])
    return lines[0][lines[0].index(PREFIX):]


def _run_main(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    return _one_line(err)


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _fake_checkpoint(path: Path) -> Path:
    torch.save({"state_dict": {"model.w": torch.randn(128, 128)}, "epoch": 0, "global_step": 2}, path)
    return path


# ------------------------------------------------------------------------------------------- 1. a cut .ckpt file
@pytest.mark.parametrize("damage", ["half", "empty", "zip_not_torch"])
def test_damaged_ckpt_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    ckpt = _fake_checkpoint(tmp_path / "last.ckpt")
    if damage == "half":
        _cut(ckpt)
    elif damage == "empty":
        ckpt.write_bytes(b"")
    else:  # a whole zip archive that torch.save did not write
        import zipfile

        with zipfile.ZipFile(ckpt, "w") as z:
            z.writestr("hello.txt", "not a checkpoint")
    line = _run_main(capsys, _fit_args(tmp_path, "--trainer.devices=1", f"--ckpt_path={ckpt}"))
    expected = {
        "half": f"--ckpt_path={ckpt}: truncated or corrupt file ({ckpt.stat().st_size} bytes, its zip directory is "
                "missing or damaged), not a loadable checkpoint",
        "empty": f"--ckpt_path={ckpt}: empty file (0 bytes), not a loadable checkpoint",
        "zip_not_torch": f"--ckpt_path={ckpt}: not a loadable checkpoint (RuntimeError: file in archive is not in a "
                         "subdirectory: hello.txt)",
    }[damage]
    assert line.startswith(PREFIX + expected), line


# ------------------------------------------------------------------------------------ 2. a damaged DCP directory
def _engine_dir(tmp_path: Path) -> Path:
    from lightning_llm.strategies.engine.hybrid_checkpoint import from_lightning_checkpoint

    return from_lightning_checkpoint(_fake_checkpoint(tmp_path / "src.ckpt"), tmp_path / "sharded")


@pytest.mark.parametrize("damage, message", [
    ("no_index", "incomplete checkpoint directory: .metadata (the index of its shards) is missing"),
    ("bad_index", "corrupt checkpoint directory: .metadata cannot be read ("),
    ("no_shard", "incomplete checkpoint directory: shard __0_0.distcp is missing (1 shard file in its index)"),
    ("cut_shard", "truncated checkpoint directory: shard __0_0.distcp has {size} bytes, its index needs {full}"),
    ("no_meta", "incomplete checkpoint directory: meta.pt (loop, scheduler and optimizer metadata) is missing"),
    ("cut_meta", "meta.pt: truncated or corrupt file ("),
])
def test_damaged_engine_directory_names_what_is_missing(tmp_path: Path, damage: str, message: str) -> None:
    d = _engine_dir(tmp_path)
    check_engine_dir(d, name="X")  # whole: no error
    shard = d / "__0_0.distcp"
    full = shard.stat().st_size
    {"no_index": lambda: (d / ".metadata").unlink(), "bad_index": lambda: _cut(d / ".metadata"),
     "no_shard": shard.unlink, "cut_shard": lambda: _cut(shard), "no_meta": lambda: (d / "meta.pt").unlink(),
     "cut_meta": lambda: _cut(d / "meta.pt")}[damage]()
    size = shard.stat().st_size if shard.exists() else 0
    with pytest.raises(CheckpointError) as info:
        check_engine_dir(d, name="X")
    print(info.value)
    assert str(info.value).startswith("X: " + message.format(size=size, full=full))


def test_converted_engine_directory_is_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_lightning_checkpoint`` stages the directory and publishes it at the end: a conversion that fails
    midway (here the metadata write) leaves the previous conversion intact and no staging directory behind."""
    import lightning_llm.strategies.engine.hybrid_checkpoint as hc

    d = _engine_dir(tmp_path)
    before = sorted(p.name for p in d.iterdir())

    def full_disk(path: Path) -> None:
        raise OSError(f"{path}: disk full")

    monkeypatch.setattr(hc, "atomic_path", full_disk)
    with pytest.raises(OSError, match="disk full"):
        hc.from_lightning_checkpoint(tmp_path / "src.ckpt", d)
    assert sorted(p.name for p in d.iterdir()) == before
    check_engine_dir(d, name="X")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sharded", "src.ckpt"]


def test_damaged_engine_directory_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The check runs in the engine's load_checkpoint, before DCP reads a byte (strategy=zero3 on one device)."""
    d = _engine_dir(tmp_path)
    (d / ".metadata").unlink()
    line = _run_main(capsys, _fit_args(tmp_path, "--trainer.devices=1", "--trainer.strategy=zero3",
                                       f"--ckpt_path={d}"))
    assert line == f"{PREFIX}--ckpt_path={d}: incomplete checkpoint directory: .metadata (the index of its shards) " \
                   "is missing"
    assert not torch.distributed.is_initialized()  # the failed run's process group is gone


@pytest.mark.parametrize("kind", ["engine", "deepspeed", "plain"])
def test_checkpoint_directory_given_to_a_single_file_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              kind: str) -> None:
    """One device / ddp read one .ckpt file: a checkpoint directory is refused in one line naming the strategies
    that read it (was torch.load's IsADirectoryError traceback); the engine's directory then resumes under 3d."""
    if kind == "engine":  # a real one: 2 steps under zero3 on one device, saved by ModelCheckpoint
        assert main(_fit_args(tmp_path, "--trainer.strategy=zero3", *_with_checkpoints(tmp_path))) == 0
        d = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
        assert (d / "meta.pt").is_file()
    else:
        d = tmp_path / "dir"
        d.mkdir()
        if kind == "deepspeed":
            (d / "latest").write_text("global_step2")
    line = _run_main(capsys, _fit_args(tmp_path, f"--ckpt_path={d}"))
    want = {"engine": "is a checkpoint directory of the parallel engine (tp, pp, cp, zero1/2/3, 3d); the strategy "
                      "SingleDeviceStrategy reads one .ckpt file: any layout of the engine resumes it: "
                      "--trainer.strategy=3d",
            "deepspeed": "is a DeepSpeed checkpoint directory; the strategy SingleDeviceStrategy reads one .ckpt "
                         "file: resume it with the DeepSpeed preset that wrote it",
            "plain": "is a directory; the strategy SingleDeviceStrategy reads one .ckpt file: give the .ckpt file "
                     "inside it"}[kind]
    assert line.startswith(f"{PREFIX}--ckpt_path={d} {want}")
    if kind == "engine":  # as the message says: the 3d preset (data parallel, here one device) resumes it
        assert main(_fit_args(tmp_path / "resumed", "--trainer.strategy=3d", "--trainer.max_steps=4",
                              f"--ckpt_path={d}")) == 0


def test_shard_corrupted_in_the_middle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes overwritten inside a shard (sizes intact, so only reading finds it): DCP's failure, raised on every
    rank, becomes one line. The bytes are the head of the shard's first record (DCP keeps no checksums: zeroed tensor
    data inside a record would load as zeros)."""
    one = ["--trainer.devices=1", "--trainer.strategy=zero3"]
    assert main(_fit_args(tmp_path, *one, *_with_checkpoints(tmp_path))) == 0
    ckpt = next((tmp_path / "ckpt").glob("*.ckpt"))
    shard = ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(bytes(64) + data[64:])
    line = _run_main(capsys, _fit_args(tmp_path, *one, "--trainer.max_steps=3", f"--ckpt_path={ckpt}"))
    assert line.startswith(f"{PREFIX}--ckpt_path={ckpt}: corrupt checkpoint directory: reading its shards failed on "
                           "rank 0 ("), line


def _deepspeed_dir(tmp_path: Path, *, ranks: int = 2) -> Path:
    """The file layout of a DeepSpeed ZeRO-1/2 checkpoint written by ``ranks`` processes (tiny stand-in contents;
    the real thing is checked by the torchrun test below)."""
    d = tmp_path / "ds.ckpt"
    (d / "checkpoint").mkdir(parents=True)
    (d / "latest").write_text("checkpoint")
    torch.save({"dp_world_size": ranks, "module": {"w": torch.zeros(4)}}, d / "checkpoint" / "mp_rank_00_model_states.pt")
    for r in range(ranks):
        torch.save({"optimizer_state_dict": {}}, d / "checkpoint" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return d


@pytest.mark.parametrize("damage, message", [
    ("no_latest", "not a DeepSpeed checkpoint directory (no 'latest' file naming its tag)"),
    ("no_tag", "incomplete DeepSpeed checkpoint: 'latest' names checkpoint/, which is missing"),
    ("no_model", "incomplete DeepSpeed checkpoint: checkpoint/mp_rank_00_model_states.pt is missing"),
    ("no_optim", ("incomplete DeepSpeed checkpoint: checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt is missing "
                  "(it was written by 2 ranks)")),
    ("world_size", ("this DeepSpeed ZeRO checkpoint was written by 2 ranks and this run has 3; DeepSpeed cannot "
                    "repartition its optimizer state. Resume with 2 processes")),
])
def test_damaged_deepspeed_directory_names_what_is_missing(tmp_path: Path, damage: str, message: str) -> None:
    import shutil

    from lightning_llm.checkpoint import check_deepspeed_dir

    d = _deepspeed_dir(tmp_path)
    assert check_deepspeed_dir(d, name="X", world_size=2) == 2  # whole, same world size: no error
    assert check_deepspeed_dir(d, name="X") == 2  # weights only (validate/test/predict): any world size
    {"no_latest": lambda: (d / "latest").unlink(), "no_tag": lambda: shutil.rmtree(d / "checkpoint"),
     "no_model": lambda: (d / "checkpoint" / "mp_rank_00_model_states.pt").unlink(),
     "no_optim": lambda: (d / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
     "world_size": lambda: None}[damage]()
    with pytest.raises(CheckpointError) as info:
        check_deepspeed_dir(d, name="X", world_size=3)
    print(info.value)
    assert str(info.value).startswith("X: " + message)


# ------------------------------------------------------------------------------------------- 4. unknown strategy
def test_unknown_strategy_lists_ours_with_a_suggestion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _run_main(capsys, _fit_args(tmp_path, "--trainer.strategy=zero4"))
    assert line.startswith(f"{PREFIX}--trainer.strategy='zero4': unknown strategy; did you mean 'zero3'? "
                           "lightning_llm's: tp, pp, cp, ep, 3d, zero1, zero2, zero3, zero2_offload, zero3_offload, "
                           "deepspeed_zero1, deepspeed_zero2, deepspeed_zero3, deepspeed_zero3_offload, deepspeed_zero3_nvme; "
                           "Lightning's: auto, ddp, "), line
    assert "fsdp" in line and "single_tpu" not in line


def test_strategy_class_path_runs_and_a_wrong_one_is_one_line(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A bare class path (no init args) is instantiated (it stayed a string, which Trainer refused); a path that names
    no Strategy class is one line."""
    assert main(_fit_args(tmp_path, "--trainer.strategy=lightning_llm.strategies.presets.ZeroStrategy")) == 0
    line = _run_main(capsys, _fit_args(tmp_path, "--trainer.strategy=lightning_llm.strategies.presets.NoSuchStrategy"))
    assert "--trainer.strategy='lightning_llm.strategies.presets.NoSuchStrategy': unknown strategy (a class path " \
           "must name a Strategy subclass)" in line, line


LAYOUTS: dict[str, Callable[[], Any]] = {
    "tp": TensorParallelStrategy, "ep": ExpertParallelStrategy, "zero3": lambda: ZeroStrategy(stage=3),
    "3d": HybridParallelStrategy}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_processes_miscounted_by_devices_are_refused(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """torchrun started 2 processes, the config says ``devices: 1`` (as configs/lora_qwen3_5.yaml does): the native
    engine's layouts refuse it when the Trainer is built, with Lightning's own line for ddp (the CLI prints it as its
    one error line); they went on to an IndexError from ``root_device`` on rank 1 while rank 0 waited for it. Rank 0
    of torchrun's environment, faked: nothing is launched."""
    for key, value in {"TORCHELASTIC_RUN_ID": "test", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                       "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=re.escape("You set `devices=1` and `num_nodes=1` in Lightning, but the "
                                                   "product (1 * 1) does not match the world size (2).")):
        pl.Trainer(accelerator="cpu", devices=1, strategy=LAYOUTS[layout](), logger=False)


# ------------------------------------------------------------------------------------------------ 5. batch sizes
def _datamodules() -> list[type]:
    from lightning_llm import data

    return [data.TextDataModule, data.SentencePairDataModule, data.SyntheticPairDataModule,
            data.InstructionDataModule, data.PromptDataModule]


@pytest.mark.parametrize("cls", _datamodules(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, param", [
    ({"eval_batch_size": -1}, "--data.eval_batch_size"), ({"eval_batch_size": 0}, "--data.eval_batch_size"),
    ({"batch_size": 0}, "--data.batch_size"), ({"batch_size": -2}, "--data.batch_size"),
])
def test_batch_sizes_below_one_are_refused_at_construction(tmp_path: Path, cls: type, kwargs: dict[str, int],
                                                           param: str) -> None:
    extra = {"out_dir": str(tmp_path / "gen")} if cls.__name__ == "SyntheticPairDataModule" else {}
    with pytest.raises(ValueError, match=f"^{param} must be >= 1"):
        cls(**kwargs, **extra)
    assert not (tmp_path / "gen").exists()  # refused before generating any data


def test_eval_batch_size_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = _run_main(capsys, _fit_args(tmp_path, "--data.eval_batch_size=-1"))
    assert line == f"{PREFIX}--data.eval_batch_size must be >= 1 (or null for --data.batch_size), got -1"


# ---------------------------------------------------------------------------------------------- 6. rank 0 only
@pytest.mark.parametrize("rank", ["0", "1"])
def test_error_printed_by_global_rank_zero_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, rank: str) -> None:
    monkeypatch.setenv("RANK", rank)
    rc = main(_fit_args(tmp_path, "--trainer.strategy=zero4"))
    err = capsys.readouterr().err
    assert rc == 2
    assert (PREFIX in err) == (rank == "0"), err


# ------------------------------------------------------------------------------- 7. exact resume, no warning
def test_exact_resume_does_not_warn_that_the_dataloader_is_not_resumable(tmp_path: Path) -> None:
    """A mid-epoch resume: Lightning warns the DataLoader is "not resumable", but our datamodule restores the
    position (tests/checkpoints/test_reliability.py checks the losses). That one warning is filtered; others still show."""
    assert main(_fit_args(tmp_path, *_with_checkpoints(tmp_path))) == 0
    ckpt = next((tmp_path / "ckpt").glob("*.ckpt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(_fit_args(tmp_path, "--trainer.max_steps=3", f"--ckpt_path={ckpt}")) == 0
    messages = [str(w.message) for w in caught]
    print("\n".join(m[:100] for m in messages))
    assert not [m for m in messages if "dataloader is not resumable" in m]
    # Another warning of the same resume still shows (the checkpoint's ModelCheckpoint is not configured now).
    assert any("callbacks used to create the checkpoint need to be provided" in m for m in messages)


# --------------------------------------------------------------------------- multi-process: sharded checkpoints
def _torchrun_fails(args: list[str], cwd: Path) -> str:
    return torchrun_cli_fails(args, cwd, timeout=120)


def _one_line_from_ranks(out: str) -> str:
    line = one_error_line_from_ranks(out)
    print(line)
    return line[line.index(PREFIX):]


@pytest.mark.multiprocess
def test_cut_native_shard_under_torchrun(tmp_path: Path) -> None:
    """zero3 on 2 processes, one shard cut in half: both ranks stop before DCP reads, rank 0 prints one line."""
    out = tmp_path / "run"
    run_cli(_fit_args(out, "--trainer.devices=2", "--trainer.strategy=zero3", *_with_checkpoints(out)), nproc=2,
            cwd=tmp_path)
    ckpt = next((out / "ckpt").glob("*.ckpt"))
    shard = ckpt / "__1_0.distcp"
    full = shard.stat().st_size
    _cut(shard)
    log = _torchrun_fails(_fit_args(out, "--trainer.devices=2", "--trainer.strategy=zero3", "--trainer.max_steps=3",
                                    f"--ckpt_path={ckpt}"), tmp_path)
    line = _one_line_from_ranks(log)
    assert line == f"{PREFIX}--ckpt_path={ckpt}: truncated checkpoint directory: shard __1_0.distcp has " \
                   f"{shard.stat().st_size} bytes, its index needs {full}"


@pytest.mark.multiprocess
def test_deepspeed_checkpoint_at_another_world_size_and_cut(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """deepspeed_zero2 saved by 2 processes: a resume on 1 device names both world sizes and the ways out; with a
    rank's optimizer file cut, a resume on 2 processes stops on both ranks with one line naming the file."""
    out = tmp_path / "run"
    two = ["--trainer.devices=2", "--trainer.strategy=deepspeed_zero2"]
    run_cli(_fit_args(out, *two, *_with_checkpoints(out)), nproc=2, cwd=tmp_path)
    ckpt = next((out / "ckpt").glob("*.ckpt"))

    line = _run_main(capsys, _fit_args(tmp_path / "one", "--trainer.devices=1", "--trainer.strategy=deepspeed_zero2",
                                       "--trainer.max_steps=3", f"--ckpt_path={ckpt}"))
    assert line.startswith(f"{PREFIX}--ckpt_path={ckpt}: this DeepSpeed ZeRO checkpoint was written by 2 ranks and "
                           "this run has 1; DeepSpeed cannot repartition its optimizer state. Resume with 2 processes "
                           "(--trainer.devices x --trainer.num_nodes), or convert it once with 'python -m "
                           "deepspeed.checkpoint.ds_to_universal --input_folder "), line
    assert line.endswith('{"checkpoint": {"load_universal": true}} in --trainer.strategy.config'), line

    optim = ckpt / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _cut(optim)
    log = _torchrun_fails(_fit_args(out, *two, "--trainer.max_steps=3", f"--ckpt_path={ckpt}"), tmp_path)
    assert _one_line_from_ranks(log) == (
        f"{PREFIX}--ckpt_path={ckpt}: checkpoint/{optim.name}: truncated or corrupt file ({optim.stat().st_size} "
        "bytes, its zip directory is missing or damaged), not a loadable checkpoint")
