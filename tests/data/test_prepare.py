"""Pretraining corpora prepared once into a token store (lightning_llm/data/corpus/prepare.py): the same ids as the
tokenizer itself over every format and with worker processes, reuse and re-preparation, an interrupted (SIGKILLed)
preparation, concurrent preparers, bad input named by file and line, mixtures at their weights, the data a checkpoint
records, and ``lightning_llm prepare``. Corpora and tokenizers are written by the tests."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lightning_llm.data import ByteTokenizer, DataError, TextDataModule, load_tokenizer
from lightning_llm.data.corpus import documents as corpus
from lightning_llm.data.corpus import prepare, token_store
from lightning_llm.data.corpus.prepare import CorpusSource, prepare_corpus, store_path
from lightning_llm.data.corpus.token_store import TokenizerSpec, TokenStore
from lightning_llm.reliability import staging_path
from lightning_llm.testing import write_bpe_tokenizer

CHARS = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你"


def _texts(n: int, *, seed: int) -> list[str]:
    """Mixed English/Chinese documents with single newlines (so a .txt cut after a newline tokenizes the same)."""
    rng = random.Random(seed)
    words = ["the", "cat", "sees", "a", "tree.", "Moon", "river,", "42", "naïve", "data"]
    docs = []
    for _ in range(n):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + "".join(
            rng.choice(CHARS) for _ in range(rng.randint(0, 20))) for _ in range(rng.randint(1, 4))]
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer saved by transformers (``</s>`` is EOS)."""
    return write_bpe_tokenizer(tmp_path_factory.mktemp("bpe"), _texts(300, seed=9))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WordPiece vocab.txt (Chinese characters and a few words): BertTokenizer, ``[SEP]`` ends a document."""
    out = tmp_path_factory.mktemp("bert")
    words = ["the", "cat", "sees", "a", "tree", "moon", "river", "data", "##s", ".", ",", "4", "2"]
    (out / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CHARS, *words]) + "\n",
                                   encoding="utf-8")
    return out


def _write_corpus(root: Path, docs: list[str]) -> list[str]:
    """``docs`` spread over a JSONL file, a JSON array, a two-row-group Parquet file and a .txt document; returns
    the documents in the corpus's order (files sorted by name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    a, b, c, d = docs[:len(docs) // 2], docs[len(docs) // 2:-40], docs[-40:-1], docs[-1]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n"
                                          for i, t in enumerate(a)), encoding="utf-8")
    (root / "b.json").write_text(json.dumps([{"text": t} for t in b], ensure_ascii=False), encoding="utf-8")
    pq.write_table(pa.table({"text": c, "n": list(range(len(c)))}), root / "c.parquet", row_group_size=20)
    (root / "d.txt").write_text(d, encoding="utf-8")
    return [*a, *b, *c, d]


def _expected(tokenizer: Any, docs: list[str], eos: int) -> tuple[list[int], list[int]]:
    """``tokenizer(doc, add_special_tokens=False)`` per document, EOS after each: (tokens, document ends)."""
    stream, ends = [], []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += [*ids, eos]
        ends.append(len(stream))
    return stream, ends


def _small_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks of a few KiB and batches of a few hundred characters, so a small corpus exercises the worker pool, task
    boundaries inside files, and a .txt document tokenized in pieces."""
    monkeypatch.setattr(prepare, "MIN_TASK_BYTES", 2048)
    monkeypatch.setattr(prepare, "MAX_TASK_BYTES", 4096)
    monkeypatch.setattr(corpus, "BATCH_CHARS", 300)
    monkeypatch.setattr(token_store, "BATCH_CHARS", 300)


@pytest.mark.multiprocess  # 2 forked tokenizing workers
@pytest.mark.parametrize("kind", ["bpe", "bert"])
def test_prepared_tokens_equal_the_tokenizer_over_every_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               kind: str, bpe_dir: Path, bert_dir: Path) -> None:
    """2 worker processes, many tasks: the store holds exactly transformers' ids of each document + EOS, in order."""
    _small_tasks(monkeypatch)
    tok_dir = bpe_dir if kind == "bpe" else bert_dir
    docs = _texts(400, seed=1)
    docs[-1] = "\n".join(docs[:12])  # the .txt document: longer than a batch, so tokenized in pieces
    ordered = _write_corpus(tmp_path / "corpus", docs)
    dm = TextDataModule(str(tmp_path / "corpus"), str(tok_dir), block_size=16, cache_dir=str(tmp_path / "cache"),
                        num_proc=2)
    dm.prepare_data()
    assert dm.prepared is True
    dm.setup("fit")
    store = dm.stores[0]
    tok = load_tokenizer(str(tok_dir))
    eos = tok.eos_token_id if kind == "bpe" else tok.sep_token_id
    stream, ends = _expected(tok, ordered, eos)
    assert store.manifest["workers"] == 2 and store.manifest["documents"] == len(ordered)
    assert store.tokens.tolist() == stream
    assert store.documents().tolist() == ends
    assert store.manifest["dtype"] == "uint16" and store.manifest["tokenizer"]["eos"] == eos


