"""Context parallelism (``context_parallel_size``) equals one device on rows of 4096 tokens.

The ``debug`` decoder (GQA: 4 query heads, 2 kv heads; rotary positions) trains ``CausalLMTask`` on 2 rows of
``SEQ`` = 4096 byte tokens per step, fp32, dropout 0, for ``STEPS`` steps, under each layout (torchrun, CPU, gloo):
cp2, cp2 on packed rows (``segment_ids`` and per-example ``position_ids``, examples crossing the slices' boundaries),
cp2 with activation checkpointing, cp2 with ZeRO-1 and ZeRO-2 on 2 processes; cp4, cp2 x dp2 with ZeRO-3, cp2 x tp2 and pp2 x cp2 on 4; while the pytest process trains the same
batches on one device. Compared (bound 1e-5):

* every token's loss before training (the model's fused per-token losses of each rank's slice, put back in column
  order) against one device's;
* every gradient of the first step (after the ``dp x cp`` reduction; gathered full) against one device's, per tensor
  within 1e-5 of its largest entry (the harness's check: ``testing.run_layouts_and_reference``);
* ``train_loss`` at each step, on every rank, and (dp = 1) the evaluation loss of the first batch.

The 2-process launch then saves a cp2 run after 2 steps and resumes it at tp2, and a one-process launch resumes it
too: steps 3-4 must be the uninterrupted one-device curve's. The 2- and 4-process launches also call the model
directly at cp2 and cp4 in float64
on both attention paths (``attention=sdpa``: the CPU's masks; ``attention=varlen``: the device path's layouts with the
CPU reference kernel) against one device, the ``debug`` decoder and the Multi-head Latent Attention of
``debug-deepseek-v3``: packed rows with padding, and rows four times longer than the position tables (1024 tokens,
tables of 256: cp4's slices of 256 look nothing up past them). One-process tests check the slicing, the block attention against float64 and the
task declaration; 2-process CLI runs check the one-line refusals.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

SEQ = 4096
STEPS = 4  # the first step's gradients carry the comparison; the curve shows the steps after it
HALF = 2  # the resume tests save after this many steps
TOL = 1e-5
PACKED_LENGTHS = (1000, 777, 1500, 300, 519)  # examples of a packed row, repeated: crossing the slices' boundaries
PROMPT = 400  # the first tokens of each packed example are not learned (SFT's prompt)
LAYOUTS2 = ["cp2", "cp2_packed", "cp2_recompute", "cp2_zero1", "cp2_zero2"]  # 2 processes
LAYOUTS4 = ["cp4", "cp2_dp2_zero3", "cp2_tp2", "pp2_cp2"]  # 4 processes


def _strategy(name: str) -> tuple[Any, int]:
    """(strategy, per-rank batch size) of a layout: 2 rows per step in all."""
    from lightning_llm.strategies import ContextParallelStrategy, HybridParallelStrategy

    return {"cp2": (ContextParallelStrategy(), 2),
            "cp2_packed": (ContextParallelStrategy(), 2),
            "cp2_recompute": (ContextParallelStrategy(activation_checkpointing=True), 2),  # the gather runs again
            "cp2_zero1": (ContextParallelStrategy(zero_stage=1), 2),  # optimizer states partitioned over dp x cp
            "cp2_zero2": (ContextParallelStrategy(zero_stage=2), 2),  # gradients reduced to their owner
            "cp4": (ContextParallelStrategy(), 2),
            "cp2_dp2_zero3": (HybridParallelStrategy(data_parallel_size=2, context_parallel_size=2, zero_stage=3), 1),
            "cp2_tp2": (HybridParallelStrategy(data_parallel_size=1, context_parallel_size=2,
                                               tensor_parallel_size=2), 2),
            "pp2_cp2": (HybridParallelStrategy(data_parallel_size=1, context_parallel_size=2,
                                               pipeline_parallel_size=2, n_microbatches=2), 2)}[name]


def pack_rows(batch: dict[str, torch.Tensor], lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    b, s = batch["input_ids"].shape
    seg, pos = torch.zeros(s, dtype=torch.long), torch.zeros(s, dtype=torch.long)
    labels = batch["labels"].clone()
    start, k = 0, 0
    while start < s:
        n = min(lengths[k % len(lengths)], s - start)
        seg[start:start + n] = k + 1
        pos[start:start + n] = torch.arange(n)
        labels[:, start:start + min(n, PROMPT)] = -100  # a prompt: the slices hold very different label counts
        labels[:, start + n - 1] = -100  # an example's last token predicts nothing of it
        start, k = start + n, k + 1
    return {**batch, "labels": labels, "segment_ids": seg.expand(b, s).clone(), "position_ids": pos.expand(b, s).clone()}


class Probe(pl.Callback):
    """Every token's loss before training (in column order, from every rank's slice) and the evaluation loss of the
    first batch."""

    def __init__(self) -> None:
        self.token_losses: torch.Tensor | None = None
        self.rows = 0
        self.eval_loss = float("nan")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step or self.token_losses is not None:
            return
        from lightning_llm.strategies.context import family_spec, order_gathered, shard_batch

        cp = pl_module.capabilities.context_parallel_size
        local = batch
        if cp > 1:
            rank = trainer.strategy.cp_rank
            local = shard_batch(batch, cp=cp, rank=rank, positions=family_spec(pl_module.model).segment_positions)
        kw = {k: local[k] for k in ("position_ids", "segment_ids") if k in local}
        with torch.no_grad():
            losses = pl_module.run_model(local["input_ids"], labels=local["labels"], reduction="none", **kw)
        with torch.no_grad():  # the evaluation loss of the rows (under cp: the slices weighted by their tokens)
            self.eval_loss = float(pl_module._eval_step(local, "val"))
        losses = losses.full_tensor() if hasattr(losses, "full_tensor") else losses
        if cp > 1:
            parts = [torch.empty_like(losses) for _ in range(cp)]
            torch.distributed.all_gather(parts, losses.contiguous(), group=trainer.strategy.context_parallel_group)
            losses = order_gathered(parts, dim=1)
        self.token_losses = losses.detach().clone()
        self.rows = getattr(trainer.strategy, "dp_rank", 0) * losses.shape[0]  # the first global row it holds


def _fit(strategy: Any, devices: int, out: Path, *, packed: bool, batch_size: int = 2, steps: int = STEPS,
         save: bool = False, ckpt_path: Path | None = None, grads: str | None = None) -> dict[str, Any]:
    """``steps`` steps; the first step's gradients recorded as ``grads`` (against the one-device ``plain`` or
    ``packed`` run)."""
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(7)
    class PackedText(TextDataModule):
        def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            return pack_rows(super()._collate(examples), PACKED_LENGTHS)

    dm = (PackedText if packed else TextDataModule)(block_size=SEQ, batch_size=batch_size, cache_dir=str(out / "cache"),
                                                    generated_docs=400, val_fraction=0.0)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    rec, probe = LoggedLoss(grads=grads, reference="packed" if packed else "plain"), Probe()
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=[rec, probe],
                            save_every_step=save)
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    return {"losses": rec.losses, "tokens": (probe.rows, probe.token_losses), "start": rec.start,
            "eval": probe.eval_loss}


def _resume(mode: str, out: Path) -> None:
    """``resume``: ``HALF`` steps at cp=2 saving a checkpoint, then the rest from it at tp=2 (2 processes);
    ``resume_single``: the same rest on one process (``3d`` with every degree 1)."""
    from lightning_llm.strategies import ContextParallelStrategy, HybridParallelStrategy
    from lightning_llm.testing import write_json_on_rank0

    saved = out / "cp2_save"
    if mode == "resume":
        _fit(ContextParallelStrategy(), 2, saved, packed=False, steps=HALF, save=True)
        tp2 = _fit(HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2, out / "tp2_resume",
                   packed=False, ckpt_path=saved / "ckpt" / "last.ckpt")
        write_json_on_rank0(out / "resume_tp2.json", {"start": tp2["start"], "losses": tp2["losses"]})
    else:
        one = _fit(HybridParallelStrategy(data_parallel_size=1), 1, out / "single_resume", packed=False,
                   ckpt_path=saved / "ckpt" / "last.ckpt")
        write_json_on_rank0(out / "resume_single.json", {"start": one["start"], "losses": one["losses"]})


DIRECT_TOL = 1e-9  # float64
DIRECT_MODELS = {"debug": "", "debug-deepseek-v3": "mla "}
"""Models called directly at cp (dense: float64 throughout): GQA, and Multi-head Latent Attention (values narrower
than the keys, its own softmax scale)."""


def _direct_batches() -> dict[str, dict[str, torch.Tensor]]:
    """Packed rows with padding (row 0: padding at the end; row 1: left-padded) and a row past the tables."""
    from lightning_llm.models.layers.masks import segment_positions

    g = torch.Generator().manual_seed(3)
    s = 512
    seg = torch.zeros(2, s, dtype=torch.long)
    for r, edges in enumerate(([0, 100, 177, 327, 357, 480], [0, 61, 250, 251, 400, s])):
        for k, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=False)):
            seg[r, a:b] = k + 1
    keep = torch.ones(2, s, dtype=torch.long)
    keep[1, :9] = 0
    labels = torch.randint(0, 200, (2, s), generator=g).masked_fill_((seg == 0) | (keep == 0), -100)
    packed = {"input_ids": torch.randint(0, 200, (2, s), generator=g), "labels": labels, "segment_ids": seg,
              "attention_mask": keep, "position_ids": segment_positions(seg)}
    long_ids = torch.randint(0, 200, (1, 1024), generator=g)
    return {"packed_padded": packed, "past_tables": {"input_ids": long_ids, "labels": long_ids.roll(-1, 1)}}


def _direct_errors(one: Any, split: Any, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Per-token losses (every column, gathered in order) and summed gradients of ``split`` (this process's cp slice)
    against ``one`` on the whole batch (from logits: the fused loss sums the head's gradient in fp32)."""
    import torch.distributed as dist

    from lightning_llm.models.layers.masks import segment_positions
    from lightning_llm.strategies.context import order_gathered, shard_batch

    cp, rank = dist.get_world_size(), dist.get_rank()
    keys = ("attention_mask", "segment_ids", "position_ids")
    def token_losses(model: Any, rows: dict[str, torch.Tensor]) -> torch.Tensor:  # from float64 logits [B, S]
        logits = model(rows["input_ids"], **{k: rows[k] for k in keys if k in rows})
        return torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows["labels"], reduction="none")

    ref = token_losses(one, batch)
    want = torch.autograd.grad(ref.sum(), list(one.parameters()))
    got = token_losses(split, shard_batch(batch, cp=cp, rank=rank, positions=segment_positions))
    grads = torch.autograd.grad(got.sum(), list(split.parameters()))
    for grad in grads:
        dist.all_reduce(grad)
    parts = [torch.empty_like(got) for _ in range(cp)]
    dist.all_gather(parts, got.detach().contiguous())
    tokens = (order_gathered(parts, dim=1) - ref).abs().max().item()
    return tokens, max((a - b).abs().max().item() for a, b in zip(grads, want, strict=True))


