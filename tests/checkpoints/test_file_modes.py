"""Files the product writes atomically (exports, prepared data, checkpoints) end with the mode a plain ``open(path,
"w")`` gives under the user's umask, as the files next to them do: on a shared cluster a teammate can read them.
Every atomic write starts at ``files.fresh_sibling``; this checks each kind of output under two umasks."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.fixture(params=[0o022, 0o002], ids=["umask022", "umask002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _plain(tmp_path: Path) -> tuple[int, int]:
    """The modes a plain file write and a plain mkdir give here, now."""
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "plain_dir").mkdir()
    return _mode(tmp_path / "plain.txt"), _mode(tmp_path / "plain_dir")


def test_atomic_open_gives_a_plain_writes_mode(tmp_path: Path, umask: int) -> None:
    from lightning_llm.files import atomic_open

    file_mode, _ = _plain(tmp_path)
    assert file_mode == 0o666 & ~umask
    with atomic_open(tmp_path / "new.json") as f:
        f.write("{}")
    assert _mode(tmp_path / "new.json") == file_mode
    kept = tmp_path / "kept.json"  # a plain write over an existing file keeps that file's mode
    kept.write_text("old")
    kept.chmod(0o640)
    with atomic_open(kept) as f:
        f.write("new")
    assert kept.read_text() == "new" and _mode(kept) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json", "new.json", "plain.txt", "plain_dir"]


def test_export_checkpoint_and_prepared_data_modes(tmp_path: Path, umask: int) -> None:
    import torch

    from lightning_llm.data import ByteTokenizer
    from lightning_llm.data.corpus.prepare import CorpusSource, prepare_corpus
    from lightning_llm.data.corpus.token_store import TokenizerSpec
    from lightning_llm.export.files import ExportSources, write_model_directory
    from lightning_llm.models import build_model
    from lightning_llm.peft import PeftConfig, apply_peft, export_adapter
    from lightning_llm.reliability import AtomicCheckpointIO, staged_directory

    file_mode, dir_mode = _plain(tmp_path)
    model = build_model("debug", family="decoder")
    with staged_directory(tmp_path / "hf", flag="--to") as d:
        write_model_directory(model, d, ExportSources(tokenizer=None))
    export = tmp_path / "hf"
    assert _mode(export) == dir_mode
    files = {p.name: _mode(p) for p in export.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= set(files)
    assert files == dict.fromkeys(files, file_mode), files

    cfg = PeftConfig(method="lora")
    export_adapter(apply_peft(build_model("debug", family="decoder"), cfg), cfg, tmp_path / "adapter")
    files = {p.name: _mode(p) for p in (tmp_path / "adapter").iterdir()}
    assert "adapter_model.safetensors" in files and files == dict.fromkeys(files, file_mode), files

    AtomicCheckpointIO().save_checkpoint({"step": torch.tensor(3)}, tmp_path / "ckpt" / "last.ckpt")
    assert _mode(tmp_path / "ckpt" / "last.ckpt") == file_mode

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one document\n\nanother one\n")
    store, built = prepare_corpus(CorpusSource((str(corpus),)), spec=TokenizerSpec.of(ByteTokenizer(), vocab_size=259),
                                  cache_dir=tmp_path / "cache", num_proc=1)
    assert built
    written = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    assert any(p.name.endswith(".json") for p in written), written
    assert {p.name: _mode(p) for p in written} == {p.name: file_mode for p in written}
