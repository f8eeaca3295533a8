# One-command entry points for a fresh machine. `make install` never lets pip resolve a newer torch:
# it installs torch==2.13.0 only when no torch is present, then pins whatever torch is installed.
PYTHON ?= python3
TORCH_PIN = $$($(PYTHON) -c "import torch; print(torch.__version__.split('+')[0])")

.PHONY: install quickstart test test-fast

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "torch==2.13.0"
	$(PYTHON) -m pip install -e ".[dev]" "torch==$(TORCH_PIN)"

quickstart: install
	lightning_llm fit --config configs/quickstart.yaml

test: install
	$(PYTHON) -m pytest -q tests

test-fast:
	$(PYTHON) -m pytest -q tests -m "not multiprocess"

# GPU suite (kernel correctness + timings, fused linear CE, end-to-end fit runs): one command on a CUDA machine, writing
# benchmarks/results/gpu-<device>.md. Wheels for a machine without network: benchmarks/gpu/wheels.sh (see its header).
.PHONY: bench-gpu bench-gpu-smoke

bench-gpu:
	$(PYTHON) benchmarks/gpu/suite.py $(ARGS)

# The same code path on CPU in about a minute (Triton interpreter, tiny shapes, debug backbones).
bench-gpu-smoke:
	$(PYTHON) benchmarks/gpu/suite.py --smoke --out /tmp/lightning_llm-gpu-smoke.md $(ARGS)
