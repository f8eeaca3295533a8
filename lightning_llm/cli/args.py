"""What the command line hands LightningCLI's parser: registered strategy names as their class plus the name's preset
(so a name takes options), and config files checked before jsonargparse reads them.

Lightning types ``--trainer.strategy`` as ``str | Strategy``: a registered name (``3d``, ``zero3_offload``) parses as a
plain string, and jsonargparse attaches ``--trainer.strategy.OPTION`` only to a class (``class_path``). So a name is
rewritten to ``{"class_path": <its class>, "init_args": <its preset>}`` (``zero3_offload``: ``ZeroStrategy`` with
``stage=3, offload_optimizer=True, offload_params=True``), after which options override the preset and
``--print_config`` shows the class and every value. Two places see a name:

* the argument list (:func:`prepare_argv`): ``--trainer.strategy=NAME`` (lightning_llm's names always; Lightning's
  own names, e.g. ``ddp``, only once an option follows, so a bare ``ddp`` still reaches Lightning as the string it
  knows), and every ``--trainer.strategy.OPTION`` is checked against the class (one line naming the option and the
  strategy instead of jsonargparse's usage dump);
* config files and YAML values, through the parser mode :data:`PARSER_MODE` (a jsonargparse loader: the YAML loader,
  or OmegaConf's when installed, then :func:`expand_config`): ``strategy: 3d`` and ``strategy: {class_path: 3d,
  init_args: {...}}``.

``--config`` files are read here first: a missing, unreadable or malformed file is one line naming the file (and the
line of a YAML error), exit code 2, before anything is built.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.strategies import StrategyRegistry

from lightning_llm.files import DataError
from lightning_llm.strategies import (  # importing it registers our names
    check_strategy_name,
    strategy_class,
)

__all__ = ["PARSER_MODE", "StrategyChoice", "expand_config", "prepare_argv", "read_config_file", "strategy_choice",
           "strategy_options"]

PARSER_MODE = "lightning_llm"
"""jsonargparse parser mode of :class:`~lightning_llm.cli.app.LLMCLI`: its loader expands registered strategy names."""

STRATEGY = "--trainer.strategy"
SUBCOMMANDS = ("fit", "validate", "test", "predict")


@dataclass(frozen=True)
class StrategyChoice:
    """What a ``--trainer.strategy`` value names: a class and the preset init args of a registered name."""

    value: str
    """As the user wrote it: a registered name or a class path."""
    cls: type
    preset: dict[str, Any] = field(default_factory=dict)
    registered: bool = False

    @property
    def class_path(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    @property
    def ours(self) -> bool:
        return self.cls.__module__.startswith("lightning_llm.")

    def describe(self) -> str:
        return f"strategy {self.value!r} ({self.class_path})" if self.registered else f"strategy {self.value}"

    def check_option(self, option: str, *, where: str) -> None:
        """Raise ``ValueError`` naming ``where`` and this strategy when its class has no init arg ``option``."""
        known = strategy_options(self.cls)
        if option in known or option == "help":
            return
        close = difflib.get_close_matches(option, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; its options: {', '.join(sorted(known))}"
        raise ValueError(f"{where}: {self.describe()} has no option {option!r}{hint}")

    def spec(self, init_args: dict[str, Any] | None = None, *, where: str = STRATEGY) -> dict[str, Any]:
        """The class form jsonargparse takes options on: the preset, overridden by ``init_args`` (checked)."""
        for key in init_args or {}:
            self.check_option(key, where=f"{where}.{key}")
        return {"class_path": self.class_path, "init_args": {**self.preset, **(init_args or {})}}


def strategy_choice(value: Any) -> StrategyChoice | None:
    """A registered name (ours or Lightning's) or a ``package.module.Class`` path -> its class and preset; ``None``
    for anything else (``auto``, an unknown name: :func:`lightning_llm.strategies.check_strategy_name` names it)."""
    if not isinstance(value, str):
        return None
    if value.lower() in StrategyRegistry:
        entry = StrategyRegistry[value.lower()]
        return StrategyChoice(value, entry["strategy"], dict(entry["init_params"]), registered=True)
    cls = strategy_class(value)
    return StrategyChoice(value, cls) if cls is not None else None


@functools.cache
def strategy_options(cls: type) -> frozenset[str]:
    """The init args jsonargparse accepts for ``cls`` (``**kwargs`` passed on to a base class included)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, fail_untyped=False)
    return frozenset(k.split(".")[0] for k in parser.get_defaults().keys())  # noqa: SIM118 - a Namespace


