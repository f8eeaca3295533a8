"""Preparing a corpus once: documents -> tokens in worker processes -> a memory-mapped token store, reused while
its inputs and tokenizer are unchanged.

:func:`prepare_corpus` is what ``TextDataModule.prepare_data`` and ``lightning_llm prepare`` run. The store's
directory name is a key of the corpus (its paths, text field) and of the tokenizer's fingerprint, so another tokenizer
never reads it; its manifest records every input file's size, mtime and a digest of sampled content
(:func:`content_sample`), so a changed input is prepared again, also one replaced by a file of the same size whose
mtime was kept (``cp -p``, ``rsync -t``, an archive extracted again). One
process prepares while others wait on a file lock beside the store (ranks of a node, nodes sharing a filesystem); it
writes into ``.<name>.partial`` and renames the finished directory into place with its manifest in it, so an
interrupted preparation never leaves a store that looks finished (its leftovers are removed by the next one).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import multiprocessing as mp
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from filelock import FileLock, Timeout

from lightning_llm.data.corpus.documents import Task, generated_tasks, plan_tasks, resolve_inputs
from lightning_llm.data.corpus.token_store import (
    DOCUMENTS,
    FORMAT,
    MANIFEST,
    TOKENS,
    Shard,
    TokenizerSpec,
    TokenStore,
    tokenize_task,
)
from lightning_llm.files import DataError, atomic_open
from lightning_llm.logs import PER_RANK
from lightning_llm.reliability import publish, remove_path, staging_path

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
MIN_TASK_BYTES, MAX_TASK_BYTES = 1 << 20, 8 << 20
COPY_CHUNK = 16 << 20
WHOLE_FILE_DIGEST = 256 << 10
"""Inputs up to this size are hashed whole; larger ones by :func:`content_sample`'s windows."""
SAMPLE_WINDOWS, SAMPLE_BYTES, END_BYTES = 16, 4 << 10, 64 << 10


