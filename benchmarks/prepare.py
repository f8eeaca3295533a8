"""Preparing pretraining corpora: peak memory and throughput of ``lightning_llm prepare`` against a plain
``datasets.map(batched=True, num_proc=2)`` tokenization, and training from the prepared stores.

Run (CPU; about an hour on 2 shared cores, 8 GB of disk under --work)::

    python benchmarks/prepare.py --alternatives --out benchmarks/results/prepare-cpu.md

(the shared data is read from ``../shared/data`` beside the repository, or ``$LIGHTNING_LLM_SHARED_DATA``).

Corpora of about 50 MiB, 200 MiB and 1 GiB of real Chinese text are generated at run time under ``--work`` (never
committed): documents of 1-3 CSL abstracts (with their titles) and 5-30 AFQMC sentences joined, drawn with a seeded
RNG from ``../shared/data`` (JSONL, ``{"text": ...}``). The tokenizer is bert-base-chinese's vocabulary
(``../shared/data/tokenizers/bert-base-chinese``), loaded by the project's ``load_tokenizer`` for both sides.

* prepare: ``lightning_llm prepare --data.num_proc 2`` into an empty cache, per corpus; the baseline is the HF
  ``run_clm`` recipe's tokenization (``load_dataset("json")`` + ``map(tokenizer(batch["text"]), batched=True,
  num_proc=2)``, Arrow cache in an empty directory). Where both run on a corpus they alternate, ``--rounds`` times
  each, and the medians are reported (the machine is shared: timings are noisy). Tokens/s counts the text tokens
  (without our EOS or the baseline's [CLS]/[SEP]; the two counts are checked equal), over the whole command
  (start-up included) and over the work alone (our manifest's seconds; the baseline's load + map).
* peak memory of the whole process tree, sampled every 0.2 s: the sum of RSS (a forked worker's shared pages are
  counted in every process) and the sum of PSS (shared pages split between the processes sharing them: the memory
  the tree really holds).
* training: ``lightning_llm fit --config configs/pretrain_debug.yaml`` for 5 steps from each prepared store, on one
  device and under ``--trainer.strategy=ddp --trainer.devices=2`` (per-rank peak RSS); and a ddp x2 fit with an
  empty cache on the smallest corpus, whose log must show the corpus tokenized once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LIGHTNING_LLM_SHARED_DATA", REPO.parent / "shared" / "data"))
BERT = SHARED / "tokenizers" / "bert-base-chinese"
MIB = 1 << 20


# ------------------------------------------------------------------------------------------------ corpora
def _pieces() -> tuple[list[str], list[str]]:
    sentences, abstracts = [], []
    for split in ("train", "dev", "test"):
        for line in (SHARED / "afqmc" / f"{split}.json").read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            sentences += [r["sentence1"], r["sentence2"]]
    for split in ("dev", "test"):
        for line in (SHARED / "csl_title" / f"{split}.json").read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            abstracts.append(r["output"] + "\n" + r["input"])
    return sentences, abstracts


def make_corpus(path: Path, mib: int, *, seed: int = 0) -> Path:
    """A JSONL corpus of about ``mib`` MiB (kept when it exists with that size: it is deterministic)."""
    if path.is_file() and path.stat().st_size >= mib * MIB and path.stat().st_size < mib * MIB + 64 * 1024:
        return path
    sentences, abstracts = _pieces()
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        while f.tell() < mib * MIB:
            parts = rng.sample(abstracts, rng.randint(1, 3)) + ["，".join(rng.sample(sentences, rng.randint(5, 30)))
                                                                 + "。"]
            rng.shuffle(parts)
            f.write(json.dumps({"text": "\n".join(parts)}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ measuring
def _tree(root: Any) -> list[Any]:
    import psutil

    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def run_measured(cmd: list[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> dict[str, Any]:
    """Run ``cmd``; sample its process tree every 0.2 s: peak sum of RSS and of PSS, and each process's own peak RSS
    keyed by its ``LOCAL_RANK`` (torchrun ranks) or role."""
    import psutil

    t0 = time.perf_counter()
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    root = psutil.Process(proc.pid)
    peak = {"rss": 0, "pss": 0}
    per: dict[str, int] = {}
    while proc.poll() is None:
        rss = pss = 0
        for p in _tree(root):
            try:
                info = p.memory_full_info()
                rank = p.environ().get("LOCAL_RANK")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, pss = rss + info.rss, pss + info.pss
            role = f"pid {p.pid}"
            if rank is not None and p.pid != root.pid:  # a torchrun rank, or a worker it forked
                role = f"rank {rank}" if p.ppid() == root.pid else f"rank {rank} worker {p.pid}"
            per[role] = max(per.get(role, 0), info.rss)
        peak = {"rss": max(peak["rss"], rss), "pss": max(peak["pss"], pss)}
        time.sleep(0.2)
    if log:
        out.close()
    return {"rc": proc.returncode, "wall_s": time.perf_counter() - t0, "peak_rss": peak["rss"],
            "peak_pss": peak["pss"], "per_process_rss": per}


def ours(corpus: Path, cache: Path, log: Path) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    r = run_measured([sys.executable, "-m", "lightning_llm", "prepare", f"--data.data_path={corpus}",
                      f"--data.tokenizer_dir={BERT}", "--data.num_proc=2", f"--data.cache_dir={cache}"], log=log)
    if r["rc"]:
        raise RuntimeError(f"prepare failed, see {log}")
    (store,) = [p for p in cache.iterdir() if p.is_dir()]
    m = json.loads((store / "manifest.json").read_text())
    return {**r, "work_s": m["seconds"], "text_tokens": m["tokens"] - m["documents"], "documents": m["documents"],
            "store": str(store)}


def datasets_baseline(corpus: Path, cache: Path, log: Path) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    result = cache.with_suffix(".json")
    r = run_measured([sys.executable, __file__, "_datasets", str(corpus), str(cache), str(result)], log=log,
                     env={"TOKENIZERS_PARALLELISM": "false"})
    if r["rc"]:
        raise RuntimeError(f"datasets baseline failed, see {log}")
    shutil.rmtree(cache, ignore_errors=True)
    return {**r, **json.loads(result.read_text())}


def _datasets_main(corpus: str, cache: str, result: str) -> None:
    """The baseline, in its own process: run_clm's load_dataset + tokenize_function map."""
    import pyarrow.compute as pc
    from datasets import disable_progress_bars, load_dataset

    from lightning_llm.data import load_tokenizer

    disable_progress_bars()
    tok = load_tokenizer(str(BERT))
    t0 = time.perf_counter()
    raw = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    ds = raw.map(lambda batch: tok(batch["text"]), batched=True, num_proc=2, remove_columns=raw.column_names)
    work = time.perf_counter() - t0
    lengths = pc.list_value_length(ds.data.column("input_ids"))
    tokens = int(pc.sum(lengths).as_py())
    Path(result).write_text(json.dumps({"work_s": work, "text_tokens": tokens - 2 * len(ds), "documents": len(ds)}))


