"""Reading checkpoints: one-line errors for those that cannot be loaded (:mod:`.errors`, :mod:`.checks`) and loading
that never runs code from a checkpoint (:mod:`.safe_load`)."""

from lightning_llm.checkpoint.checks import check_deepspeed_dir, check_engine_dir, check_strategy_reads
from lightning_llm.checkpoint.errors import (
    CheckpointError,
    UnsafeCheckpointError,
    check_torch_file,
    first_line,
    loading,
)
from lightning_llm.checkpoint.safe_load import (
    TRUST_ENV,
    SafeEmptyLoadPlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    dcp_refusals,
    load_file,
    read_dcp_metadata,
    trusted,
    verify_checkpoint,
    verify_file,
)

__all__ = ["TRUST_ENV", "CheckpointError", "SafeEmptyLoadPlanner", "SafeFileSystemReader", "SafeLoadPlanner",
           "UnsafeCheckpointError", "check_deepspeed_dir", "check_engine_dir", "check_strategy_reads",
           "check_torch_file", "dcp_refusals", "first_line",
           "load_file", "loading", "read_dcp_metadata", "trusted", "verify_checkpoint", "verify_file"]
