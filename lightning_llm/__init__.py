"""lightning_llm: pluggable large-model training on PyTorch Lightning."""

__version__ = "0.1.0"