def test_unchanged_corpus_is_reused_and_a_change_is_prepared_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   bpe_dir: Path) -> None:
    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text("".join(json.dumps({"text": f"document number {i}."}) + "\n" for i in range(40)))
    cache = str(tmp_path / "cache")
    first = TextDataModule(str(corpus_file), block_size=8, cache_dir=cache)
    first.setup("fit")
    assert first.prepared is True
    tokens = first.stores[0].tokens.tolist()

    def boom(*_a: Any, **_k: Any) -> None:
        raise AssertionError("tokenizer called although the store is up to date")

    monkeypatch.setattr(ByteTokenizer, "__call__", boom)
    second = TextDataModule(str(corpus_file), block_size=8, cache_dir=cache)
    second.setup("fit")
    assert second.prepared is False and second.stores[0].tokens.tolist() == tokens
    assert isinstance(second.stores[0].tokens, np.memmap)
    monkeypatch.undo()

    os.utime(corpus_file, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched, same content: prepared again
    touched = TextDataModule(str(corpus_file), block_size=8, cache_dir=cache)
    touched.setup("fit")
    assert touched.prepared is True and touched.stores[0].content == first.stores[0].content

    # Replaced by a file of the same size with the old mtime kept (cp -p, rsync -t): still prepared again.
    st = corpus_file.stat()
    corpus_file.write_text(corpus_file.read_text().replace("document number 1.", "document number 9."))
    os.utime(corpus_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert corpus_file.stat().st_size == st.st_size and corpus_file.stat().st_mtime_ns == st.st_mtime_ns
    replaced = TextDataModule(str(corpus_file), block_size=8, cache_dir=cache)
    replaced.setup("fit")
    assert replaced.prepared is True and replaced.stores[0].content != first.stores[0].content

    corpus_file.write_text(corpus_file.read_text() + json.dumps({"text": "one more"}) + "\n")
    third = TextDataModule(str(corpus_file), block_size=8, cache_dir=cache)
    third.setup("fit")
    assert third.prepared is True and len(third.stores[0]) > len(tokens)
    assert third.stores[0].path == first.stores[0].path  # replaced in place: one store per corpus and tokenizer

    other = TextDataModule(str(corpus_file), str(bpe_dir), block_size=8, cache_dir=cache)  # another tokenizer
    other.setup("fit")
    assert other.prepared is True and other.stores[0].path != third.stores[0].path
    tok = load_tokenizer(str(bpe_dir))
    assert other.stores[0].tokens[:5].tolist() == tok("document number 0.", add_special_tokens=False)["input_ids"][:5]
    # A store copied under another tokenizer's name is not read as that tokenizer's: its fingerprint differs.
    spec = TokenizerSpec.of(tok, vocab_size=other.vocab_size)
    assert prepare.stale_reason(third.stores[0], CorpusSource((str(corpus_file),)).inputs(), spec) == \
        "it was prepared with another tokenizer"


def test_content_sample_reads_windows_of_a_large_input(tmp_path: Path) -> None:
    """Past 256 KiB an input is hashed by its ends and 16 windows: a change in a window (or the ends) changes the
    digest (a file of another size is another file anyway), and 192 KiB is read whatever the size."""
    size = 12 << 20
    data = bytearray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    f = tmp_path / "big.txt"
    f.write_bytes(data)
    digest = prepare.content_sample(f, size)
    step = (size - prepare.END_BYTES - prepare.SAMPLE_BYTES) // (prepare.SAMPLE_WINDOWS + 1)
    for offset in (0, size - 1, prepare.END_BYTES + 7 * step + 5):  # first MiB, last byte, inside window 7
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        f.write_bytes(changed)
        assert prepare.content_sample(f, size) != digest, offset
    f.write_bytes(data)
    assert prepare.content_sample(f, size) == digest
    small = tmp_path / "small.txt"
    small.write_bytes(data[:1000])
    assert prepare.content_sample(small, 1000) == hashlib.sha256(bytes(data[:1000])).hexdigest()  # whole file
    reads: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        handle = real_open(self, *args, **kwargs)
        read = handle.read
        handle.read = lambda n=-1: reads.append(len(chunk := read(n))) or chunk  # type: ignore[method-assign]
        return handle

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(Path, "open", counting_open)
        prepare.content_sample(f, size)
    assert sum(reads) == 2 * prepare.END_BYTES + prepare.SAMPLE_WINDOWS * prepare.SAMPLE_BYTES == 192 << 10


def _slow_encoder(self: TokenizerSpec) -> Any:
    encode = _REAL_ENCODER(self)

    def slow(texts: list[str]) -> Any:
        time.sleep(0.01)
        return encode(texts)
    return slow


_REAL_ENCODER = TokenizerSpec.encoder


def _prepare_in_child(source: CorpusSource, spec: TokenizerSpec, cache: str, out: str) -> None:
    start = time.time()
    _, built = prepare_corpus(source, spec=spec, cache_dir=cache, num_proc=1)
    Path(out).write_text(json.dumps({"built": built, "start": start, "end": time.time()}))


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"doc {i}: " + "word " * 40}) + "\n" for i in range(n)))
    return path


