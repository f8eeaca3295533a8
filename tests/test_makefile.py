"""``make install`` on a fresh environment (torch present, numpy not yet: it comes with the package's dependencies)
prints no "Failed to initialize NumPy" and pins the installed torch. pip is replaced by a recorder; every other
``$(PYTHON)`` call runs this interpreter with numpy hidden."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_make_install_reads_the_torch_version_without_importing_torch(tmp_path: Path) -> None:
    hidden = tmp_path / "hide" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    calls = tmp_path / "pip_calls"
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "$@" >> {calls}; exit 0; fi
PYTHONPATH={hidden.parent} exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    proc = subprocess.run(["make", "-s", "-C", str(REPO), "install", f"PYTHON={python}"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MAKEFLAGS": ""})
    assert proc.returncode == 0, proc.stderr
    assert "NumPy" not in proc.stderr + proc.stdout, proc.stderr
    torch_version = importlib.metadata.version("torch").split("+")[0]
    assert calls.read_text().splitlines() == [f"-m pip install -e .[dev] torch=={torch_version}"]
