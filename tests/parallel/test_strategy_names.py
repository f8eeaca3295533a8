"""Registered strategy names take their class's options: ``--trainer.strategy=NAME --trainer.strategy.OPTION=VALUE``
and YAML ``strategy: {class_path: NAME, init_args: {...}}`` build the class with the name's preset unless overridden;
a misspelt option is one line naming it and the strategy (``lightning_llm.cli.args``)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_llm.cli import LLMCLI, main
from lightning_llm.cli.args import prepare_argv

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "pretrain_debug.yaml")
PREFIX = "lightning_llm: error: "
NVME = str(Path(tempfile.gettempdir()) / "lightning_llm-test-strategy-names-nvme")


def _native(stage: int, opt: bool = False, params: bool = False) -> Callable[[Any], bool]:
    return lambda s: (type(s).__name__ == "ZeroStrategy" and s.zero_stage == stage and s.offload_optimizer is opt
                      and s.offload_params is params and s.activation_checkpointing is True)


def _deepspeed(stage: int, opt: bool = False, params: bool = False) -> Callable[[Any], bool]:
    def check(s: Any) -> bool:
        zero = s.config["zero_optimization"]
        return (type(s).__name__ == "DeepSpeedZeroStrategy" and s.optimizer_name == "adamw" and zero["stage"] == stage
                and ("offload_optimizer" in zero) is opt and ("offload_param" in zero) is params)
    return check


# name -> (option, value, the built strategy has that value and the name's preset). Written out here, not read from
# the registry, so a preset that changes (or a new name) fails this table.
CASES: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "tp": ("sequence_parallel", "true", lambda s: type(s).__name__ == "TensorParallelStrategy"
           and s.sequence_parallel is True and s.args.dims.tp == -1 and s.args.dims.dp == 1),
    "pp": ("n_microbatches", "2", lambda s: type(s).__name__ == "PipelineParallelStrategy" and s.n_microbatches == 2
           and s.args.dims.pp == -1 and s.log_pipeline_stats is True),
    "cp": ("zero_stage", "3", lambda s: type(s).__name__ == "ContextParallelStrategy" and s.zero_stage == 3
           and (s.args.dims.cp, s.args.dims.dp, s.args.dims.tp) == (-1, 1, 1)),
    "ep": ("zero_stage", "3", lambda s: type(s).__name__ == "ExpertParallelStrategy" and s.zero_stage == 3
           and (s.args.dims.ep, s.args.dims.dp, s.args.dims.tp) == (-1, -1, 1)),
    "3d": ("zero_stage", "1", lambda s: type(s).__name__ == "HybridParallelStrategy" and s.zero_stage == 1
           and (s.args.dims.dp, s.args.dims.tp, s.args.dims.pp) == (-1, 1, 1)),
    "zero1": ("activation_checkpointing", "true", _native(1)),
    "zero2": ("activation_checkpointing", "true", _native(2)),
    "zero3": ("activation_checkpointing", "true", _native(3)),
    "zero2_offload": ("activation_checkpointing", "true", _native(2, opt=True)),
    "zero3_offload": ("activation_checkpointing", "true", _native(3, opt=True, params=True)),
    "deepspeed_zero1": ("optimizer", "adamw", _deepspeed(1)),
    "deepspeed_zero2": ("optimizer", "adamw", _deepspeed(2)),
    "deepspeed_zero3": ("optimizer", "adamw", _deepspeed(3)),
    "deepspeed_zero3_offload": ("optimizer", "adamw", _deepspeed(3, opt=True, params=True)),
    "deepspeed_zero3_nvme": ("nvme_path", NVME, lambda s: type(s).__name__ == "DeepSpeedZeroStrategy"
                             and s.config["zero_optimization"]["offload_param"]["device"] == "nvme"
                             and s.config["zero_optimization"]["offload_optimizer"]["nvme_path"] == NVME),
}


def _strategy(*args: str) -> Any:
    """The strategy LightningCLI builds for the pretraining config plus ``args`` (nothing is run)."""
    return LLMCLI(args=["--config", CONFIG, "--trainer.logger=false", *args], run=False).trainer.strategy


def _error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["fit", "--config", CONFIG, "--trainer.logger=false", *args]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(PREFIX)]
    assert len(lines) == 1 and "usage:" not in err and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_every_registered_name_is_covered() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llm.strategies  # noqa: F401 - registers them

    ours = {n for n in StrategyRegistry.available_strategies()
            if StrategyRegistry[n]["strategy"].__module__.startswith("lightning_llm.")}
    assert ours == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_name_takes_an_option_and_keeps_its_preset(name: str) -> None:
    option, value, built_right = CASES[name]
    strategy = _strategy(f"--trainer.strategy={name}", f"--trainer.strategy.{option}={value}")
    print(name, type(strategy).__name__, option, value)
    assert built_right(strategy)
    # A misspelt option is refused naming it, the strategy and the closest option, before anything is parsed.
    bad = option.replace("_", "", 1) if "_" in option else option + "s"
    with pytest.raises(ValueError) as info:
        prepare_argv(["fit", f"--trainer.strategy={name}", f"--trainer.strategy.{bad}={value}"])
    assert str(info.value).startswith(f"--trainer.strategy.{bad}: strategy '{name}' (lightning_llm.strategies.")
    assert str(info.value).endswith(f"has no option '{bad}'; did you mean '{option}'?")


def test_misspelt_option_is_one_line_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, "--trainer.strategy=3d", "--trainer.strategy.tensor_paralel_size=2")
    assert line == (f"{PREFIX}--trainer.strategy.tensor_paralel_size: strategy '3d' (lightning_llm.strategies.presets."
                    "HybridParallelStrategy) has no option 'tensor_paralel_size'; did you mean 'tensor_parallel_size'?")


@pytest.mark.parametrize(("args", "expected"), [
    (("--trainer.strategy=zero2", "--trainer.strategy.bucket_size_mb=0"),
     "lightning_llm.strategies.presets.ZeroStrategy: bucket_size_mb=0.0: must be > 0"),
    (("--trainer.strategy=lightning_llm.strategies.ZeroStrategy", "--trainer.strategy.engine=deepspeed",
      "--trainer.strategy.bucket_size_mb=50"),
     "lightning_llm.strategies.ZeroStrategy: ZeroStrategy(engine='deepspeed'): bucket_size_mb is an option of the "
     "native engine"),
    (("--trainer.strategy=3d", "--trainer.strategy.zero_stage=7"),
     "lightning_llm.strategies.presets.HybridParallelStrategy: zero_stage=7: must be 0, 1, 2 or 3"),
])
def test_a_value_the_strategy_refuses_is_its_own_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                                      expected: str) -> None:
    """The constructor's error, not jsonargparse's union dump ("Expected a <class 'str'>. Got value: Namespace(...")."""
    line = _error(capsys, *args)
    assert line.startswith(PREFIX + expected), line


def test_option_overrides_the_preset_and_space_separated_values() -> None:
    s = _strategy("--trainer.strategy", "zero3_offload", "--trainer.strategy.offload_params", "false",
                  "--trainer.strategy.offload_optimizer", "false")
    assert (s.zero_stage, s.offload_optimizer, s.offload_params) == (3, False, False)
    assert _strategy("--trainer.strategy=deepspeed_zero2", "--trainer.strategy.stage=1").stage == 1


def test_lightning_names_take_options_once_given() -> None:
    """Lightning's own names get the same treatment when an option follows (else they stay the string Lightning
    knows)."""
    from lightning.pytorch.strategies import DDPStrategy

    s = _strategy("--trainer.strategy=ddp_spawn", "--trainer.strategy.find_unused_parameters=true")
    assert type(s) is DDPStrategy and s._ddp_kwargs["find_unused_parameters"] is True and s._start_method == "spawn"


def test_yaml_names_with_init_args(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "strategy.yaml"
    cfg.write_text("trainer:\n  strategy:\n    class_path: zero3_offload\n    init_args:\n"
                   "      activation_checkpointing: true\n")
    assert _native(3, opt=True, params=True)(_strategy("--config", str(cfg)))
    # A name as a plain string in YAML, then an option on the command line.
    cfg.write_text("trainer:\n  strategy: deepspeed_zero3\n")
    assert _deepspeed(3)(_strategy("--config", str(cfg), "--trainer.strategy.optimizer=adamw"))
    # A class path in the file, an option on the command line.
    cfg.write_text("trainer:\n  strategy:\n    class_path: lightning_llm.strategies.HybridParallelStrategy\n"
                   "    init_args: {zero_stage: 1}\n")
    s = _strategy("--config", str(cfg), "--trainer.strategy.sequence_parallel=true")
    assert (s.zero_stage, s.sequence_parallel) == (1, True)
    # A misspelt init arg in the file: one line naming the file, the key and the strategy.
    cfg.write_text("trainer:\n  strategy:\n    class_path: 3d\n    init_args: {tensor_paralel_size: 2}\n")
    line = _error(capsys, "--config", str(cfg))
    assert line == (f"{PREFIX}--config={cfg}: trainer.strategy.init_args.tensor_paralel_size: strategy '3d' "
                    "(lightning_llm.strategies.presets.HybridParallelStrategy) has no option 'tensor_paralel_size'; "
                    "did you mean 'tensor_parallel_size'?")


def test_print_config_shows_the_class_and_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", CONFIG, "--trainer.strategy=zero3_offload",
              "--trainer.strategy.activation_checkpointing=true", "--print_config"])
    assert done.value.code == 0
    strategy = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_llm.strategies.presets.ZeroStrategy"
    args = strategy["init_args"]
    assert (args["stage"], args["offload_optimizer"], args["offload_params"], args["activation_checkpointing"]) == \
        (3, True, True, True)


def test_option_without_a_strategy_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error(capsys, "--trainer.strategy.zero_stage=1")
    assert line.startswith(f"{PREFIX}--trainer.strategy.zero_stage: no strategy to give it to; choose one first"), line
    line = _error(capsys, "--trainer.strategy=zero4", "--trainer.strategy.stage=1")
    assert line.startswith(f"{PREFIX}--trainer.strategy='zero4': unknown strategy; did you mean 'zero3'?"), line


@pytest.mark.parametrize("name", list(CASES))
def test_async_save_on_every_native_name_refused_by_deepspeed(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """``--trainer.strategy.async_save=true`` builds every native preset with background saves; a DeepSpeed name
    refuses it in one line (DeepSpeed writes its files itself, synchronously)."""
    if name.startswith("deepspeed_"):
        line = _error(capsys, f"--trainer.strategy={name}", "--trainer.strategy.async_save=true")
        assert "async_save=true is not available with DeepSpeed" in line, line
    else:
        assert _strategy(f"--trainer.strategy={name}", "--trainer.strategy.async_save=true").async_save is True
