"""The eager decoding loop's model feeding (:class:`Stepper`): one forward per step, with or without the dynamic KV
cache, over :class:`~lightning_llm.models.decoding.DecodeRows` buffers."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_llm.models.decoding import DecodeRows, KVCache

from .sampling import last_logits

__all__ = ["Stepper"]


class Stepper:
    """Feeds the model one step at a time, with or without a KV cache. Rows may be reordered (beam search)."""

    def __init__(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, max_new: int,
                 use_cache: bool) -> None:
        self.model = model
        self.rows = DecodeRows(input_ids, attention_mask, max_new)
        self.cache = KVCache(capacity=input_ids.shape[1] + max_new) if use_cache else None

    @property
    def seqs(self) -> Tensor:
        return self.rows.seqs

    def _call(self, ids: Tensor, kwargs: dict[str, Tensor]) -> Tensor:
        return last_logits(self.model(ids, **kwargs, kv_cache=self.cache, logits_to_keep=1))

    def first(self) -> Tensor:
        return self._call(*self.rows.prefill())

    def next(self, tokens: Tensor) -> Tensor:  # tokens [R] -> next-token logits [R, V] fp32
        self.rows.append(tokens)
        return self._call(*(self.rows.step() if self.cache is not None else self.rows.whole()))

    def reorder(self, index: Tensor) -> None:
        self.rows.reorder(index)
        if self.cache is not None:
            self.cache.reorder(index)
