"""torchao's import lines are not printed by a process that imports the package (issue 60): transformers and peft
import torchao whenever it is installed (``import peft``, every LoRA run), and on a CPU torch it printed "Failed to
load .../torchao/_C_mxfp8...so" and "..._C_cutlass_90a.abi3.so" (CUDA kernels) plus torch's deprecation of
torchao's Enum registrations. ``logs.TorchaoImportFilter`` drops exactly those records; quantization (NF4, int8) runs
without the kernels they name."""

from __future__ import annotations

import logging
import subprocess
import sys
from enum import Enum

import pytest

SCRIPT = """
import sys
{first}
import peft  # imports transformers' modeling code, which imports torchao
import torch
from torch.nn import functional as F
from lightning_llm.models.quantize import QuantizationConfig, dequantize_weight, quantize_weight
assert "torchao" in sys.modules
w, x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), torch.randn(3, 128)
for mode in ("nf4", "int8"):
    q = quantize_weight(w, mode, QuantizationConfig())
    assert torch.allclose(F.linear(x, q), F.linear(x, dequantize_weight(q)), atol=1e-5), mode
    assert (dequantize_weight(q) - w).norm() < 0.15 * w.norm(), mode  # measured: nf4 0.092, int8 0.0067
print("quantized ok")
"""
NOISE = ("Failed to load", "is an Enum subclass")


def _stderr(first: str) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(first=first)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "quantized ok" in proc.stdout, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@pytest.mark.multiprocess  # an import is seen in a fresh interpreter
def test_importing_the_package_drops_torchaos_import_lines_and_quantization_runs() -> None:
    _, ours = _stderr("import lightning_llm")
    _, bare = _stderr("pass")  # torchao imported (by peft) before the package: the filter comes too late
    noisy = [ln for ln in bare.splitlines() if any(n in ln for n in NOISE)]
    print(f"torchao imported before the package: {len(noisy)} lines: {[ln[:90] for ln in noisy]}")
    assert not [ln for ln in ours.splitlines() if any(n in ln for n in NOISE)], ours


def test_the_filter_drops_only_those_records() -> None:
    from lightning_llm.logs import TorchaoImportFilter

    class Mine(Enum):
        A = 1

    class Theirs(Enum):
        A = 1

    Theirs.__module__ = "torchao.quantization.quantize_.common"

    def record(name: str, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)

    f = TorchaoImportFilter()
    enum_msg = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    dropped = [record("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                      "Could not load this library"),
               record("torch.utils._pytree", enum_msg, Theirs)]
    kept = [record("torchao", "Failed to load the config"), record("torchao", "Skipping import of cpp extensions"),
            record("torch.utils._pytree", enum_msg, Mine), record("lightning_llm", "Failed to load /torchao/_C.so")]
    assert [f.filter(r) for r in dropped] == [False, False]
    assert [f.filter(r) for r in kept] == [True, True, True, True]
