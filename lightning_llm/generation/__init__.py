"""Batched autoregressive generation for our decoders (left-padded prompts; greedy, sampling, beam search).

* :mod:`.config`: :class:`GenerationConfig` (transformers' names; ``cache_implementation`` dynamic | static and our
  ``compile``) and :func:`for_datamodule`;
* :mod:`.loop`: :func:`generate` and the :class:`TokenChooser` (a step's tokens; what a pipeline's or a row share's
  decoding loop calls), the dynamic cache's eager loop;
* :mod:`.static`: the static cache's loop, its one-token step compiled (CUDA graphs on CUDA);
* :mod:`.sampling`: the token choice as tensor functions; :mod:`.beam`: beam search; :mod:`.stepper`: the eager
  loop's model feeding.
"""

from .config import GenerationConfig, for_datamodule
from .loop import TokenChooser, generate
from .sampling import last_logits, strip_after_eos

__all__ = ["GenerationConfig", "TokenChooser", "for_datamodule", "generate", "last_logits", "strip_after_eos"]