# ---------------------------------------------------------------------------------------------------- config files
def read_config_file(value: str) -> dict[str, Any] | None:
    """Check a ``--config`` value before jsonargparse reads it: the parsed YAML of a file (``None`` for an inline YAML
    string, which jsonargparse parses itself). ``DataError`` naming the file (and line) when it cannot be read."""
    import yaml

    path = Path(value)
    if not path.exists():
        if _inline_yaml(value):
            return None
        raise DataError(f"--config={value}: file not found")
    name = f"--config={value}"
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise DataError(f"{name}: a directory, not a config file") from None
    except OSError as e:
        raise DataError(f"{name}: cannot read the file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{name}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}" if mark is not None else name
        raise DataError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DataError(f"{name}: expected a mapping of options (trainer:, model:, data:, ...), got a "
                        f"{type(data).__name__}")
    return data


def _inline_yaml(value: str) -> bool:
    """``--config`` also takes YAML itself (``--config='{trainer: {max_steps: 1}}'``)."""
    import yaml

    try:
        return isinstance(yaml.safe_load(value), dict)
    except yaml.YAMLError:
        return False


def _config_strategy(data: dict[str, Any]) -> tuple[Any, bool]:
    """The ``trainer.strategy`` a config file sets (top level or under a subcommand), and whether it sets one."""
    for holder in (data, *(data[s] for s in SUBCOMMANDS if isinstance(data.get(s), dict))):
        trainer = holder.get("trainer")
        if isinstance(trainer, dict) and "strategy" in trainer:
            return trainer["strategy"], True
    return None, False


def expand_config(data: Any, *, where: str = "config") -> Any:
    """A loaded config with its registered strategy names in class form: ``trainer.strategy`` (top level or under a
    subcommand) when it is one of lightning_llm's names or ``{class_path: NAME, ...}`` of any registered name, and a
    value that is itself such a spec (``--trainer.strategy='{class_path: 3d, ...}'``). The ``init_args`` of every
    strategy spec (a class path too) are checked against its class."""
    if _spec_choice(data) is not None:
        return _expand_spec(data, where=where)
    if not isinstance(data, dict):
        return data
    for holder in (data, *(data[s] for s in SUBCOMMANDS if isinstance(data.get(s), dict))):
        trainer = holder.get("trainer")
        if not isinstance(trainer, dict):
            continue
        value = trainer.get("strategy")
        choice = strategy_choice(value)
        if choice is not None and choice.registered and choice.ours:
            trainer["strategy"] = choice.spec()
        elif _spec_choice(value) is not None:
            trainer["strategy"] = _expand_spec(value, where=f"{where}: trainer.strategy.init_args")
    return data


def _spec_choice(value: Any) -> StrategyChoice | None:
    """The strategy a ``{class_path: NAME_OR_PATH, init_args: {...}}`` mapping names, else ``None``."""
    if not isinstance(value, dict) or "class_path" not in value or set(value) - {"class_path", "init_args",
                                                                                  "dict_kwargs"}:
        return None
    return strategy_choice(value["class_path"])


def _expand_spec(value: dict[str, Any], *, where: str) -> dict[str, Any]:
    """The class form of a strategy spec: the preset of a registered name under its ``init_args`` (checked)."""
    choice = _spec_choice(value)
    assert choice is not None
    init_args = value.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise ValueError(f"{where}: expected a mapping of {choice.describe()}'s options, got {init_args!r}")  # noqa: TRY004 - a user error (exit 2)
    return {**value, **choice.spec(init_args, where=where)}


def _loader(base: Callable[[str], Any]) -> Callable[..., Any]:
    def load(value: str, path: str | None = None) -> Any:
        return expand_config(base(value), where=f"--config={path}" if path else "config")

    return load


def register_parser_mode(base_mode: str) -> str:
    """Register :data:`PARSER_MODE`: jsonargparse's ``base_mode`` loader (``yaml`` or ``omegaconf``), then
    :func:`expand_config`. Returns the mode to give the parser."""
    from jsonargparse import get_loader, set_loader
    from jsonargparse._loaders_dumpers import (  # the lazy omegaconf set-up
        get_loader_exceptions,
        set_omegaconf_loader,
    )

    if base_mode.startswith("omegaconf"):
        set_omegaconf_loader(base_mode)
    set_loader(PARSER_MODE, _loader(get_loader(base_mode)), get_loader_exceptions("yaml"))
    return PARSER_MODE


# ---------------------------------------------------------------------------------------------------- argv
def _options(argv: list[str]) -> Iterator[tuple[int, str, str | None, bool]]:
    """``(index, key, value, inline)`` of each ``--key=value`` / ``--key value`` item (value None for a flag)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg.partition("=")
            yield i, key, value, True
        elif arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            yield i, arg, nxt, False
            i += nxt is not None
        i += 1


def prepare_argv(argv: list[str]) -> list[str]:
    """The argument list with registered strategy names in class form (see the module doc), every
    ``--trainer.strategy.OPTION`` checked against the chosen class, and every ``--config`` file checked."""
    out = list(argv)
    inserted = 0
    current: StrategyChoice | None = None  # the strategy the options so far select
    plain = False  # it is still a string to jsonargparse (a Lightning name): an option needs the class form first
    for i, key, value, inline in _options(argv):
        at = i + inserted
        if key == "--config" and value is not None:
            data = read_config_file(value)
            strategy, sets = _config_strategy(data) if data else (None, False)
            expand_config(data, where=f"--config={value}")  # its strategy options checked, named by this path
            if sets:
                current = strategy_choice(strategy) or _spec_choice(strategy)
                plain = isinstance(strategy, str) and current is not None and current.registered and not current.ours
        elif key == STRATEGY and value is not None:
            current, plain = strategy_choice(value), False
            if current is not None and current.registered:
                if current.ours:
                    _replace_value(out, at, inline, json.dumps(current.spec()))
                else:
                    plain = True
        elif key.startswith(STRATEGY + "."):
            option = key[len(STRATEGY) + 1:].removeprefix("init_args.").split(".")[0]
            if option in ("dict_kwargs", "class_path"):  # jsonargparse's own keys of a class spec
                continue
            if option == "help" and value is not None and (named := strategy_choice(value)) is not None:
                _replace_value(out, at, inline, named.class_path)  # --trainer.strategy.help 3d: its class's help
                continue
            if current is None:
                _check_name(out, at, key)
            current.check_option(option, where=key)
            if plain:
                out.insert(at, f"{STRATEGY}={json.dumps(current.spec())}")
                inserted += 1
                plain = False
    return out


def _replace_value(out: list[str], at: int, inline: bool, value: str) -> None:
    if inline:
        out[at] = f"{out[at].partition('=')[0]}={value}"
    else:
        out[at + 1] = value


def _check_name(out: list[str], at: int, key: str) -> NoReturn:
    """An option, and no strategy this module resolves before it: the bad ``--trainer.strategy`` named, or none."""
    given = [v for _, k, v, _ in _options(out[:at]) if k == STRATEGY and v is not None]
    if given:
        check_strategy_name(given[-1])
    raise ValueError(f"{key}: no strategy to give it to; choose one first with --trainer.strategy=NAME (e.g. 3d, "
                     "zero3) or a Strategy class path")
