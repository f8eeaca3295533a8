#!/usr/bin/env bash
# Wheels for running benchmarks/gpu/suite.py on a GPU machine that has Python 3.12 (manylinux x86_64) with torch, triton,
# transformers, peft, lightning (and torchmetrics, einops, msgpack, ninja, nvidia-ml-py, psutil, py-cpuinfo, numpy,
# PyYAML, rich, click, joblib, regex, six, tqdm, typing-extensions) preinstalled and NO network. Run it here, where PyPI
# is reachable, from anywhere in the repository:
#
#   bash benchmarks/gpu/wheels.sh            # -> .whl/ (git-ignored): the missing wheels + this project as a wheel
#
# Then, on the GPU machine, in the repository root (with .whl/ carried along):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
#   python benchmarks/gpu/suite.py --out $OUT/gpu.md
#
# (~20 min on an H100. Where one command may run at most 10 minutes, split it, each with its own budget:
#   python benchmarks/gpu/suite.py --only kernels --only flce --time-budget-s 540 --out $OUT/gpu-kernels.md
#   python benchmarks/gpu/suite.py --only e2e-encoder --time-budget-s 540 --out $OUT/gpu-e2e-encoder.md
#   python benchmarks/gpu/suite.py --only e2e-offload --only e2e-decoder --time-budget-s 540 --out $OUT/gpu-e2e-rest.md)
#
# Versions are the ones installed here (what the tests ran with); liger-kernel and fla-core (the optional [fla] extra,
# not installed here: CUDA only) are pinned below. DeepSpeed publishes only an sdist: if `pip download --only-binary=:all:` finds no wheel, a
# pure-python wheel is built from the sdist with DS_BUILD_OPS=0 (its C++/CUDA ops are then JIT-built on first use,
# which the runs above do not need). Every other sdist-only package (jieba) is built the same way with
# `pip wheel --no-deps`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT=.whl
LIGER_VERSION="${LIGER_VERSION:-0.8.5}"
FLA_VERSION="${FLA_VERSION:-0.6.0}"  # flash-linear-attention (the [fla] extra): benchmarks/gpu/hybrid.py
# Missing on the GPU machine: the project's own dependencies, DeepSpeed's (hjson, pydantic and its parts), the test-only
# metric references (rouge-chinese, jieba, nltk + defusedxml), and Liger-Kernel for the comparisons. typing-extensions
# is there, in an unknown version: pydantic-core needs >= 4.14.1, so the (backward-compatible) one from here goes too.
PACKAGES=(deepspeed hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions jsonargparse
          docstring-parser typeshed-client rouge-chinese jieba nltk defusedxml)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

version_here() {  # installed version of $1 in this environment (the pin)
  "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

fetch() {  # $1=name $2=version: a binary wheel for cp312 manylinux x86_64, else a pure-python wheel built here
  local name="$1" version="$2"
  if "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$OUT" "$name==$version" 2>/dev/null; then
    echo "downloaded $name==$version"
  else
    echo "no wheel on PyPI for $name==$version: building one from the sdist"
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$name==$version"
  fi
}

rm -rf "$OUT"
mkdir -p "$OUT"
for name in "${PACKAGES[@]}"; do
  fetch "$name" "$(version_here "$name")"
done
fetch liger-kernel "$LIGER_VERSION"
fetch fla-core "$FLA_VERSION"
# This project, from a copy of the working tree (tracked and untracked-not-ignored files), so that building leaves no
# build/ or egg-info behind here.
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$SRC"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$SRC"
echo "built lightning_llm from the working tree of $ROOT"

# The set must install with --no-deps: one version per package, every wheel usable by CPython 3.12 on x86_64 Linux.
"$PY" - "$OUT" <<'EOF'
import collections
import pathlib
import re
import sys

wheels = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
versions = collections.defaultdict(set)
bad = []
for w in wheels:
    name, version, *_, py, abi, plat = w.stem.split("-")
    versions[re.sub(r"[-_.]+", "-", name).lower()].add(version)
    if not (py in ("py3", "py2.py3", "cp312") and abi in ("none", "abi3", "cp312")
            and (plat == "any" or ("manylinux" in plat and plat.endswith("x86_64")))):
        bad.append(w.name)
dupes = {n: v for n, v in versions.items() if len(v) > 1}
total = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB")
if dupes or bad or not wheels:
    sys.exit(f"inconsistent wheel set: several versions {dupes}, not for cp312 x86_64 {bad}")
EOF
