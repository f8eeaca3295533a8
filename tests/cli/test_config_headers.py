"""Every config's header stays true: each command line it shows (``lightning_llm ...``, ``python -m ...``, with its
backslash continuations) runs as written, in order, for two steps (trainer overrides appended, and on the user's files
their first records only; ``/path/to/...`` placeholders given the shared data in ``../shared`` where they name the
user's files, skipped with the reason when that is absent, or files generated here) in this process; the commands on
several devices on as many processes, the first as the user types it and the others in one launch; every inline
```lightning_llm ...``` command parses; every other ``--flag`` the header names is an option of the config.

The README's commands are checked by ``tests/house/test_readme.py``, whose parser this reuses."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import yaml
from tests.conftest import SHARED_DATA
from tests.grouped import run_commands
from tests.house.test_readme import LIGHTNING_SUBCOMMANDS, _cli, command_error

from lightning_llm.cli import LLMCLI, main
from lightning_llm.data.corpus.documents import generated_corpus

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))

STEPS = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
         "--trainer.limit_predict_batches=1", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false"]
"""Appended to every fit/validate/test/predict: two steps (no validation but the sanity check where a config has one;
``last.ckpt`` is written at the end) and one test/predict batch."""
FEWER_RECORDS = {"data.limit_examples": "64", "data.max_train_samples": "256", "data.generated_pairs": "32",
                 "data.generated_val_pairs": "8", "data.generated_prompts": "32", "data.generated_val_prompts": "8",
                 "data.generated_conversations": "64", "data.generated_examples": "32",
                 "data.generated_val_examples": "8"}
"""Appended where the datamodule has them: the first records of the user's files, fewer generated ones (encoding
all 1,000 CSL records, or precomputing DPO's reference on 288 pairs, would take most of this test's time)."""

_START = re.compile(r"^(lightning_llm|python -m) ")
_LS = re.compile(r"\$\(ls ([^)\s]+)\)")  # the one shell expansion headers use: $(ls runs/.../*.ckpt)
_LS_TOKEN = re.compile(r"@ls\(([^)]+)\)")
_INLINE = re.compile(r"`(lightning_llm [^`]+)`")
_FLAG = re.compile(r"(?<![\w-])--([a-z_][\w]*(?:\.\w+)*)")


# ------------------------------------------------------------------------------------------------- reading headers
def header(config: Path) -> list[str]:
    """The text of the config's leading comment lines."""
    lines = []
    for line in config.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return lines


def header_commands(lines: list[str]) -> tuple[list[list[str]], list[str]]:
    """``(command lines as argv, the remaining prose lines)``. A command starts a line with ``lightning_llm`` or
    ``python -m`` and goes on over lines ending in a backslash or inside an open quote; a trailing ``# ...`` is a
    comment. ``$(ls PATTERN)`` is kept as one ``@ls(PATTERN)`` token, expanded when the command runs."""
    commands, prose, buffer = [], [], None
    for line in lines:
        if buffer is None and not _START.match(line):
            prose.append(line)
            continue
        buffer = line if buffer is None else f"{buffer} {line}"
        if buffer.endswith("\\"):
            buffer = buffer[:-1]
            continue
        try:
            argv = shlex.split(_LS.sub(r"@ls(\1)", buffer), comments=True)
        except ValueError:  # a quote open across lines
            continue
        commands.append(argv)
        buffer = None
    if buffer is not None:
        raise AssertionError(f"a command is not closed at the end of the header: {buffer!r}")
    return commands, prose


def _keys(value: object, prefix: str = "") -> set[str]:
    """Dotted option names of a printed config (``class_path``/``init_args`` levels folded as the CLI folds them)."""
    if not isinstance(value, dict):
        return set()
    value = value.get("init_args", value) if "class_path" in value else value
    out = set()
    for key, sub in value.items():
        name = f"{prefix}{key}"
        out |= {name} | _keys(sub, f"{name}.")
    return out


