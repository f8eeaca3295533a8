"""Log records of a multi-process run: a fact about the whole run is printed once, by global rank 0; a fact that
differs per rank is logged with ``extra=PER_RANK`` and says its rank.

Every rank runs the same code and reaches the same ``log.info`` (data prepared, plan applied, checkpoint saved), so
N processes printed each line N times. :class:`RankZeroFilter` (installed on the command line's log handler by
:func:`lightning_llm.cli.app.main`; add it to your own handler when you drive a ``Trainer`` from Python) drops the
``lightning_llm`` records of the other ranks unless they are marked per rank.

:class:`TorchaoImportFilter` (installed when the package is imported) drops the lines torchao prints as it is
imported, which transformers and peft do whenever it is installed (``import peft``, any LoRA run, a model loaded
through ``transformers``), quantized run or not.
"""

from __future__ import annotations

import logging
import os

__all__ = ["PER_RANK", "RankZeroFilter", "TorchaoImportFilter", "is_global_zero", "quiet_torchao_import"]

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


class TorchaoImportFilter(logging.Filter):
    """Drops exactly two kinds of records torchao's import causes, on every device:

    * torchao's "Failed to load .../torchao/_C*.so": its optional compiled kernels (MX-FP8, CUTLASS sm90a) built for
      a CUDA torch; ``--model.quantize`` (NF4Tensor, Int8Tensor) never calls them (``tests/cli/test_import_noise.py``
      quantizes and runs a linear with them unloaded);
    * torch's "<enum 'torchao...'> is an Enum subclass ... register_constant() ... is deprecated": torchao's own
      call of a torch API, nothing a run can act on.

    Every other record of those loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "torchao":
            message = record.getMessage()
            return not (message.startswith("Failed to load ") and "torchao" in message and "/_C" in message
                        and ".so" in message)
        if record.name == "torch.utils._pytree" and "is an Enum subclass" in str(record.msg) and record.args:
            cls = record.args[0] if isinstance(record.args, tuple) else None
            return not str(getattr(cls, "__module__", "")).startswith("torchao")
        return True


def quiet_torchao_import() -> None:
    """Install :class:`TorchaoImportFilter` on the loggers torchao's import writes to (before it is imported: a
    logger's filters stay with it)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, TorchaoImportFilter) for f in logger.filters):
            logger.addFilter(TorchaoImportFilter())