def _direct(out: Path) -> None:
    """The model at cp = the world size against one device, float64, both attention paths (``_direct_batches``)."""
    import copy
    import json

    import torch.distributed as dist

    from lightning_llm.models import build_model
    from lightning_llm.strategies.context import apply_context_parallel

    results = {}
    for attention in ("sdpa", "varlen"):
        for backbone, prefix in DIRECT_MODELS.items():
            torch.manual_seed(0)
            one = build_model(backbone, family="decoder", dropout=0.0, attention=attention, moe=None).double()
            split = copy.deepcopy(one)
            apply_context_parallel(split, group=dist.group.WORLD, cp=dist.get_world_size(), rank=dist.get_rank())
            for rows, batch in _direct_batches().items():
                results[f"{prefix}{rows} {attention}"] = _direct_errors(one, split, batch)
    if dist.get_rank() == 0:
        (out / f"direct_cp{dist.get_world_size()}.json").write_text(json.dumps(results))


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing import gathered

    if mode.startswith("resume"):
        _resume(mode, out)
        return
    if mode == "reference":
        torch.save({"plain": _fit("auto", 1, out, packed=False, grads="plain"),
                    "packed": _fit("auto", 1, out, packed=True, grads="packed")}, out / "reference.pt")
        return
    results = {}
    for layout in LAYOUTS2 if mode == "layouts" else LAYOUTS4:
        strategy, batch_size = _strategy(layout)
        every = gathered(_fit(strategy, int(os.environ["WORLD_SIZE"]), out, packed=layout.endswith("packed"),
                              batch_size=batch_size, grads=layout))
        results[layout] = {"losses": [r["losses"] for r in every], "tokens": [r["tokens"] for r in every],
                           "eval": [r["eval"] for r in every]}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / f"{mode}.pt")
    _direct(out)
    if mode == "layouts":  # in the same process group: the cp2 checkpoint, resumed at tp2
        _resume("resume", out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference

    out = tmp_path_factory.mktemp("context_parallel")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=1200,
                                     then=((4, "layouts4"), (1, "resume_single")))


