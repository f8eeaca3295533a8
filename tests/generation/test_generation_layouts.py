"""Generation under every layout equals one device, token for token (issue 37).

The debug decoder (the engine builds the same weights under every layout) continues one left-padded batch of prompts
of different lengths, greedy with the KV cache and without, seeded sampling (the same U(0, 1) draws on every rank),
and beam search (rows reordered between steps), through ``task.decoding_model()``: the model itself under tensor
parallelism (full logits on every tensor-parallel rank), the stages run token by token under a pipeline
(``strategies/pipeline/decode.py``: micro-batches in flight for greedy and per-row sampled decoding, lock-step for
beam search and decoding without a cache), the model under ZeRO-3 with its parameters gathered once per generation
(counted: no all-gather per token) or, as the fallback, per layer in every step; and under tp and pp by default whole
copies assembled once per generation (``strategies/decoding/copies.py``; counted: the same few collectives for every
decoding, no message per token; row-wise decodings share the rows out over the ranks and all-gather the tokens; also
over FSDP2 x tp shards), or through the stages where ``auto`` finds the copies would not fit. Two torchrun launches: 2 processes (tp x2 and pp x2 both ways, pp x2 with two
interleaved stages per rank, pp x2 without room for copies, pp x2 of an MoE decoder, zero3 x2 both ways) and 4 (3d
dp2 x tp2 with and without ZeRO-3, pp2 x tp2 both ways, pp x4 of a decoder whose head is tied to its embeddings); the one-device reference
runs in this process meanwhile.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.strategies.decoding import fit
from lightning_llm.testing import (
    CollectiveCounter,
    gathered,
    launch,
    run_reference_meanwhile,
    run_worker,
    table_trainer,
    wait,
)

NEW = 6
CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=NEW, eos_token_id=None),
    "greedy_nocache": GenerationConfig(max_new_tokens=NEW, eos_token_id=None, use_cache=False),
    "sampled": GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=50),
    "beam": GenerationConfig(max_new_tokens=NEW, num_beams=2, eos_token_id=3),
    # rows end at different steps (about 4 in 10 tokens end a row), so pipeline micro-batches stop at their own step
    "sampled_eos": GenerationConfig(max_new_tokens=NEW, do_sample=True, eos_token_id=list(range(4, 100))),
    # the static cache (issue 57; its steps eagerly: compiling is one device's code on a whole copy): the same tokens
    "greedy_static": GenerationConfig(max_new_tokens=NEW, eos_token_id=None, cache_implementation="static"),
    "sampled_eos_static": GenerationConfig(max_new_tokens=NEW, do_sample=True, eos_token_id=list(range(4, 100)),
                                           cache_implementation="static"),
}
LAYOUTS_2 = ["tp", "tp_shards", "pp", "pp_ring", "pp_interleaved", "pp_nofit", "pp_moe", "zero3", "zero3_per_layer"]
LAYOUTS_4 = ["dp2_tp2", "dp2_tp2_zero3", "pp2_tp2", "pp2_tp2_ring", "pp4_tied"]
COPIES = {"tp", "pp", "pp_moe", "dp2_tp2", "dp2_tp2_zero3", "pp2_tp2", "pp4_tied"}  # auto: whole copies (they fit)
BACKBONES = {"pp_moe": "debug-moe", "pp4_tied": "debug-qwen2"}  # else debug; each has its one-device reference


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """4 prompts of 3, 7, 5 and 9 tokens, left-padded to 9."""
    g = torch.Generator().manual_seed(7)
    ids = torch.zeros(4, 9, dtype=torch.long)
    mask = torch.zeros(4, 9, dtype=torch.long)
    for row, n in enumerate((3, 7, 5, 9)):
        ids[row, 9 - n:] = torch.randint(4, 250, (n,), generator=g)
        mask[row, 9 - n:] = 1
    return ids, mask


def _strategy(layout: str) -> Any:
    from lightning_llm.strategies import HybridParallelStrategy

    # tp, pp, dp2_tp2, dp2_tp2_zero3 (FSDP2 x tp shards), pp2_tp2: whole copies (gather_for_decoding=auto, which
    # they fit; pp_nofit: told the host has no free memory, so auto falls back). The layouts' own decoding
    # (per_layer): tp_shards through the shards; pp_ring, pp_interleaved with micro-batches in flight, one per stage,
    # as for a model with work enough for them; pp2_tp2_ring keeps "auto", which decodes this tiny model's rows as one
    # micro-batch
    own = dict(gather_for_decoding="per_layer")
    kw = {"tp": dict(tensor_parallel_size=2), "tp_shards": dict(tensor_parallel_size=2, **own),
          "pp": dict(pipeline_parallel_size=2), "pp_nofit": dict(pipeline_parallel_size=2),
          "pp_moe": dict(pipeline_parallel_size=2, schedule="gpipe"), "pp4_tied": dict(pipeline_parallel_size=4),
          "pp_ring": dict(pipeline_parallel_size=2, decode_microbatches="stages", **own),
          "pp_interleaved": dict(pipeline_parallel_size=2, stages_per_rank=2, schedule="interleaved_1f1b",
                                 decode_microbatches="stages", **own),
          "zero3": dict(data_parallel_size=2, zero_stage=3),
          "zero3_per_layer": dict(data_parallel_size=2, zero_stage=3, gather_for_decoding="per_layer"),
          "dp2_tp2": dict(data_parallel_size=2, tensor_parallel_size=2),
          "dp2_tp2_zero3": dict(data_parallel_size=2, tensor_parallel_size=2, zero_stage=3),
          "pp2_tp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2),
          "pp2_tp2_ring": dict(pipeline_parallel_size=2, tensor_parallel_size=2, **own)}[layout]
    return HybridParallelStrategy(**kw)


class _Generate(pl.Callback):
    """Generates every configuration once the strategy has set the model up (before validation runs), counting the
    all-gathers of each generation (ZeRO-3: FSDP2's ``all_gather_single``) and the model's FSDP2 units."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[list[int]]] = {}

    def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        ids, mask = (t.to(pl_module.device) for t in _prompts())
        uniforms = torch.rand(4, NEW, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        pl_module.eval()
        counter = CollectiveCounter()
        with pl_module.decoding():  # a first session decides the plan (a collective) before anything is counted
            pass
        for name, cfg in CONFIGS.items():
            with counter.counting() as calls, pl_module.decoding() as model:
                out = generate(model, ids, mask, config=cfg, uniforms=uniforms if cfg.do_sample else None)
            self.tokens[name] = out.tolist()
            self.tokens[f"{name}:gathers"] = sum(1 for f, _, _ in calls if f.startswith("all_gather"))
            self.tokens[f"{name}:calls"] = [f for f, _, _ in calls]
            self.tokens["decoder"] = type(model).__name__  # what generate() was given: a whole copy, or not
        copies = getattr(trainer.strategy, "_whole_copies", None)  # after the sessions: nothing of them allocated
        self.tokens["copies_freed"] = copies is not None and all(
            t.is_meta for skeleton in copies.skeletons.values() for t in [*skeleton.parameters(), *skeleton.buffers()])
        self.tokens["units"] = sum(isinstance(m, FSDPModule) for m in pl_module.model.modules())
        runner = pl_module.pipeline()
        self.tokens["microbatches"] = runner.decoder().microbatches_for(ids.shape[0]) if runner is not None else 0


def _run(layout: str, devices: int, out: Path, backbone: str = "debug") -> dict[str, list[list[int]]]:
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(11)
    # dropout on in training: generation runs in eval mode, on the model and on whole copies alike
    task = CausalLMTask(backbone, dropout=0.3)
    dm = TextDataModule(block_size=16, batch_size=4, cache_dir=str(out / "cache"), generated_docs=40)
    cb = _Generate()
    if layout == "pp_nofit":  # what auto decides when the copies do not fit: the stages (the run summary says so)
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr(fit, "free_memory_bytes", lambda device: 1)
    trainer = table_trainer(out / layout, strategy=_strategy(layout) if devices > 1 else "auto", devices=devices,
                            max_steps=1, callbacks=[cb])
    trainer.limit_val_batches = 1
    trainer.validate(task, dm, verbose=False)
    if layout == "pp_nofit":
        monkeypatch.undo()
    note = getattr(trainer.strategy, "decoding_note", lambda: None)()
    cb.tokens["note"] = note or ""
    return cb.tokens


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        refs = {b: _run(f"1-{b}", 1, out, b) for b in ("debug", *BACKBONES.values())}
        (out / "reference.json").write_text(json.dumps(refs))
        return
    layouts = LAYOUTS_2 if mode == "2" else LAYOUTS_4
    results = {layout: gathered(_run(layout, int(mode), out, BACKBONES.get(layout, "debug"))) for layout in layouts}
    if torch.distributed.get_rank() == 0:
        (out / f"layouts-{mode}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generation")
    four = launch(__file__, 4, "4", str(out))
    two_out = run_reference_meanwhile(launch(__file__, 2, "2", str(out)), lambda: _worker("reference", out))
    print(two_out[-2000:] if "Traceback" in two_out else "")
    wait(four, 1200)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS_2, *LAYOUTS_4])
