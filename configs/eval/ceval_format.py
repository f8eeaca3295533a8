"""The data of ceval_format.yaml: C-Eval's CSV files under ``--metadata '{"data_dir": ...}'`` as one validation split,
each question with its subject and its subject's first ``shots`` dev questions (the few-shot examples its prompt
starts with). Read with the standard library; every problem is one line naming the file (and row)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

COLUMNS = ("question", "A", "B", "C", "D", "answer")
HOW = "pass --metadata '{\"data_dir\": \"/path/to/ceval\"}' (val/<subject>_val.csv, dev/<subject>_dev.csv)"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}:1: C-Eval's columns are id,question,A,B,C,D,answer; missing {missing}")
        rows = []
        for line, row in enumerate(reader, start=2):
            if row["answer"].strip() not in ("A", "B", "C", "D"):
                raise ValueError(f"{path}:{line}: answer {row['answer']!r} is not one of A, B, C, D")
            rows.append({k: row[k].strip() if k == "answer" else row[k] for k in COLUMNS})
        return rows


def _files(root: Path, split: str) -> dict[str, Path]:
    """``{subject: file}`` of ``<root>/<split>/<subject>_<split>.csv`` (or directly under ``root``)."""
    found = sorted((root / split).glob(f"*_{split}.csv")) or sorted(root.glob(f"*_{split}.csv"))
    return {f.name[: -len(f"_{split}.csv")]: f for f in found}


def load(data_dir: str | None = None, shots: int = 0, **_: Any) -> Any:
    """``DatasetDict({"val": ...})`` of every ``*_val.csv`` under ``data_dir``."""
    import datasets

    if not data_dir:
        raise ValueError(f"ceval_format: no data_dir given: {HOW}")
    root = Path(data_dir).expanduser()
    val, dev = _files(root, "val"), _files(root, "dev")
    if not val:
        raise FileNotFoundError(f"ceval_format: data_dir={data_dir} holds no <subject>_val.csv file ({HOW})")
    names = {}
    if (root / "subject_mapping.json").is_file():
        names = {k: v[1] for k, v in json.loads((root / "subject_mapping.json").read_text(encoding="utf-8")).items()}
    docs = []
    for subject, path in val.items():
        if shots and subject not in dev:
            raise FileNotFoundError(f"ceval_format: shots={shots} needs {root}/dev/{subject}_dev.csv")
        examples = _rows(dev[subject])[: int(shots)] if shots else []
        if len(examples) < int(shots):
            raise ValueError(f"ceval_format: {dev[subject]} has {len(examples)} questions, fewer than shots={shots}")
        title = names.get(subject, subject.replace("_", " "))
        docs += [{**row, "subject": title, "shots": examples} for row in _rows(path)]
    return datasets.DatasetDict({"val": datasets.Dataset.from_list(docs)})
