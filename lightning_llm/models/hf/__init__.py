"""Local Hugging Face checkpoints in and out: ``config.json`` <-> :class:`~lightning_llm.models.ModelConfig`, weights
<-> :class:`~lightning_llm.models.DecoderLM` / :class:`~lightning_llm.models.EncoderModel`; never downloads.

========================  ============================================================================================
``families/``             one file per family, holding its record (``RECORDS``): classes, config conversion, weight
                          names, adapters, options not built, named sizes, tiny checkpoint; ``llama.py`` is the LLaMA
                          layout the decoders with LLaMA's names derive from (a family states its differences)
``family.py``             the record type (``Family``, ``Multimodal``, ``Arch``, ``NestedLM``)
``registry.py``           the records, found in ``families/`` (a new family is its file alone)
``architectures.py``      the supported HF classes, read from the records (the docs' family list is generated from it)
``config.py``             ``config.json`` <-> ``ModelConfig``: what families share, each record's conversion,
                          representability
``readers.py``            config readers families share (activations, rope parameters, labels)
``multimodal.py``         a multimodal class's language model, the rest copied at export
``weights.py``            the weight mapping's entries per config, from the class's record
``entries.py``            the entry types (one key, per-expert keys, fused layouts, MXFP4)
``source.py``             reading checkpoint files lazily: only the elements a rank holds
``options.py``            ``Unbuilt``: options of a family's config.json that are not built, refused by name
``adapters.py``           a peft adapter of a decoder in the checkpoint's names and row order
``load.py`` / ``save.py``  ``load_hf`` / ``save_hf``
========================  ============================================================================================
"""

from __future__ import annotations

from .architectures import SUPPORTED_ARCHITECTURES
from .config import config_from_hf, config_to_hf
from .load import load_hf
from .save import default_architecture, save_hf

__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf", "default_architecture", "SUPPORTED_ARCHITECTURES"]