def _errors(run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float]:
    whole = ref["tokens"][1]
    assert sorted({(r, len(t)) for r, t in run["tokens"]}) in ([(0, 2)], [(0, 1), (1, 1)])  # every row compared
    tokens = max((t - whole[r:r + len(t)]).abs().max().item() for r, t in run["tokens"])
    loss = max(abs(a - b) for curve in run["losses"] for a, b in zip(curve, ref["losses"], strict=True))
    if all(r == 0 for r, _ in run["tokens"]):  # every rank holds both rows (dp = 1): the rows' evaluation loss
        loss = max(loss, *(abs(e - ref["eval"]) for e in run["eval"]))
    return tokens, loss


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS2, *LAYOUTS4])
def test_context_parallel_equals_one_device(runs: Path, layout: str) -> None:
    from lightning_llm.testing import gradient_summary

    refs = torch.load(runs / "reference.pt")
    ref = refs["packed" if layout.endswith("packed") else "plain"]
    assert len(ref["losses"]) == STEPS and ref["losses"][0] - ref["losses"][-1] > 0.05  # it trains
    assert ref["tokens"][1].shape == (2, SEQ)
    run = torch.load(runs / ("layouts4.pt" if layout in LAYOUTS4 else "layouts.pt"))[layout]
    tokens, loss = _errors(run, ref)
    print(f"{layout} vs one device at {SEQ} tokens: per-token losses {tokens:.2e}, train_loss over {STEPS} steps "
          f"{loss:.2e}; {gradient_summary(runs, layout)}")
    assert tokens <= TOL and loss <= TOL



