"""Optimizers beyond torch's AdamW: Muon for the hidden weight matrices (``--model.optim.name=muon``) on every layout.

* :mod:`.roles`: which parameters are hidden matrices (by their role in a registered family's blocks) and how each
  tensor holds them (stacked experts, fused q/k/v and gate/up parts);
* :mod:`.muon`: :class:`MuonWithAdamW`, torch.optim.Muon's update for those, torch's AdamW for the rest;
* :mod:`.orthogonalize`: Newton-Schulz on whole matrices under any layout (owner ranks, all-to-all of shards);
* :mod:`.qk_clip`: Kimi K2's QK-Clip (``--model.optim.qk_clip_tau``);
* :mod:`.config`: :class:`OptimConfig` (``--model.optim.*``) and torch's AdamW from it;
* :mod:`.build`: Muon's optimizer from a task's ``OptimConfig``.
"""

from lightning_llm.optim.build import build_muon, check_muon_config, default_fused, muon_param_groups
from lightning_llm.optim.config import OptimConfig, build_adamw, param_groups
from lightning_llm.optim.muon import MUON_DEFAULTS, STATE_TENSORS, MuonWithAdamW
from lightning_llm.optim.roles import Matrices, MuonSplit, split_parameters

__all__ = ["MUON_DEFAULTS", "Matrices", "MuonSplit", "MuonWithAdamW", "OptimConfig", "STATE_TENSORS", "build_adamw",
           "build_muon", "check_muon_config", "default_fused", "muon_param_groups", "param_groups", "split_parameters"]
