"""Test-wide setup: CPU only, Triton in interpreter mode, quiet logs, helpers shared by tests."""

from __future__ import annotations

import os

# Triton has no CPU backend; its interpreter must be enabled before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def pair_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated sentence-pair dataset (CLUE format) with its vocab in ``tokenizer/``."""
    from lightning_llm.data import generate_pair_dataset

    return generate_pair_dataset(tmp_path_factory.mktemp("pairs"), n_train=64, n_val=32, n_test=24, seed=0)


@pytest.fixture(autouse=True)
def _restore_environment():  # noqa: ANN202 - a generator fixture
    """Undo what a test's in-process run left in ``os.environ``: Lightning and DeepSpeed set ``MASTER_PORT`` (and
    ``PL_GLOBAL_SEED``, ``RANK``, ...) when a 1-device run initializes a process group, and the port can stay bound
    by this process; every later subprocess (torchrun tests, the CLI) would inherit it and fail with EADDRINUSE."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)
