"""One file per group of Hugging Face families: their ``config.json`` <-> :class:`~lightning_llm.models.ModelConfig`
conversion, and their weight entries where they differ from the LLaMA layout (the table: :mod:`lightning_llm.models.hf`)."""
