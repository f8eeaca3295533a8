"""``lightning_llm eval`` and ``LMEvalCallback`` (issue 49): lm-evaluation-harness scores our checkpoints at any layout
as lm-eval's own ``HFLM`` scores their export.

One tiny decoder (2 layers, a byte-level BPE tokenizer trained here) is trained 60 steps on the answers of a
generation task, with the callback scoring every 30 steps. Local data only, written here: a multiple-choice set in
C-Eval's CSV format read by the shipped ``configs/eval/ceval_format.yaml`` (two subjects, one-shot prompts from the
dev files), a generation task (``exact_match``, stop at a newline) and a perplexity task (``loglikelihood_rolling``).
Then, in this process: ``lightning_llm eval`` on the ``.ckpt`` (one device), ``lightning_llm export`` and lm-eval's
``HFLM`` on the export; after them one launch of 2 processes runs ``eval`` under tp x2 (PATH: the HF export) and
pp x2 (PATH: the checkpoint as a layout-free DCP directory). Per-sample log-likelihoods must agree
within 1e-4, generated strings and every metric exactly.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.cli import main as cli_main
from lightning_llm.testing import CLI_ERROR, launch, logged_rows, run_worker, wait, write_bpe_tokenizer

pytestmark = pytest.mark.multiprocess  # lm-eval's results gather the environment (pip list, compilers: processes)
REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "eval"
TASKS = "ceval_format,gen_local,ppl_local"
STEPS, EVERY = 60, 30
TOL = 1e-4
LAYOUTS = {"tp": ["--trainer.strategy=tp", "--trainer.devices=2"],
           "pp": ["--trainer.strategy=pp", "--trainer.devices=2"]}
SUBJECTS = {"computer_network": ["路由器工作在哪一层？", "TCP是什么协议？", "IP地址有多少位？", "HTTP默认端口是多少？",
                                 "DNS的作用是什么？", "交换机工作在哪一层？"],
            "art_studies": ["京剧起源于哪个朝代？", "清明上河图的作者是谁？", "兰亭集序是谁写的？"]}
SUMS = [(1, 2), (3, 4), (2, 2), (5, 1), (7, 1)]


def _write_data(out: Path) -> list[str]:
    """C-Eval CSVs under ``out/ceval`` (val/ and dev/), the generation and perplexity tasks under ``out/tasks``;
    returns the training texts."""
    for subject, questions in SUBJECTS.items():
        for split, rows in (("val", questions), ("dev", questions[:2])):
            (out / "ceval" / split).mkdir(parents=True, exist_ok=True)
            lines = ["id,question,A,B,C,D,answer"] + [f"{i},{q},第一,第二,第三,第四,{'ABCD'[i % 4]}"
                                                       for i, q in enumerate(rows)]
            (out / "ceval" / split / f"{subject}_{split}.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tasks = out / "tasks"
    tasks.mkdir()
    gen = [{"q": f"{a}加{b}等于几？", "a": str(a + b)} for a, b in SUMS]
    # short texts: a sum of token log-probs near -1000 would carry fp32's rounding there (1.2e-4) in HFLM's own sum
    ppl = [{"text": "今天天气很好。"}, {"text": "The quick brown fox jumps over the lazy dog."}]
    for name, rows in (("gen", gen), ("ppl", ppl)):
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                             encoding="utf-8")
    data = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "gen_local.yaml").write_text(
        "task: gen_local\n" + data.format(tasks / "gen.jsonl") + "output_type: generate_until\n"
        'doc_to_text: "问：{{q}}\\n答："\ndoc_to_target: "{{a}}"\n'
        'generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}\n'
        "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n", encoding="utf-8")
    (tasks / "ppl_local.yaml").write_text(
        "task: ppl_local\n" + data.format(tasks / "ppl.jsonl") + "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n" + "".join(f"  - {{metric: {m}, aggregation: {a}, higher_is_better: false}}\n" for m, a in
                                   (("word_perplexity", "weighted_perplexity"), ("bits_per_byte", "bits_per_byte"))),
        encoding="utf-8")
    texts = [q for qs in SUBJECTS.values() for q in qs] + [r["text"] for r in ppl]
    return [f"问：{r['q']}\n答：{r['a']}\n" for r in gen] + texts


def _metadata(out: Path) -> str:
    return json.dumps({"data_dir": str(out / "ceval"), "shots": 1})


def _fit(out: Path) -> Path:
    """Train the tiny decoder with the callback scoring every EVERY steps (CSV log under ``out/fit``); returns the
    final checkpoint."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.evaluation import LMEvalCallback
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    texts = _write_data(out)
    tok = write_bpe_tokenizer(out / "tok", texts * 5, vocab_size=300)
    (out / "corpus.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n"
                                              for t in texts[:len(SUMS)] * 40), encoding="utf-8")
    pl.seed_everything(5)
    task = CausalLMTask("debug", model_overrides={"num_layers": 2}, dropout=0.0,
                        optim=OptimConfig(lr=1e-2, scheduler="constant"))
    dm = TextDataModule(str(out / "corpus.jsonl"), str(tok), block_size=32, batch_size=8, cache_dir=str(out / "cache"))
    callback = LMEvalCallback(["ceval_format", "gen_local"], EVERY, include_path=[str(CONFIGS), str(out / "tasks")],
                              metadata=json.loads(_metadata(out)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=pl.loggers.CSVLogger(str(out / "fit")),
                         log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[callback], default_root_dir=str(out))
    trainer.fit(task, dm)
    trainer.save_checkpoint(out / "model.ckpt")
    return out / "model.ckpt"


def _eval_args(path: Path, out: Path, results: Path, *extra: str) -> list[str]:
    return ["eval", str(path), "--tasks", TASKS, "--include_path", str(CONFIGS), "--include_path",
            str(out / "tasks"), "--metadata", _metadata(out), "--output_path", str(results), "--log_samples",
            "--batch_size", "3", "--bootstrap_iters", "0", *extra]


def _eval(args: list[str]) -> int:
    """``lightning_llm ARGS`` in this process, the environment put back afterwards (Lightning's one-process set-up
    leaves MASTER_ADDR & co., which would make accelerate, under HFLM, start a process group)."""
    env = dict(os.environ)
    try:
        return cli_main(args)
    finally:
        os.environ.clear()
        os.environ.update(env)


def _samples(results: Path) -> dict[str, dict[int, Any]]:
    """``{task: {doc_id: sample}}`` of the ``samples_<task>_*.jsonl`` lm-eval's tracker wrote under ``results``."""
    out: dict[str, dict[int, Any]] = {}
    for f in results.rglob("samples_*.jsonl"):
        task = f.name[len("samples_"):].rsplit("_", 1)[0]
        out[task] = {r["doc_id"]: r for r in map(json.loads, f.read_text(encoding="utf-8").splitlines())}
    return out


def _metrics(results: Path) -> dict[str, Any]:
    (f,) = results.rglob("results_*.json")
    return {t: {k: v for k, v in m.items() if "," in k} for t, m in json.loads(f.read_text())["results"].items()}


def _hflm(hf: Path, out: Path, tasks: str = TASKS) -> dict[str, Any]:
    """lm-eval's own HFLM on the export: the reference (samples in the JSON form the tracker writes)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=str(hf), device="cpu", batch_size=1, dtype="float32")
    manager = TaskManager(include_path=[str(CONFIGS), str(out / "tasks")], metadata=json.loads(_metadata(out)))
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks.split(","), task_manager=manager, log_samples=True,
                                  bootstrap_iters=0, random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                                  fewshot_random_seed=1234)
    samples = json.loads(json.dumps(res["samples"], default=float))  # tuples -> lists, numpy -> float
    metrics = {t: {k: float(v) for k, v in m.items() if "," in k and "stderr" not in k}
               for t, m in res["results"].items()}
    return {"samples": {t: {s["doc_id"]: s for s in rows} for t, rows in samples.items()}, "metrics": metrics}


def _layouts(out: Path) -> None:
    """torchrun worker: ``eval`` under tp x2 (the HF export) and pp x2 (the DCP directory)."""
    from lightning_llm.cli.evaluate import main

    paths = {"tp": out / "hf", "pp": out / "dcp"}
    for layout, flags in LAYOUTS.items():
        assert main(_eval_args(paths[layout], out, out / f"results-{layout}", *flags)[1:]) == 0, layout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The trained checkpoint, its export and DCP directory, HFLM's scores of the export and ``eval``'s of the
    checkpoint on one device, in this process."""
    from lightning_llm.strategies.engine.hybrid_checkpoint import from_lightning_checkpoint

    out = tmp_path_factory.mktemp("eval")
    ckpt = _fit(out)
    assert cli_main(["export", str(ckpt), "--to", str(out / "hf")]) == 0
    from_lightning_checkpoint(ckpt, out / "dcp")
    reference = _hflm(out / "hf", out)
    # one device with the static cache (issue 57): the generations equal HFLM's as the layouts' dynamic ones do
    assert _eval(_eval_args(ckpt, out, out / "results-1", "--cache_implementation", "static")) == 0
    return {"out": out, "hflm": reference}


@pytest.fixture(scope="module")
def layout_runs(runs: dict[str, Any]) -> Path:
    """``eval`` under every layout of :data:`LAYOUTS`: one launch of 2 processes, after the one-device runs."""
    print(wait(launch(__file__, 2, str(runs["out"])), 900)[-3000:])
    return runs["out"]


def _compare(got: dict[str, dict[int, Any]], ref: dict[str, dict[int, Any]], what: str, tasks: str = TASKS) -> float:
    """Largest per-sample log-likelihood difference; generated strings must be equal."""
    worst = 0.0
    assert sorted(got) == sorted(ref) == sorted(tasks.split(",")), (what, sorted(got))
    for task, docs in ref.items():
        assert sorted(got[task]) == sorted(docs), (what, task)
        for doc_id, sample in docs.items():
            mine = got[task][doc_id]
            if task == "gen_local":
                assert mine["filtered_resps"] == sample["filtered_resps"], (what, doc_id)
                continue
            for a, b in zip(mine["resps"], sample["resps"], strict=True):
                ll_a, ll_b = (r[0][0] if isinstance(r[0], list) else r[0] for r in (a, b))
                worst = max(worst, abs(float(ll_a) - float(ll_b)))
                if task == "ceval_format":
                    assert str(a[0][1]) == str(b[0][1]), (what, doc_id, "is_greedy")  # the tracker writes str
    return worst


EXACT = ("acc,none", "acc_norm,none", "exact_match,none")
"""Counted metrics: equal. The others (perplexities) are functions of the summed log-likelihoods: within their
tolerance (relative 1e-5 at these sizes)."""


def _same_metrics(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert sorted(got) == sorted(ref)
    for task, metrics in ref.items():
        for key, value in metrics.items():
            if "stderr" in key:
                continue
            expected = value if key in EXACT else pytest.approx(value, rel=1e-5)
            assert got[task][key] == expected, (task, key, got[task][key], value)


def test_eval_equals_lm_eval_hflm_on_the_export(runs: dict[str, Any]) -> None:
    out, ref = runs["out"], runs["hflm"]
    worst = _compare(_samples(out / "results-1"), ref["samples"], "one device")
    ours = _metrics(out / "results-1")
    print(f"one device vs HFLM: max |loglikelihood diff| {worst:.2e}; ours {ours}")
    assert worst <= TOL
    _same_metrics(ours, ref["metrics"])
    # The checks can fail: a trained model, not a constant one (the generation task's first answer is learned)
    assert 0 < ours["gen_local"]["exact_match,none"] < 1
    texts = [s["filtered_resps"][0] for s in ref["samples"]["gen_local"].values()]
    assert all(t.isdigit() for t in texts), texts


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_eval_under_layouts_equals_one_device(layout_runs: Path, layout: str) -> None:
    out = layout_runs
    one = _samples(out / "results-1")
    worst = _compare(_samples(out / f"results-{layout}"), one, layout)
    print(f"{layout} x2 vs one device: max |loglikelihood diff| {worst:.2e}")
    assert worst <= TOL
    _same_metrics(_metrics(out / f"results-{layout}"), _metrics(out / "results-1"))


def test_callback_logs_the_commands_scores_at_the_steps_asked(runs: dict[str, Any]) -> None:
    out = runs["out"]
    rows = logged_rows(out / "fit", key="lm_eval/ceval_format/acc")
    steps = [int(r["step"]) for r in rows]
    scores = [(r["lm_eval/ceval_format/acc"], r["lm_eval/gen_local/exact_match"]) for r in rows]
    print(f"callback rows at steps {steps}: (acc, exact_match) {scores}")
    # after optimizer steps 30 and 60, on the rows of those steps' train_loss (Lightning's step column counts from 0)
    assert steps == [EVERY - 1, 2 * EVERY - 1] and all("train_loss" in r for r in rows)
    command = _metrics(out / "results-1")
    last = rows[-1]
    assert last["lm_eval/ceval_format/acc"] == pytest.approx(command["ceval_format"]["acc,none"], abs=1e-6)
    assert last["lm_eval/ceval_format/acc_norm"] == pytest.approx(command["ceval_format"]["acc_norm,none"], abs=1e-6)
    assert last["lm_eval/gen_local/exact_match"] == pytest.approx(command["gen_local"]["exact_match,none"], abs=1e-6)


def test_lora_checkpoint_scored_with_its_adapters(runs: dict[str, Any]) -> None:
    """A LoRA run's checkpoint (adapters only; the frozen base read from its backbone directory) is scored with its
    adapters unmerged: the same log-likelihoods and generations as HFLM on its merged export."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    out, tasks = runs["out"], "gen_local,ppl_local"
    pl.seed_everything(4)
    task = CausalLMTask(str(out / "hf"), dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"),
                        lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]),
                        adapter_dir=str(out / "lora-adapter"))
    dm = TextDataModule(str(out / "corpus.jsonl"), str(out / "hf"), block_size=32, batch_size=8,
                        cache_dir=str(out / "cache"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(out))
    trainer.fit(task, dm)
    trainer.save_checkpoint(out / "lora.ckpt")
    assert cli_main(["export", str(out / "lora.ckpt"), "--to", str(out / "lora-merged")]) == 0
    ref = _hflm(out / "lora-merged", out, tasks)
    args = _eval_args(out / "lora.ckpt", out, out / "results-lora")
    args[args.index("--tasks") + 1] = tasks
    assert _eval(args) == 0
    worst = _compare(_samples(out / "results-lora"), ref["samples"], "lora", tasks)
    base = _samples(out / "results-1")["ppl_local"]
    shift = max(abs(float(base[d]["resps"][0][0]) - float(s["resps"][0][0])) for d, s in
                ref["samples"]["ppl_local"].items())
    print(f"LoRA checkpoint (unmerged) vs HFLM on its merged export: max |loglikelihood diff| {worst:.2e}; "
          f"the adapters moved the log-likelihoods by up to {shift:.2e}")
    assert worst <= TOL and shift > 1e-2


def _one_error(capsys: pytest.CaptureFixture[str], args: list[str]) -> str:
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(CLI_ERROR)]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_errors_are_one_line(runs: dict[str, Any], capsys: pytest.CaptureFixture[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = runs["out"]
    ckpt = str(out / "model.ckpt")
    bad = out / "bad_tasks"
    bad.mkdir()
    (bad / "gen_bad.yaml").write_text((out / "tasks" / "gen_local.yaml").read_text(encoding="utf-8").replace(
        "gen_local", "gen_bad").replace("do_sample: false", "do_sample: false, typical_p: 0.9"), encoding="utf-8")
    missing_task = _one_error(capsys, ["eval", ckpt, "--tasks", "no_such_task"])
    missing_data = _one_error(capsys, ["eval", ckpt, "--tasks", "ceval-valid_computer_network"])
    no_data_dir = _one_error(capsys, ["eval", ckpt, "--tasks", "ceval_format", "--include_path", str(CONFIGS)])
    unsupported = _one_error(capsys, ["eval", ckpt, "--tasks", "gen_bad", "--include_path", str(bad)])
    no_path = _one_error(capsys, ["eval", str(out / "nowhere.ckpt"), "--tasks", "gen_local"])
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    no_extra = _one_error(capsys, ["eval", ckpt, "--tasks", "gen_local"])
    for line in (missing_task, missing_data, no_data_dir, unsupported, no_path, no_extra):
        print(line)
    assert "no_such_task: no such task" in missing_task
    assert "ceval-valid_computer_network" in missing_data and "--include_path" in missing_data
    assert "data_dir" in no_data_dir and "--metadata" in no_data_dir
    assert "typical_p" in unsupported and "not supported" in unsupported
    assert "no such file" in no_path
    assert "lightning_llm[eval]" in no_extra


if __name__ == "__main__":
    run_worker(_layouts, Path(sys.argv[1]))
