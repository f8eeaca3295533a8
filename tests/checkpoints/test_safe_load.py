"""Loading a checkpoint never runs code from it (``lightning_llm.checkpoint.safe_load``).

Real checkpoints of short runs (one device, the native engine's zero3, DeepSpeed's zero2) and the pre-engine layouts
get one object each whose unpickling runs ``touch MARKER`` (``tests/safe_load_fixtures.py``): in a ``.ckpt`` file, the
engine's ``meta.pt``, DCP's ``.metadata``, a DeepSpeed optimizer file, a legacy ``meta.pt``, a pipeline-stage file,
ZeRO-1/2's ``model.pt``, and an object stored inside a DCP shard. ``export`` and ``fit --ckpt_path`` under every
strategy refuse each with exit code 2 and one line naming the file, and the marker is never written; with the
opt-in (``LIGHTNING_LLM_TRUST_CHECKPOINT=1``) the same files do run the command, so the payloads are live. The
strategies' own ``load_checkpoint`` refuse too when the CLI's check is bypassed (a Trainer driven from Python)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import lightning_llm.cli.app as cli_app
from lightning_llm.checkpoint import TRUST_ENV, verify_checkpoint
from lightning_llm.cli import main
from lightning_llm.testing import one_error_line_from_ranks, torchrun_cli_fails
from tests.safe_load_fixtures import CRAFTED, craft, dcp_object_checkpoint, fit_args, legacy_layouts, saved_run

PREFIX = "lightning_llm: error: "
EXPORT_PREFIX = "lightning_llm export: error: "
REFUSED = "refused: it holds objects other than tensors and plain data (posix.system), and loading them could run code"
FILES = {  # the file each crafted checkpoint's error names, relative to the checkpoint
    **{name: rel for name, (_, rel) in CRAFTED.items()},
    "dcp_object": "the object 'model.payload' in a shard",
}
STRATEGIES = ["auto", "ddp", "zero3", "tp", "pp", "deepspeed_zero2"]
WEIGHT = "model.layers.0.attn_norm.weight"  # a weight of the debug decoder (LightningModule names)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    out = {"plain": saved_run(root / "plain"), "engine": saved_run(root / "engine", "--trainer.strategy=zero3"),
           "deepspeed": saved_run(root / "deepspeed", "--trainer.strategy=deepspeed_zero2")}
    out.update(legacy_layouts(out["plain"], root))
    return out


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("marker") / "MARKER"


@pytest.fixture(scope="module")
def crafted(sources: dict[str, Path], marker: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("crafted")
    out = {name: craft(sources, name, root, marker) for name in CRAFTED}
    out["dcp_object"] = dcp_object_checkpoint(sources["engine"], root, marker)
    assert not marker.exists()
    return out


@pytest.fixture(autouse=True)
def _no_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test but the trusted one ends with the marker unwritten."""
    yield
    if "trusted" not in request.node.name and "marker" in request.fixturenames:
        assert not request.getfixturevalue("marker").exists(), "a crafted checkpoint ran its command"


def _error_line(err: str, prefix: str) -> str:
    lines = [ln for ln in err.splitlines() if prefix in ln]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    print(lines[0])
    return lines[0][lines[0].index(prefix) + len(prefix):]


def _refusal(name: str, path: Path, flag: str) -> str:
    where = FILES[name]
    return f"{flag}={path}: {where + ': ' if where else ''}{REFUSED}"


def test_untouched_checkpoints_pass(sources: dict[str, Path]) -> None:
    """The allow-lists admit everything our strategies, Lightning and DeepSpeed write (DeepSpeed's optimizer files
    hold its loss scaler, stage enum and fragment addresses; DCP's index its metadata classes)."""
    for name, path in sources.items():
        verify_checkpoint(path, name=name)


