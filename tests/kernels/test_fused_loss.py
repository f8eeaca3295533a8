"""The fused LM-head loss in the training path (``--model.fused_loss``): the model's ``forward(labels=)`` computes the
token cross-entropy from the hidden states and the head in chunks. Compared with the eager reference
(``F.cross_entropy`` on full fp32 logits): loss and every parameter gradient within 1e-5 (fp32), for plain, tied,
biased, NormHead and peft ``modules_to_save`` heads; a head with hooks is called as a module (the hook still runs);
a task whose loss hooks are overridden receives logits; one-device training with the flag on equals it off.
The layout x flag matrix is ``tests/kernels/test_fused_loss_layouts.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.kernels.loss.head_loss import fusable_head, head_cross_entropy

TOL = 1e-5


def _labels(b: int, s: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, :3] = -100  # a masked prompt
    labels[-1, -2:] = -100  # padding
    return labels


def _grads(module: nn.Module, *extra: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None] + [t.grad.clone() for t in extra]


def _compare(head: nn.Module, reduction: str = "mean") -> tuple[float, float]:
    """(loss err, max grad err) of head_cross_entropy against F.cross_entropy(head(h)) on the same inputs."""
    torch.manual_seed(0)
    v = head.weight.shape[0] if hasattr(head, "weight") else 97
    h = torch.randn(3, 11, 16, requires_grad=True)
    labels = _labels(3, 11, v)
    upstream = torch.rand(3, 11) if reduction == "none" else torch.tensor(1.0)
    ref = F.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction=reduction)
    (ref.view_as(upstream) * upstream).sum().backward()
    want = _grads(head, h)
    head.zero_grad()
    h.grad = None
    got = head_cross_entropy(h, head, labels, reduction=reduction)
    (got.view_as(upstream) * upstream).sum().backward()
    have = _grads(head, h)
    assert got.dtype == torch.float32 and len(want) == len(have)
    return (got.view(-1) - ref.view(-1)).abs().max().item(), max((a - b).abs().max().item() for a, b in zip(want, have))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_head_matches_eager_loss_and_gradients(bias: bool, reduction: str) -> None:
    head = nn.Linear(16, 97, bias=bias)
    assert fusable_head(head) is not None
    loss_err, grad_err = _compare(head, reduction)
    assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)


def test_norm_head_is_fused_through_its_effective_weight() -> None:
    from lightning_llm.models.layers.block import NormHead

    head = NormHead(16, 97, bias=False)
    nn.init.normal_(head.weight, std=0.5)
    assert fusable_head(head) is not None
    loss_err, grad_err = _compare(head)
    assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)


def test_modules_to_save_head_trains_its_copy() -> None:
    from lightning_llm.models import build_model
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft

    torch.manual_seed(0)
    model = apply_peft(build_model("debug", family="decoder", vocab_size=96, dropout=0.0),
                       PeftConfig(method="lora", lora=LoraArgs(r=4, dropout=0.0, modules_to_save=["lm_head"])))
    head = model.lm_head
    found = fusable_head(head)
    assert found is not None and found[0] is not head.original_module.weight  # the trained copy, not the frozen one
    ids = torch.randint(0, 96, (2, 12))
    labels = _labels(2, 12, 96)
    ref = F.cross_entropy(model(ids).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = model(ids, labels=labels)
    got.backward()
    have = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert want.keys() == have.keys() and any("modules_to_save" in n for n in have)
    assert abs(got.item() - ref.item()) <= TOL
    assert max((want[n] - have[n]).abs().max().item() for n in want) <= TOL


def test_head_with_hooks_or_lora_is_called_as_a_module() -> None:
    head = nn.Linear(16, 97)
    seen: list[torch.Size] = []
    head.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))  # a value head reading its input
    assert fusable_head(head) is None
    loss_err, grad_err = _compare(head)
    assert seen and loss_err <= TOL and grad_err <= TOL

    from peft import LoraConfig, inject_adapter_in_model

    wrapped = inject_adapter_in_model(LoraConfig(r=2, target_modules=["head"]),
                                      nn.ModuleDict({"head": nn.Linear(16, 97)}))
    assert fusable_head(wrapped["head"]) is None


@pytest.mark.parametrize("backbone", ["debug", "debug-qwen2", "debug-baichuan2"])
def test_decoder_labels_equal_eager_loss(backbone: str) -> None:
    """``DecoderLM(ids, labels=)`` against the cross-entropy of its logits: loss and all gradients (tied head on
    Qwen2, NormHead on Baichuan2)."""
    from lightning_llm.models import build_model

    torch.manual_seed(0)
    model = build_model(backbone, family="decoder", dropout=0.0)
    v = model.config.vocab_size
    ids = torch.randint(0, v, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    labels = _labels(3, 20, v)
    ref = F.cross_entropy(model(ids, attention_mask=mask).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = model(ids, attention_mask=mask, labels=labels)
    got.backward()
    err = max((want[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert abs(got.item() - ref.item()) <= TOL and err <= TOL, (abs(got.item() - ref.item()), err)


def test_bf16_autocast_matches_eager_in_the_same_precision() -> None:
    head = nn.Linear(16, 97)
    h = torch.randn(4, 9, 16)
    labels = _labels(4, 9, 97)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        got = head_cross_entropy(h, head, labels)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) <= 2e-2 * abs(ref.item())  # bf16 logits either way


# ------------------------------------------------------------------------------------------------ the task


def _fit(tmp: Path, **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    task_cls = kwargs.pop("task_cls", CausalLMTask)
    pl.seed_everything(5)
    # eps=1e-3: Adam divides by sqrt(v) + eps, so with a tiny eps fp32 summation-order noise in near-zero gradients
    # (1e-9) becomes parameter steps of lr size; a larger eps keeps parameter parity meaningful at 1e-5.
    task = task_cls("debug", dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-3), **kwargs)
    dm = TextDataModule(block_size=32, batch_size=4, cache_dir=str(tmp / "cache"), generated_docs=60)
    rec = LoggedLoss()
    table_trainer(tmp, strategy="auto", devices=1, max_steps=4, callbacks=[rec]).fit(task, dm)
    return rec.losses, {k: v.detach().clone() for k, v in task.model.state_dict().items()}


def test_one_device_training_with_the_flag_on_equals_off(tmp_path: Path) -> None:
    on, params_on = _fit(tmp_path / "on")
    off, params_off = _fit(tmp_path / "off", fused_loss=False)
    assert on[0] - on[-1] > 0.05
    loss_err = max(abs(a - b) for a, b in zip(on, off))
    param_err = max((params_on[k] - params_off[k]).abs().max().item() for k in params_on)
    print(f"fused vs eager over 4 steps: loss err {loss_err:.2e}, parameter err {param_err:.2e}")
    assert loss_err <= TOL and param_err <= TOL


def test_a_task_overriding_its_loss_hook_receives_logits(tmp_path: Path) -> None:
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.tasks.decoder import fused_loss_blocker

    shapes: list[int] = []

    class SmoothedLM(CausalLMTask):  # a user's loss: label smoothing on the logits
        def loss_from_output(self, output, batch, stage):  # noqa: ANN001, ANN201
            shapes.append(output.dim())
            return F.cross_entropy(output.flatten(0, 1).float(), batch["labels"].flatten(), label_smoothing=0.1), {}

    losses, _ = _fit(tmp_path, task_cls=SmoothedLM)
    assert shapes and set(shapes) == {3} and len(losses) == 4
    assert "overrides loss_from_output" in fused_loss_blocker(SmoothedLM("debug"))


@pytest.mark.parametrize("reference", ["precomputed", "on_the_fly"])
def test_dpo_with_the_fused_token_losses_equals_logits(tmp_path: Path, reference: str) -> None:
    """DPO's sequence log-probs from the model's per-token cross-entropy (``reduction="none"``; the chunks are
    recomputed in backward) against log-softmax of full logits: same losses and reward margins, step by step."""
    import lightning.pytorch as pl

    from lightning_llm.data import PreferenceDataModule
    from lightning_llm.tasks import DPOTask
    from lightning_llm.tasks.base import OptimConfig
    from lightning_llm.tasks.preference.dpo import DPOConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    def fit(fused: bool) -> list[float]:
        pl.seed_everything(5)
        task = DPOTask("debug", model_overrides={"num_layers": 2}, fused_loss=fused,
                       dpo=DPOConfig(beta=0.5, reference=reference),
                       optim=OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0, eps=1e-3))
        dm = PreferenceDataModule(generated_pairs=32, generated_val_pairs=0, cutoff_len=32, max_prompt_len=16,
                                  batch_size=8)
        rec = LoggedLoss()
        table_trainer(tmp_path / str(fused), strategy="auto", devices=1, max_steps=4, callbacks=[rec]).fit(task, dm)
        assert task.uses_fused_loss() is fused
        return rec.losses

    on, off = fit(True), fit(False)
    err = max(abs(a - b) for a, b in zip(on, off))
    print(f"DPO ({reference}) fused vs logits over 4 steps: max |loss err| {err:.2e}; losses {on}")
    assert len(on) == 4 and on[0] - on[-1] > 0.01 and err <= TOL


def test_bf16_head_gradient_is_as_accurate_as_one_matmul() -> None:
    """The head's gradient sums over every token chunk: accumulated in fp32 and rounded once, its error against
    float64 equals the eager bf16 path's (a bf16 running sum over 16 chunks would be several times worse)."""
    from lightning_llm.kernels.loss.cross_entropy import fused_linear_cross_entropy

    torch.manual_seed(0)
    h, w, t = torch.randn(2048, 128), torch.randn(4000, 128) * 0.05, torch.randint(0, 4000, (2048,))
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(h64 @ w64.t(), t).backward()

    def rel_err(loss_fn) -> float:  # noqa: ANN001
        hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        loss_fn(hb, wb).backward()
        assert wb.grad.dtype == torch.bfloat16
        return ((wb.grad.double() - w64.grad).norm() / w64.grad.norm()).item()

    eager = rel_err(lambda hb, wb: F.cross_entropy((hb @ wb.t()).float(), t))
    fused = rel_err(lambda hb, wb: fused_linear_cross_entropy(hb, wb, t, chunk_size=128))
    print(f"bf16 dW relative error vs float64: eager {eager:.2e}, fused (16 chunks) {fused:.2e}")
    assert fused <= 1.1 * eager