@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["tp2", "single"])
def test_cp2_checkpoint_resumes_at_other_layouts(runs: Path, target: str) -> None:
    """cp shards no parameter: a run saved at cp=2 resumes at tp=2 and on one process on the uninterrupted curve."""
    from lightning_llm.testing import resumed_curve_error

    err = resumed_curve_error(runs / f"resume_{target}.json", torch.load(runs / "reference.pt")["plain"]["losses"], start=HALF)
    print(f"cp2 -> {target}: steps {HALF + 1}-{STEPS} vs one device uninterrupted: {err:.2e}")
    assert err <= TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_model_under_cp_equals_one_device_on_both_attention_paths(runs: Path, cp: int) -> None:
    """Packed rows with padding, and a row of 1024 tokens past the tables of 256 (cp4: slices of 256): per-token
    losses and summed gradients at cp equal one device's in float64, on the mask path and on the varlen path."""
    import json

    errors = json.loads((runs / f"direct_cp{cp}.json").read_text())
    assert set(errors) == {f"{m}{r} {a}" for m in DIRECT_MODELS.values() for r in ("packed_padded", "past_tables")
                           for a in ("sdpa", "varlen")}
    for case, (tokens, grads) in errors.items():
        print(f"cp{cp} {case}: per-token losses {tokens:.1e}, gradients {grads:.1e}")
        assert tokens <= DIRECT_TOL and grads <= DIRECT_TOL


