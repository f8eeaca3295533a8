"""The block logged once before step 1 (``lightning_llm.run_summary``), the model summary without Lightning's FLOPs
column of zeros, FLOP/s in the throughput log, and facts about the whole run logged by rank 0 only
(``lightning_llm.logs``). The node-0 log of a two-node run is checked in
``tests/parallel/test_trainer_flags.py::test_two_nodes_match_one_process``."""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.logs import PER_RANK, RankZeroFilter
from lightning_llm.memory import estimate_layout
from lightning_llm.models import named_config
from lightning_llm.run_summary import NOT_ONE_CALL, Layout, RunSummary, placement
from lightning_llm.tasks import CausalLMTask, DPOTask

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_dir(tiny_llama: Callable[..., Path]) -> Path:
    """A tiny LlamaForCausalLM (GQA, untied head) with a BPE tokenizer, written by transformers/tokenizers."""
    return tiny_llama()


def _reference_flops(hf_dir: Path, batch: int, seq: int) -> int:
    """Forward + backward FLOPs of the transformers model: 6 per token and linear weight (forward 2, backward 4),
    plus attention's two batched matmuls (QK^T, AV: 2 * B * S^2 * heads * head_dim each forward, x3 with backward)."""
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 6 * batch * seq * linear + 12 * batch * seq * seq * cfg.num_attention_heads * head_dim * \
        cfg.num_hidden_layers