def alternative(tool: str, corpus: Path, out: Path, log: Path) -> dict[str, Any]:
    """One run of a candidate we did not pick, on the same corpus: ``litdata`` (``optimize`` into chunks for its
    ``TokensLoader``) or ``datasets-tuned`` (our tokenization call inside ``datasets.map``, uint16 ids only)."""
    shutil.rmtree(out, ignore_errors=True)
    result = out.with_suffix(".json")
    r = run_measured([sys.executable, __file__, f"_{tool}", str(corpus), str(out), str(result)], log=log,
                     env={"TOKENIZERS_PARALLELISM": "false"})
    if r["rc"]:
        raise RuntimeError(f"{tool} failed, see {log}")
    shutil.rmtree(out, ignore_errors=True)
    return {**r, **json.loads(result.read_text())}


def _encoder() -> Any:
    from lightning_llm.data import load_tokenizer
    from lightning_llm.data.base import tokenizer_vocab_size
    from lightning_llm.data.corpus.token_store import TokenizerSpec

    tok = load_tokenizer(str(BERT))
    spec = TokenizerSpec.of(tok, vocab_size=tokenizer_vocab_size(tok))
    return spec, spec.encoder()


_ENCODER: list[Any] = []


def _litdata_fn(task: Any) -> Any:
    """litdata's per-input function (module level: litdata spawns its workers): the same byte-range tasks and reader
    as ours; only the writer differs."""
    import numpy as np
    import torch

    from lightning_llm.data.corpus.documents import read_task

    if not _ENCODER:
        _ENCODER.extend(_encoder())
    spec, encode = _ENCODER
    texts = [t for t, _ in read_task(task, text_field="text")]
    for i in range(0, len(texts), 256):
        for ids in encode(texts[i:i + 256]):
            yield torch.from_numpy(np.asarray([*ids, spec.eos], dtype=np.int32))


def _litdata_main(corpus: str, out: str, result: str) -> None:
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    from lightning_llm.data.corpus.documents import plan_tasks

    t0 = time.perf_counter()
    tasks = plan_tasks([Path(corpus)], text_field="text", task_bytes=8 * MIB)
    optimize(fn=_litdata_fn, inputs=tasks, output_dir=out, chunk_bytes="64MB", num_workers=2,
             item_loader=TokensLoader())
    work = time.perf_counter() - t0
    index = json.loads((Path(out) / "index.json").read_text())
    tokens = sum(c["dim"] for c in index["chunks"])
    docs = sum(c["chunk_size"] for c in index["chunks"])
    Path(result).write_text(json.dumps({"work_s": work, "text_tokens": tokens - docs, "documents": docs}))


