"""Frozen Mixture-of-Experts models under expert parallelism, against one device: a torchrun launch of 2 ranks, then
one of 4 (expert parallelism beside tensor and pipeline parallelism).

A task's frozen models (``frozen_models()``) are placed like its model, experts included: DPO with an MoE policy's
on-the-fly reference (a full fine-tune's frozen copy) and distillation from an MoE teacher, under ep2 and ep2 with
ZeRO-3 (every rank of the ``ep`` group holds ``E / 2`` of the frozen model's experts and dispatches its tokens to them
in the no-grad forwards), and on 4 ranks ep2 x tp2 and ep2 x pp2 (gpipe: each stage's frozen layers hold half their
experts; the replicas' batches of other lengths make the pipeline infer its stages' shapes at other steps, which runs
no token exchange). Student, policy and teacher are tiny Qwen3-MoE checkpoints (8 experts, top-2) written by
transformers, the teacher another draw than the student. Compared per step (bound 1e-5): ``train_loss`` (DPO: also
``rewards/margins``) on every rank, and every first-step gradient of the trained model (the harness's check); per
rank, the frozen model's routed-expert bytes are half one device's (the rest whole under ep2, halved by ZeRO-3).

Distillation samples its responses on every step (``lmbda=1``) with many end-of-sequence ids, so the rows of one rank
end at another decoding step than the other rank's: the ranks of an ``ep`` group decode until all of them have ended
(each MoE layer of a decoding step exchanges tokens with the others), the same number of decoding forwards each, with
the tokens one device samples. A tp2 run of the same distillation shows what a generation assembles (task's
``decoding_frozen_models()``): a whole copy of the student only, not of the teacher, which sampling never calls; under
ep2 with ZeRO-3, a generation gathers none of the teacher's FSDP2 units."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    gradient_summary,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    table_trainer,
    write_json_on_rank0,
)

STEPS = 3
TOL = 1e-5
RUNS = ["dpo@ep2", "dpo@ep2_zero3", "distill@ep2", "distill@ep2_zero3", "distill@tp2"]
RUNS4 = ["dpo@ep2_tp2", "dpo@ep2_pp2", "distill@ep2_tp2", "distill@ep2_pp2"]
"""On 4 ranks: expert parallelism beside tensor and pipeline parallelism (2 replicas, 4 rows or pairs each)."""
EOS = list(range(3, 83))
"""End-of-sequence ids of the sampling: about a quarter of the vocabulary, so rows end at different steps."""
MAX_NEW = 24


def _write_moe(out: Path, *, seed: int, tokenizer: bool) -> Path:
    """A tiny ``Qwen3MoeForCausalLM`` (2 layers of 8 experts, top-2) as ``save_pretrained`` writes it, and with
    ``tokenizer`` a BPE tokenizer trained by ``tokenizers`` (else the student's copied in by the caller)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_llm.data.text import generated_corpus
    from lightning_llm.testing import write_bpe_tokenizer

    if tokenizer:
        write_bpe_tokenizer(out, generated_corpus(50), vocab_size=300)
    config = Qwen3MoeConfig(vocab_size=304, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.2 if seed else 0.02,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Qwen3MoeForCausalLM(config).save_pretrained(str(out))
    return out


def _strategy(layout: str) -> tuple[Any, int]:
    """(strategy, per-rank batch) of a layout: 8 rows (DPO: pairs) per step."""
    from lightning_llm.strategies import ExpertParallelStrategy, HybridParallelStrategy

    if layout == "ep2_tp2":
        return HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2), 4
    if layout == "ep2_pp2":
        return HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2,
                                      schedule="gpipe", n_microbatches=2), 4
    return {"ep2": (ExpertParallelStrategy(), 4), "ep2_zero3": (ExpertParallelStrategy(zero_stage=3), 4),
            "tp2": ("tp", 8)}[layout]


