"""``OptimConfig`` (``--model.optim.*``) lives in :mod:`lightning_llm.optim.config`; checkpoints written while it lived
in ``lightning_llm.tasks.base`` still resume, since Lightning loads their hyper-parameters with ``weights_only``."""

from __future__ import annotations

import io

import torch

from lightning_llm.optim.config import OptimConfig


def test_a_checkpoint_naming_the_old_home_loads_weights_only(monkeypatch) -> None:
    buf = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(OptimConfig, "__module__", "lightning_llm.tasks.base")  # as pickled before the move
        torch.save({"optim": OptimConfig(lr=0.125, name="muon")}, buf)
    assert b"lightning_llm.tasks.base" in buf.getvalue()
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["optim"]
    assert isinstance(loaded, OptimConfig) and (loaded.lr, loaded.name) == (0.125, "muon")
