"""The optimizer settings every task takes (``--model.optim.*``) and torch's AdamW built from them; Muon's
optimizer is :func:`lightning_llm.optim.build.build_muon`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_llm.optim.build import default_fused

__all__ = ["OptimConfig", "build_adamw", "param_groups"]


@dataclass
class OptimConfig:
    """AdamW (or Muon for the hidden matrices) with linear warmup and a cosine/linear/constant decay, stepped every
    optimizer step."""

    name: Literal["adamw", "muon"] = "adamw"
    """``adamw``; or ``muon``: Muon (Nesterov momentum orthogonalised by Newton-Schulz, torch.optim.Muon's update) for
    the hidden weight matrices of the blocks, AdamW (the settings below) for embeddings, heads, norms, biases and
    routers, on every layout (:mod:`lightning_llm.optim`; the run summary prints the split)."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay; not applied to biases, norms or embeddings' 1-D params."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: float = 0.0
    """Warmup length: a step count (>= 1) or a fraction of the total steps (< 1)."""
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of ``lr``."""
    max_consecutive_skips: int = 10
    """Stop the run when more optimizer steps than this in a row were skipped for a NaN/inf loss or gradients
    (``--model.nonfinite_loss=skip``, an fp16 loss scaler, DeepSpeed's overflow check)."""
    fused: bool | None = None
    """torch's fused AdamW (one kernel per device and dtype for every parameter, instead of a dozen per-tensor
    launches): None = wherever torch has it for the parameters' devices and dtypes (CUDA, CPU, ...)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    muon_nesterov: bool = True
    """Muon's Nesterov step (else plain momentum)."""
    muon_ns_steps: int = 5
    """Muon's Newton-Schulz iterations (torch.optim.Muon's quintic coefficients, in bf16)."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Muon's learning rate per matrix: ``match_rms_adamw`` lr x 0.2 x sqrt(max(rows, cols)) (Moonlight: AdamW's lr
    and weight decay carry over), ``original`` lr x sqrt(max(1, rows / cols)) (Keller Jordan's; wants ~0.02)."""
    muon_lr: float | None = None
    """Muon's peak learning rate (None: ``lr``); the schedule scales it like ``lr``."""
    muon_adapters: bool = False
    """PEFT runs: the adapters' matrices (LoRA's A and B) on Muon too (default: AdamW)."""
    qk_clip_tau: float | None = None
    """Kimi K2's QK-Clip (MuonClip): after each step, every attention head whose largest pre-softmax logit of the
    step exceeded tau has W_q and W_k scaled by sqrt(tau / max) (None: off). Logs the largest logit and the heads
    clipped."""

    def lr_lambda(self, total_steps: int):  # noqa: ANN201 - returns a closure for LambdaLR
        warmup = int(self.warmup_steps * total_steps) if 0 < self.warmup_steps < 1 else int(self.warmup_steps)
        total = max(total_steps, 1)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if self.scheduler == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.scheduler == "cosine" else 1 - progress
            return self.min_lr_ratio + (1 - self.min_lr_ratio) * decay

        return factor


# In checkpoints' hyper-parameters (resume loads weights_only); checkpoints written before this module existed name
# the class by its old home.
torch.serialization.add_safe_globals([OptimConfig, (OptimConfig, "lightning_llm.tasks.base.OptimConfig")])


def build_adamw(groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.AdamW:
    """torch's AdamW over ``groups`` with ``cfg``'s hyper-parameters, fused where torch supports it (``cfg.fused``
    None) or as ``cfg.fused`` says (a fused request torch cannot serve raises its own error)."""
    params = [p for g in groups for p in g["params"]]
    fused = default_fused(params) if cfg.fused is None else cfg.fused
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    # A fused AdamW says it unscales fp16 gradients inside its step, and Lightning's mixed precision then refuses
    # gradient clipping (bf16 too) and skips unscaling before clipping and the non-finite check. The kernel does not
    # need to: with this off, the GradScaler unscales first as for any optimizer (one foreach kernel) and the fused
    # step runs on the unscaled gradients.
    optimizer._step_supports_amp_scaling = False
    return optimizer


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: matrices decay, vectors (biases, norm weights) do not. Frozen params are left out."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # DeepSpeed's zero.Init leaves 1-D placeholders; ds_shape is the real (full) shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
