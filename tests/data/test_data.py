"""Sentence-pair datamodule: parsing, label map, padding, truncation count and every bad-input error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lightning_llm.data import DataError, SentencePairDataModule, generate_pair_dataset, read_records


def _dm(data_dir: Path, **kw) -> SentencePairDataModule:
    return SentencePairDataModule(str(data_dir), str(data_dir / "tokenizer"), **kw)


def test_generated_dataset_is_deterministic(tmp_path: Path) -> None:
    a = generate_pair_dataset(tmp_path / "a", n_train=10, n_val=4, n_test=4, seed=3)
    b = generate_pair_dataset(tmp_path / "b", n_train=10, n_val=4, n_test=4, seed=3)
    assert (a / "train.json").read_text() == (b / "train.json").read_text()
    rows = read_records(a / "train.json")
    assert {r["label"] for r in rows} <= {"0", "1"}
    assert all("label" not in r for r in read_records(a / "test.json"))


def test_setup_label_map_and_dynamic_padding(pair_data: Path) -> None:
    dm = _dm(pair_data, batch_size=8)
    dm.setup("fit")
    assert dm.label_names == ["0", "1"] and dm.num_labels == 2
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape[0] == 8
    lengths = batch["attention_mask"].sum(1)
    assert lengths.max() == batch["input_ids"].shape[1]  # padded to the longest of this batch only
    assert torch.all(batch["input_ids"][batch["attention_mask"] == 0] == 0)
    assert set(batch["labels"].tolist()) <= {0, 1}
    cls = dm.tokenizer.cls_token_id
    assert torch.all(batch["input_ids"][:, 0] == cls)


def test_predict_split_without_labels(pair_data: Path) -> None:
    dm = _dm(pair_data)
    dm.setup("predict")
    assert len(dm.datasets["predict"]) == 24
    assert dm.ids["predict"][0] == "test-0"


def test_truncation_is_counted_and_reported(pair_data: Path, caplog: pytest.LogCaptureFixture) -> None:
    dm = _dm(pair_data, max_length=12)
    with caplog.at_level("WARNING"):
        dm.setup("validate")
    assert dm.truncated["validate"] > 0
    assert all(len(e["input_ids"]) <= 12 for e in dm.datasets["validate"].examples)
    assert "were truncated" in caplog.text and "max_length=12" in caplog.text


def _copy(pair_data: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "d"
    shutil.copytree(pair_data, dst)
    return dst


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"sentence1": "a", "sentence2": "b", "label": "0"}\n{"sentence1": "a", \n', r"train.json:2: malformed JSON"),
        ('{"sentence1": "a", "label": "0"}\n', r"train.json:1: missing field 'sentence2'"),
        ("", r"train.json: file is empty"),
        ('{"sentence1": 3, "sentence2": "b", "label": "0"}\n', r"train.json:1: field 'sentence1' must be str"),
        ('[1, 2]\n', r"train.json:1: expected a JSON object"),
    ],
)
def test_bad_train_file(pair_data: Path, tmp_path: Path, content: str, expected: str) -> None:
    d = _copy(pair_data, tmp_path)
    (d / "train.json").write_text(content)
    with pytest.raises(DataError, match=expected):
        _dm(d).setup("fit")


def test_truncated_utf8_names_line(pair_data: Path, tmp_path: Path) -> None:
    d = _copy(pair_data, tmp_path)
    good = json.dumps({"sentence1": "借呗", "sentence2": "花呗", "label": "0"}, ensure_ascii=False).encode()
    cut = "借".encode()[:2]  # a multi-byte character cut in half
    (d / "train.json").write_bytes(good + b"\n" + b'{"sentence1": "' + cut + b'", "sentence2": "b", "label": "0"}\n')
    with pytest.raises(DataError, match=r"train.json:2: not valid UTF-8"):
        _dm(d).setup("fit")


def test_unknown_dev_label(pair_data: Path, tmp_path: Path) -> None:
    d = _copy(pair_data, tmp_path)
    lines = (d / "dev.json").read_text().splitlines()
    row = json.loads(lines[2])
    row["label"] = "2"
    lines[2] = json.dumps(row, ensure_ascii=False)
    (d / "dev.json").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"dev.json:3: label '2' never appears in the training split"):
        _dm(d).setup("fit")


def test_missing_dirs_name_the_parameter(pair_data: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"--data.tokenizer_dir=.*nope: directory not found"):
        SentencePairDataModule(str(pair_data), str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"--data.data_dir=.*missing: directory not found"):
        SentencePairDataModule(str(tmp_path / "missing"), str(pair_data / "tokenizer"))
    with pytest.raises(FileNotFoundError, match=r"--data.tokenizer_dir=.*: no tokenizer.json"):
        SentencePairDataModule(str(pair_data), str(tmp_path))


def test_byte_tokenizer_pairs_are_laid_out_and_cut_as_bert_pairs(pair_data: Path, tmp_path: Path) -> None:
    """Without --data.tokenizer_dir (a named backbone) the pairs are byte ids laid out as BERT lays out a pair,
    <bos> a <eos> b <eos> with token types 0 then 1, and cut as transformers' truncation="longest_first" cuts a
    BertTokenizer pair (a WordPiece vocabulary with one token per character: same lengths, every case)."""
    from transformers import BertTokenizer

    from lightning_llm.data import ByteTokenizer

    dm = SentencePairDataModule(str(pair_data), None, max_length=16)
    dm.setup("fit")
    first = read_records(pair_data / "train.json")[0]
    a, b = (list(first[k].encode()) for k in ("sentence1", "sentence2"))
    assert isinstance(dm.tokenizer, ByteTokenizer) and dm.vocab_size == 259
    full = [257, *a, 258, *b, 258]
    row = dm.datasets["fit"][0]
    assert len(full) > 16 and len(row["input_ids"]) == 16 and dm.truncated["fit"] > 0
    assert row["input_ids"][0] == 257 and row["input_ids"][-1] == 258 and row["token_type_ids"][-1] == 1

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "x", "##x", "y",
                                                    "##y"]) + "\n")
    bert, byte = BertTokenizer.from_pretrained(str(tmp_path)), ByteTokenizer()
    for max_length in range(4, 18):
        for n_a in range(1, 18):
            for n_b in range(1, 18):
                ref = bert("x" * n_a, "y" * n_b, truncation="longest_first", max_length=max_length)
                ids, types = byte.encode_pair("x" * n_a, "y" * n_b, max_length=max_length)
                assert types == ref["token_type_ids"] and len(ids) == len(ref["input_ids"])
                assert [i for i in ids if i < 256] == [ord("x")] * (types.count(0) - 2) + [ord("y")] * (
                    types.count(1) - 1)


def test_jsonl_lines_break_at_newline_only(tmp_path) -> None:
    """U+2028, U+2029 and U+0085 are legal unescaped inside JSON strings: one record, not a malformed line."""
    import json

    from lightning_llm.data import read_records

    path = tmp_path / "train.json"
    rows = [{"sentence1": "上海\u2028浦东", "sentence2": "a\u2029b\u0085c", "label": "1"}, {"sentence1": "x",
                                                                                       "sentence2": "y", "label": "0"}]
    path.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    got = read_records(path, required=("sentence1", "sentence2"))
    assert [{k: v for k, v in r.items() if k != "_line"} for r in got] == rows
    assert [r["_line"] for r in got] == [1, 2]


@pytest.mark.parametrize(("drop_last", "shuffle"), [(False, True), (True, True), (False, False)])
def test_resumable_sampler_gives_torchs_indices(drop_last: bool, shuffle: bool) -> None:
    """The sampler keeps its epoch as a tensor (4 bytes a sample, not Python lists) but yields exactly torch's
    DistributedSampler indices (order, padding, striding by rank), and skips the first samples on a resume."""
    from torch.utils.data import DistributedSampler

    from lightning_llm.data.base import ResumableDistributedSampler

    for n, replicas in [(1, 1), (3, 2), (7, 4), (1_003, 3), (700, 8)]:
        for rank in range(replicas):
            kw = {"num_replicas": replicas, "rank": rank, "seed": 5, "drop_last": drop_last, "shuffle": shuffle}
            ours, torchs = ResumableDistributedSampler(range(n), **kw), DistributedSampler(range(n), **kw)
            for epoch in (0, 2):
                ours.set_epoch(epoch)
                torchs.set_epoch(epoch)
                assert list(ours) == list(torchs) and len(list(ours)) == len(ours)
            ours.skip_epoch, ours.skip_samples = 2, 1
            assert list(ours) == list(torchs)[1:] and list(ours) == list(torchs)  # the skip applies once
