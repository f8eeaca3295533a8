"""ZeRO stages 1/2/3 (native and DeepSpeed engines): parity with one device (every parameter's first-step gradient,
read from each engine's shards and partitions, and the loss curve), model-state bytes against theory, checkpoint
save/resume, LoRA adapter export under stage 3.

Start-up is what is slow (Lightning, DeepSpeed, process groups), so the module makes ONE torchrun launch of this file
(``python -m torch.distributed.run --nproc_per_node=2 tests/parallel/test_zero.py layouts DIR``) that runs every fresh
Trainer in sequence: the native and DeepSpeed ZeRO variants, their resumes and the LoRA fits, all on the same global
batches (2 ranks x batch 4), after the one-device references (batch 8) ran in the pytest process
(``testing.run_layouts_and_reference``, which compares the first-step gradients per tensor).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
STEPS = 6  # two epochs of 3 steps: the resume test stops at an epoch boundary (no mid-epoch sampler replay)
HALF = STEPS // 2
BATCH = 4  # per rank
BLOCK = 32
VOCAB = 264  # byte tokenizer (259 ids) padded to a multiple of 8
LORA_IDS: Any = None  # fixed input for the LoRA logits (set in the worker)
LORA_RUNS = (("native", 3, "native"), ("deepspeed", 3, "deepspeed"), ("native-zero1", 1, "native"))
"""(label, stage, engine) of the LoRA export fits."""


def _lora_ids() -> Any:
    import torch

    return (torch.arange(2 * BLOCK).remainder(250) + 3).view(2, BLOCK)


# ---------------------------------------------------------------------------------------------------- worker side
def _lora_task_class() -> type:
    from peft import LoraConfig, inject_adapter_in_model

    from lightning_llm.tasks import CausalLMTask

    class LoRACausalLM(CausalLMTask):
        """Test-only: the debug decoder with a peft LoRA adapter on q_proj/v_proj; base weights frozen."""

        def build_model(self) -> Any:
            model = super().build_model()
            cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            model = inject_adapter_in_model(cfg, model)
            for n, p in model.named_parameters():
                p.requires_grad = "lora_" in n
            return model

    return LoRACausalLM


def _fit(strategy: Any, out: Path, *, task_cls: type | None = None, max_steps: int = STEPS, save_at: int | None = None,
         ckpt_in: Path | None = None, measure_step: int | None = 2,
         export: Path | None = None, devices: int = 2, grads: str | None = None,
         reference: str | None = None) -> dict[str, Any]:
    """One fresh Trainer on ``devices`` ranks (batch 8 / devices); returns mean-over-ranks losses per step and each
    rank's model-state bytes. ``export``: a directory for the consolidated adapter/full weights and the logits of the
    trained model. The first step's gradients are recorded as ``grads``, against the one-device run ``reference``."""
    import lightning.pytorch as pl
    import torch

    from lightning_llm.data import TextDataModule
    from lightning_llm.strategies.zero import ExportWeights
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import StepRecorder, recorder_for

    class Meter(pl.Callback):
        """Model-state bytes of this rank from live tensors, after backward of step ``measure_step`` (optimizer
        states exist from the first step on; gradients are reduced/partitioned by then)."""

        def __init__(self) -> None:
            self.bytes: dict[str, int] | None = None

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
            if measure_step is not None and trainer.global_step == measure_step:
                self.bytes = _measure(trainer, pl_module)

    pl.seed_everything(1, verbose=False)
    task = (task_cls or CausalLMTask)(backbone="debug", dropout=0.0,
                                      optim=OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.01))
    data = TextDataModule(block_size=BLOCK, batch_size=BATCH * 2 // devices, cache_dir=str(out.parent / "cache"),
                          generated_docs=120)
    meter, rec = Meter(), StepRecorder(str(out / "steps.json"))
    class Logits(pl.Callback):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            with torch.no_grad():  # a collective forward under stage 3 (parameters are gathered)
                logits = pl_module.model(LORA_IDS.clone())
            if trainer.is_global_zero:
                torch.save(logits, export / "logits.pt")

    callbacks: list[pl.Callback] = [meter, rec, *recorder_for(grads, reference)]
    if save_at is not None:  # the strategy's sharded checkpoint (a directory) after step `save_at`
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=str(out / "ckpt"), filename="s{step}", auto_insert_metric_name=False,
                                         every_n_train_steps=save_at, save_top_k=-1))
    if export is not None:
        callbacks += [ExportWeights(str(export / "adapter.pt"), adapter_only=True),
                      ExportWeights(str(export / "full.pt")), Logits()]
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                         enable_checkpointing=save_at is not None, enable_progress_bar=False, enable_model_summary=False,
                         limit_train_batches=HALF, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
                         precision="32-true", default_root_dir=str(out))
    trainer.fit(task, datamodule=data, ckpt_path=str(ckpt_in) if ckpt_in else None)
    ranks = json.loads((out / "steps.json").read_text())["losses"] if trainer.is_global_zero else None
    losses = [sum(x) / len(x) for x in zip(*ranks)] if ranks else None  # each rank: mean over its 4 samples
    n_params = sum(p.numel() for p in task.model.parameters()) if devices == 1 else None  # whole on one device
    all_bytes = [meter.bytes]
    if devices > 1:
        all_bytes = [None] * devices
        torch.distributed.all_gather_object(all_bytes, meter.bytes)
    return {"losses": losses, "bytes": all_bytes, "numel": n_params}


