"""``lightning_llm plot RUN_DIR [--out PNG] [--all]``: loss and throughput curves from CSVLogger metrics.

RUN_DIR is a CSVLogger version directory (holding ``metrics.csv``) or a run root holding ``version_*/``
directories (then the newest version is drawn, or every version with ``--all``). The figure has one panel of
losses (``train_loss`` per step as a line, ``val_loss`` and other ``*_loss`` columns as markers), one of rates
(``*_tokens_per_s``, ``*samples_per_s``) and one of step times (``*step_time*`` / ``*_step_s``) when such
columns exist. The PNG is written atomically (temp file + rename), by default to ``RUN_DIR/metrics.png``.
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import re
import sys
from pathlib import Path

from lightning_llm.files import atomic_open

log = logging.getLogger(__name__)

PROG = "lightning_llm plot"


class PlotError(Exception):
    """Bad input to the plot command (the message names the path)."""


def _version_key(path: Path) -> tuple[int, float]:
    """Sort key of a metrics.csv: the version number of its directory, then its modification time."""
    m = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(m.group(1)) if m else -1, path.stat().st_mtime)


def find_metrics(run_dir: str | Path, *, all_versions: bool = False) -> list[Path]:
    """The metrics.csv files to draw: RUN_DIR's own, else the newest (or every) ``*/metrics.csv`` below it."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlotError(f"{root}: no such directory")
    if (root / "metrics.csv").is_file():
        return [root / "metrics.csv"]
    # A logger root (name/version_N/) or one level above it (save_dir/name/version_N/).
    found = sorted({*root.glob("*/metrics.csv"), *root.glob("*/*/metrics.csv")}, key=_version_key)
    if not found:
        raise PlotError(f"{root}: no metrics.csv in it or in its version_*/ subdirectories "
                        "(is this a CSVLogger run directory?)")
    return found if all_versions else found[-1:]


def read_metrics(path: Path) -> dict[str, list[tuple[float, float]]]:
    """Column name -> [(step, value)] for every numeric, non-empty cell (CSVLogger writes sparse rows)."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise PlotError(f"{path}: no rows")
    if "step" not in rows[0]:
        raise PlotError(f"{path}: no 'step' column (not a CSVLogger metrics file?)")
    series: dict[str, list[tuple[float, float]]] = {}
    for i, row in enumerate(rows):
        try:
            step = float(row["step"]) if row.get("step") else float(i)
        except ValueError:
            step = float(i)
        for name, cell in row.items():
            if name in ("step", "epoch") or name is None or not cell:
                continue
            try:
                value = float(cell)
            except ValueError:
                continue
            if math.isfinite(value):
                series.setdefault(name, []).append((step, value))
    return series


def _is_loss(name: str) -> bool:
    return name.endswith(("loss", "loss_step", "loss_epoch"))


def _is_rate(name: str) -> bool:
    return name.endswith(("tokens_per_s", "samples_per_s"))


def _is_step_time(name: str) -> bool:
    return "step_time" in name or name.endswith(("step_s", "_step_ms"))


def plot_runs(files: list[Path], out: Path, *, title: str | None = None) -> Path:
    """Draw the metrics of ``files`` into one PNG at ``out`` (atomically); returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    data = [(f, read_metrics(f)) for f in files]
    names = sorted({n for _, s in data for n in s})
    panels = [("loss", [n for n in names if _is_loss(n)]), ("throughput", [n for n in names if _is_rate(n)]),
              ("step time", [n for n in names if _is_step_time(n)])]
    panels = [(label, cols) for label, cols in panels if cols]
    if not panels:
        raise PlotError(f"{', '.join(map(str, files))}: no loss, *_tokens_per_s, samples_per_s or step time columns "
                        f"(columns: {', '.join(names) or 'none'})")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (label, cols) in zip(axes[0], panels):
        for f, series in data:
            prefix = f"{f.parent.name}: " if len(data) > 1 else ""
            for col in cols:
                pts = series.get(col)
                if not pts:
                    continue
                x, y = zip(*pts)
                # Per-step series as lines; sparse ones (validation every N steps) as markers joined thinly.
                sparse = len(pts) < 0.5 * max(len(v) for v in series.values())
                ax.plot(x, y, marker="o" if sparse else None, markersize=4, linewidth=1.0 if sparse else 1.3,
                        label=f"{prefix}{col}")
        ax.set_xlabel("step")
        ax.set_ylabel({"loss": "loss", "throughput": "per second", "step time": "seconds"}[label])
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or (str(files[0].parent) if len(files) == 1 else str(files[0].parent.parent)), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    with atomic_open(out, "wb") as f:  # a reader never sees a half-written PNG
        f.write(buf.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a CSVLogger version directory or a run root with version_*/ directories")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    parser.add_argument("--all", action="store_true", help="draw every version under RUN_DIR, not only the newest")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else Path(args.run_dir) / "metrics.png"
    try:
        files = find_metrics(args.run_dir, all_versions=args.all)
        plot_runs(files, out)
    except (PlotError, OSError, csv.Error, UnicodeDecodeError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(str(f) for f in files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