def test_summary_states_batch_memory_and_flops(llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_llm.tools.estimate import main as estimate

    args = ["fit", "--config", str(REPO / "configs" / "pretrain_debug.yaml"), f"--model.backbone={llama_dir}",
            "--trainer.strategy=zero2", "--trainer.max_steps=2", "--trainer.accumulate_grad_batches=2",
            "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false", "--trainer.enable_model_summary=true",
            f"--trainer.logger.init_args.save_dir={tmp_path}", f"--data.cache_dir={tmp_path / 'cache'}",
            "--data.generated_docs=40", "--data.batch_size=4", "--data.block_size=32"]
    with caplog.at_level(logging.INFO, logger="lightning_llm"):
        assert main(args) == 0
    # The model summary table has no FLOPs column (Lightning's was all zeros).
    out = capsys.readouterr().out
    assert "Params" in out and "FLOPs" not in out and "Total Flops" not in out
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")]
    assert len(blocks) == 1, blocks
    block = blocks[0]
    print(block)
    assert "layout: 1 rank(s) = pp 1 x dp 1 x tp 1, ZeRO stage 2 (ZeroStrategy); 1 node" in block
    assert "batch: 4 samples per replica x 1 replica(s) x 2 accumulation = global batch 8; 256 tokens per optimizer " \
           "step (32 per sample)" in block
    assert "attention: SDPA with a [B, 1, S, S] mask for padded, packed and sliding-window rows; plain rows: " \
           "is_causal (cpu device)" in block
    # Memory: the estimate tool's figure for the same model, layout, batch and precision.
    capsys.readouterr()
    assert estimate(["--model", str(llama_dir), "--strategy", "zero2", "--devices", "1", "--batch-size", "4",
                     "--seq-len", "32", "--precision", "32-true", "--fused-loss", "on", "--json"]) == 0
    tool = json.loads(capsys.readouterr().out)
    assert f"estimated memory per rank (lightning_llm estimate, 32-true): {tool['bytes']['total'] / 2**20:.1f} MiB" \
        in block
    # FLOPs: the count equals the transformers model's analytic FLOPs (x 2 accumulated batches).
    flops = int(re.search(r"FLOPs per optimizer step: ([0-9,]+) ", block).group(1).replace(",", ""))
    ref = _reference_flops(llama_dir, 4, 32)
    print(f"FLOPs per step: counted {flops:,}, reference {2 * ref:,}")
    assert flops == 2 * ref
    # FLOP/s next to tokens/s, from the same step time: their ratio is the counted FLOPs per token.
    rows = [r for r in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if r.get("train_tflops_per_s")]
    assert rows
    for r in rows:
        per_token = float(r["train_tflops_per_s"]) * 1e12 / float(r["train_tokens_per_s"])
        assert per_token == pytest.approx(ref / (4 * 32), rel=1e-4)


@pytest.mark.parametrize("layout, per_node, nodes, expected", [
    (Layout(dp=2, tp=2), 2, 2, "2 nodes x 2: tp inside a node; dp across nodes"),
    (Layout(dp=1, tp=4), 2, 2, "2 nodes x 2: tp across nodes"),
    (Layout(dp=2, tp=2, pp=2), 4, 2, "2 nodes x 4: tp and dp inside a node; pp across nodes"),
    (Layout(dp=4), 4, 1, "1 node: every dimension inside it"),
    (Layout(dp=2, cp=2, tp=2), 4, 2, "2 nodes x 4: tp and cp inside a node; dp across nodes"),
])
def test_placement_names_what_stays_inside_a_node(layout: Layout, per_node: int, nodes: int, expected: str) -> None:
    assert placement(layout, per_node=per_node, nodes=nodes) == expected


def test_rank_zero_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Facts about the whole run pass on global rank 0 only; per-rank records and other libraries' pass on every
    rank."""
    def record(name: str, per_rank: bool = False) -> logging.LogRecord:
        r = logging.LogRecord(name, logging.INFO, __file__, 1, "msg", None, None)
        if per_rank:
            r.__dict__.update(PER_RANK)
        return r

    f = RankZeroFilter()
    for rank, whole_run in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        assert f.filter(record("lightning_llm.data.text")) is whole_run
        assert f.filter(record("lightning_llm.strategies.zero.native", per_rank=True))
        assert f.filter(record("lightning.pytorch"))
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_RANK", "1")  # Lightning's own launcher
    assert not f.filter(record("lightning_llm.data.text"))


def test_library_tasks_get_no_contract_messages(caplog: pytest.LogCaptureFixture) -> None:
    """"overrides build_policy, ...: built whole on every rank" speaks to user subclasses; the library's own tasks
    (ClassificationTask has no build_policy at all) never get it."""
    from lightning_llm.contract import builds_lazily
    from lightning_llm.tasks import CausalLMTask, ClassificationTask

    class MyTask(CausalLMTask):
        def build_model(self) -> torch.nn.Module:
            return super().build_model()

    with caplog.at_level(logging.INFO, logger="lightning_llm"):
        assert builds_lazily(ClassificationTask(backbone="debug")) is True
        assert builds_lazily(CausalLMTask(backbone="debug")) is True
        assert not caplog.records
        assert builds_lazily(MyTask(backbone="debug")) is False
    assert [r.getMessage() for r in caplog.records] == [(
        "MyTask overrides build_model: its model is built whole on every rank (set deferred_init = True on the class "
        "if its own modules are real or belong to a model family)")]


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_the_memory_estimate_leaves_the_random_generator_as_it_was(family: str) -> None:
    """The run summary estimates memory on rank 0 alone before step 1, building a meta model for its shapes (whose
    constructor draws an init seed): torch's generator must come out unchanged, or rank 0's dropout, and a resumed
    run's, would differ (a resume was 7.3e-3 off the uninterrupted run)."""
    before = torch.get_rng_state()
    estimate_layout(named_config("debug", family=family), tp=1, pp=1, dp=2, stage=0, engine="native", batch_size=4,
                    seq_len=16, precision="32-true", fused_loss=False)
    assert torch.equal(before, torch.get_rng_state())



def test_flops_of_a_step_that_changes_its_batch_are_not_counted_rather_than_failing() -> None:
    """DPO adds the reference log-probs to the batch in its own training_step (and, on the fly, runs the reference
    model): the count on the dataloader's batch would fail (KeyError 'ref_logps') or leave the reference forward out,
    so the summary says why there is no count. The base step and a subclass that keeps it are counted."""
    class Logged(CausalLMTask):
        def on_train_batch_end(self, *args: object) -> None:
            pass

    ids = torch.randint(0, 200, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    for task, counted in ((CausalLMTask("debug"), True), (Logged("debug"), True), (DPOTask("debug"), False)):
        summary = RunSummary()
        task.configure_model()
        summary.capture(task.model)
        flops, why = summary._flops(task, batch)
        expected = (flops is not None and flops > 0 and why == "") if counted else (flops is None and why == NOT_ONE_CALL)
        assert expected, (type(task).__name__, flops, why)
    assert "training_step" in NOT_ONE_CALL
