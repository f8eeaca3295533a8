"""Parallel strategies, registered in Lightning's StrategyRegistry on import.

``tp``, ``pp``, ``cp``, ``ep``, ``zero1/2/3(_offload)`` and ``3d`` are presets (:mod:`.presets`) of the one native engine
(:class:`~.engine.strategy.ParallelEngine`, :mod:`.engine`: its layout, gradients and buckets, checkpoint IO and the
layout-free checkpoint format). Each parallel dimension has its folder: :mod:`.tensor` (plans, parallelize),
:mod:`.pipeline`, :mod:`.context`, :mod:`.expert`, and :mod:`.zero` (native ZeRO and DeepSpeed's engine,
``deepspeed_zero*``); :mod:`.decoding` is what a layout does around a generation. The root keeps what every dimension
shares: :mod:`.mesh`, :mod:`.frozen` (frozen models placed like the model) and :mod:`.materialize`.
"""

from lightning.pytorch.strategies import StrategyRegistry as _StrategyRegistry

from lightning_llm.strategies.engine.strategy import ParallelEngine
from lightning_llm.strategies.presets import (
    ContextParallelStrategy,
    ExpertParallelStrategy,
    HybridParallelStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    ZeroStrategy,
    register_presets,
)
from lightning_llm.strategies.zero.deepspeed import DeepSpeedZeroStrategy

__all__ = ["ContextParallelStrategy", "DeepSpeedZeroStrategy", "ExpertParallelStrategy", "HybridParallelStrategy", "ParallelEngine", "PipelineParallelStrategy",
           "TensorParallelStrategy", "ZeroStrategy", "check_strategy_name", "strategy_class"]

register_presets(_StrategyRegistry)  # tp, pp, cp, ep, 3d, zero1/2/3(_offload), deepspeed_zero1/2/3(_offload); idempotent


def strategy_class(name: str) -> type | None:
    """The ``Strategy`` subclass a ``package.module.Class`` path names, or a bare class name as jsonargparse resolves
    it (unique among the imported subclasses); ``None`` otherwise."""
    import importlib

    from lightning.pytorch.strategies import Strategy

    module, _, cls = name.rpartition(".")
    if not module:
        found = {c for c in _subclasses(Strategy) if c.__name__ == name}
        return found.pop() if len(found) == 1 else None
    try:
        obj = getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None
    return obj if isinstance(obj, type) and issubclass(obj, Strategy) else None


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def check_strategy_name(name: str) -> None:
    """Raise ``ValueError`` for a ``--trainer.strategy`` name that is not registered, listing ours and Lightning's
    names with the closest match (Lightning's own error lists only a few of its names)."""
    import difflib

    known = _StrategyRegistry.available_strategies()
    if name.lower() == "auto" or name.lower() in known or strategy_class(name) is not None:
        return
    modules = {n: _StrategyRegistry[n]["strategy"].__module__ for n in known}
    ours = [n for n in known if modules[n].startswith("lightning_llm.")]
    lightning = ["auto", *(n for n in known if n not in ours and "_graveyard" not in modules[n])]
    close = difflib.get_close_matches(name.lower(), [*ours, *lightning], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    path = " (a class path must name a Strategy subclass)" if "." in name else ""
    # The 8 ddp*_find_unused_parameters_* variants are shown as one entry to keep the line readable.
    shown = [n for n in lightning if "_find_unused_parameters_" not in n]
    if len(shown) < len(lightning):
        shown.append("ddp*_find_unused_parameters_true/false")
    raise ValueError(f"--trainer.strategy={name!r}: unknown strategy{path}; {hint}lightning_llm's: {', '.join(ours)}; "
                     f"Lightning's: {', '.join(shown)}")
