"""The README's install: a virtual environment first (``.venv``, ignored by git as the README's ``hf/`` exports are),
then ``make install``, which on a fresh environment (torch present, numpy not yet: it comes with the package's
dependencies) prints no "Failed to initialize NumPy" and pins the installed torch."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # make and git run as the README's reader runs them

REPO = Path(__file__).resolve().parents[2]


def test_make_install_reads_the_torch_version_without_importing_torch(tmp_path: Path) -> None:
    """pip is replaced by a recorder; every other ``$(PYTHON)`` call runs this interpreter with numpy hidden."""
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


def test_readme_installs_into_a_virtual_environment_git_ignores() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install = readme.split("## Install and test", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert install[0].startswith("python3 -m venv .venv") and install[1].startswith("make install"), install[:2]
    exports = [argv[argv.index("--to") + 1] for line in readme.splitlines()
               if line.startswith("lightning_llm export") and "--to" in (argv := shlex.split(line, comments=True))]
    assert exports and all(re.match(r"^hf/", p) for p in exports), exports
    paths = [".venv/bin/python", *(f"{p}/model.safetensors" for p in exports)]
    proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", *paths], capture_output=True, text=True)
    assert proc.stdout.split() == paths, (proc.stdout, proc.stderr)
