"""`lightning_llm estimate`: ZeRO model-state formulas, activation/max-batch search, CLI output and errors.

(Agreement with the bytes measured from live tensors on 2 ranks is checked in tests/test_zero.py.)
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from lightning_llm.cli import main
from lightning_llm.memory import model_state_theory


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


def test_frozen_copies_count_like_the_model_share() -> None:
    """A frozen reference placed like the policy: its parameters per rank follow the model's share (whole on one
    device and under DeepSpeed, halved by zero3 x2 and tp x2), with no gradients or optimizer states."""
    got = {}
    for name, args in {"1": ["--strategy=ddp", "--devices=1"], "zero3": ["--strategy=zero3", "--devices=2"],
                       "tp": ["--strategy=tp", "--devices=2"], "ds": ["--strategy=deepspeed_zero3", "--devices=2"]}.items():
        rc, out, _ = _run("--model=debug", "--precision=32-true", "--seq-len=64", "--frozen-copies=1", "--json", *args)
        assert rc == 0
        got[name] = json.loads(out)
    params = sum(got["1"]["bytes"][k] for k in ("params",))
    frozen = {k: v["bytes"]["frozen"] for k, v in got.items()}
    assert frozen["1"] == frozen["ds"] == params == 4 * got["1"]["parameters"]  # fp32, whole
    assert abs(frozen["zero3"] / frozen["1"] - 0.5) < 1e-2 and frozen["tp"] / frozen["1"] <= 0.51
    for report in got.values():  # counted in the model states, as parameters only
        b = report["bytes"]
        assert b["model_states"] == b["params"] + b["grads"] + b["optim"] + b["frozen"]
    rc, _, err = _run("--model=debug", "--frozen-copies=-1")
    assert rc == 2 and "--frozen-copies=-1" in err
