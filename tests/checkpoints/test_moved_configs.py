"""The RL config dataclasses saved in checkpoints' hyper-parameters moved with ``lightning_llm/rl/``'s regrouping
(``rl/dpo.py`` -> ``rl/losses/dpo.py``, ...): checkpoints naming their old homes still load with ``weights_only`` (as
Lightning and :func:`~lightning_llm.checkpoint.load_file` read them), and new ones name the new homes."""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch

from lightning_llm.checkpoint import load_file
from lightning_llm.rl.losses.dpo import DPOConfig
from lightning_llm.rl.losses.kto import KTOConfig
from lightning_llm.rl.multiturn.env import EnvConfig
from lightning_llm.rl.rewards import RewardConfig

MOVED = [pytest.param(DPOConfig(beta=0.25), "lightning_llm.rl.dpo", "lightning_llm.rl.losses.dpo", id="dpo"),
         pytest.param(KTOConfig(beta=0.25), "lightning_llm.rl.kto", "lightning_llm.rl.losses.kto", id="kto"),
         pytest.param(EnvConfig(max_turns=3), "lightning_llm.rl.env", "lightning_llm.rl.multiturn.env", id="env"),
         pytest.param(RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", weight=0.5),
                      "lightning_llm.rl.rewards", "lightning_llm.rl.rewards.config", id="reward")]


@pytest.mark.parametrize(("cfg", "old", "new"), MOVED)
def test_a_checkpoint_naming_the_old_home_loads_weights_only(monkeypatch, cfg, old, new) -> None:
    cls = type(cfg)
    assert cls.__module__ == new
    buf = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(cls, "__module__", old)  # as pickled before the move
        if old not in sys.modules:  # the old module is gone: pickle checks that the name resolves to the class
            m.setitem(sys.modules, old, types.SimpleNamespace(**{cls.__name__: cls}))
        torch.save({"hyper_parameters": {"cfg": cfg}}, buf)
    assert old.encode() in buf.getvalue() and new.encode() not in buf.getvalue()
    for load in (lambda b: torch.load(b, weights_only=True), lambda b: load_file(b, name="old.ckpt")):
        buf.seek(0)
        loaded = load(buf)["hyper_parameters"]["cfg"]
        assert type(loaded) is cls and loaded == cfg
