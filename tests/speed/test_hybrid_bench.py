"""benchmarks/gpu/hybrid.py on the CPU (``--smoke``: tiny sizes, the torch paths): every row runs and reports, so the
GPU run a lent device makes has a script that works. On the CPU the dispatch takes the torch form, so its parity
rows must read 0; the model rows time our 2-layer Qwen3.5 stack and transformers' with the same weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_smoke_run_fills_every_row(tmp_path: Path) -> None:
    out = tmp_path / "hybrid.md"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "hybrid.py"), "--device", "cpu",
                           "--smoke", "--out", str(out), "--work", str(tmp_path / "work")], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