def _measure(trainer: Any, pl_module: Any) -> dict[str, int]:
    from lightning_llm.strategies.zero.native import model_state_bytes

    if hasattr(trainer.strategy, "deepspeed_engine"):
        from lightning_llm.strategies.zero.deepspeed import deepspeed_model_state_bytes

        return deepspeed_model_state_bytes(trainer.strategy.deepspeed_engine)
    return model_state_bytes(pl_module, trainer.optimizers)


ENGINES = {"native": ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"],
           "deepspeed": ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"]}
"""engine -> its layouts (registered names), in the order they run."""


def reference(out: Path) -> None:
    """The one-device runs the layouts are compared with: the decoder (``one``) and its LoRA (``lora``)."""
    results = {"one": _fit("auto", out / "one", devices=1, grads="one"),
               "lora": _fit("auto", out / "lora-one", devices=1, task_cls=_lora_task_class(), max_steps=4,
                            measure_step=None, grads="lora")}
    (out / "reference.json").write_text(json.dumps(results, indent=1))


def worker(out: Path) -> None:
    import torch

    global LORA_IDS
    import lightning_llm.strategies  # noqa: F401 - registers zero*/deepspeed_zero* names
    from lightning_llm.strategies import ZeroStrategy

    results: dict[str, Any] = {}
    for engine, names in ENGINES.items():
        for name in names:  # stages 2 and 3 also save a sharded checkpoint after step HALF
            results[name] = _fit(name, out / name, save_at=HALF if name[-1] in "23" else None, grads=name,
                                 reference="one")
        # Resume each checkpoint in a fresh Trainer: steps HALF+1..STEPS must equal the uninterrupted run's.
        for stage in (2, 3):
            ck = out / (names[stage - 1]) / "ckpt" / f"s{HALF}.ckpt"
            key = f"{engine}/resume{stage}"
            results[key] = _fit(ZeroStrategy(stage=stage, engine=engine), out / f"{engine}-resume-{stage}",
                                ckpt_in=ck, measure_step=None)
            results[key]["ckpt_files"] = sorted(str(p.relative_to(ck)) for p in ck.rglob("*") if p.is_file())
    LORA_IDS = _lora_ids()
    task_cls = _lora_task_class()
    for label, stage, engine in LORA_RUNS:
        results[f"lora-{label}"] = _fit(ZeroStrategy(stage=stage, engine=engine), out / f"lora-{label}",
                                        task_cls=task_cls, max_steps=4, export=out / f"export-{label}",
                                        measure_step=None, grads=f"lora-{label}", reference="lora")
    if torch.distributed.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))