def _wrote_tokens(staging: Path) -> bool:
    try:
        return any(f.stat().st_size > 0 for f in staging.glob("*.bin"))
    except FileNotFoundError:
        return False


@pytest.mark.multiprocess  # the preparation in a forked process, killed
def test_sigkilled_preparation_leaves_no_store_that_looks_finished(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A preparation killed (SIGKILL) after writing tokens: no store under the final name (its manifest is written
    last, inside the staging directory); the next preparation removes the leftovers and writes the whole store."""
    monkeypatch.setattr(token_store, "BATCH_CHARS", 2000)
    monkeypatch.setattr(TokenizerSpec, "encoder", _slow_encoder)
    source = CorpusSource((str(_jsonl(tmp_path / "c.jsonl", 3000)),))
    spec = TokenizerSpec.of(ByteTokenizer(), vocab_size=259)
    cache = tmp_path / "cache"
    target = store_path(source, spec=spec, text_field="text", cache_dir=cache)
    child = mp.get_context("fork").Process(target=_prepare_in_child,
                                           args=(source, spec, str(cache), str(tmp_path / "built")))
    child.start()
    deadline = time.time() + 60
    while not _wrote_tokens(staging_path(target)) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL and not (tmp_path / "built").exists()  # killed mid-way
    assert staging_path(target).exists() and not target.exists()
    assert TokenStore.open(target) is None and prepare.current_store(source, spec=spec, text_field="text",
                                                                     cache_dir=cache) is None
    monkeypatch.undo()
    store, built = prepare_corpus(source, spec=spec, cache_dir=cache, num_proc=1)
    assert built and not staging_path(target).exists()
    clean, _ = prepare_corpus(source, spec=spec, cache_dir=tmp_path / "clean", num_proc=1)
    assert store.content == clean.content and store.tokens.tolist() == clean.tokens.tolist()


@pytest.mark.multiprocess  # two forked preparers
def test_concurrent_preparers_tokenize_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes preparing the same corpus at once (two nodes on a shared filesystem): one tokenizes, the other
    waits on the lock and reuses its store."""
    monkeypatch.setattr(token_store, "BATCH_CHARS", 2000)
    monkeypatch.setattr(TokenizerSpec, "encoder", _slow_encoder)
    source = CorpusSource((str(_jsonl(tmp_path / "c.jsonl", 600)),))
    spec = TokenizerSpec.of(ByteTokenizer(), vocab_size=259)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_prepare_in_child, args=(source, spec, str(tmp_path / "cache"),
                                                         str(tmp_path / f"built{i}"))) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    runs = [json.loads((tmp_path / f"built{i}").read_text()) for i in range(2)]
    assert max(r["start"] for r in runs) < min(r["end"] for r in runs)  # they overlapped: both found no store
    assert sorted(r["built"] for r in runs) == [False, True]
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1


