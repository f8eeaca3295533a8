"""Log records of a multi-process run: a fact about the whole run is printed once, by global rank 0; a fact that
differs per rank is logged with ``extra=PER_RANK`` and says its rank.

Every rank runs the same code and reaches the same ``log.info`` (data prepared, plan applied, checkpoint saved), so
N processes printed each line N times. :class:`RankZeroFilter` (installed on the command line's log handler by
:func:`lightning_llm.cli.app.main`; add it to your own handler when you drive a ``Trainer`` from Python) drops the
``lightning_llm`` records of the other ranks unless they are marked per rank.
"""

from __future__ import annotations

import logging
import os

__all__ = ["PER_RANK", "RankZeroFilter", "is_global_zero"]

PER_RANK = {"per_rank": True}
"""``log.info(..., extra=PER_RANK)``: printed by every rank (the message names the rank)."""


def is_global_zero() -> bool:
    """Whether this process is rank 0 of the job: the process group's rank once it exists, else the launcher's
    environment (torchrun's ``RANK``; Lightning's launcher sets ``NODE_RANK``/``LOCAL_RANK`` in the processes it
    starts); True in a plain process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    return os.environ.get("NODE_RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0"


class RankZeroFilter(logging.Filter):
    """Pass ``lightning_llm`` records on global rank 0, and records marked :data:`PER_RANK` on every rank; records of
    other libraries pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("lightning_llm") or getattr(record, "per_rank", False):
            return True
        return is_global_zero()
