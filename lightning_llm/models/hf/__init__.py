"""Local Hugging Face checkpoints in and out: ``config.json`` <-> :class:`~lightning_llm.models.ModelConfig`, weights
<-> :class:`~lightning_llm.models.DecoderLM` / :class:`~lightning_llm.models.EncoderModel`; never downloads.

==============================  ======================================================================================
``load.py``                     ``load_hf``: how a checkpoint is read in
``source.py``                   reading checkpoint files lazily: only the elements a rank holds
``save.py``                     ``save_hf``: how a model is written out
``families/``                   one file per family, holding its record (``RECORDS``): classes, config conversion,
                                weight names, adapters, options not built, named sizes, tiny checkpoint; ``llama.py``
                                is the LLaMA layout the decoders with LLaMA's names derive from (a family states its
                                differences)
``record/``                     what a record is written with:
``record/family.py``            the record type (``Family``, ``Multimodal``, ``Arch``, ``NestedLM``)
``record/entries.py``           the weight mapping's entry types (one key, per-expert keys, fused layouts, MXFP4)
``record/options.py``           ``Unbuilt``: options of a family's config.json that are not built, refused by name
``record/readers.py``           config readers families share (activations, rope parameters, labels)
``convert/``                    the records read as tables, what load and save translate by:
``convert/registry.py``         the records, found in ``families/`` (a new family is its file alone)
``convert/architectures.py``    the supported HF classes (the docs' family list is generated from it)
``convert/config.py``           ``config.json`` <-> ``ModelConfig``: what families share, each record's
                                conversion, representability
``convert/weights.py``          the weight mapping's entries per config, from the class's record
``convert/multimodal.py``       a multimodal class's language model, the rest copied at export
``convert/adapters.py``         a peft adapter of a decoder in the checkpoint's names and row order
==============================  ======================================================================================
"""

from __future__ import annotations

from .convert.architectures import SUPPORTED_ARCHITECTURES
from .convert.config import config_from_hf, config_to_hf
from .load import load_hf
from .save import default_architecture, save_hf

__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf", "default_architecture", "SUPPORTED_ARCHITECTURES"]
