"""TensorParallelStrategy: parity with one device (decoder/encoder, with and without sequence parallel, with LoRA),
vocab-parallel loss, communication counts per block, sharded checkpoints, configuration errors.

All 2-process work happens in ONE torchrun launch of this file (``python tests/parallel/test_tensor_parallel.py layouts
OUT``), which runs every configuration and writes ``results.json`` + parameter files; the single-device references
are computed before it in the pytest process with the same Lightning loop (``testing.run_layouts_and_reference``,
which also compares every parameter's first-step gradient per tensor).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from lightning_llm.data.base import LLMDataModule
from lightning_llm.tasks.base import OptimConfig
from lightning_llm.tasks.causal_lm import CausalLMTask
from lightning_llm.tasks.classification import ClassificationTask

STEPS = 10
TOL = 1e-5
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (family, lora); the TP runs use each with and without sequence parallel
MODELS = {"decoder": ("decoder", False), "encoder": ("encoder", False), "decoder_lora": ("decoder", True)}
TP_RUNS = [(m, sp) for m in MODELS for sp in (False, True)]


# ---------------------------------------------------------------------------------------------------- tiny data/tasks
class _Random(Dataset):
    """Seeded random samples: token blocks for the decoder, (tokens, label) for the encoder."""

    def __init__(self, family: str, n: int = 64, seq: int = 16, vocab: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.family = family
        self.ids = torch.randint(1, vocab, (n, seq + 1), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.family == "decoder":
            return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}
        return {"input_ids": self.ids[i, :-1], "attention_mask": torch.ones(self.ids.shape[1] - 1, dtype=torch.long),
                "labels": self.labels[i]}


class RandomDataModule(LLMDataModule):
    def __init__(self, family: str, batch_size: int = 4, n: int = 64) -> None:
        super().__init__(batch_size=batch_size, seed=0)
        self.family = family
        self.n = n

    def train_dataloader(self) -> Any:
        return self.make_loader(_Random(self.family, n=self.n), train=True)


class LoraCausalLM(CausalLMTask):
    """Test-only: the debug decoder with PEFT LoRA adapters on every projection (base weights frozen)."""

    def build_model(self) -> torch.nn.Module:
        from peft import LoraConfig, inject_adapter_in_model

        model = super().build_model()
        return inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS),
                                       model)


def make_task(name: str) -> Any:
    family, lora = MODELS[name]
    # eps=1e-6: with Adam's 1e-8, fp32 reduction-order noise in gradients near 1e-8 becomes +-lr steps (2.9e-5 on a
    # parameter after 10 steps here), which says nothing about the layout.
    optim = OptimConfig(lr=1e-3, warmup_steps=0, scheduler="constant", eps=1e-6)
    if family == "encoder":
        return ClassificationTask("debug", num_labels=2, dropout=0.0, optim=optim)
    return (LoraCausalLM if lora else CausalLMTask)("debug", dropout=0.0, optim=optim)


def fit(name: str, *, strategy: Any = "auto", devices: int = 1, steps: int = STEPS, ckpt_path: str | None = None,
        callbacks: list | None = None, root: str | None = None, n: int = 64,
        grads: str | None = None) -> tuple[Any, Any]:
    """``steps`` steps of the model ``name``; the first step's gradients recorded as ``grads`` (against the one-device
    ``name``)."""
    import lightning.pytorch as pl

    from lightning_llm.testing import StepRecorder, recorder_for

    pl.seed_everything(1, verbose=False)
    task = make_task(name)
    recorder = StepRecorder(os.devnull)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder, *recorder_for(grads, name), *(callbacks or [])], default_root_dir=root)
    trainer.fit(task, datamodule=RandomDataModule(MODELS[name][0], n=n), ckpt_path=ckpt_path)
    return trainer, recorder


def _full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from lightning_llm.testing import full_parameters

    return full_parameters(module)


# ---------------------------------------------------------------------------------------------------- 2-process worker
def _comm_counts(out: dict[str, Any]) -> None:
    """Collectives of one transformer block (forward, then backward), counted with CommDebugMode.

    The block is called directly with its residual-stream input in the layout the plan gives it (replicated
    [B, S, H], or a DTensor sharded on S with sequence parallel).
    """
    from peft import LoraConfig, inject_adapter_in_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_llm.models import build_model
    from lightning_llm.strategies.tensor.plans import tp_plan

    mesh = init_device_mesh("cpu", (2,))
    for sp in (False, True):
        for lora in (False, True):
            torch.manual_seed(0)
            model = build_model("debug", family="decoder")
            if lora:
                model = inject_adapter_in_model(LoraConfig(r=4, target_modules=LORA_TARGETS), model)
            parallelize_module(model, mesh, tp_plan(model, sequence_parallel=sp, loss_parallel=True))
            block = model.layers["1"]
            x = torch.randn(2, 8, 64)
            x = distribute_tensor(x, mesh, [Shard(1)]) if sp else x
            x.requires_grad_()
            rope = (model.rope_cos[:8].expand(2, 8, -1), model.rope_sin[:8].expand(2, 8, -1))
            counts = {}
            with CommDebugMode() as comm:
                # = block(x) for a pre-norm block with dropout 0. Spelled out because CommDebugMode's module tracker
                # fails on a module called twice in one forward (the block's shared residual dropout).
                h = x + block.self_attn(block.attn_norm(x), rope=rope, is_causal=True)
                y = h + block.mlp(block.mlp_norm(h))
            counts["forward"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            with CommDebugMode() as comm:
                (y.to_local() if isinstance(y, DTensor) else y).pow(2).sum().backward()
            counts["backward"] = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            out[f"comm_sp{int(sp)}_lora{int(lora)}"] = {"block": counts}


def _vocab_parallel_loss(out: dict[str, Any]) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_llm.kernels import vocab_parallel_cross_entropy

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 16, 264, generator=g)  # [B, S, V], V = 264 as the padded byte vocabulary
    target = torch.randint(0, 264, (4, 16), generator=g)
    target[0, :5] = -100
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()
    shard = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(shard.flatten(0, 1), target.flatten(), ignore_index=-100)
        loss.backward()
    local = logits.chunk(2, dim=-1)[mesh.get_local_rank()]
    kern = vocab_parallel_cross_entropy(local, target, group=mesh.get_group())
    out["vocab_loss"] = {
        "loss_err": abs(float(loss.full_tensor()) - float(ref)),
        "grad_err": float((shard.grad.full_tensor() - full.grad).abs().max()),
        "kernel_loss_err": abs(float(kern) - float(ref)),
    }


def _optim_state(trainer: Any) -> dict[str, torch.Tensor]:
    state = trainer.optimizers[0].state_dict()["state"]
    return {f"{k}.{n}": (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
            for k, v in state.items() for n, t in v.items()}


def _checkpoint_roundtrip(out_dir: Path, out: dict[str, Any]) -> None:
    """5 steps, sharded save, resume in a fresh Trainer: parameters and AdamW state restored exactly."""
    import lightning.pytorch as pl

    from lightning_llm.strategies import TensorParallelStrategy

    class StopAt(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step >= 5:
                trainer.should_stop = True

    class Restored(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            p, o = _full_params(pl_module), _optim_state(trainer)
            out["restore_param_err"] = max(float((p[k] - saved_params[k]).abs().max()) for k in saved_params)
            out["restore_optim_err"] = max(float((o[k] - saved_optim[k]).abs().max()) for k in saved_optim)
            out["restore_n"] = [len(p), len(o), trainer.global_step]

    ckpt_dir = out_dir / "sharded.ckpt"
    trainer, _ = fit("decoder", strategy=TensorParallelStrategy(), devices=2, n=20, callbacks=[StopAt()],
                     root=str(out_dir))
    trainer.save_checkpoint(ckpt_dir)
    saved_params, saved_optim = _full_params(trainer.lightning_module), _optim_state(trainer)
    full = trainer.strategy.full_state_dict()  # consolidated, rank 0 only
    trainer2, rec2 = fit("decoder", strategy=TensorParallelStrategy(), devices=2, n=20, ckpt_path=str(ckpt_dir),
                         root=str(out_dir), callbacks=[Restored()])
    if torch.distributed.get_rank() == 0:
        torch.save(full, out_dir / "full_after5.pt")
        out["resumed_losses"] = [rec2.losses]
        out["sharded_files"] = sorted(p.name for p in ckpt_dir.iterdir())


def worker(out_dir: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from lightning_llm.strategies import TensorParallelStrategy

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    if os.environ.get("TP_WORKER_ONLY") == "comm":  # debugging aid: only the cheap checks
        _comm_counts(out)
        _vocab_parallel_loss(out)
        print(json.dumps(out))
        return
    for name, sp in TP_RUNS:
        trainer, rec = fit(name, strategy=TensorParallelStrategy(sequence_parallel=sp), devices=2,
                           grads=f"{name}_sp{int(sp)}")
        params = _full_params(trainer.lightning_module)
        local_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                          for p in trainer.lightning_module.parameters())
        losses: list[Any] = [None, None]
        dist.all_gather_object(losses, rec.losses)
        if dist.get_rank() == 0:
            torch.save(params, out_dir / f"{name}_sp{int(sp)}.pt")
        out[f"{name}_sp{int(sp)}"] = {"losses": losses, "local_param_bytes": local_bytes}
    _comm_counts(out)
    _vocab_parallel_loss(out)
    _checkpoint_roundtrip(out_dir, out)
    if dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Single-device runs (same seed, data and loop) of every model configuration, then one torchrun launch (2
    processes, gloo) running every TP configuration of this module; their first-step gradients compared."""
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("tp")
    refs: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}

    def reference() -> None:
        for name in MODELS:
            trainer, rec = fit(name, grads=name)
            refs[name] = (rec.losses, _full_params(trainer.lightning_module))

    run_layouts_and_reference(__file__, out, reference)
    return out, json.loads((out / "results.json").read_text()), refs


