"""Files the package reads and writes: JSON/JSONL records with errors that name the file and line, and atomic writes
that end with the mode a plain write gives (every checkpoint, export and prepared store goes through them). A module of
its own, at the lowest layer, so that reliability, checkpoints and exports use it without importing the datamodules."""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


class DataError(ValueError):
    """Bad input data: the message names the file (and line) at fault."""


def read_records(path: str | os.PathLike, *, required: Sequence[str] = (), types: dict[str, type | tuple] | None = None
                 ) -> list[dict[str, Any]]:
    """Read a JSONL file (one object per line) or a JSON array file into a list of dicts.

    Every problem raises :class:`DataError` naming ``path:line``: a missing or empty file, undecodable bytes,
    malformed JSON, a non-object record, a missing ``required`` field, or a field of the wrong type.
    """
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    records: list[tuple[int, Any]]
    if text.lstrip().startswith("["):  # a JSON array file (alpaca style)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
        records = [(i + 1, r) for i, r in enumerate(data)]  # "line" = record number for arrays
    else:
        records = []
        # JSON Lines breaks at "\n" only ("\r\n" too): str.splitlines() would also break inside strings at U+2028,
        # U+2029 and U+0085, which JSON allows unescaped (they occur in scraped Chinese text).
        for lineno, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                records.append((lineno, parse_json_line(path, lineno, line)))
    out: list[dict[str, Any]] = []
    for lineno, rec in records:
        check_record(path, lineno, rec, required=required, types=types)
        rec["_line"] = lineno
        out.append(rec)
    if not out:
        raise DataError(f"{path}: no records")
    return out


def parse_json_line(path: str | os.PathLike, lineno: int, line: str) -> Any:
    """One JSON Lines record; :class:`DataError` naming ``path:lineno`` when it is not valid JSON."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None


def check_record(path: str | os.PathLike, lineno: int, rec: Any, *, required: Sequence[str] = (),
                 types: dict[str, type | tuple] | None = None) -> None:
    """:class:`DataError` naming ``path:lineno`` unless ``rec`` is a JSON object with every ``required`` field and
    ``types`` holding for the fields present."""
    if not isinstance(rec, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
    for key in required:
        if key not in rec:
            raise DataError(f"{path}:{lineno}: missing field {key!r} (fields present: {sorted(rec)})")
    for key, typ in (types or {}).items():
        if key in rec and not isinstance(rec[key], typ):
            want = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            raise DataError(f"{path}:{lineno}: field {key!r} must be {want}, got {type(rec[key]).__name__}")


def read_text(path: str | os.PathLike, *, name: str | None = None) -> str:
    """A UTF-8 text file (a BOM is dropped); :class:`DataError` naming the file (``name``, default the path) and the
    line of an undecodable byte, or why it cannot be read."""
    label = name or str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise DataError(f"{label}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{label}: a directory, not a file") from None
    except OSError as e:
        raise DataError(f"{label}: cannot read the file ({e.strerror})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(f"{label}:{line}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_json(path: str | os.PathLike, *, name: str | None = None) -> Any:
    """A JSON file's value (a model's ``config.json``, a tokenizer's files, an index); :class:`DataError` naming the
    file (``name``, default the path) and the line when it cannot be read or parsed."""
    label = name or str(path)
    text = read_text(path, name=label)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{label}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})") from None


def fresh_sibling(path: str | os.PathLike, *, directory: bool = False) -> Path:
    """A new, uniquely named hidden file (``directory=True``: directory) beside ``path``, made as a plain
    ``open(path, "w")`` (``mkdir``) would make it: mode 0o666 (0o777) less the umask, a file replacing an existing
    one keeps that one's mode. Every atomic write starts here: ``tempfile.mkstemp``/``mkdtemp`` make 0600/0700, which
    the rename carries to the final name, and a teammate on a shared cluster could not read the export."""
    path = Path(path)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            if directory:
                os.mkdir(tmp)
            else:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        if not directory and path.is_file():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        return tmp
    raise FileExistsError(f"{path}: no free temporary name beside it")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a :func:`fresh_sibling` of ``path`` for a writer that takes a path (safetensors, ``torch.save``); on a
    clean exit fsync it and rename it over ``path``, else delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_sibling(path)
    mode = stat.S_IMODE(tmp.stat().st_mode)
    try:
        yield tmp
        os.chmod(tmp, mode)  # safetensors >= 0.8 writes a 0600 file of its own and renames it over ``tmp``
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Open a temp file beside ``path`` (:func:`atomic_path`); on clean exit fsync and rename it over ``path``,
    else delete it. Readers never see a half-written file and a crash keeps the previous version intact."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as f:
        yield f


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> int:
    """Write ``rows`` as JSONL (UTF-8, non-ASCII kept) atomically; returns the number of lines."""
    n = 0
    with atomic_open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
