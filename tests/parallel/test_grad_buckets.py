"""Bucketed, asynchronous data-parallel gradient reduction (``strategies/engine/grad_buckets.py``).

One torchrun launch (2 CPU processes, gloo) runs:

* the reducer alone on hand-made gradients, against the mean of every rank's gradients gathered separately: several
  buckets, a gradient only one rank has (averaged with a zero), one no rank has (stays ``None``), ZeRO-2's reduce to
  owners (the other ranks drop theirs), the bucketed owner broadcast, and a second backward before the step (refused);
* Lightning fits with buckets of 0.05 MiB (10-12 buckets for the debug decoder's 39 tensors) under ZeRO 0, 1 and 2
  with ``accumulate_grad_batches=2`` and global-norm clipping, counting the collectives of every batch
  (:class:`~lightning_llm.testing.CollectiveCounter`); a pipeline of a tied-embedding decoder with accumulation; and
  ZeRO-2 under manual optimization (backward, ``clip_gradients``, ``step``: PPO's order, the clip waits for the
  buckets);

after the pytest process ran the same fits on one device. Asserted: every parameter's gradient of the first optimizer
step (summed over the accumulation window, after the bucketed reduction) and per-batch losses equal one device's
(per tensor within 1e-5 of its largest entry: the harness's check; losses 1e-5); the
gradient collectives of an optimizer step are exactly one per bucket, all launched before backward returns, and an
accumulation micro-batch sends none; ZeRO-2 keeps half the gradient bytes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    gradient_summary,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    write_json_on_rank0,
)

STEPS = 3  # optimizer steps
ACC = 2  # micro-batches per step
GLOBAL_BATCH = 8
BUCKET_MB = 0.05
TOL = 1e-5
GRAD_MIN_ELEMENTS = 64  # gradient buckets move >= 64 elements; the logged loss, norm and guard decisions 1-2
LAYOUTS = ["zero0", "zero1", "zero2", "pp_tied", "zero2_manual"]


# ---------------------------------------------------------------------------------------------------- the reducer
def _reducer_cases() -> dict[str, Any]:
    """The reducer on gradients set by hand (rank ``r`` holds ``(r + 1) * base``), against the mean of the gathered
    local gradients."""
    import torch.distributed as dist
    from torch import nn

    from lightning_llm.strategies.engine.grad_buckets import GradReducer

    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (3000, 70, 5000, 11, 2000, 600, 900)]
    missing_here = {1} if rank == 1 else set()  # param 1: a gradient only rank 0 has; param 3: none has
    out: dict[str, Any] = {}

    def backward(reducer: GradReducer) -> list[torch.Tensor | None]:
        local = []
        for i, p in enumerate(params):
            g = None if i == 3 or i in missing_here else (rank + 1) * torch.linspace(-1, 1, p.numel())
            local.append(g)
        for i in reversed(range(len(params))):  # as backward would: last layer first, through the hooks
            if local[i] is not None:
                loss = (params[i] * local[i]).sum()
                loss.backward()
        return local

    def expected(local: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        every = gathered([None if g is None else g.tolist() for g in local])
        mean = []
        for i, p in enumerate(params):
            have = [torch.tensor(e[i]) for e in every if e[i] is not None]
            mean.append(None if not have else sum(have) / world)
        return mean

    for mode in ("all_reduce", "owners"):
        owner_of = (lambda p: [id(q) for q in params].index(id(p)) % world) if mode == "owners" else None
        reducer = GradReducer(params, group=group, world=world, rank=rank, bucket_size_mb=0.002, owner_of=owner_of)
        hooks = reducer.register_hooks()
        for p in params:
            p.grad = None
        want = expected(backward(reducer))
        launched = reducer._next  # buckets whose collective backward itself started
        reducer.finish()
        errs, nones = [], []
        for i, p in enumerate(params):
            mine = owner_of is None or owner_of(p) == rank
            if want[i] is None or not mine:
                nones.append(p.grad is None)
            else:
                errs.append((p.grad - want[i]).abs().max().item())
        flat_sizes = sorted((sum(p.numel() for p in b.params) + len(b.params)) * 4 for b in reducer.buckets)
        out[mode] = {"buckets": len(reducer.buckets), "launched_in_backward": launched, "max_err": max(errs),
                     "none_where_expected": all(nones), "peak_in_flight": reducer.peak_in_flight_bytes,
                     "two_largest_buckets": sum(flat_sizes[-2:])}
        try:  # a second gradient for a parameter before finish() is refused
            for p in params:
                p.grad = None
            backward(reducer)
            backward(reducer)
            out[mode]["second_backward"] = "accepted"
        except RuntimeError as e:
            out[mode]["second_backward"] = str(e)
        finally:  # what the first backward launched, then a fresh round
            while reducer._in_flight:
                reducer._in_flight.popleft().work.wait()
            reducer._arrived.clear()
            for b in reducer.buckets:
                b.ready = 0
            reducer._next = 0
        for h in hooks:
            h.remove()

    late = nn.Parameter(torch.zeros(3))  # frozen at set-up, unfrozen later: its gradient would not be averaged
    reducer = GradReducer(params, group=group, world=world, rank=rank, bucket_size_mb=0.002, frozen=[("late", late)])
    late.grad = torch.ones(3)
    try:
        reducer.finish()
        out["unfrozen_later"] = "accepted"
    except RuntimeError as e:
        out["unfrozen_later"] = str(e)

    return out


def _broadcast_cases() -> dict[str, Any]:
    """The ZeRO-1/2 parameter broadcast: packed parameters become views of their bucket's buffer and receive the
    owner's values in place; a parameter whose storage is aliased on one rank stays unpacked on every rank."""
    import torch.distributed as dist
    from torch import nn

    from lightning_llm.strategies.engine.grad_buckets import OwnerBroadcast
    from lightning_llm.strategies.engine.hybrid_checkpoint import full_weights

    rank, world = dist.get_rank(), dist.get_world_size()
    params = [nn.Parameter(torch.full((n,), float(i))) for i, n in enumerate((300, 70, 500, 11, 200))]
    before = [(id(p), p.shape) for p in params]
    alias = params[2].data if rank == 1 else None  # a `.data` alias held on one rank only: it must not go stale
    owners = [i % world for i in range(len(params))]
    broadcast = OwnerBroadcast(params, owners, group=dist.group.WORLD, rank=rank, bucket_size_mb=0.001)
    flats = [b.flat.untyped_storage().data_ptr() for b in broadcast.buckets if b.flat is not None]
    packed = [p.untyped_storage().data_ptr() in flats for p in params]
    kept = all(bool((p == i).all()) for i, p in enumerate(params)) and [(id(p), p.shape) for p in params] == before
    with torch.no_grad():
        for i, p in enumerate(params):  # each rank's "step": only the owners' values may survive
            p.fill_(100 * rank + i)
    broadcast()
    # Params 1 and 3 share a bucket's buffer: a full-weights export must not save the whole buffer for each.
    full = full_weights(nn.ParameterList(params))
    return {"packed": packed, "values_kept": kept, "owners_of_buckets": [b.owner for b in broadcast.buckets],
            "received": all(bool((p == 100 * o + i).all()) for i, (p, o) in enumerate(zip(params, owners))),
            "alias_follows": alias is None or bool((alias == params[2]).all()),
            "export_storage_bytes": [v.untyped_storage().nbytes() for v in full.values()],
            "export_bytes": [v.nbytes for v in full.values()],
            "export_equal": all(bool((v == p).all()) for v, p in zip(full.values(), params))}


