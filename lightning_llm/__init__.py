"""lightning_llm: pluggable large-model training on PyTorch Lightning."""

from lightning_llm.logs import quiet_torchao_import

__version__ = "0.1.0"

quiet_torchao_import()  # transformers and peft import torchao whenever it is installed: its import lines are noise here
