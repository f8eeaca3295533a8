"""What a layout does around one generation (a rollout batch, an evaluation's decoding): the engine's
``decoding_session`` (``contract.decoding_session``) and ``decoding_copy``.

* tensor parallel and pipeline layouts (:mod:`.copies`): whole copies of the model and of the frozen models a
  generation calls (the task's ``decoding_frozen_models()``: an RL rollout's reference, not a distillation teacher),
  assembled once per session where they fit, decode and run the no-grad forwards as on one device;
* ZeRO-3 (:mod:`.zero`): the parameters of the same models all-gathered once per session (FSDP2's ``unshard``) where
  they fit;
* otherwise, and as the fallback of both, the layout decodes as it trains (per-layer all-gathers, the stages token by
  token, the shards' collectives); the run summary names the path (:meth:`DecodingSessions.decoding_note`).
* expert parallelism: each MoE layer of a decoding step exchanges tokens with the other ranks of its ``ep`` group,
  which decode other rows, so those ranks end a generation together (:class:`~.stop.StopTogether`: a rank whose rows
  all ended decodes on until every rank's have; the tokens are each row's own either way).

Sessions nest: an RL task opens one around a whole rollout, so its generation and no-grad forwards share one gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from lightning_llm.strategies.decoding.copies import WholeCopies, copy_skeletons, meta_skeleton
from lightning_llm.strategies.decoding.fit import fit_in_free_memory, free_memory_bytes
from lightning_llm.strategies.decoding.stop import StopTogether
from lightning_llm.strategies.decoding.zero import GatherForDecoding, ZeroDecoding, gathered_extra_bytes

__all__ = ["DecodingSessions", "GatherForDecoding", "StopTogether", "WholeCopies", "ZeroDecoding", "copy_skeletons",
           "fit_in_free_memory", "free_memory_bytes", "gathered_extra_bytes", "meta_skeleton"]


class DecodingSessions:
    """A layout's side of ``contract.decoding_session`` (a part of :class:`~..engine.ParallelEngine`): set at set-up,
    ``_whole_copies`` (tp, pp) or ``_zero_decoding`` (ZeRO-3), or neither; ``_stop_group`` (expert parallelism:
    the ``ep`` group, whose ranks end each generation together) and the device of its flag."""

    _zero_decoding: ZeroDecoding | None = None
    _whole_copies: WholeCopies | None = None
    _stop_group: tuple[Any, Any] | None = None

    @contextlib.contextmanager
    def decoding_session(self, decoder: Any) -> Iterator[Any]:
        """What one generation decodes with: the whole copy of ``decoder`` (tp, pp), the model with its ZeRO-3
        parameters gathered once or the per-layer fallback, or ``decoder`` itself; under expert parallelism ending
        together with the other ranks of its ``ep`` group."""
        with contextlib.ExitStack() as stack:
            if self._whole_copies is not None and stack.enter_context(self._whole_copies.session()):
                whole = self._whole_copies.copy_of(decoder)
                yield decoder if whole is None else whole
                return
            if self._zero_decoding is not None:
                decoder = stack.enter_context(self._zero_decoding.session(decoder))
            if self._stop_group is not None:
                decoder = StopTogether(decoder, *self._stop_group)
            yield decoder

    def decoding_copy(self, module: Any) -> Any | None:
        """What to call for ``module`` inside a session that holds whole copies, else ``None``."""
        return self._whole_copies.copy_of(module) if self._whole_copies is not None else None

    def decoding_note(self) -> str | None:
        """How generation runs under this layout, for the run summary (``None``: nothing to say)."""
        copies, zero = self._whole_copies, self._zero_decoding
        if copies is not None and not (zero is not None and copies.falls_back):
            return copies.note()
        note = zero.note() if zero is not None else None
        if self._stop_group is not None:
            ends = ("generation under expert parallelism: the ranks of an ep group end each generation together (their "
                    "MoE layers exchange tokens in every decoding step)")
            note = f"{note}; {ends}" if note else ends
        return note
