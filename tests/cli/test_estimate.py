"""`lightning_llm estimate`: ZeRO model-state formulas, activation/max-batch search, CLI output and errors; for
Mixture-of-Experts models the parameter counts (total against transformers' model, active against Qwen3-30B-A3B's
published figures), the FLOPs per token against ``torch.utils.flop_counter``, an MoE layer's activations against the
tensors autograd saves, and the model states per rank under expert parallelism (ep2, ep2 + ZeRO-3) against the bytes
measured from live tensors on 2 ranks (one launch; the dense layouts' agreement is checked in tests/parallel/test_zero.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.memory import activation_bytes_per_sample, model_state_theory, moe_layer_bytes_per_token
from lightning_llm.models import model_from_config, named_config
from lightning_llm.testing import saved_tensor_bytes


def _run(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["estimate", *args])
    return rc, out.getvalue(), err.getvalue()


def test_zero_formulas_fp32_and_mixed() -> None:
    psi, n = 1000, 4
    s = {k: model_state_theory(numel=psi, stage=k, dp=n, precision="32-true") for k in (0, 1, 2, 3)}
    assert sum(s[0].values()) == 16 * psi  # DDP: 4 + 4 + 8
    assert sum(s[1].values()) == 8 * psi + 8 * psi // n  # Ψ(4+4) + 8Ψ/N
    assert sum(s[2].values()) == 4 * psi + 12 * psi // n
    assert sum(s[3].values()) == 16 * psi // n
    ds = model_state_theory(numel=psi, stage=1, dp=n, precision="bf16-mixed", engine="deepspeed")
    # DeepSpeed bf16: 2Ψ + 2Ψ/N + 12Ψ/N (its stage 1 already partitions gradients; the paper's stage 1 is 2Ψ+2Ψ+12Ψ/N)
    assert ds == {"params": 2 * psi, "grads": 2 * psi // n, "optim": 12 * psi // n}
    off = model_state_theory(numel=psi, stage=3, dp=n, offload_optimizer=True, offload_params=True)
    assert sum(off.values()) == 0


def test_cli_json_split_and_largest_batch() -> None:
    rc, out, _ = _run("--model=small", "--devices=8", "--strategy=zero3", "--precision=bf16-mixed", "--seq-len=512",
                      "--batch-size=2", "--gpu-memory-gib=1", "--json")
    r = json.loads(out)
    b = r["bytes"]
    assert rc == 0 and r["stage"] == 3 and r["parameters"] > 0
    assert b["model_states"] == b["params"] + b["grads"] + b["optim"]
    assert b["activations"] == 2 * r["activations_per_sample"]
    assert r["max_batch_size"] == 0  # 1 GiB minus the default 1 GiB reserve leaves nothing
    rc, out, _ = _run("--model=small", "--devices=8", "--strategy=zero3", "--seq-len=512", "--gpu-memory-gib=80",
                      "--json")
    r = json.loads(out)
    fit = r["max_batch_size"]
    room = 79 * 1024**3 - r["bytes"]["model_states"]
    from lightning_llm.memory import loss_peak_bytes
    from lightning_llm.tools.estimate import load_config

    cfg = load_config("small", "decoder")

    def need(batch: int) -> int:  # activations + the fused loss's transient at that batch
        return batch * r["activations_per_sample"] + loss_peak_bytes(
            tokens=batch * 512, vocab=cfg.vocab_size, hidden=cfg.hidden_size, precision="bf16-mixed", fused=True)

    assert r["fused_loss"] and fit > 0 and need(fit) <= room < need(fit + 1)
    # Higher stages never need more model-state memory.
    states = [json.loads(_run("--model=small", "--devices=8", f"--strategy={s}", "--json")[1])["bytes"]["model_states"]
              for s in ("ddp", "zero1", "zero2", "zero3")]
    print("small, 8 devices, bf16-mixed model states (ddp, zero1-3):", states)
    assert states == sorted(states, reverse=True) and states[0] > states[-1]


def test_loss_term_with_and_without_the_fused_path() -> None:
    """The fused path keeps no logits: fewer activation bytes and a smaller loss transient; with it off, the total
    counts full logits; under tensor parallelism the fused path runs on vocab shards (chunks of [C, V/tp]), under
    a pipeline on its last stage."""
    args = ["--model=llama-1b", "--seq-len=2048", "--batch-size=4", "--strategy=zero3", "--devices=8", "--json"]
    on = json.loads(_run(*args)[1])
    off = json.loads(_run(*args, "--fused-loss=off")[1])
    assert on["fused_loss"] and not off["fused_loss"]
    assert on["loss_bytes"] == off["loss_bytes"] and on["loss_bytes"]["fused"] < on["loss_bytes"]["eager"]
    assert on["bytes"]["loss"] == on["loss_bytes"]["fused"] and off["bytes"]["loss"] == off["loss_bytes"]["eager"]
    assert on["activations_per_sample"] < off["activations_per_sample"]
    assert on["bytes"]["total"] < off["bytes"]["total"]
    tp = json.loads(_run("--model=llama-1b", "--seq-len=2048", "--strategy=tp", "--devices=2", "--json")[1])
    assert tp["fused_loss"] and tp["bytes"]["loss"] == tp["loss_bytes"]["fused"]
    assert tp["loss_bytes"]["eager"] < on["loss_bytes"]["eager"]  # [N, V/2] shards, batch 1 vs 4
    pp = json.loads(_run("--model=llama-1b", "--seq-len=2048", "--strategy=pp", "--devices=2", "--json")[1])
    assert pp["fused_loss"] and pp["bytes"]["loss"] == pp["loss_bytes"]["fused"]


def test_cli_table_and_errors() -> None:
    rc, out, _ = _run("--model=llama2-7b", "--devices=8", "--strategy=zero3", "--batch-size=1", "--seq-len=2048")
    print(out)
    assert rc == 0 and "optimizer states" in out and "largest batch" in out
    rc, _, err = _run("--model=nope")
    assert rc == 2 and "--model=nope" in err
    rc, _, err = _run("--strategy=zero9")
    assert rc == 2 and "--strategy=zero9" in err
    rc, _, err = _run("--devices=0")
    assert rc == 2 and "--devices=0" in err


@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload", "deepspeed_zero3_offload"])
def test_offload_moves_states_to_host(strategy: str) -> None:
    r = json.loads(_run("--model=small", "--devices=2", f"--strategy={strategy}", "--json")[1])
    assert r["bytes"]["optim"] == 0 and r["bytes"]["host_offloaded"] > 0


# ------------------------------------------------------------------------------------------ Mixture of Experts
def _moe_config(**moe: Any) -> Any:
    """``debug-moe`` (Qwen3-MoE-shaped: 8 experts, top-2) with ``moe`` fields changed."""
    cfg = named_config("debug-moe", family="decoder").replace(dropout=0.0)
    return cfg.replace(moe={**vars(cfg.moe), **moe})


def test_moe_parameter_counts_and_flops_per_token() -> None:
    """Total parameters equal transformers' Qwen3MoeForCausalLM of the same config; active ones are Qwen3-30B-A3B's
    published 3.3B (of 30.5B); the training FLOPs per token equal what ``torch.utils.flop_counter`` counts for a
    forward and backward of the model (the run summary's count; routing spread evenly on the meta device) within
    1% (norm weights count in 6N but do no matmul)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_llm.models.hf import config_to_hf

    r = json.loads(_run("--model=qwen3-30b-a3b", "--seq-len=4096", "--json")[1])
    hf = {k: v for k, v in config_to_hf(named_config("qwen3-30b-a3b", family="decoder"),
                                         "Qwen3MoeForCausalLM").items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        reference = sum(p.numel() for p in Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).parameters())
    print(f"qwen3-30b-a3b: {r['parameters']:,} parameters (transformers: {reference:,}), "
          f"{r['active_parameters']:,} active, {r['train_flops_per_token']:.3e} FLOPs per token at 4096")
    # the model card: "30.5B in total and 3.3B activated", "29.9B non-embedding" (embedding and head untied)
    assert r["parameters"] == reference and round(r["parameters"] / 1e9, 1) == 30.5
    assert round((r["parameters"] - 2 * r["embedding_parameters"]) / 1e9, 1) == 29.9
    assert 3.3e9 <= r["active_parameters"] < 3.4e9 and r["expert_parameters"] > 0.9 * r["parameters"]
    rc, out, _ = _run("--model=qwen3-30b-a3b", "--seq-len=4096")
    assert rc == 0 and f"{r['active_parameters']:,} of them active per token (top-8 of 128 experts" in out

    cfg = _moe_config(shared_intermediate_size=48, shared_gate=True, dense_layers=[0])
    batch, seq = 2, 64
    with torch.device("meta"):
        model = model_from_config(cfg)
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.zeros(batch, seq, dtype=torch.long, device="meta")).float().sum().backward()
    from lightning_llm.tools.estimate import parameter_counts, train_flops_per_token

    counts = parameter_counts(cfg)
    est = train_flops_per_token(params=counts.active - counts.embedding, layers=cfg.num_layers,
                                attention_width=cfg.num_heads * cfg.head_dim, seq_len=seq)
    counted = counter.get_total_flops() / (batch * seq)
    print(f"debug-moe + shared expert: estimate {est:,} FLOPs per token, flop counter {counted:,.0f}")
    assert abs(est / counted - 1) <= 0.01


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_layer_activations_equal_the_tensors_autograd_saves(precision: str, shared: bool) -> None:
    """One MoE block's forward in training (load-balancing loss on, 512 tokens): the bytes autograd saves (its
    input and weights aside) equal :func:`moe_layer_bytes_per_token` x tokens within 1% (the weights' per-layer
    fp32/int32 copies are not per token; under autocast the bf16 copies of the weights, one per layer, are taken
    out); and the whole model's term: the saved bytes of an MoE model minus those of its dense twin equal the
    estimate's difference."""
    from lightning_llm.models.layers.moe import RoutingInput
    from lightning_llm.models.layers.routing import RoutingStats

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    cfg = _moe_config(shared_intermediate_size=48 if shared else 0, shared_gate=shared, aux_loss_coef=0.01)
    torch.manual_seed(0)
    block = model_from_config(cfg).layers["1"].mlp.to(dtype)
    n = 512
    x = torch.randn(1, n, cfg.hidden_size, dtype=dtype, requires_grad=True)
    stats = RoutingStats([1], num_experts=8, top_k=2, aux_loss_coef=0.01)
    stats.begin()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        got = saved_tensor_bytes(lambda: block(x, routing=RoutingInput(stats=stats)), [x, *block.parameters()])
    if precision == "bf16-mixed":  # bf16 copies of every weight but the router's (which computes in fp32)
        got -= 2 * sum(p.numel() for name, p in block.named_parameters() if not name.startswith("gate."))
    est = moe_layer_bytes_per_token(cfg, precision=precision) * n
    print(f"MoE block, {precision}, shared expert {shared}: saved {got:,} B, estimate {est:,} B")
    assert abs(est / got - 1) <= 0.01

    if precision != "32-true" or shared:
        return
    moe, dense = _moe_config(dense_layers=[0], aux_loss_coef=0.01), None
    dense = moe.replace(moe=None)
    ids = torch.randint(0, 250, (2, 64))
    measured = {}
    for name, c in (("moe", moe), ("dense", dense)):
        torch.manual_seed(0)
        model = model_from_config(c)
        if model.routing is not None:
            model.routing.begin()
        measured[name] = saved_tensor_bytes(lambda m=model: m(ids), list(model.parameters())) / 2
    est_moe, est_dense = (activation_bytes_per_sample(c, seq_len=64, precision="32-true")[1] for c in (moe, dense))
    print(f"whole model, MoE minus dense twin per sample: saved {measured['moe'] - measured['dense']:,.0f} B, "
          f"estimate {est_moe - est_dense:,} B")
    assert abs((est_moe - est_dense) / (measured["moe"] - measured["dense"]) - 1) <= 0.01


