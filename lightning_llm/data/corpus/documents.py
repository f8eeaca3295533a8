"""Pretraining corpora as documents: which files a ``--data.data_path`` names, how they are cut into tasks for worker
processes, and each task's documents read as a stream (errors name the file and line before any training).

Formats: JSON Lines (``.jsonl``, or ``.json`` not starting with ``[``; one object per line, the text in
``text_field``), JSON arrays (``.json`` starting with ``[``: read whole, so keep them small), Parquet (``.parquet``;
the ``text_field`` column, read per row group; needs ``pyarrow``) and plain text (``.txt``: one file = one document).
A path may be a file, a directory (its files of those suffixes, recursively, in sorted order; hidden entries
skipped) or a glob (``corpus/*.jsonl``, ``**`` allowed).
"""

from __future__ import annotations

import glob as globlib
import json
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_llm.files import DataError, check_record, parse_json_line, read_records

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
TASK_BYTES = 8 << 20
"""Input bytes per task: what one worker reads, tokenizes and writes as one shard (its memory is a batch, not this)."""
BATCH_CHARS = 1 << 18
"""Characters tokenized per call: bounds a worker's memory (the tokenizer's encodings of one batch, ~100 bytes a
token in the Rust encodings)."""
BATCH_DOCS = 1024


def generated_corpus(n_docs: int = 400, *, seed: int = 0) -> list[str]:
    """Deterministic toy documents with learnable structure (a tiny grammar), for runs with no data files."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the bird", "my friend", "the teacher", "a robot"]
    verbs = ["sees", "likes", "follows", "draws", "finds", "helps"]
    objects = ["the ball", "a tree", "the river", "a small house", "the moon", "an old book"]
    docs = []
    for _ in range(n_docs):
        sents = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(rng.randint(3, 8))]
        docs.append(" ".join(s.capitalize() for s in sents))
    return docs


def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def resolve_inputs(specs: list[str], *, param: str = "--data.data_path") -> list[Path]:
    """The files ``specs`` name (files, directories, globs), each once, in order; errors name ``param``."""
    files: list[Path] = []
    for spec in specs:
        p = Path(spec).expanduser()
        if _is_glob(spec):
            found = sorted(Path(f) for f in globlib.glob(str(p), recursive=True) if Path(f).is_file())
            found = [f for f in found if f.suffix in SUFFIXES]
            if not found:
                raise FileNotFoundError(f"{param}={spec}: the pattern matches no {'/'.join(SUFFIXES)} file")
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES and _visible(f, p))
            if not found:
                raise DataError(f"{param}={spec}: no {', '.join(SUFFIXES)} files in that directory")
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise DataError(f"{param}={spec}: unsupported file type {p.suffix!r} (expected {', '.join(SUFFIXES)})")
            found = [p]
        else:
            raise FileNotFoundError(f"{param}={spec}: no such file or directory")
        files.extend(f.resolve() for f in found)
    seen: set[Path] = set()
    return [f for f in files if not (f in seen or seen.add(f))]


@dataclass(frozen=True)
class Task:
    """One worker's share of a corpus. ``kind``: ``jsonl`` (bytes ``start:stop``, cut at line ends), ``array`` (a
    whole JSON array file), ``parquet`` (row groups ``start:stop``), ``txt`` (bytes ``start:stop`` of a document
    that ends at ``stop`` when ``ends_document``), ``generated`` (documents ``start:stop`` of :func:`generated_corpus`
    of ``int(path)`` documents)."""

    kind: str
    path: str
    start: int
    stop: int
    ends_document: bool = True
    size: int = 0
    """Input bytes (for progress; a Parquet row group's uncompressed size, a generated document counts 1)."""


def _after_newline(f: Any, offset: int, size: int, *, within: int | None = None) -> int | None:
    """The offset just after the first ``\\n`` at or after ``offset`` (``size`` if none), scanning in 1 MiB reads;
    ``None`` when ``within`` bytes hold none."""
    f.seek(offset)
    pos = offset
    while pos < size and (within is None or pos - offset < within):
        chunk = f.read(1 << 20)
        i = chunk.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(chunk)
    return size if within is None or pos >= size else None


def _byte_ranges(path: Path, size: int, task_bytes: int, *, utf8_safe: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of about ``task_bytes`` that end after a newline (a text document without one within
    ``task_bytes``: before a UTF-8 lead byte, so no character is split)."""
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            stop = min(size, start + task_bytes)
            if stop < size:
                cut = _after_newline(f, stop, size, within=task_bytes if utf8_safe else None)
                if cut is None:
                    f.seek(stop)
                    cut = stop + next((i for i, b in enumerate(f.read(4)) if b & 0xC0 != 0x80), 0)
                stop = cut
            ranges.append((start, stop))
            start = stop
    return ranges


def _json_kind(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return "array" if head.startswith(b"[") else "jsonl"


def plan_tasks(files: list[Path], *, text_field: str, task_bytes: int = TASK_BYTES) -> list[Task]:
    """Cut ``files`` into tasks of about ``task_bytes``, in corpus order; empty files and a Parquet file without the
    ``text_field`` column are refused here."""
    tasks: list[Task] = []
    for f in files:
        try:
            tasks.extend(_file_tasks(f, text_field=text_field, task_bytes=task_bytes))
        except OSError as e:
            raise DataError(f"{f}: cannot read the file ({e.strerror})") from None
    return tasks


def _file_tasks(f: Path, *, text_field: str, task_bytes: int) -> list[Task]:
    size = f.stat().st_size
    if size == 0:
        raise DataError(f"{f}: file is empty")
    if f.suffix == ".parquet":
        return _parquet_tasks(f, text_field=text_field, task_bytes=task_bytes)
    if f.suffix == ".txt":
        ranges = _byte_ranges(f, size, task_bytes, utf8_safe=True)
        return [Task("txt", str(f), a, b, ends_document=b == size, size=b - a) for a, b in ranges]
    if f.suffix == ".json" and _json_kind(f) == "array":
        return [Task("array", str(f), 0, size, size=size)]
    return [Task("jsonl", str(f), a, b, size=b - a) for a, b in _byte_ranges(f, size, task_bytes, utf8_safe=False)]


def generated_tasks(n_docs: int, *, per_task: int = 2000) -> list[Task]:
    return [Task("generated", str(n_docs), a, min(n_docs, a + per_task), size=min(n_docs, a + per_task) - a)
            for a in range(0, n_docs, per_task)]


def _parquet_tasks(path: Path, *, text_field: str, task_bytes: int) -> list[Task]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    names = meta.schema.names
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {names})")
    tasks, start, acc = [], 0, 0
    for g in range(meta.num_row_groups):
        acc += meta.row_group(g).total_byte_size
        if acc >= task_bytes or g == meta.num_row_groups - 1:
            tasks.append(Task("parquet", str(path), start, g + 1, size=acc))
            start, acc = g + 1, 0
    return tasks


def _line_at(path: str, offset: int) -> int:
    """1-based number of the line holding byte ``offset`` (counted only when an error message needs it)."""
    n = 1
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


BOM = b"\xef\xbb\xbf"


def _jsonl_texts(task: Task, text_field: str) -> Iterator[str]:
    first_line: int | None = None  # the line number of task.start: counted only for an error message

    def lineno(k: int) -> int:
        nonlocal first_line
        if first_line is None:
            first_line = _line_at(task.path, task.start)
        return first_line + k

    with open(task.path, "rb") as f:
        f.seek(task.start)
        pos = task.start
        for k, raw in enumerate(iter(f.readline, b"")):
            if pos >= task.stop:
                break
            at, pos = pos, pos + len(raw)
            if at == 0 and raw.startswith(BOM):
                raw, at = raw[len(BOM):], len(BOM)
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{task.path}:{lineno(k)}: not valid UTF-8 ({e.reason} at byte {at + e.start})"
                                ) from None
            try:
                rec = json.loads(line)
            except ValueError:
                rec = parse_json_line(task.path, lineno(k), line)  # raises with read_records' message
            text = rec.get(text_field) if isinstance(rec, dict) else None
            if not isinstance(text, str):
                check_record(task.path, lineno(k), rec, required=[text_field], types={text_field: str})
            yield text


def _parquet_texts(task: Task, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(task.path)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(task.start))
    for batch in pf.iter_batches(columns=[text_field], row_groups=range(task.start, task.stop), batch_size=BATCH_DOCS):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{task.path}: row {row}: field {text_field!r} must be str, got {type(text).__name__}")
            yield text


def _txt_pieces(task: Task) -> Iterator[tuple[str, bool]]:
    """A text document's bytes ``start:stop`` in pieces of at most :data:`BATCH_CHARS` characters, cut after a
    newline where there is one (a document larger than one piece is tokenized piece by piece: bounded memory; a
    token that would span a cut is split there)."""
    with open(task.path, "rb") as f:
        f.seek(task.start)
        raw = f.read(task.stop - task.start)
    if task.start == 0 and raw.startswith(BOM):
        raw = raw[len(BOM):]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = _line_at(task.path, task.start) + raw[:e.start].count(b"\n")
        raise DataError(f"{task.path}:{line}: not valid UTF-8 ({e.reason} at byte {task.start + e.start})") from None
    start = 0
    while start < len(text):
        stop = len(text) if len(text) - start <= BATCH_CHARS else text.rfind("\n", start, start + BATCH_CHARS) + 1
        if stop <= start:
            stop = start + BATCH_CHARS
        yield text[start:stop], task.ends_document and stop == len(text)
        start = stop


def read_task(task: Task, *, text_field: str) -> Iterator[tuple[str, bool]]:
    """The task's texts in corpus order, each with whether a document ends with it (always, except inside a large
    ``.txt`` document). Bad input raises :class:`DataError` naming the file and line (or row)."""
    if task.kind == "txt":
        yield from _txt_pieces(task)
        return
    if task.kind == "jsonl":
        texts: Any = _jsonl_texts(task, text_field)
    elif task.kind == "array":
        texts = (r[text_field] for r in read_records(task.path, required=[text_field], types={text_field: str}))
    elif task.kind == "parquet":
        texts = _parquet_texts(task, text_field)
    else:
        texts = generated_corpus(int(task.path))[task.start:task.stop]
    for text in texts:
        yield text, True
