"""Context parallelism (``context_parallel_size``) equals one device on rows of 4096 tokens.

The ``debug`` decoder (GQA: 4 query heads, 2 kv heads; rotary positions) trains ``CausalLMTask`` on 2 rows of
``SEQ`` = 4096 byte tokens per step, fp32, dropout 0, for ``STEPS`` steps, under each layout of :data:`LAYOUTS`
(torchrun, CPU, gloo), while the pytest process trains the same batches on one device. Compared (bound 1e-5):

* every token's loss before training (the model's fused per-token losses of each rank's slice, put back in column
  order) against one device's;
* every gradient of the first step (after the ``dp x cp`` reduction; gathered full) against one device's;
* ``train_loss`` at each step, on every rank.

Packed rows (``segment_ids`` and per-example ``position_ids``, examples crossing the slices' boundaries) are the same
comparison with the block-diagonal mask rebuilt across slices.
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
STEPS = 6
TOL = 1e-5
PACKED_LENGTHS = (1000, 777, 1500, 300, 519)  # examples of a packed row, repeated: crossing the slices' boundaries
LAYOUTS2 = ["cp2", "cp2_packed"]  # 2 processes
LAYOUTS4 = ["cp4"]  # 4 processes


def _strategy(name: str) -> Any:
    from lightning_llm.strategies import HybridParallelStrategy

    cp = int(name.split("_")[0][2:])
    return HybridParallelStrategy(data_parallel_size=1, context_parallel_size=cp)


def pack_rows(batch: dict[str, torch.Tensor], lengths: tuple[int, ...]) -> dict[str, torch.Tensor]:
    b, s = batch["input_ids"].shape
    seg, pos = torch.zeros(s, dtype=torch.long), torch.zeros(s, dtype=torch.long)
    labels = batch["labels"].clone()
    start, k = 0, 0
    while start < s:
        n = min(lengths[k % len(lengths)], s - start)
        seg[start:start + n] = k + 1
        pos[start:start + n] = torch.arange(n)
        labels[:, start + n - 1] = -100  # an example's last token predicts nothing of it
        start, k = start + n, k + 1
    return {**batch, "labels": labels, "segment_ids": seg.expand(b, s).clone(), "position_ids": pos.expand(b, s).clone()}


class Probe(pl.Callback):
    """Every token's loss before training (in column order, from every rank's slice) and the first step's full
    gradients."""

    def __init__(self) -> None:
        self.token_losses: torch.Tensor | None = None
        self.grads: dict[str, torch.Tensor] = {}

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
        if cp > 1:
            parts = [torch.empty_like(losses) for _ in range(cp)]
            torch.distributed.all_gather(parts, losses.contiguous(), group=trainer.strategy._cp_group)
            losses = order_gathered(parts, dim=1)
        self.token_losses = losses.detach().clone()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step:
            return
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                self.grads[name] = g.detach().clone()


def _fit(strategy: Any, devices: int, out: Path, *, packed: bool) -> dict[str, Any]:
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(7)
    class PackedText(TextDataModule):
        def _collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
            return pack_rows(super()._collate(examples), PACKED_LENGTHS)

    dm = (PackedText if packed else TextDataModule)(block_size=SEQ, batch_size=2, cache_dir=str(out / "cache"),
                                                    generated_docs=400, val_fraction=0.0)
    task = CausalLMTask("debug", dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    rec, probe = LoggedLoss(), Probe()
    table_trainer(out, strategy=strategy, devices=devices, max_steps=STEPS, callbacks=[rec, probe]).fit(task, dm)
    return {"losses": rec.losses, "tokens": probe.token_losses, "grads": probe.grads}


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.testing import gathered

    if mode == "reference":
        torch.save({"plain": _fit("auto", 1, out, packed=False), "packed": _fit("auto", 1, out, packed=True)},
                   out / "reference.pt")
        return
    results = {}
    for layout in LAYOUTS2 if mode == "layouts" else LAYOUTS4:
        every = gathered(_fit(_strategy(layout), int(os.environ["WORLD_SIZE"]), out,
                              packed=layout.endswith("packed")))
        results[layout] = {"losses": [r["losses"] for r in every], "tokens": [r["tokens"] for r in every],
                           "grads": every[0]["grads"]}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / f"{mode}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import launch, run_reference_meanwhile, wait

    out = tmp_path_factory.mktemp("context_parallel")
    two = launch(__file__, 2, "layouts", str(out))
    run_reference_meanwhile(two, lambda: _worker("reference", out), timeout=1200)
    wait(launch(__file__, 4, "layouts4", str(out)), timeout=1200)
    return out


def _errors(run: dict[str, Any], ref: dict[str, Any]) -> tuple[float, float, float]:
    tokens = max((t - ref["tokens"]).abs().max().item() for t in run["tokens"])
    assert set(run["grads"]) == set(ref["grads"])
    grad = max((run["grads"][n] - g).abs().max().item() for n, g in ref["grads"].items())
    loss = max(abs(a - b) for curve in run["losses"] for a, b in zip(curve, ref["losses"], strict=True))
    return tokens, grad, loss


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS2, *LAYOUTS4])
def test_context_parallel_equals_one_device(runs: Path, layout: str) -> None:
    refs = torch.load(runs / "reference.pt")
    ref = refs["packed" if layout.endswith("packed") else "plain"]
    assert len(ref["losses"]) == STEPS and ref["losses"][0] - ref["losses"][-1] > 0.05  # it trains
    assert ref["tokens"].shape == (2, SEQ)
    run = torch.load(runs / ("layouts4.pt" if layout in LAYOUTS4 else "layouts.pt"))[layout]
    tokens, grad, loss = _errors(run, ref)
    print(f"{layout} vs one device at {SEQ} tokens: per-token losses {tokens:.2e}, first-step gradients {grad:.2e}, "
          f"train_loss over {STEPS} steps {loss:.2e}")
    assert tokens <= TOL and grad <= TOL and loss <= TOL


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