@pytest.mark.multiprocess  # 2 forked tokenizing workers
@pytest.mark.parametrize(("bad", "message"), [
    (b'{"text": "cut here', "bad.jsonl:1234: malformed JSON"),
    (b'{"body": "no text field"}', "bad.jsonl:1234: missing field 'text'"),
    (b'{"text": 5}', "bad.jsonl:1234: field 'text' must be str, got int"),
    (b'{"text": "\xff\xfe"}', "bad.jsonl:1234: not valid UTF-8"),
], ids=["malformed", "missing", "type", "utf8"])
def test_bad_line_is_named_with_file_and_line_and_nothing_is_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  bad: bytes, message: str) -> None:
    """The bad line sits in a later task of a worker process: the error still names its line; no store and no
    staging directory remain."""
    _small_tasks(monkeypatch)
    lines = [json.dumps({"text": f"line {i} " + "x" * 30}).encode() for i in range(3000)]
    lines[1233] = bad
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    dm = TextDataModule(str(tmp_path / "bad.jsonl"), block_size=8, cache_dir=str(tmp_path / "cache"), num_proc=2)
    with pytest.raises(DataError, match=message.replace(".", r"\.", 1)):
        dm.prepare_data()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_bad_parquet_row_and_missing_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["fine", None, "also fine"]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: row 2: field 'text' must be str, got NoneType"):
        TextDataModule(str(tmp_path / "n.parquet"), cache_dir=str(tmp_path / "c")).prepare_data()
    with pytest.raises(DataError, match=r"n\.parquet: no column 'body' \(columns: \['text'\]\)"):
        TextDataModule(str(tmp_path / "n.parquet"), text_field="body", cache_dir=str(tmp_path / "c")).prepare_data()