@pytest.mark.parametrize("name", [*CRAFTED, "dcp_object"])
def test_export_refuses(crafted: dict[str, Path], marker: Path, tmp_path: Path, name: str,
                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(crafted[name]), "--to", str(out)]) == 2
    line = _error_line(capsys.readouterr().out, EXPORT_PREFIX)
    assert line.startswith(_refusal(name, crafted[name], "CKPT")), line
    assert not out.exists() and not marker.exists()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fit_refuses_under_every_strategy(crafted: dict[str, Path], marker: Path, tmp_path: Path, strategy: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``fit --ckpt_path`` of every crafted checkpoint under each strategy (one process): refused by the CLI before
    the model, data or strategy are built."""
    for name in CRAFTED:
        args = fit_args(tmp_path / name, "--trainer.devices=1", f"--trainer.strategy={strategy}",
                        f"--ckpt_path={crafted[name]}")
        assert main(args) == 2, name
        line = _error_line(capsys.readouterr().err, PREFIX)
        assert line.startswith(_refusal(name, crafted[name], "--ckpt_path")), line
        assert not marker.exists(), name


@pytest.mark.parametrize("strategy, name", [
    ("auto", "ckpt"), ("zero3", "engine_meta"), ("tp", "engine_metadata"), ("pp", "engine_meta"),
    ("zero3", "dcp_object"), ("deepspeed_zero2", "deepspeed"),
])
def test_strategies_refuse_on_their_own(sources: dict[str, Path], crafted: dict[str, Path], marker: Path, tmp_path: Path, strategy: str,
                                        name: str, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """With the CLI's check bypassed, the checkpoint reaches the strategy's own ``load_checkpoint`` (as from a
    Trainer driven in Python): each refuses it too. A one-device run reads a plain ``.ckpt`` through torch's
    ``weights_only`` load; the engine checks ``meta.pt`` and ``.metadata`` and its planner the objects in shards (a
    resume reads only the keys the model has, so the stored object is put under a weight's name here)."""
    monkeypatch.setattr(cli_app, "verify_checkpoint", lambda *a, **k: None)
    path = crafted[name]
    if name == "dcp_object":  # make the resume read it: the payload in a weight's place
        path = dcp_object_checkpoint(sources["engine"], tmp_path, marker, key=WEIGHT)
    assert main(fit_args(tmp_path, "--trainer.devices=1", f"--trainer.strategy={strategy}",
                         f"--ckpt_path={path}")) == 2
    line = _error_line(capsys.readouterr().err, PREFIX)
    where = f"the object 'model.{WEIGHT}' in a shard" if name == "dcp_object" else FILES[name]
    assert line.startswith(f"--ckpt_path={path}: {where + ': ' if where else ''}{REFUSED}"), line


def test_hf_backbone_weights_refused(tmp_path: Path, marker: Path, tiny_llama: Callable[..., Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A backbone directory whose ``pytorch_model.bin`` was crafted: one line naming it."""
    from tests.safe_load_fixtures import Payload
    from safetensors.torch import load_file

    d = Path(shutil.copytree(tiny_llama(), tmp_path / "llama"))
    weights = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({**weights, "payload": Payload(marker)}, d / "pytorch_model.bin")
    assert main(fit_args(tmp_path, f"--model.backbone={d}")) == 2
    line = _error_line(capsys.readouterr().err, PREFIX)
    assert line.startswith(f"{d / 'pytorch_model.bin'}: {REFUSED}"), line


@pytest.fixture
def trusting(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The opt-in, and torch's allow-list restored afterwards (the opt-in admits what a loaded file names)."""
    before = torch.serialization.get_safe_globals()
    monkeypatch.setenv(TRUST_ENV, "1")
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


@pytest.mark.parametrize("name", [*CRAFTED, "dcp_object"])
def test_trusted_opt_in_runs_the_payload(crafted: dict[str, Path], marker: Path, tmp_path: Path, name: str,
                                         trusting: None, caplog: pytest.LogCaptureFixture) -> None:
    """The control: with ``LIGHTNING_LLM_TRUST_CHECKPOINT=1`` each crafted file does run its command (so each
    refusal above stopped a live payload), and a zip-format file's imports are named in a warning first."""
    marker.unlink(missing_ok=True)
    # What the payload leaves behind may not export (DCP's CheckpointException is a BaseException): the marker counts.
    with contextlib.suppress(Exception, CheckpointException):
        main(["export", str(crafted[name]), "--to", str(tmp_path / "hf")])
    assert marker.exists(), name
    marker.unlink()
    if name not in ("engine_metadata", "dcp_object"):  # .metadata is a bare pickle; shards are checked per object
        assert any("posix.system" in r.getMessage() and TRUST_ENV in r.getMessage() for r in caplog.records)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, name", [("zero3", "engine_meta"), ("ddp", "ckpt"),
                                            ("deepspeed_zero2", "deepspeed")])
def test_refused_under_torchrun(crafted: dict[str, Path], marker: Path, tmp_path: Path, strategy: str,
                                name: str) -> None:
    """2 processes: every rank refuses before loading, rank 0 prints the one line, every rank exits with 2."""
    out = torchrun_cli_fails(fit_args(tmp_path, "--trainer.devices=2", f"--trainer.strategy={strategy}",
                                      f"--ckpt_path={crafted[name]}"), tmp_path)
    line = one_error_line_from_ranks(out)  # rank 0 alone prints; every rank exits with 2
    print(line)
    assert line[line.index(PREFIX):].startswith(PREFIX + _refusal(name, crafted[name], "--ckpt_path")), line
    assert not marker.exists()