# ---------------------------------------------------------------------------------------------------- fits
class ManualClip:
    """Mixed into CausalLMTask: a user's manual-optimization loop (zero_grad, backward, clip by norm, step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        return loss


def _strategy(layout: str) -> tuple[Any, int]:
    from lightning_llm.strategies import HybridParallelStrategy, PipelineParallelStrategy, ZeroStrategy

    if layout == "zero0":
        return HybridParallelStrategy(data_parallel_size=2, bucket_size_mb=BUCKET_MB), GLOBAL_BATCH // 2
    if layout == "pp_tied":
        return PipelineParallelStrategy(n_microbatches=2, bucket_size_mb=BUCKET_MB), GLOBAL_BATCH
    return ZeroStrategy(stage=int(layout[4]), bucket_size_mb=BUCKET_MB), GLOBAL_BATCH // 2


class _Probe(LoggedLoss):
    """Also: buckets launched when backward returned, and the model-state bytes, at each optimizer step."""

    def __init__(self, grads: str) -> None:
        super().__init__(grads=grads)
        self.launched: list[int] = []
        self.bytes: dict[str, int] = {}
        self.batch = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batch = batch_idx

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        reducer = getattr(trainer.strategy, "grad_reducer", None)
        if reducer is not None and (self.batch + 1) % ACC == 0 and not trainer.strategy.pipelined:
            self.launched.append(reducer._next)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.bytes = model_state_bytes(pl_module, trainer.optimizers)


def _fit(layout: str, devices: int, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import CollectiveCounter

    strategy, batch = _strategy(layout) if devices > 1 else ("auto", GLOBAL_BATCH)
    manual = layout.endswith("_manual")
    pl.seed_everything(5)
    # eps=1: AdamW's update ~ lr x gradient, so a wrong average or clipping norm moves the losses.
    cls = type("ManualCausalLM", (ManualClip, CausalLMTask), {}) if manual else CausalLMTask
    task = cls("debug-qwen2" if layout == "pp_tied" else "debug", dropout=0.0,
               optim=OptimConfig(lr=2.0, eps=1.0, weight_decay=0.0, scheduler="constant"))
    dm = TextDataModule(block_size=32, batch_size=batch, cache_dir=str(out / "cache"), generated_docs=100)
    probe, counter = _Probe(grads=layout), CollectiveCounter()  # one device: recorded as the layout's reference
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=1 if manual else ACC,
                         gradient_clip_val=None if manual else 0.05, callbacks=[probe, counter],
                         default_root_dir=str(out))
    trainer.fit(task, dm)
    row: dict[str, Any] = {"losses": probe.losses}
    if devices > 1:
        import torch.distributed as dist

        dp = ",".join(map(str, dist.get_process_group_ranks(trainer.strategy._dp_group)))
        grad_ops = ("reduce",) if layout.startswith("zero2") else ("all_reduce",)
        row.update(
            buckets=len(trainer.strategy.grad_reducer.buckets), launched=probe.launched, bytes=probe.bytes,
            tensors=sum(1 for p in task.parameters() if p.requires_grad),
            param_bytes=sum(p.numel() * p.element_size() for p in task.parameters()),
            grad_calls=[sum(counter.count(i, op, group=dp, min_elements=GRAD_MIN_ELEMENTS) for op in grad_ops)
                        for i in range(len(counter.steps))],
            broadcasts=[counter.count(i, "broadcast", group=dp, min_elements=GRAD_MIN_ELEMENTS)
                        for i in range(len(counter.steps))])
    return row


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        (out / "reference.json").write_text(json.dumps({layout: _fit(layout, 1, out) for layout in LAYOUTS}))
        return
    results: dict[str, Any] = {layout: gathered(_fit(layout, 2, out)) for layout in LAYOUTS}
    results["reducer"] = gathered(_reducer_cases())  # on the process group the fits set up
    results["broadcast"] = gathered(_broadcast_cases())
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("grad_buckets")
    run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=900)
    return {"ref": json.loads((out / "reference.json").read_text()),
            "got": json.loads((out / "layouts.json").read_text()), "out": out}


@pytest.mark.multiprocess
def test_reducer_matches_the_mean_of_every_ranks_gradients(runs: dict[str, Any]) -> None:
    for rank, r in enumerate(runs["got"]["reducer"]):
        for mode in ("all_reduce", "owners"):
            case = r[mode]
            print(f"rank {rank} {mode}: {case}")
            # Buckets leave in order: the first holding a parameter without a gradient waits for finish().
            assert case["buckets"] >= 4 and 2 <= case["launched_in_backward"] < case["buckets"]
            assert case["max_err"] <= 1e-6 and case["none_where_expected"]
            assert 0 < case["peak_in_flight"] <= case["two_largest_buckets"]  # at most two flat copies alive
            assert "received a second gradient before the optimizer step" in case["second_backward"]
        assert r["unfrozen_later"].startswith("late: frozen when training started")


@pytest.mark.multiprocess
def test_owner_broadcast_moves_packed_parameters_in_place(runs: dict[str, Any]) -> None:
    got = runs["got"]["broadcast"]
    for rank, r in enumerate(got):
        print(f"rank {rank}: {r}")
        assert r["packed"] == [True, True, False, True, True]  # parameter 2 is aliased on rank 1 only
        assert r["values_kept"] and r["received"] and r["alias_follows"]
        assert r["export_equal"] and r["export_storage_bytes"] == r["export_bytes"]  # torch.save writes no bucket
    assert got[0]["owners_of_buckets"] == got[1]["owners_of_buckets"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bucketed_layout_matches_one_device(runs: dict[str, Any], layout: str) -> None:
    ref = runs["ref"][layout]["losses"]
    assert len(ref) == STEPS * (1 if layout.endswith("_manual") else ACC) and ref[0] - ref[-1] > 0.05  # it learns
    for rank, r in enumerate(runs["got"][layout]):
        err = max_abs_err(r["losses"], ref)
        print(f"{layout} rank {rank}: max |train_loss - one device| over {len(ref)} micro-batches = {err:.2e}; "
              f"{gradient_summary(runs['out'], layout)}")
        assert err <= TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["zero0", "zero1", "zero2"])
def test_one_collective_per_bucket_launched_during_backward(runs: dict[str, Any], layout: str) -> None:
    for rank, r in enumerate(runs["got"][layout]):
        n, calls, casts = r["buckets"], r["grad_calls"], r["broadcasts"]
        print(f"{layout} rank {rank}: {r['tensors']} tensors in {n} buckets; gradient collectives per batch {calls}, "
              f"parameter broadcasts {casts}; launched before backward returned {r['launched']}; bytes {r['bytes']}")
        assert 4 <= n < r["tensors"]  # buckets, not one collective per parameter
        assert calls[0::ACC] == [0] * STEPS  # accumulation micro-batches communicate nothing
        assert calls[ACC - 1::ACC] == [n] * STEPS  # one collective per bucket per optimizer step
        assert r["launched"] == [n] * STEPS  # every bucket's collective started inside backward (overlap)
        max_casts = 2 + math.ceil(r["param_bytes"] / (BUCKET_MB * 2**20))  # one owner's last bucket may be partial
        assert casts[0::ACC] == [0] * STEPS
        assert all(0 < c <= max_casts for c in casts[ACC - 1::ACC]) if layout != "zero0" else sum(casts) == 0
        if layout == "zero2":  # each rank keeps the gradients of the parameters it owns: about half
            assert r["bytes"]["grads"] <= 0.55 * r["bytes"]["params"]
    for r in runs["got"]["zero2_manual"]:  # manual optimization: every batch steps, one reduce per bucket
        assert r["grad_calls"] == [r["buckets"]] * STEPS


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