@pytest.fixture(scope="module")
def tp_results(tp_run: tuple[Path, dict[str, Any], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
    return tp_run[0], tp_run[1]


@pytest.fixture(scope="module")
def references(tp_run: tuple[Path, dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """(losses, final parameters) of each model configuration on one device."""
    return tp_run[2]


# ---------------------------------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
@pytest.mark.parametrize("name,sp", TP_RUNS, ids=[f"{n}-sp{int(s)}" for n, s in TP_RUNS])
def test_tp_matches_single_device(tp_results: tuple[Path, dict[str, Any]], references: dict, name: str,
                                  sp: bool) -> None:
    """10 steps on 2 TP ranks vs 1 device: first-step gradients (the harness's check), per-step loss and final full
    parameters within 1e-5."""
    from lightning_llm.testing import gradient_summary

    out_dir, res = tp_results
    ref_losses, ref_params = references[name]
    run = res[f"{name}_sp{int(sp)}"]
    params = torch.load(out_dir / f"{name}_sp{int(sp)}.pt")
    assert len(ref_losses) == STEPS and all(len(r) == STEPS for r in run["losses"])
    loss_err = max(abs(a - b) for rank in run["losses"] for a, b in zip(rank, ref_losses))
    assert params.keys() == ref_params.keys()
    param_err = max(float((params[k] - ref_params[k]).abs().max()) for k in params)
    print(f"{name} sp={sp}: loss max|err|={loss_err:.2e} param max|err|={param_err:.2e} "
          f"losses={['%.5f' % x for x in run['losses'][0]]}; {gradient_summary(out_dir, f'{name}_sp{int(sp)}')}")
    assert loss_err <= TOL and param_err <= TOL
    assert ref_losses[0] != ref_losses[-1]  # it trained
    if MODELS[name][1]:  # LoRA: the adapters trained, the base stayed frozen
        lora_b = [k for k in params if "lora_B" in k]
        assert lora_b and any(float(params[k].abs().max()) > 0 for k in lora_b)


@pytest.mark.multiprocess
def test_vocab_parallel_loss_equals_full_cross_entropy(tp_results: tuple[Path, dict[str, Any]]) -> None:
    errs = tp_results[1]["vocab_loss"]
    print(f"vocab-parallel CE vs full CE: {errs}")
    assert errs["loss_err"] <= 1e-6 and errs["kernel_loss_err"] <= 1e-6 and errs["grad_err"] <= 1e-6


@pytest.mark.multiprocess
def test_block_communication_matches_megatron(tp_results: tuple[Path, dict[str, Any]]) -> None:
    """Per transformer block, forward: 2 all-reduces (no SP) or 2 all-gathers + 2 reduce-scatters (SP); backward
    the mirror image. LoRA adds no collective (the adapter's partial sum joins the base layer's reduction)."""
    res = tp_results[1]
    for lora in (0, 1):
        plain, sp = res[f"comm_sp0_lora{lora}"]["block"], res[f"comm_sp1_lora{lora}"]["block"]
        print(f"lora={lora} no-SP block: {plain}\nlora={lora} SP block: {sp}")
        assert plain["forward"] == {"all_reduce": 2}
        assert plain["backward"] == {"all_reduce": 2}
        assert sp["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}
        assert sp["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


@pytest.mark.multiprocess
def test_sharded_checkpoint_resume_and_consolidation(tp_results: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    from lightning_llm.strategies.engine.hybrid_checkpoint import consolidated_state_dict

    out_dir, res = tp_results
    assert ".metadata" in res["sharded_files"] and "meta.pt" in res["sharded_files"]
    assert sum(f.endswith(".distcp") for f in res["sharded_files"]) == 2  # one shard file per rank
    print(f"sharded save -> load in a fresh Trainer: param max|err|={res['restore_param_err']:.2e}, AdamW state "
          f"max|err|={res['restore_optim_err']:.2e} (params, optimizer tensors, global_step = {res['restore_n']}); "
          f"resumed steps {len(res['resumed_losses'][0])}")
    assert res["restore_param_err"] == 0.0 and res["restore_optim_err"] == 0.0
    assert res["restore_n"][2] == 5 and res["restore_n"][1] > 0 and len(res["resumed_losses"][0]) == 5
    # consolidated full state dict (online) == the offline merge of the sharded directory
    full = torch.load(out_dir / "full_after5.pt")
    merged = consolidated_state_dict(out_dir / "sharded.ckpt")  # offline, no process group
    assert set(full) == set(merged["state_dict"]) and "loops" in merged
    assert all(torch.equal(full[k], merged["state_dict"][k]) for k in full)
    assert full["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # unsharded


@pytest.mark.multiprocess
def test_per_rank_parameter_bytes_shrink(tp_results: tuple[Path, dict[str, Any]], references: dict) -> None:
    full = sum(t.numel() * 4 for t in references["decoder"][1].values())
    local = tp_results[1]["decoder_sp0"]["local_param_bytes"]
    print(f"decoder params: 1 device {full} B, per TP rank {local} B ({local / full:.2f})")
    assert local < 0.6 * full


def test_modules_to_save_is_refused_by_name_before_sharding() -> None:
    """peft's modules_to_save wrapper (a trained copy of embed_tokens / lm_head) has no column/row split: the plan
    refuses it naming the module and the layouts that keep it whole, instead of torch's NotImplementedError."""
    from lightning_llm.models import build_model
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft
    from lightning_llm.strategies.tensor.parallelize import _refuse_wrapped_copies
    from lightning_llm.strategies.tensor.plans import tp_plan

    model = apply_peft(build_model("debug-qwen2", family="decoder"),
                       PeftConfig(method="lora", lora=LoraArgs(r=4, modules_to_save=["embed_tokens", "lm_head"])))
    with pytest.raises(ValueError, match="embed_tokens is trained in full through peft's modules_to_save"):
        _refuse_wrapped_copies(model, tp_plan(model))
    _refuse_wrapped_copies(apply_peft(build_model("debug-qwen2", family="decoder"),
                                      PeftConfig(method="lora", lora=LoraArgs(r=4))), tp_plan(model))  # LoRA alone


def test_validate_tp_names_the_dimension() -> None:
    from lightning_llm.models import named_config
    from lightning_llm.strategies.tensor.plans import validate_tp

    cfg = named_config("debug", family="decoder")
    validate_tp(cfg, 2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        validate_tp(cfg, 4)
    with pytest.raises(ValueError, match="vocab_size=257"):
        validate_tp(cfg.replace(vocab_size=257), 2)
    with pytest.raises(ValueError, match="intermediate_size=129"):
        validate_tp(cfg.replace(intermediate_size=129), 2)
    with pytest.raises(ValueError, match="num_heads=3"):
        validate_tp(named_config("debug", family="decoder", num_heads=3, num_kv_heads=3, hidden_size=66), 2)


def test_tp_size_must_divide_devices() -> None:
    import lightning.pytorch as pl

    from lightning_llm.strategies import TensorParallelStrategy

    with pytest.raises(ValueError, match="multiply to 2, which does not divide the world size 3"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=TensorParallelStrategy(tensor_parallel_size=2), logger=False)


def test_registered_as_tp() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_llm.strategies  # noqa: F401

    assert StrategyRegistry["tp"]["strategy"].__name__ == "TensorParallelStrategy"


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(worker, Path(sys.argv[2]))
