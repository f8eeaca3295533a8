"""benchmarks/gpu/hybrid.py on the CPU (``--smoke``: tiny sizes, the torch paths): every row runs and reports, so the
GPU run a lent device makes has a script that works. On the CPU the dispatch takes the torch form, so its parity
rows must read 0; the model rows time our 2-layer Qwen3.5 stack and transformers' with the same weights.

The script runs as ``__main__`` in this process (``runpy``, its own ``sys.argv``, one thread): a subprocess would
import torch, transformers and the package again, most of this test's time on 2 cores."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_fills_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "hybrid.md"
    script = REPO / "benchmarks" / "gpu" / "hybrid.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--smoke", "--out", str(out), "--work",
                                      str(tmp_path / "work")])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the repository and its folder first
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert done.value.code == 0
    text = out.read_text()
    print(text)
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| rows") and
            not ln.startswith("| model")]
    parity = [r for r in rows if r.startswith(("| plain", "| packed"))]
    models = [r for r in rows if r.startswith(("| lightning_llm", "| transformers"))]
    assert len(parity) == 2 and len(models) == 2, text
    for row in parity:  # the torch form against itself in fp32
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "torch" and float(cells[2]) == 0.0 and float(cells[4]) == 0.0, row
    for row in models:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2].replace(",", "")) > 0, row