# ------------------------------------------------------------------------------------------- one process, no launch
def test_slices_and_their_order() -> None:
    """Rank r holds chunks r and 2cp-1-r; the ranks' slices put back in order are the row; positions are global."""
    from lightning_llm.strategies.context import local_columns, order_gathered, shard_batch

    for cp in (1, 2, 4):
        cols = [local_columns(16, cp, r) for r in range(cp)]
        c = 16 // (2 * cp)
        assert cols[0][:c].tolist() == list(range(c)) and cols[-1][c:].tolist() == list(range(cp * c, (cp + 1) * c))
        assert torch.equal(order_gathered([x[None] for x in cols], dim=1)[0], torch.arange(16))
    batch = {"input_ids": torch.arange(32).view(2, 16), "labels": torch.arange(32).view(2, 16) + 1,
             "reference_logps": torch.tensor([1.0, 2.0])}
    part = shard_batch(batch, cp=2, rank=1, positions=None)
    assert part["input_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    assert part["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(part["labels"], part["input_ids"] + 1) and torch.equal(part["reference_logps"],
                                                                              batch["reference_logps"])
    with pytest.raises(ValueError, match="must be divisible by 2 x context_parallel_size = 8"):
        shard_batch({"input_ids": torch.zeros(1, 12, dtype=torch.long)}, cp=4, rank=0, positions=None)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_block_attention_equals_causal_attention_in_float64(cp: int) -> None:
    """The causal path (CPU flash blocks merged by log-sum-exp, GQA heads repeated per block; backward per block
    from the merged output) against float64 SDPA on the whole row: every rank's output and the summed gradients; with
    a softmax scale of its own (MLA's) too."""
    from lightning_llm.strategies.context.attention import _CausalChunks
    from lightning_llm.strategies.context.sharding import local_columns

    torch.manual_seed(0)
    b, n, k, s, d = 2, 4, 2, 64, 16
    q, key, v = (torch.randn(b, h, s, d, requires_grad=True) for h in (n, k, k))
    for scale in (None, 0.4):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), key.double().repeat_interleave(n // k, 1), v.double().repeat_interleave(n // k, 1),
            is_causal=True, scale=scale)
        go = torch.randn_like(ref)
        want = torch.autograd.grad(ref, (q, key, v), go)
        got = [torch.zeros_like(t) for t in (q, key, v)]
        for r in range(cp):
            cols = local_columns(s, cp, r)
            out = _CausalChunks.apply(q[:, :, cols], key, v, (r, 2 * cp - 1 - r), s // (2 * cp), scale)
            assert (out.double() - ref[:, :, cols]).abs().max() < 1e-6
            for acc, g in zip(got, torch.autograd.grad(out, (q, key, v), go[:, :, cols].float()), strict=True):
                acc += g
        # fp32 flash blocks against float64: relative to each gradient's largest value (scale 0.4 sharpens the scores)
        assert max(((g.double() - w).abs().max() / w.abs().max()).item()
                   for g, w in zip(got, want, strict=True)) < 1e-6


def test_the_mask_across_slices_is_built_once_per_forward_and_dropped_with_it() -> None:
    """Every attention core of a model shares one mask per forward (one TokenMask): built by the first layer, the
    same tensor for the others (and saved once for backward), rebuilt for the next forward, released with its
    TokenMask."""
    import gc

    from lightning_llm.models.layers.block import TokenMask
    from lightning_llm.strategies.context.attention import SharedMask

    shared, builds = SharedMask(), []

    def build() -> torch.Tensor:
        builds.append(torch.ones(1, 1, 4, 8, dtype=torch.bool))
        return builds[-1]

    first = TokenMask(keep=torch.ones(1, 4, dtype=torch.bool))
    masks = [shared.get(first, torch.bool, build) for _ in range(4)]  # four layers of one forward
    assert len(builds) == 1 and all(m is builds[0] for m in masks)
    second = TokenMask(keep=torch.ones(1, 4, dtype=torch.bool))
    assert shared.get(second, torch.bool, build) is builds[1] and len(builds) == 2
    del first
    gc.collect()
    assert shared._mask is builds[1]  # an older forward's mask going does not drop the newer one
    del second
    gc.collect()
    assert shared._mask is None


def test_tasks_declare_context_parallel() -> None:
    """A library token-mean task passes; one without the declaration, and a subclass overriding a loss hook without
    declaring it again, are refused naming the class."""
    from lightning_llm.contract import check_context_parallel
    from lightning_llm.tasks import CausalLMTask, DPOTask

    class OwnLoss(CausalLMTask):
        def loss_from_output(self, output: Any, batch: Any, stage: str) -> Any:
            return super().loss_from_output(output, batch, stage)

    class Declared(OwnLoss):
        context_parallel = True

    check_context_parallel(CausalLMTask.__new__(CausalLMTask), cp=2)
    check_context_parallel(Declared.__new__(Declared), cp=2)
    with pytest.raises(ValueError, match="DPOTask does not declare context_parallel = True"):
        check_context_parallel(DPOTask.__new__(DPOTask), cp=2)
    with pytest.raises(ValueError, match="OwnLoss overrides loss_from_output after CausalLMTask declared"):
        check_context_parallel(OwnLoss.__new__(OwnLoss), cp=2)


@pytest.mark.parametrize("part", ["cp", "dp", "pp"])
def test_a_part_without_labelled_tokens_weighs_nothing(part: str) -> None:
    """A context-parallel slice, data-parallel replica or pipeline micro-batch holding only prompt tokens: its loss
    is 0 with weight 0 (the global mean is the other parts'), not NaN that would poison the weighted sum; a global
    batch without labels is NaN at every layout, as on one device (the non-finite guard sees the same batches)."""
    from lightning_llm.contract import Capabilities
    from lightning_llm.tasks import CausalLMTask

    class Parted(CausalLMTask):
        parts = 2

        @property
        def capabilities(self) -> Capabilities:
            n = self.parts
            return {"cp": Capabilities(context_parallel_size=n), "dp": Capabilities(data_parallel_size=n),
                    "pp": Capabilities(pipelined=n > 1)}[part]

    task = Parted("debug", dropout=0.0)
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.full((1, 8), -100)}
    for fused, output in ((True, torch.zeros(1, 8)), (False, torch.zeros(1, 8, 256))):  # per-token losses, logits
        task.uses_fused_loss = lambda fused=fused: fused  # type: ignore[method-assign]
        task.parts = 2
        assert task.model_inputs(batch, "train")[1].get("reduction") == ("none" if fused else None)
        loss, _ = task.loss_from_output(output, batch, "train")
        assert loss.item() == 0.0 and task.loss_weight(batch) == 0.0
        # no process group here: the "global" batch is this part alone, which has no labels -> NaN for the guard
        local, global_loss, total = task.global_train_loss(loss, task.loss_weight(batch))
        assert total == 0 and torch.isnan(local) and torch.isnan(global_loss)
        task.parts = 1
        assert torch.isnan(task.loss_from_output(output, batch, "train")[0])
    labelled = dict(batch, labels=torch.arange(8).reshape(1, 8))
    task.parts, task.uses_fused_loss = 2, lambda: True  # type: ignore[method-assign]
    loss, _ = task.loss_from_output(torch.ones(1, 8), labelled, "train")  # per-token losses of 1
    local, global_loss, total = task.global_train_loss(loss, task.loss_weight(labelled))
    assert total == 8 and local.item() == global_loss.item() == 1.0


