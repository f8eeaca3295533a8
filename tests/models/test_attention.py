"""The varlen attention path (``models/layers/attention.py``) against the mask path, and what it allocates.

On the CPU the varlen path runs the same layout code as on CUDA with :func:`reference_varlen` in place of flash varlen
(per sequence, causal from the bottom right, within the window): in float64 it must equal SDPA over the dense mask
(today's path) to 1e-6 on the tokens that are real, forward and backward, for every kind of row. Context parallelism's
chunk layouts are checked the same way rank by rank (no process group needed: the keys are the whole row). On the
meta device the path is traced as CUDA runs it (the varlen op is called by name; its shape function runs), and no
tensor of S x S elements (S/cp x S for a cp slice) is allocated.

Found in torch's source (2.13, ``aten/src/ATen/native/transformers/attention.cpp``, ``_fused_sdp_choice_meta``): the
meta device does *not* dispatch ``F.scaled_dot_product_attention`` as CUDA does: it picks the CUDA choice only for a
tensor whose key set has the CUDA key (a FakeTensor on cuda), and the math backend for a plain meta tensor (which
builds a ``[S, S]`` causal mask). The ops named directly (``torch_attn._varlen_attn``,
``aten._flash_attention_forward``) do run on meta with their shape functions (``register_fake``,
``torch/_meta_registrations.py``): hence the trace below goes through the path that names its kernel.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_llm.models import build_model
from lightning_llm.models.layers.attention import (
    VarlenLayout,
    describe_attention,
    reference_varlen,
    varlen_attention,
    varlen_layout,
)
from lightning_llm.models.layers.masks import causal_padding_mask, segment_positions

TOL = 1e-6


def _packed(b: int, s: int, lengths: tuple[int, ...], *, pad: int = 0) -> torch.Tensor:
    """Segment ids [B, S]: examples of ``lengths`` (cycled, row r starting r examples in), the last ``pad`` columns
    padding (0)."""
    seg = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        start, k = 0, r
        while start < s - pad:
            n = min(lengths[k % len(lengths)], s - pad - start)
            seg[r, start:start + n] = k + 1
            start, k = start + n, k + 1
    return seg


def _batches(s: int) -> dict[str, dict[str, torch.Tensor]]:
    left = torch.ones(2, s, dtype=torch.long)
    left[0, :9] = 0  # left padding
    left[1, s - 13:] = 0  # right padding
    holes = left.clone()
    holes[1, 20:23] = 0  # padding inside a row: its keys are skipped, the example goes on
    return {"packed": {"segment_ids": _packed(2, s, (17, 5, 30, 11))},
            "padded": {"attention_mask": left},
            "padded_holes": {"attention_mask": holes},
            "packed_padded": {"segment_ids": _packed(2, s, (17, 5, 30, 11), pad=7), "attention_mask": left}}


def _run(model: torch.nn.Module, ids: torch.Tensor, kwargs: dict[str, Any], real: torch.Tensor
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hidden states at real tokens and the gradients of a loss over them."""
    out = model(ids, **kwargs)
    loss = (out[real] * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum()
    return out[real].detach(), list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize("backbone", ["debug", "debug-mistral"])  # GQA 4/2 heads; + a sliding window of 8
def test_varlen_reference_equals_the_mask_path(backbone: str) -> None:
    """Packed, padded (left, right, inside a row), packed+padded rows, with and without a sliding window, GQA: the
    varlen path (its layout + the reference kernel) equals SDPA over the dense mask on every real token, and every
    parameter gradient, in float64."""
    import lightning_llm.models.layers.attention as attention

    torch.manual_seed(0)
    s = 64
    mask_model = build_model(backbone, family="decoder", dropout=0.0, attention="sdpa").double()
    varlen_model = copy.deepcopy(mask_model)
    varlen_model.config.attention = "varlen"
    ids = torch.randint(0, 200, (2, s))
    calls = []
    original = attention.reference_varlen

    def counted(*a: Any, **k: Any) -> torch.Tensor:
        calls.append(k["window"])
        return original(*a, **k)

    for rows, kwargs in _batches(s).items():
        real = torch.ones(2, s, dtype=torch.bool)
        if "attention_mask" in kwargs:
            real &= kwargs["attention_mask"].bool()
        if "segment_ids" in kwargs:
            real &= kwargs["segment_ids"] > 0
        ref_out, ref_grads = _run(mask_model, ids, kwargs, real)
        calls.clear()
        attention.reference_varlen = counted
        try:
            out, grads = _run(varlen_model, ids, kwargs, real)
        finally:
            attention.reference_varlen = original
        err_out = (out - ref_out).abs().max().item()
        err_grad = max((g - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=True))
        print(f"{backbone} {rows}: outputs {err_out:.1e}, gradients {err_grad:.1e}, varlen calls {len(calls)}")
        assert err_out <= TOL and err_grad <= TOL
        # padding inside an example under a window: the varlen sequence would not count it, so the mask path
        masked = backbone == "debug-mistral" and rows == "padded_holes"
        assert len(calls) == (0 if masked else varlen_model.config.num_layers)
        assert all(w == varlen_model.config.sliding_window for w in calls)


def test_chunk_layouts_equal_the_whole_row_rank_by_rank() -> None:
    """Context parallelism's layouts: rank r's two chunks (columns r and 2cp-1-r of 2cp) of packed+padded rows
    against the whole rows' keys, causal from the bottom right, equal the whole row's masked SDPA at those columns;
    the ranks' gradients sum to the whole row's (float64, GQA)."""
    from lightning_llm.strategies.context.sharding import local_columns

    torch.manual_seed(0)
    b, n, kv, s, d = 2, 4, 2, 64, 8
    seg = _packed(b, s, (7, 20, 3, 13), pad=5)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, :4] = False
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for h in (n, kv, kv))
    real = keep & (seg > 0)
    mask = causal_padding_mask(real, s, segment_ids=seg)  # [B, 1, S, S]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=mask)
    go = torch.randn_like(ref) * real[:, None, :, None]  # padding outputs are read by nothing
    want = torch.autograd.grad(ref, (q, k, v), go)
    for cp in (1, 2, 4):
        got = [torch.zeros_like(t) for t in (q, k, v)]
        c = s // (2 * cp)
        for r in range(cp):
            cols = local_columns(s, cp, r)
            layout = varlen_layout(keep, seg, batch=b, seq=s, device=q.device,
                                   chunks=[(r * c, (r + 1) * c), ((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
            out = varlen_attention(q[:, :, cols], k, v, layout)
            err = ((out - ref[:, :, cols]) * real[:, None, cols, None]).abs().max().item()
            assert err < TOL, (cp, r, err)
            for acc, g in zip(got, torch.autograd.grad(out, (q, k, v), go[:, :, cols]), strict=True):
                acc += g
        err = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
        print(f"cp {cp}: chunk layouts vs the whole row, gradients {err:.1e}")
        assert err < TOL


def test_layouts_are_views_where_rows_are_whole() -> None:
    """Packed rows without padding take their rows as views (no gather), and the output needs no scatter; padding
    is gathered; an all-padding chunk makes no call."""
    seg = _packed(1, 32, (10, 6))
    whole = varlen_layout(None, seg, batch=1, seq=32, device=torch.device("cpu"))
    assert [type(c.q) for c in whole.calls] == [slice] and whole.scatter is None
    assert whole.calls[0].cu_q.tolist() == [0, 10, 16, 26, 32] and whole.calls[0].max_k == 10
    padded = varlen_layout(torch.arange(32)[None] >= 4, None, batch=1, seq=32, device=torch.device("cpu"))
    assert isinstance(padded.calls[0].q, slice) and padded.calls[0].q == slice(4, 32)  # still one range
    assert padded.scatter is not None and padded.scatter.tolist() == list(range(4, 32))
    cp = varlen_layout(torch.arange(32)[None] < 8, None, batch=1, seq=32, device=torch.device("cpu"),
                       chunks=[(8, 16), (16, 24)])  # chunks of padding only
    assert cp.calls == () and varlen_attention(torch.ones(1, 2, 16, 4), torch.ones(1, 2, 32, 4),
                                               torch.ones(1, 2, 32, 4), cp).abs().sum() == 0
    cu = torch.tensor([0, 3, 5])
    q, k = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(5, 1, 4, dtype=torch.float64)
    out = reference_varlen(q, k, k, cu, cu, window=None)  # sequence 2's first query sees only itself
    assert torch.allclose(out[3, 0], k[3, 0])


class _Sizes(TorchDispatchMode):
    """Every op's name and the largest number of elements any of its outputs has."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out


def _trace(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> _Sizes:
    with _Sizes() as sizes:
        model(ids.to("meta"), labels=ids.to("meta"), **kwargs).backward()
    return sizes


def test_device_path_on_meta_allocates_no_score_matrix() -> None:
    """A packed 8192-token row (one device) and the cp x2 slice of a 16384-token row, forward and backward on the meta
    device with ``attention=varlen``: flash varlen forward and backward once per layer, no tensor of S x S (S/cp x S)
    elements; the mask path's trace of the same packed row does allocate one (the recorder sees it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_llm.strategies.context import apply_context_parallel, shard_batch

    layers = 4
    s = 8192
    seg = _packed(1, s, (1000, 3000, 200, 777))
    ids = torch.zeros(1, s, dtype=torch.long)
    traced = {}
    for attention in ("varlen", "sdpa"):
        model = build_model("debug", family="decoder", lazy=True, dropout=0.0, attention=attention)
        # segment ids stay on the host (the layout reads them); the meta twin of a run gets the positions
        traced[attention] = _trace(model, ids, segment_ids=seg if attention == "varlen" else seg.to("meta"),
                                   position_ids=segment_positions(seg).to("meta"))
    print(f"packed {s}: largest tensor {traced['varlen'].largest:,} elements (S x S = {s * s:,}; mask path "
          f"{traced['sdpa'].largest:,})")
    assert traced["varlen"].ops["torch_attn._varlen_attn.default"] == layers
    assert traced["varlen"].ops["torch_attn._varlen_attn_backward.default"] == layers
    assert traced["varlen"].largest < s * s // 16 and traced["sdpa"].largest >= s * s

    s, cp = 16384, 2
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)  # collectives without peers
    try:
        model = build_model("debug", family="decoder", lazy=True, dropout=0.0, attention="varlen")
        apply_context_parallel(model, group=dist.group.WORLD, cp=cp, rank=0)
        part = shard_batch({"input_ids": torch.zeros(1, s, dtype=torch.long)}, cp=cp, rank=0, positions=None)
        sizes = _trace(model, part["input_ids"], position_ids=part["position_ids"].to("meta"))
    finally:
        dist.destroy_process_group()
    print(f"cp x{cp} slice of {s}: largest tensor {sizes.largest:,} elements (S/cp x S = {s * s // cp:,}); "
          f"{sizes.ops['torch_attn._varlen_attn.default']} varlen calls")
    assert sizes.ops["torch_attn._varlen_attn.default"] == 2 * layers  # the rank's two chunks
    assert sizes.ops["torch_attn._varlen_attn_backward.default"] == 2 * layers
    assert sizes.ops["c10d._allgather_base_.default"] == layers  # keys and values in one gather per layer
    assert sizes.largest < s * s // cp // 16


def test_run_summary_names_the_kernel() -> None:
    """The line the run summary logs: varlen on CUDA in bf16, the mask path on the CPU or in fp32, cp's variant."""
    config = build_model("debug", family="decoder", lazy=True).config
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert describe_attention(config, device=cpu, dtype=torch.float32).startswith("SDPA with a [B, 1, S, S] mask")
    assert "(cpu device)" in describe_attention(config, device=cpu, dtype=torch.bfloat16)
    forced = copy.deepcopy(config)
    forced.attention = "varlen"
    assert describe_attention(forced, device=cpu, dtype=torch.float32).startswith("flash varlen")
    assert "all-gathered, flash varlen per local chunk" in describe_attention(forced, device=cpu, dtype=torch.float32,
                                                                           context_parallel=2)
    assert "SDPA with a [B, 1, S/cp, S] mask" in describe_attention(config, device=cuda, dtype=torch.float32,
                                                                    context_parallel=2)
    assert isinstance(varlen_layout(None, None, batch=1, seq=4, device=cpu), VarlenLayout)
