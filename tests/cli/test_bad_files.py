"""Every file a user hands the CLI that cannot be read or parsed ends the run before training with exit code 2 and
ONE line naming the file (and the line, where the format has lines): a backbone's ``config.json`` and weights, its
tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, ``vocab.txt``), a ``--config`` YAML, a
``--ckpt_path`` and a data file. The backbone and tokenizer are written by ``transformers``/``tokenizers`` here."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_llm.cli import main

REPO = Path(__file__).resolve().parents[2]
PREFIX = "lightning_llm: error: "


@pytest.fixture(scope="module")
def backbone(tiny_llama: Callable[..., Path]) -> Path:
    """A tiny LlamaForCausalLM directory with a BPE ``tokenizers`` tokenizer, as ``save_pretrained`` writes them."""
    return tiny_llama()


def _fit(tmp_path: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), "--trainer.max_steps=1",
            "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.generated_docs=20", *extra]


def _one_line(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    """Run the CLI: exit code 2 and exactly one error line (no usage dump, no traceback); returns its text."""
    rc = main(args)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if PREFIX in ln]
    print(lines)
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "usage:" not in err, err[-3000:]
    return lines[0][lines[0].index(PREFIX) + len(PREFIX):]


def _copy(backbone: Path, tmp_path: Path) -> Path:
    d = tmp_path / "backbone"
    shutil.copytree(backbone, d)
    return d


def test_backbone_config_json(backbone: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(backbone, tmp_path)
    text = (d / "config.json").read_text().splitlines()
    text.insert(2, "  oops,")  # line 3 of the file
    (d / "config.json").write_text("\n".join(text))
    line = _one_line(capsys, _fit(tmp_path, f"--model.backbone={d}"))
    assert line.startswith(f"{d / 'config.json'}:3: malformed JSON: "), line


def test_backbone_weights_cut(backbone: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(backbone, tmp_path)
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    line = _one_line(capsys, _fit(tmp_path, f"--model.backbone={d}"))
    assert line.startswith(f"{weights}: "), line


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_json_files(backbone: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    d = _copy(backbone, tmp_path)
    text = (d / name).read_text().splitlines()
    text.insert(1, "  oops,")  # line 2 of the file
    (d / name).write_text("\n".join(text))
    # The backbone's own tokenizer is the default --data.tokenizer_dir.
    line = _one_line(capsys, _fit(tmp_path, f"--model.backbone={d}"))
    assert line.startswith(f"--data.tokenizer_dir={d}: cannot load tokenizer: {d / name}:2: malformed JSON: "), line


def test_vocab_txt_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = tmp_path / "vocab"
    tok.mkdir()
    (tok / "vocab.txt").write_bytes(b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n\xff\xfeoops\n")
    line = _one_line(capsys, _fit(tmp_path, f"--data.tokenizer_dir={tok}"))
    assert line.startswith(f"--data.tokenizer_dir={tok}: cannot load tokenizer: {tok / 'vocab.txt'}:5: not valid "
                           "UTF-8"), line


@pytest.mark.parametrize("content, expected", [
    ("trainer:\n  max_steps: 1\n model: [\n", ":3: invalid YAML: "),
    ("- a list\n- of things\n", ": expected a mapping of options"),
    (None, ": file not found"),
])
def test_yaml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str) -> None:
    cfg = tmp_path / "my.yaml"
    if content is not None:
        cfg.write_text(content)
    line = _one_line(capsys, [*_fit(tmp_path), "--config", str(cfg)])
    assert line.startswith(f"--config={cfg}{expected}"), line


def test_ckpt_path_cut(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"model.w": torch.randn(64, 64)}, "epoch": 0, "global_step": 1}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:4000])
    line = _one_line(capsys, _fit(tmp_path, f"--ckpt_path={ckpt}"))
    assert line.startswith(f"--ckpt_path={ckpt}: truncated or corrupt file (4000 bytes"), line


def test_data_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "one document"}\n{"text": "two", oops}\n')
    line = _one_line(capsys, _fit(tmp_path, f"--data.data_path={data}"))
    assert line.startswith(f"{data}:2: malformed JSON: "), line
