"""Local Hugging Face checkpoints in and out: ``config.json`` <-> :class:`~lightning_llm.models.ModelConfig`, weights
<-> :class:`~lightning_llm.models.DecoderLM` / :class:`~lightning_llm.models.EncoderModel`; never downloads.

========================  ============================================================================================
``architectures.py``      the one table of supported HF classes (the docs' family list is generated from it)
``config.py``             ``config.json`` <-> ``ModelConfig``: the dispatch per group of families, representability
``families/``             one file per group of families (configs, and weights where they differ from LLaMA's):
                          ``decoders.py`` (the LLaMA layout: Llama, Qwen, Mistral, Baichuan, the MoE families),
                          ``deepseek.py`` (DeepSeek-V2/V3, Kimi-K2, GLM-4.5: MLA, group-limited routers),
                          ``qwen3_next.py`` (the hybrids), ``gemma.py``, ``phi3.py``, ``glm4.py``, ``olmo.py``,
                          ``smollm3.py``, ``gpt2.py``; ``encoders.py`` (BERT, RoBERTa, XLM-R, MegatronBERT; the
                          encoders' dispatch), ``deberta.py`` (disentangled attention), ``modernbert.py`` (fused
                          ``Wqkv``/``Wi`` as row blocks)
``multimodal.py``         a multimodal class's language model, the rest copied at export
``weights.py``            the weight mapping's entries per config (the decoders'), dispatched per layout
``entries.py``            the entry types (one key, per-expert keys, fused layouts, MXFP4) and the experts' entries
``source.py``             reading checkpoint files lazily: only the elements a rank holds
``options.py``            options of a family's config.json that are not built, refused by name
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