class Recorder(LoggedLoss):
    """The losses (DPO: also the margins), per rank the bytes of the frozen models and of their routed experts, what
    a generation holds copies or gathers of, and per sampled step the decoding forwards of the student and the
    response lengths of this rank's rows."""

    def __init__(self, grads: str | None, reference: str) -> None:
        super().__init__(grads, reference)
        self.margins: list[float] = []
        self.frozen: dict[str, int] = {}
        self.decoding: dict[str, Any] = {}
        self.forwards: list[int] = []
        self.lengths: list[list[int]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        super().on_train_start(trainer, pl_module)
        frozen = pl_module.frozen_models()
        experts = [m for f in frozen.values() for n, m in f.named_modules() if n.endswith("mlp.experts")]
        self.replica = int(getattr(trainer.strategy, "replica_rank", 0))  # ranks of a replica sample the same rows
        self.frozen = {"all": sum(model_state_bytes(m, [])["params"] for m in frozen.values()),
                       "experts": sum(model_state_bytes(m, [])["params"] for m in experts),
                       "expert_modules": len(experts), "estimate": _frozen_estimate(trainer, pl_module)}
        strategy = trainer.strategy
        copies, zero = getattr(strategy, "_whole_copies", None), getattr(strategy, "_zero_decoding", None)
        teacher = {id(m) for f in frozen.values() for m in f.modules()}
        self.decoding = {
            "copied_roots": sorted({s.root for s in copies.slots}) if copies is not None else None,
            "copy_bytes": copies.extra if copies is not None else 0,
            "gathered_frozen_units": sum(id(u) in teacher for u in zero.units) if zero is not None else None,
            "gathered_units": len(zero.units) if zero is not None else None}
        sample = pl_module.sample_rows if hasattr(pl_module, "sample_rows") else None
        if sample is None:
            return

        def sampled(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            rows = sample(batch)
            self.lengths.append((rows["labels"] != -100).sum(-1).tolist())
            return rows

        pl_module.sample_rows = sampled

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        self.margins.append(float(trainer.callback_metrics.get("rewards/margins", float("nan"))))


class Counted:
    """A decoder whose calls (a prefill, then one per token) are counted; everything else is the decoder's."""

    def __init__(self, decoder: Any, calls: list[int]) -> None:
        self.decoder, self.calls = decoder, calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[-1] += 1
        return self.decoder(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.decoder, name)


def counting_generate(calls: list[int]) -> Any:
    """``generate`` counting the decoding calls of each generation into ``calls``."""
    from lightning_llm.generation import generate

    def counted(decoder: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(0)
        return generate(Counted(decoder, calls), *args, **kwargs)

    return counted


def _frozen_estimate(trainer: pl.Trainer, task: Any) -> int:
    """The memory model's bytes of the task's frozen models on a rank (what the run summary states), each by its own
    config under the run's layout."""
    from lightning_llm.memory import estimate_layout

    dims = getattr(trainer.strategy, "dims", None)
    layout = dict(tp=dims.tp, pp=dims.pp, dp=dims.dp, ep=dims.ep, stage=trainer.strategy.zero_stage) \
        if dims is not None else dict(tp=1, pp=1, dp=1, ep=1, stage=0)
    est, _ = estimate_layout(task.model.config, engine="native", batch_size=1, seq_len=32, precision="32-true",
                             fused_loss=True, frozen_configs=[m.config for m in task.frozen_models().values()],
                             **layout)
    return est.frozen


def _fit(run: str, devices: int, out: Path) -> dict[str, Any]:
    from lightning_llm.data import InstructionDataModule, PreferenceDataModule
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.rl.losses.dpo import DPOConfig
    from lightning_llm.tasks import DistillTask, DPOTask
    from lightning_llm.tasks import distill
    from lightning_llm.tasks.base import OptimConfig

    kind, _, layout = run.partition("@")
    strategy, batch = _strategy(layout) if devices > 1 else ("auto", 8)
    pl.seed_everything(7)
    optim = OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0)
    student = str(out / "student")
    task: Any
    if kind == "dpo":
        task = DPOTask(student, dropout=0.0, dpo=DPOConfig(beta=0.5, reference="on_the_fly"), optim=optim)
        dm: Any = PreferenceDataModule(tokenizer_dir=student, generated_pairs=48, generated_val_pairs=0,
                                       cutoff_len=32, max_prompt_len=16, batch_size=batch)
    else:
        task = DistillTask(student, teacher=str(out / "teacher"), divergence="jsd", beta=0.3, lmbda=1.0, seed=3,
                           optim=optim, generation=GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True,
                                                                    temperature=1.3, eos_token_id=EOS))
        dm = InstructionDataModule(tokenizer_dir=student, template="alpaca", generated_conversations=48,
                                   cutoff_len=96, batch_size=batch)
    rec = Recorder(grads=kind if devices == 1 else run, reference=kind)
    with mock.patch.object(distill, "generate", counting_generate(rec.forwards)):
        table_trainer(out / run.replace("@", "-"), strategy=strategy, devices=devices, max_steps=STEPS,
                      callbacks=[rec]).fit(task, dm)
    return {"losses": rec.losses, "margins": rec.margins, "frozen": rec.frozen, "decoding": rec.decoding,
            "forwards": rec.forwards, "lengths": rec.lengths, "replica": rec.replica}


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({k: _fit(f"{k}@1", 1, out) for k in ("dpo", "distill")}))
        return
    runs, n = (RUNS, 2) if mode == "layouts" else (RUNS4, 4)
    write_json_on_rank0(out / f"{mode}.json", {run: gathered(_fit(run, n, out)) for run in runs})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("frozen-experts")
    student = _write_moe(out / "student", seed=0, tokenizer=True)
    teacher = _write_moe(out / "teacher", seed=1, tokenizer=False)
    for f in student.iterdir():
        if "token" in f.name:
            (teacher / f.name).write_bytes(f.read_bytes())
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=1500,
                                     then=((4, "layouts4"),))


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", [*RUNS, *RUNS4])
def test_frozen_moe_models_under_expert_parallelism_equal_one_device(runs: Path, run: str) -> None:
    kind, _, layout = run.partition("@")
    ref = json.loads((runs / "reference.json").read_text())[kind]
    rows = json.loads((runs / ("layouts4.json" if run in RUNS4 else "layouts.json")).read_text())[run]
    assert ref["frozen"]["expert_modules"] == 2 and ref["frozen"]["experts"] > 0  # one per layer of the frozen model
    assert ref["frozen"]["all"] == ref["frozen"]["estimate"]
    for rank, row in enumerate(rows):
        err = max_abs_err(row["losses"], ref["losses"])
        if kind == "dpo":
            err = max(err, max_abs_err(row["margins"], ref["margins"]))
        share = row["frozen"]["experts"] / ref["frozen"]["experts"]
        print(f"{run} rank {rank}: max |train_loss{', margins' if kind == 'dpo' else ''} - one device| over {STEPS} "
              f"steps {err:.2e}; frozen experts' bytes {row['frozen']['experts']:,} = {share:.3f}x one device's, "
              f"frozen model {row['frozen']['all']:,} B (one device {ref['frozen']['all']:,} B)")
        assert err <= TOL, (row["losses"], ref["losses"])
        # the run summary's frozen bytes (a pipeline's: of its fullest stage)
        assert row["frozen"]["all"] <= row["frozen"]["estimate"] if "pp2" in layout else \
            row["frozen"]["all"] == row["frozen"]["estimate"], row["frozen"]
        if layout.startswith("ep2"):  # E / 2 experts of each frozen MoE layer on each rank (of its stage's layers)
            assert share == (0.25 if "pp2" in layout else 0.5), row["frozen"]
        if layout in ("ep2", "ep2_zero3"):  # the rest whole, or ZeRO-3 shards
            assert row["frozen"]["all"] <= (ref["frozen"]["all"] - row["frozen"]["experts"] if layout == "ep2"
                                            else 0.55 * ref["frozen"]["all"])
    print(f"{run}: {gradient_summary(runs, run)}")
    if kind == "distill":
        _check_decoding(run, layout, rows, ref)