# ---------------------------------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The one-device references, then the one launch; (its folder, the layouts' results with the references as
    ``one`` and ``lora``)."""
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("zero")
    run_layouts_and_reference(HERE, out, lambda: reference(out), timeout=900)
    refs = json.loads((out / "reference.json").read_text())
    return out, {**json.loads((out / "results.json").read_text()), **refs}


def _cli_estimate(strategy: str) -> dict[str, Any]:
    """``lightning_llm estimate --json`` for the named debug decoder (vocab 256, so ~0.6% fewer parameters than the
    trained model whose vocabulary is padded to 264)."""
    import contextlib
    import io

    from lightning_llm.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["estimate", "--model=debug", "--devices=2", f"--strategy={strategy}", "--precision=32-true",
                     "--seq-len=32", "--json"]) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def _check_estimate(res: dict[str, Any], names: list[str]) -> None:
    for name in names:
        est = _cli_estimate(name)["bytes"]["model_states"]
        for rank, measured in enumerate(res[name]["bytes"]):
            rel = est / sum(measured.values()) - 1
            print(f"estimate {name}: {est:,} B vs measured rank{rank} {sum(measured.values()):,} B ({rel:+.2%})")
            assert abs(rel) <= 0.10


def _check_parity(out: Path, res: dict[str, Any], names: list[str], tol: float = 1e-5) -> None:
    from lightning_llm.testing import gradient_summary

    ref = res["one"]["losses"]
    assert len(ref) == STEPS and ref[0] != ref[-1]
    for name in names:
        got = res[name]["losses"]
        err = max(abs(a - b) for a, b in zip(ref, got))
        print(f"{name:26s} max|loss - one device| over {len(got)} steps = {err:.2e}; {gradient_summary(out, name)}")
        assert len(got) == STEPS and err <= tol, (name, ref, got)


def _check_resume(res: dict[str, Any], stage: int, name: str, engine: str) -> None:
    resumed = res[f"{engine}/resume{stage}"]
    ref, got = res[name]["losses"][HALF:], resumed["losses"]
    err = max(abs(a - b) for a, b in zip(ref, got))
    print(f"resume stage {stage}: steps {HALF + 1}-{STEPS} after reload vs uninterrupted: max err {err:.2e}; "
          f"files {resumed['ckpt_files'][:6]}")
    assert len(got) == STEPS - HALF and err <= 1e-5


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(stage=4), "stage=4"),
    (dict(stage=2, offload_params=True), "offload_params=True needs stage=3"),
    (dict(stage=3, offload_optimizer=True), "offload_optimizer and offload_params must be equal"),
    (dict(engine="megatron"), "engine='megatron'"),
    (dict(stage=2, optimizer="adamw"), "need engine='deepspeed'"),
    (dict(stage=2, engine="deepspeed", optimizer="onebitadam"), "no longer ships 1-bit Adam"),
    (dict(stage=2, engine="deepspeed", optimizer="lamb"), "CUDA kernel"),
    (dict(stage=2, engine="deepspeed", optimizer="sgd"), "optimizer='sgd'"),
])
def test_bad_configuration_is_rejected_with_the_parameter_named(kwargs: dict[str, Any], message: str) -> None:
    from lightning_llm.strategies import ZeroStrategy

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("=", "=")):
        ZeroStrategy(**kwargs)


def test_presets_are_registered_and_dispatch_to_engines() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llm.strategies  # noqa: F401
    from lightning_llm.strategies import DeepSpeedZeroStrategy, ZeroStrategy

    for name in ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "deepspeed_zero1", "deepspeed_zero2",
                 "deepspeed_zero3", "deepspeed_zero3_offload"):
        assert name in StrategyRegistry
    s = StrategyRegistry.get("zero3_offload")
    assert isinstance(s, ZeroStrategy) and s.stage == 3 and s.offload_params
    d = ZeroStrategy(stage=3, engine="deepspeed", offload_optimizer=True, offload_params=True)
    assert isinstance(d, DeepSpeedZeroStrategy)
    zero = d.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]
    merged = ZeroStrategy(stage=1, engine="deepspeed", config={"zero_optimization": {"reduce_bucket_size": 7}})
    assert merged.config["zero_optimization"] == {**merged.config["zero_optimization"], "stage": 1,
                                                  "reduce_bucket_size": 7}


@pytest.mark.multiprocess
def test_native_zero_matches_one_device_and_memory_theory(runs: tuple[Path, dict[str, Any]]) -> None:
    out, res = runs
    _check_parity(out, res, ENGINES["native"])
    numel = res["one"]["numel"]
    from lightning_llm.memory import model_state_theory

    for stage in (1, 2, 3):
        theory = model_state_theory(numel=numel, stage=stage, dp=2, precision="32-true", engine="native")
        for rank, measured in enumerate(res[f"zero{stage}"]["bytes"]):
            rel = {k: (measured[k] - theory[k]) / theory[k] for k in theory}
            total = sum(measured.values()) / sum(theory.values()) - 1
            print(f"zero{stage} rank{rank}: measured {measured} theory {theory} total rel.err {total:+.2%}")
            assert abs(total) <= 0.05
            assert all(abs(r) <= 0.05 for r in rel.values()), rel
    _check_estimate(res, ["zero1", "zero2", "zero3"])
    _check_resume(res, 2, "zero2", "native")
    _check_resume(res, 3, "zero3", "native")


@pytest.mark.multiprocess
def test_deepspeed_zero_matches_one_device(runs: tuple[Path, dict[str, Any]]) -> None:
    out, res = runs
    _check_parity(out, res, ENGINES["deepspeed"])
    numel = res["one"]["numel"]
    from lightning_llm.memory import model_state_theory

    for stage in (1, 2, 3):
        theory = model_state_theory(numel=numel, stage=stage, dp=2, precision="32-true", engine="deepspeed")
        for rank, measured in enumerate(res[f"deepspeed_zero{stage}"]["bytes"]):
            total = sum(measured.values()) / sum(theory.values()) - 1
            print(f"deepspeed_zero{stage} rank{rank}: measured {measured} theory {theory} total rel.err {total:+.2%}")
            assert abs(total) <= 0.05
    _check_estimate(res, ["deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"])
    _check_resume(res, 2, "deepspeed_zero2", "deepspeed")
    _check_resume(res, 3, "deepspeed_zero3", "deepspeed")


@pytest.mark.multiprocess
def test_lora_adapter_saved_under_zero_is_full_and_reproduces_outputs(runs: tuple[Path, dict[str, Any]]) -> None:
    """peft LoRA (q_proj, v_proj) on the debug decoder, 4 steps of ZeRO-3 (native FSDP2 and DeepSpeed) and of native
    ZeRO-1 (whose trainable parameters are packed into its broadcast buckets): the LoRA factors' first-step gradients
    equal one device's, the exported adapter holds full tensors and nothing else, and base weights + adapter in a
    fresh model reproduce the trained model's logits."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from lightning_llm.models import build_model
    from lightning_llm.testing import gradient_summary

    tmp_path = runs[0]
    for engine, _, _ in LORA_RUNS:
        print(f"lora-{engine}: {gradient_summary(tmp_path, f'lora-{engine}')}")
        d = tmp_path / f"export-{engine}"
        adapter, full, logits = (torch.load(d / f) for f in ("adapter.pt", "full.pt", "logits.pt"))
        fresh = build_model("debug", family="decoder", vocab_size=VOCAB, dropout=0.0)
        fresh = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), fresh)
        shapes = {k: tuple(v.shape) for k, v in fresh.state_dict().items() if "lora_" in k}
        got = {k: tuple(v.shape) for k, v in adapter.items()}
        assert got == shapes, f"{engine}: adapter is not the full set of full-size LoRA tensors: {got} vs {shapes}"
        moved = max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k)  # lora_B starts at zero
        base = {k: v for k, v in full.items() if "lora_" not in k}  # the (frozen) pretrained weights
        fresh.load_state_dict({**base, **adapter}, strict=True)
        with torch.no_grad():
            out = fresh(_lora_ids())
        err = (out - logits).abs().max().item()
        print(f"{engine}: {len(adapter)} adapter tensors, max|lora_B| = {moved:.3e}, "
              f"max|fresh+adapter logits - trained logits| = {err:.2e}")
        # torch.save keeps shared storages: a tensor saved as a view of a packed ZeRO bucket loads as one
        shared = [k for k, v in adapter.items() if v.untyped_storage().nbytes() != v.nbytes]
        print(f"{engine}: adapter.pt {(d / 'adapter.pt').stat().st_size:,} bytes; tensors saved as views: {shared}")
        assert moved > 0 and err <= 1e-5
        assert not shared


