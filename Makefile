# One-command entry points for a fresh machine. `make install` never lets pip resolve a newer torch:
# it installs torch==2.13.0 only when no torch is present, then pins whatever torch is installed.
PYTHON ?= python3
# The installed torch's version, read from its metadata, not by importing torch: numpy comes with the package's
# dependencies, after torch, and torch imported without it prints "Failed to initialize NumPy".
TORCH_VERSION = $(PYTHON) -c "import importlib.metadata as m; print(m.version('torch').split('+')[0])"
TORCH_PIN = $$($(TORCH_VERSION))

.PHONY: install quickstart lint test test-fast

install:
	@$(TORCH_VERSION) >/dev/null 2>&1 || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev]" "torch==$(TORCH_PIN)"

quickstart: install
	lightning_llm fit --config configs/quickstart.yaml

# ruff's rules: pyproject.toml [tool.ruff]
lint: install
	$(PYTHON) -m ruff check lightning_llm tests benchmarks

# Two workers (pytest-xdist), each taking whole files (module fixtures run once): most tests leave a core idle while
# they start processes, rendezvous or write files. Files go out in collection order, the longest first
# (tests/conftest.py: HEAVY_FIRST), not xdist's by number of tests.
test: install lint
	$(PYTHON) -m pytest -q tests -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# The loop to run after each edit: every test that launches no process, in this one (a test that launches one fails
# unless marked multiprocess: tests/no_launch.py).
test-fast:
	$(PYTHON) -m pytest -q tests -m "not multiprocess and not recipe"

# GPU suite (kernel correctness + timings, fused linear CE, end-to-end fit runs): one command on a CUDA machine, writing
# benchmarks/results/gpu-<device>.md. Wheels for a machine without network: benchmarks/gpu/wheels.sh (see its header).
.PHONY: bench-gpu bench-gpu-smoke

bench-gpu:
	$(PYTHON) benchmarks/gpu/suite.py $(ARGS)

# The same code path on CPU in about a minute (Triton interpreter, tiny shapes, debug backbones).
bench-gpu-smoke:
	$(PYTHON) benchmarks/gpu/suite.py --smoke --out /tmp/lightning_llm-gpu-smoke.md $(ARGS)
