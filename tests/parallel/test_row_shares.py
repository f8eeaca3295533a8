"""Work shared by rows over the ranks that hold the same batch (``strategies/decoding/shares.py``): on 2 CPU processes
with 3 rows (shares of 2 and 1 rows), a forward's outputs (a tensor and a named tuple) and a row-wise generation (rows
ending at different steps, per-row draws) equal the whole batch computed on one rank; a call whose output is not
per-row (here of one share's size on one rank only) runs whole on every rank instead, without a hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.models import build_model
from lightning_llm.strategies.decoding.shares import RowShare, share_bounds
from lightning_llm.testing import launch, run_worker, wait


class Scores(NamedTuple):
    loss: Tensor
    hidden: Tensor


class Probe(nn.Module):
    """Per-row outputs of ``[B, S]`` ids, or (``summary=True``) a vector of ``max(B - 1, 1)`` column sums: not per-row,
    yet as long as the share on the rank holding 1 of 3 rows (and not on the rank holding 2). Records its batch
    sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, ids: Tensor, *, scale: float, summary: bool = False) -> Scores | Tensor:
        self.calls.append(ids.shape[0])
        if summary:
            return ids.float().sum(0)[: max(ids.shape[0] - 1, 1)]
        return Scores(loss=ids.float() * scale, hidden=ids.float().unsqueeze(-1).repeat(1, 1, 3))


def _worker(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ids = torch.randint(4, 200, (3, 5))
    probe = Probe()
    shared = RowShare(probe, dist.group.WORLD, torch.device("cpu"))
    got = shared(ids, scale=0.5)
    whole = probe(ids, scale=0.5)
    probe.calls.clear()
    summary = shared(ids, scale=1.0, summary=True)
    model = build_model("debug", family="decoder").eval()  # the same weights on both ranks (seeded)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    cfg = GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=list(range(4, 60)))
    uniforms = torch.rand(3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens = generate(RowShare(model, dist.group.WORLD, torch.device("cpu")), ids, mask, config=cfg,
                      uniforms=uniforms)
    reference = generate(model, ids, mask, config=cfg, uniforms=uniforms)
    result = {"equal": bool(torch.equal(got.loss, whole.loss) and torch.equal(got.hidden, whole.hidden)),
              "summary_whole": summary.tolist() == ids.float().sum(0)[:2].tolist(), "summary_calls": probe.calls,
              "tokens": tokens.tolist(), "reference": reference.tolist()}
    every: list[object] = [None, None]
    dist.all_gather_object(every, result)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(every))


def test_share_bounds_are_contiguous_and_balanced() -> None:
    assert share_bounds(3, 2) == [0, 1, 3] and share_bounds(8, 4) == [0, 2, 4, 6, 8] and share_bounds(5, 4)[-1] == 5
    assert all(b - a in (1, 2) for a, b in zip(share_bounds(7, 4), share_bounds(7, 4)[1:]))


@pytest.mark.multiprocess
def test_row_shares_equal_the_whole_batch(tmp_path: Path) -> None:
    out = tmp_path / "shares.json"
    wait(launch(__file__, 2, str(out)), 300)
    ranks = json.loads(out.read_text())
    print(f"row shares: tokens {ranks[0]['tokens']} (whole batch {ranks[0]['reference']}); a not-per-row call's "
          f"forwards per rank {[r['summary_calls'] for r in ranks]}")
    for rank, r in enumerate(ranks):
        assert r["equal"] and r["tokens"] == r["reference"] == ranks[0]["reference"]
        # its share (1 or 2 rows), then - the ranks having agreed it is not per-row - the whole batch on both
        assert r["summary_whole"] and r["summary_calls"] == [[1, 3], [2, 3]][rank]
    lengths = [sum(t != 0 for t in row) for row in ranks[0]["reference"]]  # rows end at different steps
    assert len(set(lengths)) > 1


if __name__ == "__main__":
    run_worker(_worker, Path(sys.argv[1]))
