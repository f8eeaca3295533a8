"""The `lightning_llm` CLI: help, every config parses, bad input fails early with one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_llm.cli import LLMCLI, SUBCOMMAND_HELP, TOOLS, main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_help_lists_every_subcommand_with_one_line(capsys) -> None:
    """``lightning_llm --help`` names Lightning's four subcommands and every tool, one line each with its help."""
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [*LightningCLI.subcommands(), *TOOLS]
    assert len(names) == 10 and set(SUBCOMMAND_HELP) == set(names)
    for name in names:
        [line] = [ln for ln in lines if ln.split()[:1] == [name]]
        assert SUBCOMMAND_HELP[name] in line
    assert main([]) == 2  # no subcommand: the same help on stderr, a usage error
    assert "tools:" in capsys.readouterr().err


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_has_help(tool: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([tool, "--help"])
    assert exit_.value.code == 0
    assert f"usage: lightning_llm {tool}" in capsys.readouterr().out


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses(config: Path, tmp_path: Path) -> None:
    # Parsing only (no instantiation): data dirs in real-data recipes need not exist here.
    class ParseOnly(LLMCLI):
        def instantiate_classes(self) -> None:  # validate types and class paths, build nothing
            pass

    cfg = ParseOnly(args=["--config", str(config)], run=False).config
    assert cfg.model.class_path.startswith("lightning_llm.tasks.")
    assert cfg.trainer.log_every_n_steps is not None


# Configs on files the user brings: the flags their header names; without them the run stops with one line.
NEEDS_FILES = {
    "afqmc.yaml": (["--data.data_dir", "--data.tokenizer_dir"], "--data.data_dir is required"),
    "sft_summary.yaml": (["--data.train_path", "--data.test_path", "--data.tokenizer_dir"],
                         "--data.train_path (or --data.generated_conversations) is required for fit"),
    "qlora_sft_csl.yaml": (["--data.train_path", "--data.test_path", "--data.tokenizer_dir"],
                           "--data.train_path (or --data.generated_conversations) is required for fit"),
}


def test_no_config_reads_shared_data() -> None:
    """A user has no ``../shared``: no config may point there (tests pass those paths on the command line)."""
    for config in CONFIGS:
        assert "shared/" not in config.read_text(encoding="utf-8"), config.name


@pytest.mark.parametrize("name", sorted(NEEDS_FILES))
def test_config_on_your_files_names_its_flags(name: str, tmp_path: Path, capsys) -> None:
    flags, error = NEEDS_FILES[name]
    text = (REPO / "configs" / name).read_text(encoding="utf-8")
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert all(flag in header for flag in flags)
    rc = main(["fit", "--config", str(REPO / "configs" / name), "--trainer.logger=false",
               f"--trainer.default_root_dir={tmp_path}"])
    assert rc == 2
    assert f"lightning_llm: error: {error}" in capsys.readouterr().err


def test_unknown_model_size_fails_before_training(pair_data: Path, tmp_path: Path, capsys) -> None:
    rc = main(["fit", "--model=lightning_llm.tasks.ClassificationTask", "--model.backbone=nope",
               "--data=lightning_llm.data.SentencePairDataModule", f"--data.data_dir={pair_data}",
               f"--data.tokenizer_dir={pair_data / 'tokenizer'}", "--trainer.accelerator=cpu",
               "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown encoder model size 'nope'" in err


def test_missing_tokenizer_dir_one_line(pair_data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    rc = main(["fit", "--model=lightning_llm.tasks.ClassificationTask", "--data=lightning_llm.data.SentencePairDataModule",
               f"--data.data_dir={pair_data}", f"--data.tokenizer_dir={tmp_path / 'nope'}", "--trainer.accelerator=cpu",
               "--trainer.logger=false"])
    err = capfd.readouterr().err  # what reaches the terminal
    assert rc != 0
    assert f"--data.tokenizer_dir={tmp_path / 'nope'}: directory not found" in err
    assert "Traceback" not in err


def test_lightning_misconfiguration_is_one_line(tmp_path: Path, capsys) -> None:
    """Lightning's own configuration errors (here: a config's ModelCheckpoint with checkpointing switched off) end
    the run with exit code 2 and one line, like ours."""
    rc = main(["fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.enable_checkpointing=false",
               f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "lightning_llm: error: Trainer was configured with `enable_checkpointing=False`" in err


@pytest.mark.parametrize(("bound", "title"), [(["--trainer.max_steps=2"], "Epoch 0"),
                                              (["--trainer.max_steps=-1", "--trainer.max_epochs=2",
                                                "--trainer.limit_train_batches=1"], "Epoch 1/1")])
def test_progress_bar_counts_epochs_of_a_max_steps_run(bound: list[str], title: str, tmp_path: Path, capsys) -> None:
    """The rich progress bar of a ``max_steps`` run reads "Epoch 0", not Lightning's "Epoch 0/-2" (max_epochs - 1 of
    an unbounded run); a run of two epochs still reads "Epoch 1/1"."""
    rc = main(["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), *bound, "--trainer.logger=false",
               "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.callbacks=[]",
               f"--trainer.default_root_dir={tmp_path}", f"--data.cache_dir={tmp_path / 'cache'}",
               "--data.generated_docs=40"])
    out = capsys.readouterr().out
    titles = set(re.findall(r"Epoch [0-9/-]+", out))
    assert rc == 0 and titles == {title}, titles