def test_expert_parallel_degrees_shares_and_errors() -> None:
    """``--strategy=ep`` spreads the experts over every replica by default; the routed experts are divided by ep
    only (never by tp), the rest of the model as without ep; bad degrees are refused naming the parameter."""
    common = ["--model=debug-moe", "--precision=32-true", "--seq-len=64", "--json"]
    counts = json.loads(_run(*common)[1])
    experts = counts["expert_parameters"]
    ep4 = json.loads(_run(*common, "--strategy=ep", "--devices=4")[1])
    assert (ep4["ep"], ep4["dp"], ep4["stage"]) == (4, 4, 0)
    assert ep4["bytes"]["params"] == 4 * (counts["parameters"] - experts + experts // 4)
    assert ep4["activations_per_sample"] == counts["activations_per_sample"]  # as many assignments per rank
    tp2 = json.loads(_run(*common, "--strategy=3d", "--devices=4", "--tp=2")[1])
    tp2ep2 = json.loads(_run(*common, "--strategy=3d", "--devices=4", "--tp=2", "--ep=2")[1])
    assert tp2["bytes"]["params"] - tp2ep2["bytes"]["params"] == 4 * experts // 2  # whole experts on each tp rank
    z3 = json.loads(_run(*common, "--strategy=ep", "--devices=4", "--ep=2", "--zero-stage=3")[1])
    assert z3["bytes"]["params"] < ep4["bytes"]["params"]
    for args, message in [(("--strategy=ep", "--devices=4", "--ep=3"), "ep=3: must divide the 4"),
                          (("--strategy=ep", "--devices=16"), "ep=16 does not divide the model's 8 experts"),
                          (("--strategy=ep", "--devices=2", "--zero-stage=2"), "ZeRO stage 0 or 3"),
                          (("--strategy=zero3", "--devices=2", "--ep=2"), "--tp/--pp/--cp/--ep need"),
                          (("--model=debug", "--strategy=ep", "--devices=2"), "no Mixture-of-Experts layers")]:
        rc, _, err = _run(*common, *args)
        assert rc == 2 and message in err, (args, err)


def test_frozen_copies_count_like_the_model_share() -> None:
    """A frozen reference placed like the policy: its parameters per rank follow the model's share (whole on one
    device and under DeepSpeed's stage 2, halved by zero3 x2, tp x2 and DeepSpeed's stage 3, which partitions every
    parameter of the module, frozen ones included; on the host under zero3_offload), with no gradients or optimizer
    states. (What the copies measure per rank: tests/tasks/test_grpo.py and test_ppo.py, 0.500x under zero3/tp/pp x2.)"""
    got = {}
    for name, args in {"1": ["--strategy=ddp", "--devices=1"], "zero3": ["--strategy=zero3", "--devices=2"],
                       "tp": ["--strategy=tp", "--devices=2"], "ds": ["--strategy=deepspeed_zero3", "--devices=2"],
                       "ds2": ["--strategy=deepspeed_zero2", "--devices=2"],
                       "offload": ["--strategy=zero3_offload", "--devices=2"]}.items():
        rc, out, _ = _run("--model=debug", "--precision=32-true", "--seq-len=64", "--frozen-copies=1", "--json", *args)
        assert rc == 0
        got[name] = json.loads(out)
    params = sum(got["1"]["bytes"][k] for k in ("params",))
    frozen = {k: v["bytes"]["frozen"] for k, v in got.items()}
    assert frozen["1"] == frozen["ds2"] == params == 4 * got["1"]["parameters"]  # fp32, whole
    assert abs(frozen["zero3"] / frozen["1"] - 0.5) < 1e-2 and frozen["tp"] / frozen["1"] <= 0.51
    assert frozen["ds"] == frozen["zero3"]  # DeepSpeed's stage 3 shards the reference as FSDP2 does
    assert frozen["offload"] == 0 and got["offload"]["bytes"]["host_offloaded"] - frozen["zero3"] == json.loads(
        _run("--model=debug", "--precision=32-true", "--seq-len=64", "--json", "--strategy=zero3_offload",
             "--devices=2")[1])["bytes"]["host_offloaded"]
    for report in got.values():  # counted in the model states, as parameters only
        b = report["bytes"]
        assert b["model_states"] == b["params"] + b["grads"] + b["optim"] + b["frozen"]
    rc, _, err = _run("--model=debug", "--frozen-copies=-1")
    assert rc == 2 and "--frozen-copies=-1" in err


# ------------------------------------------------------------------ measured on 2 ranks (one torchrun launch)
MEASURED = [("debug-moe", 0), ("debug-moe", 3), ("small-moe", 0), ("small-moe", 3)]
"""(named size, ZeRO stage) of the ep2 runs whose model states are measured."""


def _ep_fit(name: str, stage: int, out: Path) -> dict[str, Any]:
    """Two steps of ``CausalLMTask(name)`` under ``ExpertParallelStrategy(zero_stage=stage)`` on 2 ranks: each
    rank's model-state bytes (live tensors, before the second optimizer step), the estimate for the model as built
    (its vocabulary padded to the tokenizer's) and the run summary's memory line."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.memory import estimate_layout
    from lightning_llm.strategies import ExpertParallelStrategy
    from lightning_llm.strategies.zero.native import model_state_bytes
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.testing import gathered, table_trainer

    measured: dict[str, int] = {}

    class Meter(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, task: Any, optimizer: Any) -> None:
            if trainer.global_step == 1:  # Adam's states exist from the first step on
                measured.update(model_state_bytes(task, trainer.optimizers))

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning_llm.run_summary")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    pl.seed_everything(0, verbose=False)
    task = CausalLMTask(name, dropout=0.0)
    data = TextDataModule(block_size=32, batch_size=2, cache_dir=str(out / "cache"), generated_docs=60,
                          val_fraction=0.0)
    trainer = table_trainer(out / f"{name}-{stage}", strategy=ExpertParallelStrategy(zero_stage=stage), devices=2,
                            max_steps=2, callbacks=[Meter()])
    trainer.fit(task, data)
    logger.removeHandler(handler)
    est, _ = estimate_layout(task.model.config, tp=1, pp=1, dp=2, ep=2, stage=stage, engine="native", batch_size=2,
                             seq_len=32, precision="32-true", fused_loss=True)
    memory = [ln for block in lines for ln in block.splitlines() if "estimated memory per rank" in ln]
    return {"measured": gathered(measured), "tensors": sum(1 for _ in task.model.parameters()),
            "estimate": {"params": est.params, "grads": est.grads, "optim": est.optim}, "summary": memory}


def _worker(out: Path) -> None:
    from lightning_llm.testing import write_json_on_rank0

    write_json_on_rank0(out / "ep.json", {f"{n}-{s}": _ep_fit(n, s, out) for n, s in MEASURED})


@pytest.mark.multiprocess
def test_expert_parallel_model_states_equal_the_measured_bytes(tmp_path: Path) -> None:
    """ep2 and ep2 + ZeRO-3 of debug-moe and small-moe on 2 gloo ranks: every rank's parameters and gradients equal
    the estimate to the byte, its optimizer states up to Adam's step counters (a 4-byte tensor per parameter tensor
    the rank holds), and the run summary's memory line states the same (expert-parallel) figures."""
    from lightning_llm.testing import launch, wait

    wait(launch(__file__, 2, str(tmp_path)), timeout=600)
    res = json.loads((tmp_path / "ep.json").read_text())
    for key, r in res.items():
        est = r["estimate"]
        for rank, got in enumerate(r["measured"]):
            print(f"{key} ep2 rank {rank}: measured {got}, estimate {est}")
            assert got["params"] == est["params"] and got["grads"] == est["grads"]
            assert 0 <= got["optim"] - est["optim"] <= 4 * r["tensors"]
        (line,) = r["summary"]
        assert f"parameters {est['params'] / 2**20:.1f}, gradients {est['grads'] / 2**20:.1f}" in line, line


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, Path(sys.argv[1]))