@pytest.mark.multiprocess
def test_zero3_checkpoints_evaluate_and_predict_like_their_consolidated_weights(pair_data: Path,
                                                                               tmp_path: Path) -> None:
    """validate / predict from a stage-3 checkpoint (native DCP and DeepSpeed directories) on 2 processes equal the
    same commands on one device with the consolidated weights: val_loss within 1e-6, identical predictions."""
    import csv

    import torch

    from lightning_llm.cli import main
    from lightning_llm.export import read_checkpoint
    from lightning_llm.testing import run_cli

    def args(sub: str, out: Path, *extra: str) -> list[str]:
        return [sub, "--seed_everything=1", "--model=lightning_llm.tasks.ClassificationTask", "--model.backbone=debug",
                f"--model.predict_output={out / 'pred.json'}", "--data=lightning_llm.data.SentencePairDataModule",
                f"--data.data_dir={pair_data}", f"--data.tokenizer_dir={pair_data / 'tokenizer'}",
                "--data.batch_size=4", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={out}", "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={out}",
                *extra]

    def evaluate(out: Path, *extra: str, nproc: int) -> tuple[float, list[str]]:
        """``validate`` then ``predict`` (one device: in this process, which saves the start-up): (val_loss, lines)."""
        for sub in ("validate", "predict"):
            if nproc > 1:
                run_cli(args(sub, out, *extra), nproc=nproc)
            else:
                assert main(args(sub, out, *extra)) == 0
        rows = list(csv.DictReader(next(out.rglob("metrics.csv")).open()))
        loss = float(next(r["val_loss"] for r in rows if r.get("val_loss")))
        return loss, (out / "pred.json").read_text().splitlines()

    two = ["--trainer.devices=2"]
    for strategy in ("zero3", "deepspeed_zero3"):
        run_cli(args("fit", tmp_path / strategy, *two, f"--trainer.strategy={strategy}", "--trainer.max_steps=4",
                     "--trainer.limit_val_batches=0"), nproc=2)
        ckpt = next((tmp_path / strategy).rglob("*.ckpt"))
        full = tmp_path / f"{strategy}-full.ckpt"
        torch.save(read_checkpoint(ckpt), full)
        res = {"2": evaluate(tmp_path / f"{strategy}-eval2", *two, f"--trainer.strategy={strategy}",
                             f"--ckpt_path={ckpt}", nproc=2),
               "1": evaluate(tmp_path / f"{strategy}-eval1", "--trainer.devices=1", f"--ckpt_path={full}", nproc=1)}
        err = abs(res["2"][0] - res["1"][0])
        print(f"{strategy}: val_loss 2 procs {res['2'][0]:.6f} vs 1 device (consolidated) {res['1'][0]:.6f}, "
              f"|err| {err:.1e}; predictions identical {res['2'][1] == res['1'][1]} ({len(res['1'][1])} lines)")
        assert err <= 1e-6 and len(res["1"][1]) == 24 and res["2"][1] == res["1"][1]