def _datasets_tuned_main(corpus: str, cache: str, result: str) -> None:
    import pyarrow.compute as pc
    from datasets import Features, Sequence, Value, disable_progress_bars, load_dataset

    disable_progress_bars()
    spec, encode = _encoder()
    t0 = time.perf_counter()
    raw = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    ds = raw.map(lambda batch: {"input_ids": [[*ids, spec.eos] for ids in encode(batch["text"])]}, batched=True,
                 num_proc=2, remove_columns=raw.column_names, features=Features({"input_ids": Sequence(Value("uint16"))}))
    work = time.perf_counter() - t0
    tokens = int(pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py())
    Path(result).write_text(json.dumps({"work_s": work, "text_tokens": tokens - len(ds), "documents": len(ds)}))


def fit_rss(store_corpus: Path, cache: Path, *, ddp: bool, log: Path, steps: int = 5) -> dict[str, Any]:
    """``lightning_llm fit`` (pretrain_debug, bert-base-chinese tokenizer) for ``steps`` steps from ``cache``, then 2
validation batches (the loaders of the whole training and validation sets are built)."""
    args = ["fit", f"--config={REPO / 'configs' / 'pretrain_debug.yaml'}", f"--data.data_path={store_corpus}",
            f"--data.tokenizer_dir={BERT}", f"--data.cache_dir={cache}", "--data.num_proc=2",
            f"--trainer.max_steps={steps}", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            f"--trainer.val_check_interval={steps}", "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={cache.parent / 'runs'}"]
    if ddp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "lightning_llm", *args,
               "--trainer.strategy=ddp", "--trainer.devices=2", "--data.batch_size=4"]
    else:
        cmd = [sys.executable, "-m", "lightning_llm", *args]
    r = run_measured(cmd, env={"OMP_NUM_THREADS": "1"}, log=log)
    if r["rc"]:
        raise RuntimeError(f"fit failed, see {log}")
    text = log.read_text()
    r["prepare_lines"] = text.count("lightning_llm.data.corpus.prepare: prepared ")
    r["ranks_rss"] = {k: v for k, v in r["per_process_rss"].items() if k.startswith("rank") and "worker" not in k}
    return r


