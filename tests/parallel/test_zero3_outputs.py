"""ZeRO-3 (FSDP2) fits printed "FSDP2-wrapped module (FSDPDecoderLM) returned a view tensor ... can cause backward
to fail or produce wrong gradients" every step (issue 60). The cause: with data parallelism the decoder returns its
per-token losses (``reduction="none"``), which every loss path made as ``rows[B*S].view(B, S)``; FSDP2 registers its
pre-backward all-gather hook on the module's outputs, and an in-place op on a view output (``loss *= mask`` in a
task's ``loss_from_output``) would replace its autograd node and drop the hook. ``head_cross_entropy`` now returns
tensors of their own: the root unit's outputs are no views, FSDP2 says nothing, and an in-place op on the output
keeps the gradients (checked against the model without FSDP2). One process, a world of one (gloo)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_llm.kernels.loss.head_loss import head_cross_entropy
from lightning_llm.models import build_model

VIEW_WARNING = "returned a view tensor"


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_per_token_losses_are_not_views(fused: bool, with_entropy: bool) -> None:
    head = torch.nn.Linear(8, 11, bias=False)
    hidden, labels = torch.randn(2, 5, 8, requires_grad=True), torch.randint(0, 11, (2, 5))
    out = head_cross_entropy(hidden, head, labels, reduction="none", fused=fused, with_entropy=with_entropy)
    for t in out if with_entropy else (out,):
        assert t.shape == (2, 5) and t._base is None


def test_zero3_root_output_is_no_view_and_in_place_ops_keep_gradients(world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_llm.strategies.zero.native import apply_fsdp, fsdp_units
    from lightning_llm.testing.gradients import assert_gradients_close

    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 16))
    labels = torch.where(torch.arange(16) < 4, -100, ids)  # a prompt of 4 tokens: 0 where ignored
    scale = torch.linspace(0.5, 1.5, 16).expand(2, 16)

    def grads(task: torch.nn.Module) -> dict[str, torch.Tensor]:
        loss = task.model(ids, labels=labels, reduction="none")  # the per-token losses a data-parallel replica gets
        loss *= scale  # an in-place op on the output, as a task's loss_from_output may do
        loss.sum().backward()
        return {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in task.named_parameters()}

    ref, task = torch.nn.Module(), torch.nn.Module()
    ref.model = build_model("debug", family="decoder", dropout=0.0)
    task.model = build_model("debug", family="decoder", dropout=0.0)
    task.model.load_state_dict(ref.model.state_dict())
    expected = grads(ref)
    units = apply_fsdp(task, dp_mesh=init_device_mesh("cpu", (1,)), units=fsdp_units(task))
    assert "model" in units  # the root unit, whose output FSDP2 checks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(task)
    assert not [w for w in caught if VIEW_WARNING in str(w.message)], [str(w.message)[:120] for w in caught]
    worst = assert_gradients_close(got, expected)  # per tensor, relative to its largest entry: raises naming one
    print(f"FSDP2 (world of one) vs the plain model, an in-place op on the output: max relative |grad diff| "
          f"{worst:.1e}")