@pytest.mark.multiprocess
def test_deepspeed_config_optimizer_section_trains(tmp_path: Path) -> None:
    """A user DeepSpeed JSON with its own "optimizer" section: Lightning passes optimizer=None, DeepSpeed builds it
    from the trainable parameters we hand over, and the loss goes down."""
    from lightning_llm.testing import run_cli

    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 0.003}}}))
    out = tmp_path / "run"
    run_cli(["fit", "--config", str(HERE.parents[2] / "configs" / "pretrain_debug.yaml"), "--trainer.devices=2",
             "--trainer.strategy=lightning_llm.strategies.ZeroStrategy", "--trainer.strategy.engine=deepspeed",
             "--trainer.strategy.stage=2", f"--trainer.strategy.config={cfg}", "--trainer.max_steps=4",
             "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
             "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={out}",
             f"--data.cache_dir={out / 'cache'}", "--trainer.callbacks+=lightning_llm.testing.StepRecorder",
             f"--trainer.callbacks.output={out / 'steps.json'}"], nproc=2, cwd=tmp_path)
    losses = json.loads((out / "steps.json").read_text())["losses"]
    print(f"DeepSpeed config optimizer: per-rank losses {losses}")
    assert all(len(r) == 4 and r[-1] < r[0] - 0.1 for r in losses)

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import logging
    import warnings

    from lightning_llm.testing import run_worker

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    run_worker(worker, Path(sys.argv[2]))