def _check_decoding(run: str, layout: str, rows: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """The sampled responses are one device's; under ep the ranks decoded as many steps as each other, past where
    their own rows ended when the other replica's had not; a generation copies or gathers nothing of the teacher."""
    steps = len(ref["lengths"])
    assert steps == STEPS and len(ref["forwards"]) == STEPS
    if layout.startswith("ep2"):
        replicas = {row["replica"]: row["lengths"] for row in rows}  # (the ranks of a replica sample the same rows)
        assert all(row["lengths"] == replicas[row["replica"]] for row in rows) and len(replicas) == 2
        mine = [[lengths[s] for lengths in replicas.values()] for s in range(steps)]
        # each replica sampled its rows' responses as one device did (it holds every other row of the batch)
        assert [sorted(a + b) for a, b in mine] == [sorted(n) for n in ref["lengths"]]
        own = [[min(-(-max(n) // 8) * 8, MAX_NEW) for n in halves] for halves in mine]  # where a replica alone stops
        assert any(a != b for a, b in own), own  # the case the agreement is for happened
        for s in range(steps):  # a prefill, then a call per token until every replica's rows ended
            assert [row["forwards"][s] for row in rows] == [max(own[s])] * len(rows), \
                ([r["forwards"] for r in rows], own)
    else:  # tp: every rank decoded the whole batch's rows (sharing them out on its copy)
        assert all(row["lengths"] == ref["lengths"] for row in rows)
    for row in rows:
        d = row["decoding"]
        print(f"{run}: generation holds {d}")
        if layout == "tp2":  # a whole copy of the student only: the teacher is not a frozen model decoding uses
            assert d["copied_roots"] == ["model"] and d["copy_bytes"] > 0
        if layout == "ep2_zero3":  # the student's units gathered, none of the teacher's
            assert d["gathered_frozen_units"] == 0 and d["gathered_units"] > 0


def test_the_memory_model_counts_a_teacher_by_its_own_size(tmp_path: Path) -> None:
    """The run summary's frozen bytes of a distillation are the teacher's (here wider than the student, a Qwen2
    written by transformers), not a copy of the student's: on one device its parameters, under tp x2 its share."""
    from lightning_llm.memory import estimate_layout
    from lightning_llm.tasks import DistillTask
    from tests.conftest import tiny_hf_llama
    from tests.tasks.test_distill import _tiny_qwen2

    student = tiny_hf_llama(tmp_path / "student")
    task = DistillTask(str(student), teacher=str(_tiny_qwen2(tmp_path / "teacher", student, hidden=64)))
    task.configure_model()
    teacher, config = task.teacher_model, task.model.config
    bytes_of = {tp: estimate_layout(config, tp=tp, pp=1, dp=1, stage=0, engine="native", batch_size=1, seq_len=16,
                                    precision="32-true", fused_loss=True, frozen_configs=[teacher.config])[0].frozen
                for tp in (1, 2)}
    whole = 4 * sum(p.numel() for p in teacher.parameters())
    assert bytes_of[1] == whole > 2 * 4 * sum(p.numel() for p in task.model.parameters())
    assert 0.45 * whole < bytes_of[2] < 0.55 * whole



def test_generations_call_the_rl_reference_and_never_a_teacher(tmp_path: Path) -> None:
    """What a decoding session copies or gathers beside the model (``decoding_frozen_models()``): a full fine-tune's
    RL reference (its log-probs are computed inside the rollout's session), nothing for a LoRA policy (no copy) and
    nothing for a distillation (the teacher runs after the student sampled); a name that is not a frozen model of the
    task is refused in one line."""
    from lightning_llm.peft import LoraArgs
    from lightning_llm.strategies.frozen import decoding_frozen_models_of, frozen_models_of
    from lightning_llm.tasks import DistillTask
    from tests.tasks.test_grpo import _task as grpo

    def declared(task: Any) -> list[str]:
        task.configure_model()
        return list(decoding_frozen_models_of(task, frozen_models_of(task)))

    assert declared(grpo()) == ["reference.frozen"]
    assert declared(grpo(lora=LoraArgs(r=4, target_modules=["q_proj"]))) == []
    distill = DistillTask("debug", teacher="debug")
    assert declared(distill) == [] and list(frozen_models_of(distill)) == ["teacher_model"]
    distill.decoding_frozen_models = lambda: ("teacher",)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"^DistillTask.decoding_frozen_models\(\) names 'teacher', which "
                                         r"frozen_models\(\) does not hold \(it holds 'teacher_model'\)$"):
        declared(distill)


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
