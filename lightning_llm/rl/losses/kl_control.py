"""KL coefficient controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

The coefficient ``beta`` of the per-token penalty ``-beta * KL(policy || ref)`` is either fixed or adapted so the
observed sequence KL tracks a target: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon`` after each
rollout batch of ``n`` samples (trl's ``AdaptiveKLController``). The state is a plain float so checkpoints hold it;
under data parallelism every rank must update with the same (globally averaged) KL to stay in step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveKLController", "FixedKLController", "KLController", "make_kl_controller"]


class KLController:
    """Holds ``value`` (the current coefficient); ``update`` is called once per rollout batch."""

    def __init__(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"kl_coef must be >= 0, got {value}")
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: mean sequence KL of the batch; ``n_steps``: samples in the batch (all ranks)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant coefficient."""


class AdaptiveKLController(KLController):
    """Proportional controller towards ``target`` nats per sequence over ``horizon`` samples."""

    def __init__(self, value: float, *, target: float, horizon: int) -> None:
        super().__init__(value)
        if target <= 0:
            raise ValueError(f"kl_target must be > 0 for the adaptive KL controller, got {target}")
        if horizon < 1:
            raise ValueError(f"kl_horizon must be >= 1, got {horizon}")
        self.target, self.horizon = float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kl_coef: float, *, adaptive: bool, target: float | None, horizon: int) -> KLController:
    """Fixed controller, or adaptive when ``adaptive`` (then ``target`` is required)."""
    if not adaptive:
        return FixedKLController(kl_coef)
    if target is None:
        raise ValueError("ppo.kl_target is required when ppo.adaptive_kl=true")
    return AdaptiveKLController(kl_coef, target=target, horizon=horizon)