# ------------------------------------------------------------------------------------------------ precision on GPUs
_MATMULS = ("aten.mm.", "aten.addmm.", "aten.addmm_.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.", "aten.linear.")


def _matmul_operand_dtypes(device: str, weight_dtype: torch.dtype) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    """Every matmul a bf16 forward+backward of the fused loss dispatches, with the dtypes of its two multiplied
    operands (an accumulator it adds into is not an operand of the product)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_llm.kernels.loss.cross_entropy import fused_linear_cross_entropy

    seen: list[tuple[str, tuple[torch.dtype, ...]]] = []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            name = str(func)
            if name.startswith(_MATMULS):
                mats = args[1:3] if "addmm" in name or "baddbmm" in name else args[:2]
                seen.append((name, tuple(m.dtype for m in mats)))
            return func(*args, **(kwargs or {}))

    h = torch.randn(96, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(200, 32, device=device, dtype=weight_dtype, requires_grad=True)
    t = torch.randint(0, 200, (96,), device=device)
    with Matmuls():
        fused_linear_cross_entropy(h, w, t, chunk_size=32).backward()
    assert w.grad.dtype == weight_dtype and h.grad.dtype == torch.bfloat16
    return seen


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_bf16_fused_loss_multiplies_in_bf16_only(weight_dtype: torch.dtype) -> None:
    """The GPU's code path (the meta device takes it: it has the fp32-output GEMM a CUDA device has, the CPU does
    not): every matmul of a bf16 forward+backward multiplies bf16 operands - the chunk logits, dhidden, and the head's
    gradient as a bf16 GEMM accumulating into its fp32 buffer (``addmm.dtype_out``) - also for an fp32 master weight
    (cast once). Before, the head's gradient was an fp32 GEMM (``cutlass_80_simt_sgemm`` on the H200, no tensor
    cores)."""
    calls = _matmul_operand_dtypes("meta", weight_dtype)
    print(sorted(set(calls)))
    assert any("dtype_out" in name for name, _ in calls)  # the head's gradient: fp32 output of a bf16 product
    assert len(calls) >= 3 * 3 and all(dtypes == (torch.bfloat16, torch.bfloat16) for _, dtypes in calls), calls


def test_fp32_master_head_gradient_under_autocast() -> None:
    """bf16 autocast with an fp32 head (Lightning's bf16-mixed): the fused loss takes the fp32 master itself, its
    gradient an fp32 sum that is never rounded to bf16 (eager autocast's is a bf16 gradient cast back: every value
    bf16-representable); against float64 it is at least as accurate as eager's, the loss the same within bf16."""
    torch.manual_seed(0)
    h, head = torch.randn(2, 512, 64), nn.Linear(64, 3000, bias=False)
    head.weight.data.mul_(0.2)
    labels = _labels(2, 512, 3000)
    h64, w64 = h.double().requires_grad_(), head.weight.detach().double().requires_grad_()
    ref64 = F.cross_entropy((h64 @ w64.t()).flatten(0, 1), labels.flatten(), ignore_index=-100)
    ref64.backward()

    def run(fn: Any) -> tuple[float, float, bool]:
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        grad = head.weight.grad
        assert grad.dtype == torch.float32
        err = ((grad.double() - w64.grad).norm() / w64.grad.norm()).item()
        return loss.item(), err, torch.equal(grad, grad.bfloat16().float())

    eager_loss, eager, eager_bf16 = run(lambda: F.cross_entropy(head(h).flatten(0, 1).float(), labels.flatten(),
                                                                ignore_index=-100))
    fused_loss, fused, fused_bf16 = run(lambda: head_cross_entropy(h, head, labels))
    assert eager_bf16 and not fused_bf16
    print(f"fp32 master dW relative error vs float64: eager autocast {eager:.2e}, fused {fused:.2e}")
    assert abs(fused_loss - eager_loss) <= 1e-2 * abs(eager_loss) and abs(fused_loss - ref64.item()) <= 2e-2
    assert fused <= 1.1 * eager