@cache
def options(args: tuple[str, ...]) -> frozenset[str]:
    """Every option a ``lightning_llm`` command line (``fit --config x.yaml ...``) takes, from its ``--print_config``
    (empty when it does not parse: running it then says why)."""
    cli, out = _cli(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        LLMCLI.parse_arguments(cli, cli.kept, [*args, "--print_config"])
    return frozenset(_keys(yaml.safe_load(out.getvalue() or "{}")))


def prose_problems(config: Path, prose: list[str]) -> list[str]:
    """Inline ``lightning_llm ...`` commands that do not parse, and ``--flags`` that are no option of the config."""
    text = "\n".join(prose)
    bad = [f"`{c}`: {e}" for c in _INLINE.findall(text) if (e := command_error(shlex.split(c)[1:]))]
    known = options(("fit", "--config", str(config)))
    flags = _FLAG.findall(_INLINE.sub("", text))
    return bad + [f"--{f}: no such option of {config.name}" for f in flags if f not in known]


# ------------------------------------------------------------------------------------------------- running commands
Files = dict[str, Callable[[], Path]]


def _substitute(arg: str, files: Files, cwd: Path) -> str:
    for placeholder in sorted(files, key=len, reverse=True):
        if placeholder in arg:
            arg = arg.replace(placeholder, str(files[placeholder]()))
    if "/path/to/" in arg:
        raise AssertionError(f"{arg}: the header names a file this test does not provide (add it to FILES)")
    for pattern in _LS_TOKEN.findall(arg):
        found = sorted(cwd.glob(pattern))
        if len(found) != 1:
            raise AssertionError(f"$(ls {pattern}) matches {[str(p) for p in found]}, not one file")
        arg = arg.replace(f"@ls({pattern})", str(found[0].relative_to(cwd)))
    return arg


def _devices(argv: list[str]) -> int:
    value = next((a.split("=", 1)[1] for a in argv if a.startswith("--trainer.devices=")), "1")
    return int(value) if value.isdigit() else 1


def multi_device(argv: list[str]) -> bool:
    """A command on several devices: the real launch runs it (Lightning starts the other ranks as copies of it)."""
    return argv[0] == "lightning_llm" and _devices(argv) > 1


def cli_args(argv: list[str], *, cwd: Path, files: Files) -> list[str]:
    """The arguments after ``lightning_llm`` to run: placeholders substituted, two steps, the first records only."""
    args = [_substitute(a, files, cwd) for a in argv[1:]]
    if args[0] in LIGHTNING_SUBCOMMANDS:
        known = options(tuple(args))
        args += STEPS + [f"--{k}={v}" for k, v in FEWER_RECORDS.items() if k in known]
    return args


def run_here(argv: list[str], *, cwd: Path, files: Files) -> str | None:
    """Run one single-process header command in this process, in ``cwd``: None, or why it failed."""
    if argv[0] == "lightning_llm":
        args, err = cli_args(argv, cwd=cwd, files=files), io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as e:  # the parser's own errors (an unknown option) exit as on the command line
                rc = e.code
        return None if rc == 0 else f"exit {rc}: {err.getvalue()[-1500:]}"
    if argv[:2] == ["python", "-m"]:
        saved, sys.argv = sys.argv, [argv[2], *(_substitute(a, files, cwd) for a in argv[3:])]
        try:
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                return f"exit {e.code}"
        finally:
            sys.argv = saved
        return None
    return f"no runner for {argv[0]!r}"


def run_dir(config_dir: Path, cwd: Path) -> Path:
    """``cwd`` made, with ``configs/`` linking the configs (the commands name ``configs/x.yaml``, relative to the
    repository)."""
    (cwd / "configs").mkdir(parents=True, exist_ok=True)
    for config in config_dir.glob("*.yaml"):
        if not (cwd / "configs" / config.name).exists():
            (cwd / "configs" / config.name).symlink_to(config)
    return cwd


def check_header(config: Path, *, cwd: Path, files: Files) -> list[str]:
    """What in ``config``'s header is not true: prose problems, then the first single-process command that does not
    run (later ones may depend on it). Commands on several devices: :func:`launch`."""
    commands, prose = header_commands(header(config))
    problems = prose_problems(config, prose)
    with contextlib.chdir(run_dir(config.parent, cwd)):
        for argv in commands:
            if not multi_device(argv) and (error := run_here(argv, cwd=cwd, files=files)) is not None:
                return [*problems, f"{shlex.join(argv)}\n  -> {error}"]
    return problems


def launch(argv: list[str], *, cwd: Path, files: Files) -> subprocess.Popen:
    """Start a header command as the shell would (``python -m lightning_llm``, this checkout first on the path), its
    output to ``cwd/output.txt``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with (cwd / "output.txt").open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "lightning_llm", *cli_args(argv, cwd=cwd, files=files)],
                                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


# ------------------------------------------------------------------------------------------------- the files
def _shared(relative: str) -> Callable[[], Path]:
    def find() -> Path:
        path = SHARED_DATA / relative
        if not path.exists():
            pytest.skip(f"the header runs on the user's files; {path} (../shared) is not here")
        return path
    return find


def _generated_files(root: Path, tiny_llama: Callable[..., Path]) -> Files:
    """Placeholders of files a user brings that this test writes itself: a tiny HF Llama with its tokenizer (built
    once per test run), and a corpus (a JSONL file, or a folder of them)."""
    def llama() -> Path:
        return tiny_llama(max_position_embeddings=512)

    def corpus(name: str) -> Callable[[], Path]:
        def write() -> Path:
            path = root / name
            if not path.exists():
                (path if path.suffix == "" else path.parent).mkdir(parents=True, exist_ok=True)
                target = path / "corpus.jsonl" if path.suffix == "" else path
                target.write_text("".join(json.dumps({"text": t}) + "\n" for t in generated_corpus(200)))
            return path
        return write

    return {"/path/to/llama-hf": llama, "/path/to/corpus.jsonl": corpus("corpus.jsonl"),
            "/path/to/corpus": corpus("corpus")}


SHARED_FILES = {
    "/path/to/afqmc": "afqmc", "/path/to/tokenizer": "tokenizers/bert-base-chinese",
    "/path/to/bert-base-chinese": "tokenizers/bert-base-chinese", "/path/to/csl/train.json": "csl_title/dev.json",
    "/path/to/csl/test.json": "csl_title/test.json",
}
"""The user's files a header names, and the shared data standing for them (CSL has no train split there: dev)."""


WRITTEN = {
    "afqmc": {"runs/afqmc/afqmc_predict.json": '"label": '},
    "qlora_sft_csl": {"runs/qlora_sft_csl/version_0/adapter/quantization.json": '"quantize": "nf4"'},
    "pretrain_lora": {"runs/pretrain_lora/version_0/adapter/adapter_config.json": '"r": 64',
                      "merged/config.json": '"LlamaForCausalLM"'},
    "lora_deepseek_v3": {"runs/lora_deepseek_v3/version_0/adapter/adapter_config.json": '"kv_b_proj"',
                         "runs/tiny-deepseek-v3/config.json": '"DeepseekV3ForCausalLM"'},
    "lora_phi3": {"runs/phi3_merged/config.json": '"Phi3ForCausalLM"', "runs/tiny_glm4/config.json": '"Glm4ForCausalLM"'},
    "lora_gemma3": {"runs/gemma3_merged/config.json": '"Gemma3ForConditionalGeneration"',
                    "runs/gemma3_merged/chat_template.jinja": "<start_of_turn>"},
    "lora_qwen3_5": {"runs/qwen3_5_merged/config.json": '"Qwen3_5ForConditionalGeneration"'},
}
"""Files a header says its commands write, and a piece of their text."""


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_header_commands_run_as_written(config: Path, tmp_path: Path, tiny_llama: Callable[..., Path]) -> None:
    files = {**_generated_files(tmp_path / "files", tiny_llama), **{k: _shared(v) for k, v in SHARED_FILES.items()}}
    run = tmp_path / "run"
    assert check_header(config, cwd=run, files=files) == []
    for name, text in WRITTEN.get(config.stem, {}).items():
        assert text in (run / name).read_text(encoding="utf-8"), name


@pytest.mark.multiprocess
def test_header_commands_on_several_devices_run_as_written(tmp_path: Path) -> None:
    """The headers' multi-process commands (``--trainer.strategy=ddp --trainer.devices=2``, ...): the first as the
    user types it (``python -m lightning_llm``, Lightning starting the other ranks as copies of the command), beside
    one launch per device count running all the others one after another (:func:`tests.grouped.run_commands`: no
    interpreter start per command)."""
    commands = []
    for config in CONFIGS:
        argvs = header_commands(header(config))[0]
        for i, argv in enumerate(argvs):
            if multi_device(argv):
                cwd = run_dir(REPO / "configs", tmp_path / f"{config.stem}_{i}")
                _prepare(config, argvs[:i], cwd)
                commands.append((argv, cwd))
    assert len(commands) >= 5
    (first, first_cwd), grouped = commands[0], commands[1:]
    typed = launch(first, cwd=first_cwd, files={})
    try:
        for n in sorted({_devices(argv) for argv, _ in grouped}):
            run_commands([(cli_args(argv, cwd=cwd, files={}), cwd) for argv, cwd in grouped if _devices(argv) == n],
                         nproc=n, plan=tmp_path / f"plan-{n}.json")
        assert typed.wait(timeout=600) == 0, (f"{shlex.join(first)}: exit {typed.returncode}: "
                                              f"{(first_cwd / 'output.txt').read_text()[-1500:]}")
    finally:
        if typed.poll() is None:
            typed.kill()


def _prepare(config: Path, earlier: list[list[str]], cwd: Path) -> None:
    """Run in ``cwd`` the earlier commands of ``config``'s header that train another config (configs/distill.yaml's
    teacher from configs/sft_chat.yaml): what they write, a command on several devices reads."""
    with contextlib.chdir(cwd):
        for argv in earlier:
            if not multi_device(argv) and "--config" in argv and f"configs/{config.name}" not in argv:
                assert (error := run_here(argv, cwd=cwd, files={})) is None, f"{shlex.join(argv)}: {error}"


def test_a_wrong_flag_in_a_header_fails_the_check(tmp_path: Path) -> None:
    """A header naming an option the config does not have, in its prose or in a command, fails the check above."""
    body = (REPO / "configs" / "dpo.yaml").read_text(encoding="utf-8").split("\nseed_everything", 1)[1]
    bad = tmp_path / "configs" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_text("# Tune with --data.no_such_flag=3 or --model.dpo.beta=0.5.\n"
                   "#   lightning_llm fit --config configs/bad.yaml \\\n"
                   "#       --model.dpo.no_such_option=1   # a comment\n"
                   f"seed_everything{body}", encoding="utf-8")
    (tmp_path / "run").mkdir()
    problems = check_header(bad, cwd=tmp_path / "run", files={})
    assert problems[0] == "--data.no_such_flag: no such option of bad.yaml"
    assert len(problems) == 2 and "--model.dpo.no_such_option=1" in problems[1] and "exit 2" in problems[1]
    assert "no_such_option" in problems[1].split("->")[1]


@pytest.mark.parametrize("name", ["sft_summary", "qlora_sft_csl"])
def test_csl_without_a_tokenizer_stops_at_the_first_prompt_that_cannot_fit(name: str, tmp_path: Path, capsys) -> None:
    """What the CSL headers say of a run without --data.tokenizer_dir: the byte tokenizer's prompts outgrow
    cutoff_len and the run stops, before training, with one line naming the record's file:line."""
    data = _shared("csl_title/dev.json")()
    rc = main(["fit", "--config", str(REPO / "configs" / f"{name}.yaml"), f"--data.train_path={data}",
               "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(rf"^lightning_llm: error: {re.escape(str(data))}:\d+: the prompt is longer than \d+ "
                                 "tokens even without the text of its last user message", err, re.MULTILINE)


def test_afqmc_byte_pairs_are_cut_as_the_header_says() -> None:
    """configs/afqmc.yaml: without --data.tokenizer_dir the debug backbone's byte tokenizer cuts 2,339 of the 34,334
    AFQMC training pairs at max_length=128."""
    from lightning_llm.data import ByteTokenizer, SentencePairDataModule

    dm = SentencePairDataModule(str(_shared("afqmc")()), None, max_length=128)
    dm.setup("fit")
    assert isinstance(dm.tokenizer, ByteTokenizer)
    assert (dm.truncated["fit"], len(dm.datasets["fit"])) == (2339, 34334)
    assert "2,339 of the 34,334 training pairs pass max_length=128" in " ".join(header(REPO / "configs" / "afqmc.yaml"))
