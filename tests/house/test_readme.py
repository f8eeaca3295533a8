"""The README and the docs pages stay true to the repository: every test they name (``tests/x.py::name``) and every
repository file they name exists, every link between them lands on a file and heading, and every ``lightning_llm``
command line in a fenced block parses: ``--print_config`` for fit/validate/test/predict, each ``--option`` of a tool
among its ``--help``. In process, so the whole file takes seconds."""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from lightning_llm.cli import LLMCLI, TOOLS, main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]
ROOTS = ("lightning_llm/", "tests/", "configs/", "docs/", "benchmarks/", ".ci/")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
PATH_REF = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the pages' command lines name configs/... relative to the repository root


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


@cache
def _test_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))


def missing_tests(text: str) -> list[str]:
    """``tests/x.py::name`` references whose file or test does not exist."""
    bad = []
    for file, name in TEST_REF.findall(text):
        if not (REPO / file).is_file() or name not in _test_names(REPO / file):
            bad.append(f"{file}::{name}")
    return bad


def _repo_path(token: str) -> str | None:
    """The repository path a backticked token names, or None when it names none (a glob, a placeholder, runs/...)."""
    token = token.split("::")[0].rstrip(".,;:)")
    if any(c in token for c in "<>*{}$=") or not token.startswith(ROOTS):
        return None
    return token


def missing_paths(text: str) -> list[str]:
    """Backticked repository paths (``lightning_llm/...``, ``tests/...``, ``configs/...``, ...) that do not exist."""
    return [p for t in PATH_REF.findall(text) if (p := _repo_path(t)) and not (REPO / p).exists()]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}


def broken_links(page: Path, text: str) -> list[str]:
    """Relative links whose file, or heading (``#anchor``), is not there."""
    bad = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            bad.append(target)
    return bad


def command_lines(text: str) -> list[list[str]]:
    """The ``lightning_llm`` command lines of the fenced shell blocks, as argv after ``lightning_llm`` (backslash
    continuations and quotes spanning lines joined, comments dropped; ``torchrun ... -m lightning_llm`` included)."""
    commands = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "sh", "shell", ""):
            continue
        buffer = ""
        for line in body.splitlines():
            buffer += line.rstrip("\\") + " " if line.endswith("\\") else line + "\n"
            if line.endswith("\\"):
                continue
            try:
                argv = shlex.split(buffer, comments=True)
            except ValueError:  # a quote open across lines
                continue
            buffer = ""
            if argv[:1] == ["lightning_llm"]:
                commands.append(argv[1:])
            elif "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["lightning_llm"]:
                commands.append(argv[argv.index("-m") + 2:])
    return commands


@cache
def _tool_help(tool: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([tool, "--help"])
    return out.getvalue()


class _Built(Exception):
    pass


class _ParserOnly(LLMCLI):
    """Stops LightningCLI once it has built its parser (the costly part), keeping it: every command line is then
    parsed by the parser and ``parse_arguments`` that ``lightning_llm`` uses, the parser built once."""

    built: _ParserOnly | None = None

    def parse_arguments(self, parser, args) -> None:
        self.kept = parser
        type(self).built = self
        raise _Built


@cache
def _cli() -> _ParserOnly:
    with contextlib.suppress(_Built):
        _ParserOnly(args=[])
    assert _ParserOnly.built is not None
    return _ParserOnly.built


def command_error(argv: list[str]) -> str | None:
    """Why ``lightning_llm *argv`` would not parse, or None."""
    if not argv or argv[0] in ("-h", "--help"):
        return None
    if argv[0] in TOOLS:
        helptext = _tool_help(argv[0])
        # a whole option name in the help, not a substring of another (--to within --tokenizer)
        unknown = [a.split("=")[0] for a in argv[1:] if a.startswith("--")
                   and not re.search(rf"(?<![\w-]){re.escape(a.split('=')[0])}(?![\w-])", helptext)]
        return f"{argv[0]} has no option {unknown}" if unknown else None
    if argv[0] not in LIGHTNING_SUBCOMMANDS:
        return f"no subcommand {argv[0]!r}"
    cli, out, err = _cli(), io.StringIO(), io.StringIO()
    helps = any(a in ("-h", "--help") or a.endswith(".help") for a in argv)  # prints its help and exits 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            LLMCLI.parse_arguments(cli, cli.kept, argv if helps else [*argv, "--print_config"])
            rc = 0
        except SystemExit as e:
            rc = e.code
        except Exception as e:  # noqa: BLE001 - what main() would turn into its one-line error
            rc, _ = 2, err.write(str(e))
    return None if rc in (0, None) else f"exit {rc}: {err.getvalue().strip()[-400:]}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_named_tests_and_files_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert missing_tests(text) == []
    assert missing_paths(text) == []
    assert broken_links(page, text) == []


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_command_line_parses(page: Path) -> None:
    commands = command_lines(page.read_text(encoding="utf-8"))
    errors = {shlex.join(c): e for c in commands if (e := command_error(c))}
    assert errors == {}


def test_readme_is_an_entry_point() -> None:
    """Short; CI runs its test command (.ci/run -> make test); the five-minute path trains, switches the layout,
    exports and reloads."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make test " in text and "make install " in text
    assert "make test" in (REPO / ".ci" / "run").read_text()
    commands = [shlex.join(c) for c in command_lines(text)]
    for strategy in ("ddp", "tp", "pp", "zero3"):
        assert any(f"--trainer.strategy={strategy} --trainer.devices=2" in c for c in commands), strategy
    assert any(c.startswith("export ") for c in commands)
    assert "AutoModelForCausalLM.from_pretrained" in text


def test_the_checks_catch_what_they_are_for() -> None:
    """Each check fails on a page naming what is not there (else the tests above could pass on anything)."""
    assert missing_tests("`tests/tasks/test_ppo.py::test_ddp_two_processes_match_one_device`") == [
        "tests/tasks/test_ppo.py::test_ddp_two_processes_match_one_device"]
    assert missing_tests("`tests/tasks/test_ppo.py::test_layout_matches_one_device`") == []
    assert missing_paths("`configs/nope.yaml` and `configs/dpo.yaml`") == ["configs/nope.yaml"]
    assert broken_links(README, "[x](docs/strategies.md#no-such-heading) [y](docs/strategies.md#estimate)") == [
        "docs/strategies.md#no-such-heading"]
    block = "```bash\nlightning_llm fit --config configs/dpo.yaml \\\n    --model.no_such_option=1\n```\n"
    [argv] = command_lines(block)
    assert "no_such_option" in command_error(argv)
    assert command_error(["export", "x.ckpt", "--to", "d", "--no-such"]) == "export has no option ['--no-such']"
    assert command_error(["export", "x.ckpt", "--tok"]) == "export has no option ['--tok']"  # a prefix of --tokenizer
    assert command_error(["fit", "--config", "configs/dpo.yaml"]) is None


def test_the_docs_family_list_is_the_table() -> None:
    """docs/models.md lists the supported HF classes as the one table in models/hf/convert/architectures.py holds
    them."""
    from lightning_llm.models.hf.convert import architectures

    page = REPO / "docs" / "models.md"
    text = page.read_text(encoding="utf-8")
    assert architectures.replace_block(text) == text, (
        "docs/models.md's family list differs from models/hf/convert/architectures.py: run "
        "python -m lightning_llm.models.hf.convert.architectures --write docs/models.md")
    stale = text.replace("`LlamaForCausalLM`, ", "", 1)  # the check fails on a list that lost a class
    assert architectures.replace_block(stale) != stale
