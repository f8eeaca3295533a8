"""What a layout does around one generation (a rollout batch, an evaluation's decoding): the engine's
``decoding_session`` (``contract.decoding_session``) and ``decoding_copy``.

* tensor parallel and pipeline layouts (:mod:`.copies`): whole copies of the model and the task's frozen models,
  assembled once per session where they fit, decode and run the no-grad forwards as on one device;
* ZeRO-3 (:mod:`.zero`): the parameters all-gathered once per session (FSDP2's ``unshard``) where they fit;
* otherwise, and as the fallback of both, the layout decodes as it trains (per-layer all-gathers, the stages token by
  token, the shards' collectives); the run summary names the path (:meth:`DecodingSessions.decoding_note`).

Sessions nest: an RL task opens one around a whole rollout, so its generation and no-grad forwards share one gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_llm.strategies.decoding.copies import WholeCopies, copy_skeletons, meta_skeleton
from lightning_llm.strategies.decoding.fit import fit_in_free_memory, free_memory_bytes
from lightning_llm.strategies.decoding.zero import GatherForDecoding, ZeroDecoding, gathered_extra_bytes

__all__ = ["DecodingSessions", "GatherForDecoding", "WholeCopies", "ZeroDecoding", "copy_skeletons",
           "fit_in_free_memory", "free_memory_bytes", "gathered_extra_bytes", "meta_skeleton"]


class DecodingSessions:
    """A layout's side of ``contract.decoding_session`` (a part of :class:`~..engine.ParallelEngine`): set at set-up,
    ``_whole_copies`` (tp, pp) or ``_zero_decoding`` (ZeRO-3), or neither."""

    _zero_decoding: ZeroDecoding | None = None
    _whole_copies: WholeCopies | None = None

    @contextlib.contextmanager
    def decoding_session(self, decoder: Any) -> Iterator[Any]:
        """What one generation decodes with: the whole copy of ``decoder`` (tp, pp), the model with its ZeRO-3
        parameters gathered once or the per-layer fallback, or ``decoder`` itself."""
        with contextlib.ExitStack() as stack:
            if self._whole_copies is not None and stack.enter_context(self._whole_copies.session()):
                whole = self._whole_copies.copy_of(decoder)
                yield decoder if whole is None else whole
                return
            if self._zero_decoding is not None:
                decoder = stack.enter_context(self._zero_decoding.session(decoder))
            yield decoder

    def decoding_copy(self, module: Any) -> Any | None:
        """What to call for ``module`` inside a session that holds whole copies, else ``None``."""
        return self._whole_copies.copy_of(module) if self._whole_copies is not None else None

    def decoding_note(self) -> str | None:
        """How generation runs under this layout, for the run summary (``None``: nothing to say)."""
        copies, zero = self._whole_copies, self._zero_decoding
        if copies is not None and not (zero is not None and copies.falls_back):
            return copies.note()
        return zero.note() if zero is not None else None