def test_rows_past_the_position_tables() -> None:
    """The debug decoder's tables hold 256 positions. RoPE past them is computed from the positions, on one device
    and on a slice alike, so a 1024-token row splits over cp4 into 256-token slices (compared with one device by the
    runs above); a learned position table (one device refuses the row too) and dynamic RoPE (its frequencies follow
    the whole row's longest position) refuse rows past the tables in one line, before the forward."""
    from lightning_llm.models import DecoderLM, named_config
    from lightning_llm.strategies.context import slice_step

    row = {"input_ids": torch.randint(0, 200, (1, 1024)), "labels": torch.randint(0, 200, (1, 1024))}
    model = DecoderLM(named_config("debug", family="decoder"))
    (sliced, _), _ = slice_step("training_step", (row, 0), {}, cp=4, rank=0, model=model)
    assert sliced["input_ids"].shape == (1, 256) and int(sliced["position_ids"].max()) == 1023
    assert model(sliced["input_ids"], position_ids=sliced["position_ids"]).isfinite().all()
    for overrides in ({"position": "learned"}, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}):
        model = DecoderLM(named_config("debug", family="decoder", **overrides))
        with pytest.raises(ValueError, match=r"rows of 512 tokens are longer than the model's "
                                             r"max_position_embeddings=256, past which its positions depend on the "
                                             r"whole row"):
            slice_step("training_step", ({k: v[:, :512] for k, v in row.items()}, 0), {}, cp=2, rank=0, model=model)
        short = {k: v[:, :256] for k, v in row.items()}
        (sliced, _), _ = slice_step("training_step", (short, 0), {}, cp=2, rank=0, model=model)
        assert sliced["input_ids"].shape == (1, 128) and int(sliced["position_ids"].max()) == 255


# ------------------------------------------------------------------------------------------- refusals (2 processes)
REPO = Path(__file__).resolve().parents[2]
REFUSALS = {
    "odd_length": (["--config", "configs/pretrain_debug.yaml", "--data.block_size=30",
                    "--trainer.enable_checkpointing=false"],
                   "the sequence length 30 must be divisible by 2 x context_parallel_size = 4"),
    "sliding_window": (["--config", "configs/pretrain_debug.yaml", "--model.backbone=debug-mistral",
                        "--trainer.enable_checkpointing=false"],
                       "sliding-window attention (sliding_window=8 on layers [0, 1, 2, 3]) is not supported"),
    "dpo": (["--config", "configs/dpo.yaml"], "DPOTask does not declare context_parallel = True"),
    "ppo": (["--config", "configs/ppo.yaml"], "PPOTask does not declare context_parallel = True"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(REFUSALS))
def test_unsupported_combination_refused_in_one_line(tmp_path: Path, case: str) -> None:
    from lightning_llm.testing import one_error_line_from_ranks, torchrun_cli_fails

    args, expected = REFUSALS[case]
    out = torchrun_cli_fails(["fit", *args, "--trainer.strategy=cp", "--trainer.devices=2", "--trainer.max_steps=1",
                              "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"], REPO, timeout=300)
    line = one_error_line_from_ranks(out)
    print(line)
    assert expected in line


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