def content_sample(path: Path, size: int) -> str:
    """SHA-256 of an input's bytes: all of them up to :data:`WHOLE_FILE_DIGEST`, else its first and last 64 KiB and
    16 evenly spaced 4 KiB windows (192 KiB read per file whatever its size: every rank checks the store at every
    launch, and a corpus may be 10,000 files of many GB). With the size and mtime it tells a replaced file from the
    prepared one (another version of a file differs in its first bytes); an edit of a large file that keeps both its
    size and mtime and touches no sampled byte is the one change it cannot see (delete the store under
    ``--data.cache_dir`` to force a preparation)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        if size <= WHOLE_FILE_DIGEST:
            h.update(f.read())
            return h.hexdigest()
        step = (size - END_BYTES - SAMPLE_BYTES) // (SAMPLE_WINDOWS + 1)
        windows = [(0, END_BYTES), *((END_BYTES + k * step, SAMPLE_BYTES) for k in range(1, SAMPLE_WINDOWS + 1)),
                   (size - END_BYTES, END_BYTES)]
        for offset, n in windows:
            f.seek(offset)
            h.update(f.read(n))
    return h.hexdigest()


@dataclass(frozen=True)
class CorpusSource:
    """One corpus: the files some paths name (files, directories, globs; in order), or, with no paths, the generated
    toy corpus of ``generated_docs`` documents."""

    specs: tuple[str, ...] = ()
    generated_docs: int = 0
    param: str = field(default="--data.data_path", compare=False)

    @property
    def label(self) -> str:
        return ", ".join(self.specs) if self.specs else f"generated corpus ({self.generated_docs} documents)"

    def files(self) -> list[Path]:
        return resolve_inputs(list(self.specs), param=self.param) if self.specs else []

    def inputs(self) -> list[dict[str, Any]]:
        """What the manifest records of the inputs; a store whose record differs is prepared again."""
        if not self.specs:
            return [{"generated": self.generated_docs}]
        out = []
        for f in self.files():
            st = f.stat()
            out.append({"path": str(f), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
                        "sample_sha256": content_sample(f, st.st_size)})
        return out

    def key(self) -> str:
        if not self.specs:
            return f"generated:{self.generated_docs}"
        return json.dumps([str(Path(s).expanduser().absolute()) for s in self.specs])

    def slug(self) -> str:
        name = Path(self.specs[0]).name if self.specs else "generated"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40] or "corpus"


def store_path(source: CorpusSource, *, spec: TokenizerSpec, text_field: str, cache_dir: str | Path) -> Path:
    """Where ``source`` tokenized by ``spec`` is stored: one directory per corpus, text field and tokenizer."""
    key = json.dumps({"format": FORMAT, "source": source.key(), "text_field": text_field, "tokenizer": spec.fingerprint})
    return Path(cache_dir) / f"{source.slug()}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def stale_reason(store: TokenStore | None, inputs: list[dict[str, Any]], spec: TokenizerSpec) -> str | None:
    """Why ``store`` cannot serve these inputs and tokenizer (``None``: it can)."""
    if store is None:
        return "not prepared yet"
    m = store.manifest
    if m["tokenizer"]["fingerprint"] != spec.fingerprint:
        return "it was prepared with another tokenizer"
    if m["inputs"] != inputs:
        was = {i.get("path"): i for i in m["inputs"]}
        for now in inputs:
            old = was.get(now.get("path"))
            if old != now:
                return f"input {now.get('path', now)} changed" if old else f"input {now.get('path', now)} is new"
        return "inputs were removed"
    return None


def current_store(source: CorpusSource, *, spec: TokenizerSpec, text_field: str, cache_dir: str | Path
                  ) -> TokenStore | None:
    """The finished store of ``source`` if it is up to date, else ``None`` (nothing is written)."""
    store = TokenStore.open(store_path(source, spec=spec, text_field=text_field, cache_dir=cache_dir))
    return store if stale_reason(store, source.inputs(), spec) is None else None


def _rank() -> str:
    """`` (rank N)`` in a multi-process job: the process preparing is local rank 0 of its node, whose lines the
    command line's rank-zero filter would otherwise drop on every node but the first."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return f" (rank {dist.get_rank()})"
    return ""


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    lock = FileLock(str(path.with_name(path.name + ".lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process preparing %s (lock %s)%s", path, lock.lock_file, _rank(),
                 extra=PER_RANK)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def prepare_corpus(source: CorpusSource, *, spec: TokenizerSpec, text_field: str = "text",
                   cache_dir: str | Path = ".lightning_llm_cache/tokens", num_proc: int | None = None
                   ) -> tuple[TokenStore, bool]:
    """The up-to-date store of ``source``, tokenized now if needed; ``(store, True)`` when this call tokenized it.

    Safe to call from several processes at once: one prepares, the others wait for it and reuse its store.
    """
    target = store_path(source, spec=spec, text_field=text_field, cache_dir=cache_dir)
    inputs = source.inputs()
    store = TokenStore.open(target)
    if stale_reason(store, inputs, spec) is None:
        return store, False
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        store = TokenStore.open(target)  # another process may have prepared it while this one waited
        reason = stale_reason(store, inputs, spec)
        if reason is None:
            return store, False
        log.info("preparing %s into %s: %s%s", source.label, target, reason, _rank(), extra=PER_RANK)
        _build(source, target, inputs=inputs, spec=spec, text_field=text_field,
               num_proc=num_proc or _cpus())
    return TokenStore.open(target), True


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _tasks(source: CorpusSource, *, text_field: str, num_proc: int) -> list[Task]:
    if not source.specs:
        return generated_tasks(source.generated_docs)
    files = source.files()
    total = sum(f.stat().st_size for f in files)
    task_bytes = min(MAX_TASK_BYTES, max(MIN_TASK_BYTES, total // (4 * num_proc) + 1))
    return plan_tasks(files, text_field=text_field, task_bytes=task_bytes)


_WORKER: dict[str, Any] = {}


def _init_worker(spec: TokenizerSpec, text_field: str, out_dir: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process = one core, as --num_proc says
    _WORKER.update(spec=spec, encode=spec.encoder(), text_field=text_field, out_dir=out_dir)


def _worker_task(item: tuple[int, Task]) -> Shard:
    return tokenize_task(item[0], item[1], **_WORKER)


def _shards(tasks: list[Task], *, spec: TokenizerSpec, text_field: str, out_dir: Path, num_proc: int
            ) -> Iterator[Shard]:
    """Every task's shard, in corpus order: in this process for one task, else in ``num_proc`` forked workers (fork:
    they start at once, sharing this process's imports; they use no thread of it)."""
    if num_proc <= 1 or len(tasks) <= 1:
        encode = spec.encoder()
        for i, task in enumerate(tasks):
            yield tokenize_task(i, task, spec=spec, encode=encode, text_field=text_field, out_dir=str(out_dir))
        return
    # Frozen while forking: the workers' garbage collections then never write to the objects they inherit, whose
    # pages stay shared instead of being copied into each worker over a long preparation.
    gc.freeze()
    try:
        pool = mp.get_context("fork").Pool(min(num_proc, len(tasks)), initializer=_init_worker,
                                           initargs=(spec, text_field, str(out_dir)))
    finally:
        gc.unfreeze()
    with pool:
        yield from pool.imap(_worker_task, enumerate(tasks))


class _Progress:
    """A log line every :data:`PROGRESS_EVERY_S` seconds: share of the input done, documents and tokens per second."""

    def __init__(self, label: str, total_bytes: int, workers: int) -> None:
        self.label, self.total, self.workers = label, max(1, total_bytes), workers
        self.t0 = self.last = time.perf_counter()
        self.done = self.docs = self.tokens = 0

    def update(self, shard: Shard) -> None:
        self.done += shard.input_bytes
        self.docs += shard.n_docs
        self.tokens += shard.n_tokens
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S and self.done < self.total:
            self.last = now
            el = now - self.t0
            left = el * (self.total - self.done) / max(self.done, 1)
            log.info("preparing %s: %d%% of %.1f MiB, %s documents, %.2f M tokens (%.0f documents/s, %.2f M tokens/s, "
                     "%d workers), about %.0f s left%s", self.label, 100 * self.done // self.total, self.total / 2**20,
                     f"{self.docs:,}", self.tokens / 1e6, self.docs / el, self.tokens / el / 1e6, self.workers, left,
                     _rank(), extra=PER_RANK)

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def _build(source: CorpusSource, target: Path, *, inputs: list[dict[str, Any]], spec: TokenizerSpec,
           text_field: str, num_proc: int) -> None:
    staging = staging_path(target)
    remove_path(staging)  # an interrupted preparation's leftovers
    staging.mkdir(parents=True)
    try:
        tasks = _tasks(source, text_field=text_field, num_proc=num_proc)
        total = sum(t.size for t in tasks)
        # Worker processes only where they pay off: a small corpus is tokenized here at once.
        workers = 1 if total < 2 * MIN_TASK_BYTES else min(num_proc, len(tasks))
        progress = _Progress(source.label, total, workers)
        sha, n_tokens, n_docs, n_empty = hashlib.sha256(), 0, 0, 0
        with open(staging / TOKENS, "wb") as tokens_out, open(staging / DOCUMENTS, "wb") as docs_out:
            for shard in _shards(tasks, spec=spec, text_field=text_field, out_dir=staging, num_proc=workers):
                with open(shard.tokens_path, "rb") as f:
                    while chunk := f.read(COPY_CHUNK):
                        sha.update(chunk)
                        tokens_out.write(chunk)
                os.unlink(shard.tokens_path)
                (shard.ends + n_tokens).tofile(docs_out)
                n_tokens, n_docs, n_empty = n_tokens + shard.n_tokens, n_docs + shard.n_docs, n_empty + shard.n_empty
                progress.update(shard)
            for f in (tokens_out, docs_out):
                f.flush()
                os.fsync(f.fileno())
        if n_docs == 0:
            raise DataError(f"{source.param}={source.label}: no text found")
        seconds = progress.seconds()
        manifest = {"format": FORMAT, "corpus": source.label, "text_field": text_field, "inputs": inputs,
                    "tokenizer": {"class": spec.name, "fingerprint": spec.fingerprint, "eos": spec.eos,
                                  "vocab_size": spec.vocab_size},
                    "dtype": spec.dtype.name, "tokens": n_tokens, "documents": n_docs, "empty_documents": n_empty,
                    "tokens_sha256": sha.hexdigest(), "workers": workers, "seconds": round(seconds, 3)}
        with atomic_open(staging / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        publish(staging, target)
    except BaseException:
        remove_path(staging)
        raise
    log.info("prepared %s: %s documents, %s tokens in %.1f s (%.2f M tokens/s, %d workers) -> %s%s", source.label,
             f"{n_docs:,}", f"{n_tokens:,}", seconds, n_tokens / max(seconds, 1e-9) / 1e6, workers, target, _rank(),
             extra=PER_RANK)
