"""`lightning_llm plot RUN_DIR`: loss / throughput PNG from CSVLogger metrics, newest or all versions, clear errors."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from lightning_llm.cli import main as cli_main
from lightning_llm.tools.plot import find_metrics, main, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_metrics(version_dir: Path, steps: int = 20, *, val_every: int = 5, offset: float = 0.0) -> Path:
    """A CSVLogger-shaped file: sparse rows (train metrics each step, val_loss every ``val_every`` steps)."""
    version_dir.mkdir(parents=True, exist_ok=True)
    lines = ["epoch,step,train_loss,train_tokens_per_s,val_loss,val_ppl"]
    for s in range(steps):
        lines.append(f"0,{s},{5.0 - 0.1 * s + offset},{1000 + 10 * s},,")
        if (s + 1) % val_every == 0:
            lines.append(f"0,{s},,,{4.8 - 0.1 * s + offset},{2.0}")
    path = version_dir / "metrics.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82"), "PNG truncated (no IEND chunk)"
    return width, height


def test_plot_command_writes_valid_png(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "pretrain_debug"
    _write_metrics(run / "version_0")
    out = tmp_path / "curves.png"
    assert cli_main(["plot", str(run), "--out", str(out)]) == 0
    width, height = _png_size(out)
    print(f"PNG {out.stat().st_size} bytes, {width}x{height}")
    assert out.stat().st_size > 5000 and width > 400 and height > 200
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic write left no temp file


def test_newest_version_by_default_all_with_flag(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "version_0")
    _write_metrics(tmp_path / "version_2", offset=1.0)
    _write_metrics(tmp_path / "version_10", offset=2.0)  # numeric order, not lexicographic
    assert find_metrics(tmp_path) == [tmp_path / "version_10" / "metrics.csv"]
    assert len(find_metrics(tmp_path, all_versions=True)) == 3
    assert find_metrics(tmp_path / "version_2") == [tmp_path / "version_2" / "metrics.csv"]
    assert main([str(tmp_path), "--all"]) == 0
    _png_size(tmp_path / "metrics.png")  # default output: RUN_DIR/metrics.png


def test_sparse_rows_are_read_per_column(tmp_path: Path) -> None:
    series = read_metrics(_write_metrics(tmp_path / "version_0", steps=20, val_every=5))
    assert len(series["train_loss"]) == 20 and len(series["val_loss"]) == 4
    assert series["val_loss"][0] == (4.0, pytest.approx(4.4))


def test_step_time_and_loss_only_runs(tmp_path: Path) -> None:
    d = tmp_path / "version_0"
    d.mkdir()
    (d / "metrics.csv").write_text("epoch,step,train_loss,pp/step_time_s\n0,0,3.0,0.5\n0,1,2.5,0.4\n")
    assert main([str(d), "--out", str(tmp_path / "a.png")]) == 0
    _png_size(tmp_path / "a.png")


@pytest.mark.parametrize("layout", ["missing", "empty_dir", "no_columns"])
def test_clear_error_naming_the_path(tmp_path: Path, layout: str, capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    if layout != "missing":
        run.mkdir()
    if layout == "no_columns":
        (run / "metrics.csv").write_text("epoch,step,lr\n0,0,0.1\n")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    print(err)
    assert len(err) == 1 and err[0].startswith("lightning_llm plot: error: ") and str(run) in err[0]
    assert not (run / "metrics.png").exists()