def test_generation_equals_one_device(runs: Path, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())[BACKBONES.get(layout, "debug")]
    results = json.loads((runs / f"layouts-{2 if layout in LAYOUTS_2 else 4}.json").read_text())[layout]
    for name in CONFIGS:
        print(f"{layout} {name}: {results[0][name]}; all-gathers {results[0][name + ':gathers']}")
        assert len(ref[name]) == 4 and len(ref[name][0]) >= 1
        for rank, tokens in enumerate(results):
            assert tokens[name] == ref[name], (layout, name, rank, tokens[name], ref[name])
    assert ref["greedy"] == ref["greedy_nocache"] == ref["greedy_static"]
    assert ref["sampled_eos"] == ref["sampled_eos_static"]
    assert ref["sampled"] != ref["greedy"]  # the draws matter, so equal samples across layouts mean something
    ends = [row[-1] == 0 for row in ref["sampled_eos"]]  # rows padded after their EOS, and rows still going
    assert len(ref["sampled_eos"][0]) >= 2 and any(ends) and not all(ends)
    units = results[0]["units"]
    # the rows decode in one micro-batch per stage where asked (2, or 4 for two stages per rank); "auto" keeps
    # debug's 4 rows in one (2 x its largest stage's ~50k parameters x 2 rows is below MICROBATCH_MIN_FLOPS)
    assert results[0]["microbatches"] == {"pp_ring": 2, "pp_interleaved": 4}.get(
        layout, 1 if layout.startswith("pp") else 0)
    calls = {name: results[0][f"{name}:calls"] for name in CONFIGS}
    if layout in COPIES:  # the copies' assembly only: the same few collectives whatever the decoding, none per token
        print(f"{layout}: collectives of a generation with whole copies: {calls['greedy']}")
        # row-wise decodings (greedy with the cache, per-row draws) share the rows out: one all-gather of tokens
        assert calls["greedy_nocache"] == calls["beam"] and 1 <= len(calls["beam"]) <= 4
        assert calls["greedy"] == calls["sampled"] == calls["sampled_eos"] == [*calls["beam"], "all_gather_into_tensor"]
        assert calls["greedy_static"] == calls["sampled_eos_static"] == calls["greedy"]
        assert results[0]["decoder"] == "RowShare" and results[0]["copies_freed"]
        assert "whole copies assembled once per generation" in results[0]["note"]
    else:  # no copies: the layout's own decoding
        assert results[0]["decoder"] != "RowShare"
    if layout == "pp_nofit":
        print(f"pp_nofit: {results[0]['note']}")
        assert "through the pp x2 layout itself, the fallback" in results[0]["note"]
    if layout == "zero3":  # every unit gathered once when the generation starts, none per token
        assert units == 5 and all(results[0][f"{name}:gathers"] == units for name in CONFIGS)
    if layout == "zero3_per_layer":  # the fallback: every unit in every forward (the prefill + 5 steps)
        assert units == 5 and results[0]["greedy:gathers"] == units * NEW and results[0]["greedy_nocache:gathers"] == units * NEW


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