def test_bad_paths_are_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^--data\.data_path=.*nope\.jsonl: no such file or directory"):
        TextDataModule(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"--data\.data_path=.*\*\.jsonl: the pattern matches no"):
        TextDataModule(str(tmp_path / "*.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'"):
        TextDataModule(str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match=r"^--data\.data_path=.*a mixture is \[weight, path, weight, path"):
        TextDataModule([0.5, str(tmp_path / "x.csv"), 0.5])
    with pytest.raises(ValueError, match="mixture weights must be positive"):
        TextDataModule([0, str(tmp_path / "x.csv")])


@pytest.mark.multiprocess  # 2 forked tokenizing workers
def test_a_large_txt_document_spans_tasks_and_stays_one_document(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A .txt file without a newline, 9x a task and 20x a batch: cut between characters (never inside one), into
    tasks of 2 workers; the byte tokenizer's stream is the file's bytes, then one EOS: one document, and an empty
    .txt adds nothing."""
    _small_tasks(monkeypatch)
    text = "".join(random.Random(0).choice(CHARS + "ab") for _ in range(12_000))  # 3-byte and 1-byte characters
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "big.txt").write_text(text, encoding="utf-8")
    (tmp_path / "d" / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(DataError, match=r"empty\.txt: file is empty"):
        TextDataModule(str(tmp_path / "d"), cache_dir=str(tmp_path / "cache"), num_proc=2).prepare_data()
    (tmp_path / "d" / "empty.txt").write_text(" \n", encoding="utf-8")
    dm = TextDataModule(str(tmp_path / "d"), block_size=16, cache_dir=str(tmp_path / "cache"), num_proc=2)
    dm.setup("fit")
    store = dm.stores[0]
    assert store.tokens.tolist() == [*text.encode(), ByteTokenizer.eos_token_id]
    assert store.documents().tolist() == [len(text.encode()) + 1] and store.manifest["empty_documents"] == 1
    assert store.manifest["workers"] == 2


def test_globs_and_lists_of_paths_form_one_corpus(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    for name, text in [("2.jsonl", "two"), ("1.jsonl", "one"), ("skip.parquet.bak", "no")]:
        (tmp_path / "x" / name).write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "y.txt").write_text("three")
    dm = TextDataModule([str(tmp_path / "x" / "*.jsonl"), str(tmp_path / "y.txt")], block_size=2, val_fraction=0,
                        cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    eos = ByteTokenizer.eos_token_id
    assert dm.stores[0].tokens.tolist() == [*b"one", eos, *b"two", eos, *b"three", eos]
    assert len(dm.sources) == 1 and dm.weights == [1.0]


def _letters_corpus(path: Path, letters: str, n_docs: int, *, seed: int) -> Path:
    if path.exists():  # rewriting it would change its mtime: the store would be prepared again
        return path
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"text": "".join(rng.choice(letters) for _ in range(60))}) + "\n"
                            for _ in range(n_docs)))
    return path


def _mixture(tmp_path: Path, *, weights: tuple[float, float] = (0.3, 0.7), seed: int = 42, **kw: Any
             ) -> TextDataModule:
    a = _letters_corpus(tmp_path / "a.jsonl", "abcdefghijklm", 1100, seed=1)  # 4,000+ blocks of 16
    b = _letters_corpus(tmp_path / "b.jsonl", "nopqrstuvwxyz", 2200, seed=2)
    dm = TextDataModule([weights[0], str(a), weights[1], str(b)], block_size=16, val_fraction=0.01, batch_size=8,
                        seed=seed, cache_dir=str(tmp_path / "cache"), **kw)
    dm.setup("fit")
    return dm


def _corpus_of(input_ids: Any) -> int:
    """0 for a block of corpus a (bytes a-m), 1 for corpus b (n-z); EOS (258) belongs to both."""
    ids = set(input_ids.tolist()) - {ByteTokenizer.eos_token_id}
    assert ids <= set(range(97, 110)) or ids <= set(range(110, 123))
    return 0 if ids <= set(range(97, 110)) else 1


def test_mixture_draws_each_corpus_at_its_weight(tmp_path: Path) -> None:
    """10,000 training samples through the training loader (shuffled by seed): each corpus within 2% of its weight;
    the same seed draws the same samples, another seed another order."""
    dm = _mixture(tmp_path)
    loader = dm.train_dataloader()
    drawn: list[int] = []
    for batch in loader:
        drawn += [_corpus_of(row) for row in batch["input_ids"]]
        if len(drawn) >= 10_000:
            break
    share = sum(drawn[:10_000]) / 10_000
    print(f"corpus b drawn {share:.4f} of 10,000 samples (weight 0.7); epoch counts {dm.datasets['fit'].counts}")
    assert abs(share - 0.7) <= 0.02
    fit = dm.datasets["fit"]
    assert fit.counts == [round(0.3 * len(fit)), len(fit) - round(0.3 * len(fit))]  # exact over an epoch
    first = next(iter(loader))["input_ids"]
    assert bool((next(iter(_mixture(tmp_path).train_dataloader()))["input_ids"] == first).all())
    assert not bool((next(iter(_mixture(tmp_path, seed=7).train_dataloader()))["input_ids"] == first).all())


def test_mixture_subsamples_and_repeats_evenly() -> None:
    from lightning_llm.data.corpus.mixture import MixtureDataset

    mix = MixtureDataset([list(range(10)), list(range(100, 104))], [0.25, 0.75], total=16)
    assert mix.counts == [4, 12]
    assert [mix[k] for k in range(16)] == [0, 2, 5, 7, 100, 101, 102, 103, 100, 101, 102, 103, 100, 101, 102, 103]


def test_resume_on_other_data_is_refused(tmp_path: Path, bpe_dir: Path) -> None:
    """The checkpoint's datamodule state records the data; other weights, block size or tokens are refused."""
    dm = _mixture(tmp_path)
    state = {"epoch": 0, "batches": 3, "samples": 24, "data": dm.data_identity()}
    _mixture(tmp_path).load_state_dict(state)  # the same data: accepted
    with pytest.raises(DataError, match=r"other data \(corpora .*sha256 [0-9a-f]{12}\) -> .*sha256"):
        _mixture(tmp_path, tokenizer_dir=str(bpe_dir)).load_state_dict(state)  # the tokenizer changed
    with pytest.raises(DataError, match=r"^--ckpt_path: the checkpoint was trained on other data \(corpora .*weight "
                                        r"0\.3.* -> .*weight 0\.5"):
        _mixture(tmp_path, weights=(0.5, 0.5)).load_state_dict(state)
    other = TextDataModule([0.3, str(tmp_path / "a.jsonl"), 0.7, str(tmp_path / "b.jsonl")], block_size=32,
                           val_fraction=0.01, cache_dir=str(tmp_path / "cache"))
    other.load_state_dict(state)  # before setup: checked once the stores are mapped
    with pytest.raises(DataError, match="block_size 16 -> 32"):
        other.setup("fit")
    # Opted in (a new training phase on another mixture): accepted, from the start of the new data.
    phase2 = _mixture(tmp_path, weights=(0.5, 0.5), resume_on_other_data=True)
    phase2.load_state_dict(state)
    assert phase2._resume is None and next(iter(phase2.train_dataloader().sampler)) == \
        next(iter(_mixture(tmp_path, weights=(0.5, 0.5)).train_dataloader().sampler))


def test_prepare_tool_with_a_fit_config_and_a_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_llm.cli import main

    a = _letters_corpus(tmp_path / "a.jsonl", "abc", 50, seed=1)
    b = _letters_corpus(tmp_path / "b.jsonl", "xyz", 50, seed=2)
    config = tmp_path / "fit.yaml"
    config.write_text(f"trainer:\n  max_steps: 3\nmodel:\n  class_path: lightning_llm.tasks.CausalLMTask\n  init_args:\n"
                      f"    backbone: debug\ndata:\n  class_path: lightning_llm.data.TextDataModule\n  init_args:\n"
                      f"    data_path: [0.25, {a}, 0.75, {b}]\n    block_size: 16\n    cache_dir: {tmp_path / 'c'}\n")
    assert main(["prepare", f"--config={config}", "--data.num_proc=1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and "a.jsonl" in out[0] and "b.jsonl" in out[1] and "50 documents" in out[0]
    dm = TextDataModule([0.25, str(a), 0.75, str(b)], block_size=16, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    assert dm.prepared is False  # fit would reuse what prepare wrote
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    assert main(["prepare", f"--data.data_path={tmp_path / 'bad.jsonl'}", f"--data.cache_dir={tmp_path / 'c'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning_llm prepare: error: ") and "bad.jsonl:2: malformed JSON" in \
        err[0]


def test_validation_loader_is_sharded_as_lightning_would(tmp_path: Path) -> None:
    """Under 2 data-parallel ranks the validation loader carries the tensor-backed sampler, with the indices of the
    DistributedSampler(shuffle=False) Lightning would have injected (padded), so Lightning leaves it as it is."""
    from types import SimpleNamespace

    from torch.utils.data import DistributedSampler, SequentialSampler

    dm = TextDataModule(block_size=8, val_fraction=0.1, cache_dir=str(tmp_path / "cache"), generated_docs=30)
    dm.prepare_data()
    assert isinstance(_loader(dm, None).sampler, SequentialSampler)  # one device: Lightning's own handling
    for rank in range(2):
        sampler = _loader(dm, SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank},
                                              is_global_zero=rank == 0)).sampler
        want = DistributedSampler(dm.datasets["validate"], num_replicas=2, rank=rank, shuffle=False)
        assert isinstance(sampler, DistributedSampler) and list(sampler) == list(want)


def _loader(dm: TextDataModule, trainer: Any) -> Any:
    dm.trainer, dm.datasets = trainer, {}
    dm.setup("fit")
    return dm.val_dataloader()