# ------------------------------------------------------------------------------------------------ report
def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def _med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# Preparing pretraining corpora (CPU)", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d}, {platform.node()}, {os.cpu_count()} cores shared with other "
             f"jobs (load average at the end: {os.getloadavg()[0]:.1f}), Python {platform.python_version()}.",
             f"Command: `python benchmarks/prepare.py {' '.join(sys.argv[1:])}`", "",
             "Tokenizer: bert-base-chinese vocabulary (BertTokenizer, fast). 2 worker processes on both sides.", "",
             "## Preparation: peak memory of the process tree, throughput", "",
             "| corpus | documents | text tokens | tool | runs | peak RSS sum GiB | peak PSS sum GiB | wall s | "
             "work s | tokens/s (wall) | tokens/s (work) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, by_tool in res["prepare"].items():
        for tool, rows in by_tool.items():
            if not rows:
                continue
            toks = rows[0]["text_tokens"]
            lines.append(f"| {size} MiB | {rows[0]['documents']:,} | {toks / 1e6:.1f} M | {tool} | {len(rows)} | "
                         f"{_gib(_med(rows, 'peak_rss'))} | {_gib(_med(rows, 'peak_pss'))} | "
                         f"{_med(rows, 'wall_s'):.1f} | {_med(rows, 'work_s'):.1f} | "
                         f"{toks / _med(rows, 'wall_s') / 1e6:.2f} M | {toks / _med(rows, 'work_s') / 1e6:.2f} M |")
    lines += ["", "Medians over the runs (alternating ours / datasets where both ran). Per-run values:", ""]
    for size, by_tool in res["prepare"].items():
        for tool, rows in filter(lambda item: item[1], by_tool.items()):
            lines.append(f"- {size} MiB, {tool}: wall " + ", ".join(f"{r['wall_s']:.1f}" for r in rows) +
                         " s; peak RSS " + ", ".join(_gib(r["peak_rss"]) for r in rows) + " GiB")
    sizes = list(res["prepare"])
    lo, hi = res["prepare"][sizes[0]]["ours"], res["prepare"][sizes[-1]]["ours"]
    lines += ["", f"Peak RSS of ours, {sizes[-1]} MiB vs {sizes[0]} MiB: "
                  f"{_med(hi, 'peak_rss') / _med(lo, 'peak_rss'):.2f}x (RSS sum), "
                  f"{_med(hi, 'peak_pss') / _med(lo, 'peak_pss'):.2f}x (PSS sum)."]
    for size, by_tool in res["prepare"].items():
        for tool, d in by_tool.items():
            if tool == "ours" or not d:
                continue
            o = by_tool["ours"]
            assert o[0]["text_tokens"] == d[0]["text_tokens"], f"{tool}'s tokenization differs"
            lines.append(f"Throughput, ours / {tool} at {size} MiB (same {o[0]['text_tokens']:,} text tokens): "
                         f"{_med(d, 'wall_s') / _med(o, 'wall_s'):.2f}x (wall), "
                         f"{_med(d, 'work_s') / _med(o, 'work_s'):.2f}x (work).")
    lines += ["", "## Training from the prepared stores (pretrain_debug, 5 steps and 2 validation batches)", "",
              "| corpus | layout | prepared in this run | 'prepared' log lines | peak RSS per rank MiB | wall s |",
              "|---|---|---|---|---|---|"]
    for row in res["fit"]:
        ranks = " / ".join(f"{v / MIB:.0f}" for _, v in sorted(row["ranks_rss"].items())) or \
            f"{row['peak_rss'] / MIB:.0f}"
        lines.append(f"| {row['size']} MiB | {row['layout']} | {row['fresh']} | {row['prepare_lines']} | {ranks} | "
                     f"{row['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 1024], help="corpus sizes, MiB")
    ap.add_argument("--compare", type=int, nargs="*", default=[50, 200], help="sizes also run through datasets")
    ap.add_argument("--rounds", type=int, default=3, help="alternating runs per tool where both run")
    ap.add_argument("--alternatives", action="store_true",
                    help="also run litdata optimize and a tuned datasets.map once on the smallest compared corpus")
    ap.add_argument("--fit-only", action="store_true",
                    help="keep the preparation results and stores of an earlier run under --work; run the fits again")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lightning_llm-bench-prepare"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prepare-cpu.md")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"prepare": {}, "fit": []}
    corpora = {s: make_corpus(args.work / f"corpus-{s}mib.jsonl", s) for s in args.sizes}
    if args.fit_only:  # the preparation results and stores of an earlier run under --work
        res["prepare"] = {int(k): v for k, v in json.loads((args.work / "results.json").read_text())["prepare"].items()}
    for size, corpus in ({} if args.fit_only else corpora).items():
        rounds = args.rounds if size in args.compare else 1
        rows: dict[str, list[dict[str, Any]]] = {"ours": [], "datasets": []}
        for i in range(rounds):
            rows["ours"].append(ours(corpus, args.work / f"cache-{size}", args.work / f"ours-{size}-{i}.log"))
            print(f"{size} MiB ours: {rows['ours'][-1]['wall_s']:.1f} s", flush=True)
            if size in args.compare:
                rows["datasets"].append(datasets_baseline(corpus, args.work / f"hf-{size}",
                                                          args.work / f"hf-{size}-{i}.log"))
                print(f"{size} MiB datasets: {rows['datasets'][-1]['wall_s']:.1f} s", flush=True)
        if args.alternatives and size == min(args.compare or [size]):
            for tool in ("litdata", "datasets_tuned"):
                rows[tool.replace("_", "-")] = [alternative(tool, corpus, args.work / f"{tool}-{size}",
                                                            args.work / f"{tool}-{size}.log")]
                print(f"{size} MiB {tool}: {rows[tool.replace('_', '-')][-1]['wall_s']:.1f} s", flush=True)
        res["prepare"][size] = rows
    for size, corpus in corpora.items():  # the stores ours() left: training only maps them
        for layout in ("1 device", "ddp x2"):
            r = fit_rss(corpus, args.work / f"cache-{size}", ddp=layout != "1 device",
                        log=args.work / f"fit-{size}-{layout.replace(' ', '')}.log")
            res["fit"].append({**r, "size": size, "layout": layout, "fresh": "no"})
    smallest = min(corpora)
    fresh = args.work / "cache-fresh"
    shutil.rmtree(fresh, ignore_errors=True)
    r = fit_rss(corpora[smallest], fresh, ddp=True, log=args.work / "fit-fresh-ddp.log")
    res["fit"].append({**r, "size": smallest, "layout": "ddp x2", "fresh": "yes (empty cache)"})
    (args.work / "results.json").write_text(json.dumps(res, indent=1, default=str))
    text = report(res, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        {"_datasets": _datasets_main, "_litdata": _litdata_main, "_datasets_tuned": _datasets_tuned_main}[sys.argv[1]](
            *sys.argv[2:5])
    else:
        main()
