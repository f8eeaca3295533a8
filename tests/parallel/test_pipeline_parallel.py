"""Pipeline-parallel strategy (``strategy=pp``): parity with one device, activation memory, checkpoints, errors.

The multi-process tests share one torchrun launch of this file (2 CPU processes, gloo) that goes through every
pipeline case one after the other in the same process group, after a single-device reference run of the same cases
in the pytest process (the ``runs`` fixture, once per module: ``testing.run_layouts_and_reference``, which also
compares every case's first-step gradients per tensor). Each run writes JSON/tensors that the tests compare. Cases:
the debug decoder under GPipe, 1F1B and interleaved 1F1B (+ a checkpoint round trip), and the
debug encoder's ClassificationTask under 1F1B without and with activation checkpointing, then ``predict`` from
the pipeline checkpoint.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_llm.models import build_model
from lightning_llm.strategies.mesh import ParallelDims
from lightning_llm.strategies import PipelineParallelStrategy
from lightning_llm.strategies.pipeline.split import (
    prune_model, split_layers, stage_module, stage_ranks, stage_specs,
)
from lightning_llm.testing import gradient_summary, recorder_for, run_layouts_and_reference, run_worker

STEPS = 10
# (schedule, stages_per_rank, measure_activations)
PP_RUNS = [("gpipe", 1, True), ("1f1b", 1, True), ("interleaved_1f1b", 2, False)]
CLS_STEPS = 4
# classification under pp: (tag, activation_checkpointing); both 1F1B, m=4, measuring saved activations
CLS_RUNS = [("cls", False), ("cls_ac", True)]
TOL = 1e-5


# ---------------------------------------------------------------------------------------------------- worker
def _trainer(out: Path, strategy: Any, devices: int, **kwargs: Any) -> Any:
    import lightning.pytorch as pl

    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), **kwargs)


def _record_callback() -> Any:
    import lightning.pytorch as pl

    class Record(pl.Callback):
        """Per-step training losses (every rank: a rank without the last stage gets the broadcast loss), epoch-end
        validation losses, and the logits of every predict batch (task.forward's output)."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.val: list[float] = []
            self.logits: list[torch.Tensor] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.losses.append(float(outputs["loss"]))

        def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
            if not trainer.sanity_checking:
                self.val.append(float(trainer.callback_metrics["val_loss"]))

        def on_predict_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            forward = pl_module.forward

            def recording(*args: Any, **kwargs: Any) -> Any:
                out = forward(*args, **kwargs)
                self.logits.append(out.detach().cpu())
                return out

            pl_module.forward = recording

    return Record()


def _params(trainer: Any, task: Any) -> dict[str, torch.Tensor]:
    """Full parameters by global name: under pp each rank holds its stages' shard, so the names are merged."""
    from lightning_llm.testing import full_parameters

    params = full_parameters(task)
    if trainer.world_size > 1:
        shards: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(shards, params)
        params = {k: v for s in shards for k, v in s.items()}
    return params


def _save(out: Path, tag: str, result: dict[str, Any], tensors: dict[str, Any]) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(tensors, out / f"{tag}.pt")
        (out / f"{tag}.json").write_text(json.dumps(result))


def _fit_decoder(out: Path, strategy: Any, devices: int, *, tag: str) -> None:  # tag: its gradient record's name
    """10 steps of the debug decoder (AdamW, clipping 0.5, validation every 5 steps), validate again on the same
    Trainer; for 1F1B also a checkpoint round trip: save the shards, validate a fresh split model loaded from them."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig

    def make() -> tuple[Any, Any]:
        pl.seed_everything(1)
        task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-3, scheduler="constant"))
        dm = TextDataModule(block_size=32, batch_size=8, cache_dir=str(out / f"cache-{devices}"), generated_docs=100)
        return task, dm

    rec = _record_callback()
    task, dm = make()
    trainer = _trainer(out, strategy, devices, max_steps=STEPS, gradient_clip_val=0.5, limit_val_batches=2,
                       val_check_interval=5, num_sanity_val_steps=1, callbacks=[rec, *recorder_for(tag, "reference")])
    trainer.fit(task, dm)
    result: dict[str, Any] = {"losses": rec.losses, "val": rec.val}
    params = _params(trainer, task)
    # Validate on the same Trainer: under pp the model is already split, and must not be split again.
    (metrics,) = trainer.validate(task, dm, verbose=False)
    result["val_same_trainer"] = metrics["val_loss"]
    if devices > 1:
        result["step_stats"] = trainer.strategy.step_stats
        if tag == "1f1b":
            ckpt = out / "pp-ckpt"
            trainer.save_checkpoint(ckpt)
            task2, dm2 = make()
            t2 = _trainer(out, PipelineParallelStrategy(schedule="1f1b", n_microbatches=4), 2, limit_val_batches=2)
            (metrics,) = t2.validate(task2, dm2, ckpt_path=str(ckpt), verbose=False)
            result["val_after_load"] = metrics["val_loss"]
            result["ckpt_files"] = sorted(p.name for p in ckpt.iterdir())
    _save(out, tag, result, params)


def _fit_classifier(out: Path, data: Path, strategy: Any, devices: int, *, tag: str, predict: bool) -> None:
    """CLS_STEPS steps of the debug encoder's ClassificationTask (batch 8, AdamW, clipping 0.5), then optionally
    ``predict`` on the 24 test pairs (CLUE file + logits): on one device from the trained model, under pp from a
    fresh task loaded from the pipeline checkpoint (as ``lightning_llm predict --ckpt_path`` does)."""
    import lightning.pytorch as pl

    from lightning_llm.data import SentencePairDataModule
    from lightning_llm.tasks import ClassificationTask
    from lightning_llm.tasks.base import OptimConfig

    def make() -> tuple[Any, Any]:
        pl.seed_everything(1)
        task = ClassificationTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-3, scheduler="constant"),
                                  predict_output=str(out / f"{tag}-predictions.json"))
        return task, SentencePairDataModule(str(data), str(data / "tokenizer"), batch_size=8)

    rec = _record_callback()
    task, dm = make()
    trainer = _trainer(out, strategy, devices, max_steps=CLS_STEPS, gradient_clip_val=0.5, limit_val_batches=0,
                       callbacks=[rec, *recorder_for(tag, "cls_reference")])
    trainer.fit(task, dm)
    result: dict[str, Any] = {"losses": rec.losses}
    params = _params(trainer, task)
    if devices > 1:
        result["step_stats"] = trainer.strategy.step_stats
    preds = None
    if predict and devices == 1:
        preds = trainer.predict(task, dm)
    elif predict:
        ckpt = out / f"{tag}-ckpt"
        trainer.save_checkpoint(ckpt)
        task2, dm2 = make()
        rec = _record_callback()
        t2 = _trainer(out, PipelineParallelStrategy(schedule="1f1b", n_microbatches=4), 2, callbacks=[rec])
        preds = t2.predict(task2, dm2, ckpt_path=str(ckpt))
    _save(out, tag, result, {"params": params, "logits": rec.logits, "preds": preds})


def _worker(mode: str, out: Path, data: Path) -> None:
    times: dict[str, float] = {}

    def timed(case: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times[case] = round(time.perf_counter() - t0, 2)

    if mode == "reference":
        timed("reference", _fit_decoder, out, "auto", 1, tag="reference")
        timed("cls_reference", _fit_classifier, out, data, "auto", 1, tag="cls_reference", predict=True)
    else:
        for schedule, v, measure in PP_RUNS:
            strat = PipelineParallelStrategy(schedule=schedule, n_microbatches=4, stages_per_rank=v,
                                             measure_activations=measure)
            timed(schedule, _fit_decoder, out, strat, 2, tag=schedule)
        for tag, ac in CLS_RUNS:
            strat = PipelineParallelStrategy(schedule="1f1b", n_microbatches=4, activation_checkpointing=ac,
                                             measure_activations=True)
            timed(tag, _fit_classifier, out, data, strat, 2, tag=tag, predict=not ac)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / f"times-{mode}.json").write_text(json.dumps(times))


@pytest.fixture(scope="module")
def runs(pair_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both runs, once per module: the single-device reference in this process (no launch: it would only add
    interpreter start-up), then the pipeline runs in one torchrun launch (2 processes)."""
    out = tmp_path_factory.mktemp("pp")
    t0 = time.perf_counter()
    run_layouts_and_reference(__file__, out, lambda: _worker("reference", out, pair_data), args=(str(pair_data),))
    times = {m: json.loads((out / f"times-{m}.json").read_text()) for m in ("reference", "layouts")}
    print(f"\nwall time: reference (in-process), then the pp launch {time.perf_counter() - t0:.1f} s; "
          f"seconds per case {times}")
    return out


def _load(out: Path, tag: str) -> tuple[dict[str, Any], Any]:
    return json.loads((out / f"{tag}.json").read_text()), torch.load(out / f"{tag}.pt")


def _max_err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _param_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(ref)
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
def test_schedules_match_single_device(runs: Path) -> None:
    """10 steps of the debug decoder (fp32, AdamW, grad clipping 0.5, validation every 5 steps, then
    ``trainer.validate()`` on the same Trainer): GPipe, 1F1B and interleaved 1F1B (2 virtual stages per rank) on
    2 processes equal one device within 1e-5 in every step's loss, the final parameters and the validation losses;
    1F1B's checkpoint shards load back into a fresh split model."""
    ref, ref_params = _load(runs, "reference")
    assert len(ref["losses"]) == STEPS and ref["losses"][0] != ref["losses"][-1]
    for schedule, _, measure in PP_RUNS:
        got, params = _load(runs, schedule)
        loss_err, param_err = _max_err(got["losses"], ref["losses"]), _param_err(params, ref_params)
        assert len(got["val"]) == len(ref["val"]) == 3  # after steps 5 and 10, then trainer.validate()
        val_err = _max_err(got["val"], ref["val"])
        print(f"{schedule}: max |loss err| {loss_err:.2e}  max |param err| {param_err:.2e}  "
              f"max |val_loss err| {val_err:.2e}  losses {[round(x, 5) for x in got['losses']]}; "
              f"{gradient_summary(runs, schedule)}")
        assert loss_err <= TOL and param_err <= TOL and val_err <= TOL
        stats = got["step_stats"]
        assert len(stats) == STEPS and all(0.0 <= f < 1.0 for s in stats for f in s["idle_frac"])
        if measure:  # peak live activations in micro-batches, per pipeline rank (steps after the first)
            peak = [max(s["peak_act_bytes"][r] / s["act_bytes_per_mb"][r] for s in stats[1:]) for r in range(2)]
            print(f"{schedule}: peak live activations per rank = {[round(p, 2) for p in peak]} micro-batches (m=4)")
            if schedule == "gpipe":
                assert all(p >= 3.5 for p in peak)  # all m=4 micro-batches alive at the end of the forwards
            else:
                assert peak[0] <= 2.5 and peak[1] <= 1.5  # 1F1B: stage r holds at most p - r micro-batches
    got = json.loads((runs / "1f1b.json").read_text())
    print(f"val_loss after loading the 1f1b checkpoint {got['val_after_load']:.6f} vs reference "
          f"{ref['val_same_trainer']:.6f}; files {got['ckpt_files']}")
    # The engine's layout-free format: one DCP shard file per rank that wrote tensors, plus the metadata.
    assert got["ckpt_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert abs(got["val_after_load"] - ref["val_same_trainer"]) <= TOL


@pytest.mark.multiprocess
def test_classification_matches_single_device(runs: Path) -> None:
    """ClassificationTask (debug encoder, 2 blocks -> 1 per rank, batch 8 = 4 micro-batches of 2) under pp=2 with
    1F1B: per-step losses on both ranks and the final parameters equal one device within 1e-5."""
    ref, ref_t = _load(runs, "cls_reference")
    got, got_t = _load(runs, "cls")
    assert len(ref["losses"]) == CLS_STEPS and ref["losses"][0] != ref["losses"][-1]
    loss_err, param_err = _max_err(got["losses"], ref["losses"]), _param_err(got_t["params"], ref_t["params"])
    print(f"classification pp=2 1f1b: max |loss err| {loss_err:.2e}  max |param err| {param_err:.2e}  "
          f"losses {[round(x, 5) for x in got['losses']]}; {gradient_summary(runs, 'cls')}; with activation "
          f"checkpointing: {gradient_summary(runs, 'cls_ac')}")
    assert loss_err <= TOL and param_err <= TOL
    assert [s["loss"] for s in got["step_stats"]] == pytest.approx(got["losses"], abs=1e-6)  # what every rank logged


@pytest.mark.multiprocess
def test_activation_checkpointing_same_losses(runs: Path) -> None:
    """activation_checkpointing=True: the same losses and parameters as without, and fewer saved activation bytes
    per micro-batch on every rank (so the blocks really were recomputed)."""
    plain, plain_t = _load(runs, "cls")
    ac, ac_t = _load(runs, "cls_ac")
    loss_err, param_err = _max_err(ac["losses"], plain["losses"]), _param_err(ac_t["params"], plain_t["params"])
    per_mb = {tag: [max(s["act_bytes_per_mb"][r] for s in run["step_stats"]) for r in range(2)]
              for tag, run in (("plain", plain), ("ac", ac))}
    print(f"activation checkpointing vs none: max |loss err| {loss_err:.2e}  max |param err| {param_err:.2e}; "
          f"saved activation bytes per micro-batch per rank: none {per_mb['plain']}, checkpointed {per_mb['ac']}")
    assert loss_err <= 1e-6 and param_err <= 1e-6
    assert all(a < 0.8 * p for a, p in zip(per_mb["ac"], per_mb["plain"], strict=True))


@pytest.mark.multiprocess
def test_predict_matches_single_device(runs: Path) -> None:
    """predict under pp (forward-only schedule, model loaded from the pipeline checkpoint) returns and writes the
    same predictions (CLUE file) as one device, and the logits of every batch agree within 1e-5."""
    _, ref_t = _load(runs, "cls_reference")
    _, got_t = _load(runs, "cls")
    ref_logits, got_logits = torch.cat(ref_t["logits"]), torch.cat(got_t["logits"])
    assert ref_logits.shape == got_logits.shape == (24, 2)
    got_preds = torch.cat(got_t["preds"])  # what trainer.predict returned (predict_step: argmax of the logits)
    assert torch.equal(got_preds, got_logits.argmax(-1)) and torch.equal(got_preds, torch.cat(ref_t["preds"]))
    err = (ref_logits - got_logits).abs().max().item()
    ref_lines = (runs / "cls_reference-predictions.json").read_text().splitlines()
    got_lines = (runs / "cls-predictions.json").read_text().splitlines()
    print(f"predict pp=2 vs one device: max |logit err| {err:.2e}; {len(got_lines)} predictions, "
          f"{sum(a == b for a, b in zip(got_lines, ref_lines))} identical")
    assert err <= TOL
    assert len(ref_lines) == 24 and got_lines == ref_lines


def test_split_views_compose_to_full_model() -> None:
    """Stage views run in sequence reproduce the full model; pruning keeps only the local shard, with global names."""
    torch.manual_seed(0)
    model = build_model("debug", family="decoder")
    ids = torch.randint(0, 256, (2, 16))
    full = model(ids)
    layers = split_layers(model, 4)
    assert layers == [("0",), ("1",), ("2",), ("3",)]
    owners = stage_ranks(2, 2)
    assert owners == [0, 1, 0, 1] and stage_ranks(2, 2, style="v") == [0, 1, 1, 0]
    x = ids
    for s in range(4):
        (spec,) = [sp for sp in stage_specs(layers, owners[s], owners) if sp.index == s]
        x = stage_module(model, spec)(x)
    err = (x - full).abs().max().item()
    print(f"composed stages vs full model: max abs err {err:.2e}")
    assert err == 0.0
    prune_model(model, stage_specs(layers, 1, owners))  # rank 1: stages 1 and 3 (last)
    names = {n.split(".")[0] + ("." + n.split(".")[1] if n.startswith("layers") else "") for n, _ in
             model.named_parameters()}
    assert names == {"layers.1", "layers.3", "norm", "lm_head"}


def test_split_balance_and_points() -> None:
    model = build_model("debug", family="decoder", num_layers=6)
    assert split_layers(model, 4) == [("0", "1"), ("2", "3"), ("4",), ("5",)]
    assert split_layers(model, 2, split_points=[4]) == [("0", "1", "2", "3"), ("4", "5")]
    # by parameters the encoder's 21128 x 64 embedding weighs on the first stage: it gets fewer blocks
    enc6 = build_model("debug", family="encoder", num_layers=6, num_labels=2)
    assert split_layers(enc6, 2) == [("0", "1", "2"), ("3", "4", "5")]
    assert split_layers(enc6, 2, balance="params") == [("0",), ("1", "2", "3", "4", "5")]
    enc = build_model("debug", family="encoder", num_labels=2)
    assert split_layers(enc, 2) == [("0",), ("1",)]


def test_configuration_errors() -> None:
    model = build_model("debug", family="decoder")
    with pytest.raises(ValueError, match="5 stages, but the model has only 4 layers"):
        split_layers(model, 5)
    with pytest.raises(ValueError, match="split_points"):
        split_layers(model, 2, split_points=[0])
    with pytest.raises(ValueError, match="schedule="):
        PipelineParallelStrategy(schedule="pipedream")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stages_per_rank=2: must be 1"):
        PipelineParallelStrategy(schedule="1f1b", stages_per_rank=2)
    from lightning.pytorch.trainer.states import TrainerFn

    strat = PipelineParallelStrategy(n_microbatches=4)
    fake = SimpleNamespace(datamodule=SimpleNamespace(batch_size=6), state=SimpleNamespace(fn=TrainerFn.FITTING))
    with pytest.raises(ValueError, match="batch_size=6 is not divisible by n_microbatches=4"):
        strat.args.check_batch_size(fake)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="bubble"):
        PipelineParallelStrategy(schedule="gpipe", n_microbatches=1).args.check_pipeline(ParallelDims(dp=1, pp=2))
    with pytest.raises(ValueError, match="n_microbatches=1"), pytest.warns(UserWarning):
        PipelineParallelStrategy(schedule="1f1b", n_microbatches=1).args.check_pipeline(ParallelDims(dp=1, pp=2))


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
