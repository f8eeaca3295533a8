"""One file per Hugging Face family, each holding its record (``RECORDS``:
:class:`~lightning_llm.models.hf.record.family.Family` instances): its classes, its ``config.json`` <->
:class:`~lightning_llm.models.ModelConfig` conversion, its weight names, its adapters' names and rows, its options not
built, its named sizes, its tiny checkpoint. ``llama.py`` is the LLaMA layout the decoders with LLaMA's module names
derive from. :mod:`lightning_llm.models.hf.convert.registry` finds every file here: a new family is its file alone."""
