"""The `kernels` switch of the model families: Triton (interpreter on CPU) vs torch give the same training run."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lightning_llm import kernels  # noqa: E402
from lightning_llm.models import build_model  # noqa: E402


def _train(backend: str, *, family: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    overrides = {"num_labels": 3} if family == "encoder" else {}
    model = build_model("debug", family=family, kernels=backend, vocab_size=131, num_layers=2, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 131, (1, 9), generator=torch.Generator().manual_seed(1))  # one batch, memorised
    losses = []
    for _ in range(steps):
        if family == "decoder":
            logits = model(ids[:, :-1])  # [1, 8, V]
            loss = kernels.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), backend=backend)
        else:
            logits = model(ids, attention_mask=torch.ones_like(ids))
            loss = kernels.cross_entropy(logits, ids[:, 0] % 3, backend=backend)  # [1, 3] vs [1]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["decoder", "encoder"])
def test_triton_and_torch_kernels_train_identically(family: str) -> None:
    """20 steps of the debug model (RMSNorm+RoPE+SwiGLU decoder / LayerNorm+GELU encoder): losses within 1e-4."""
    steps = 20 if family == "decoder" else 10
    ref = _train("torch", family=family, steps=steps)
    fused = _train("triton", family=family, steps=steps)
    err = max(abs(a - b) for a, b in zip(ref, fused))
    print(f"{family}: max per-step loss difference triton vs torch over {steps} steps = {err:.2e}")
    assert err <= 1e-4
    assert ref[-1] < ref[0]  # it trained


def test_auto_resolves_to_torch_on_cpu() -> None:
    assert kernels.resolve_backend("auto", torch.zeros(1)) == "torch"
