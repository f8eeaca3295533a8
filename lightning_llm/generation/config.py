"""Decoding settings (:class:`GenerationConfig`: the names follow ``transformers.GenerationConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["GenerationConfig", "for_datamodule"]


@dataclass
class GenerationConfig:
    """Decoding settings (the names follow ``transformers.GenerationConfig``)."""

    max_new_tokens: int = 64
    """Most tokens generated per prompt (EOS included)."""
    do_sample: bool = False
    """Sample from the (temperature / top-k / top-p filtered) distribution instead of taking the argmax."""
    temperature: float = 1.0
    """Softmax temperature when sampling."""
    top_k: int = 0
    """Keep only the k most likely tokens when sampling; 0 = off."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``; 1.0 = off."""
    num_beams: int = 1
    """Beam search width; 1 = greedy or sampling."""
    length_penalty: float = 1.0
    """Beam search: finished hypotheses are ranked by ``sum logprob / generated_len ** length_penalty``."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty on tokens already in the sequence (prompt included); 1.0 = off."""
    eos_token_id: int | list[int] | None = None
    """Token id(s) that end a sequence; ``None`` generates exactly ``max_new_tokens``."""
    pad_token_id: int = 0
    """Id written after a sequence has ended."""
    use_cache: bool = True
    """Reuse keys/values of earlier tokens (``False`` recomputes the whole sequence every step)."""
    cache_implementation: Literal["dynamic", "static"] = "dynamic"
    """The KV cache (transformers' name): ``dynamic`` grows with the tokens; ``static`` is preallocated per batch
    size and length bucket (prompt + new tokens rounded up to 32, 48, 64, 96, 128, ...; at most the model's
    ``max_position_embeddings``), with the write position, positions and mask on the device, so every decoding step
    has the same shapes (kept for reuse: one cache per batch size and bucket, the last two per model). The same
    tokens as ``dynamic``. Beam search, prompt-learning models, decoding through pipeline stages and prompts past the
    largest bucket decode with the dynamic cache (one logged line)."""
    compile: bool = False
    """Compile the one-token decoding step (forward, token choice, cache and mask writes) with ``torch.compile``:
    ``mode="reduce-overhead"`` (CUDA graphs) on CUDA, plain compile elsewhere; one graph per batch size and length
    bucket (the first call of each compiles). Needs ``cache_implementation="static"``. Where the parameters are
    sharded (ZeRO-3 per layer, tensor-parallel shards) the steps run eagerly (one logged line)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"generation.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_beams < 1:
            raise ValueError(f"generation.num_beams must be >= 1, got {self.num_beams}")
        if self.num_beams > 1 and self.do_sample:
            raise ValueError("generation.do_sample=true with generation.num_beams > 1 is not supported")
        if self.temperature <= 0:
            raise ValueError(f"generation.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generation.top_p must be in (0, 1], got {self.top_p}")
        if self.cache_implementation not in ("dynamic", "static"):
            raise ValueError(f"generation.cache_implementation must be 'dynamic' or 'static', got "
                             f"{self.cache_implementation!r}")
        if self.compile and self.cache_implementation != "static":
            raise ValueError("generation.compile=true compiles the decoding step of the static cache: set "
                             "generation.cache_implementation=static as well")
        if self.cache_implementation == "static" and not self.use_cache:
            raise ValueError("generation.cache_implementation=static with generation.use_cache=false: a static cache "
                             "is a cache (use_cache=true, or cache_implementation=dynamic)")

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)


torch.serialization.add_safe_globals([GenerationConfig])  # saved in SFT checkpoints' hyper-parameters


def for_datamodule(config: GenerationConfig, datamodule: Any) -> GenerationConfig:
    """``config`` completed from the datamodule's tokenizer: where it names no ``eos_token_id``, the ids a response
    ends at (``datamodule.stop_token_ids``: a chat template's end-of-turn token and EOS; else its
    ``eos_token_id``), and its ``pad_token_id``."""
    changes: dict[str, Any] = {}
    stops = getattr(datamodule, "stop_token_ids", None) or getattr(datamodule, "eos_token_id", None)
    if config.eos_token_id is None and stops is not None:
        changes["eos_token_id"] = list(stops) if isinstance(stops, (list, tuple)) else int(stops)
    if getattr(datamodule, "pad_token_id", None) is not None:
        changes["pad_token_id"] = datamodule.pad_token_id
    return GenerationConfig(**{**config.__dict__, **changes})
