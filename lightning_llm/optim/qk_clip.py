"""QK-Clip (Kimi K2's MuonClip, arXiv 2507.20534): attention logits kept under ``tau`` by rescaling W_q and W_k.

During each training forward every softmax-attention layer records, per query head, the largest pre-softmax logit
``q . k x scale`` over the pairs its mask lets attend (the core's ``max_logits``: ``DotProductAttention`` on its
dense mask; under context parallelism this rank's queries against the whole rows' keys). After each optimizer step
the maxima are reduced over the data-parallel replicas (``dp x cp``: a cp rank saw its slice of the queries) and every
head whose maximum exceeded ``tau`` gets ``gamma = tau / max``: with as many kv heads as query heads, its W_q and W_k
rows (and biases) times ``sqrt(gamma)``; with grouped kv heads (shared by several query heads) its W_q rows times
``gamma``. Either way that head's logits scale by ``gamma``. Under tensor parallelism a rank holds whole heads and
clips its own; under ZeRO-3 a rank scales the rows of its shard. Logged each step: ``qk_clip/max_logit`` (over every
head of every layer) and ``qk_clip/heads_clipped``, from device values (no host read).

Refused where rescaling W_q/W_k does not rescale the logits or no dense logits exist: q/k norms (Qwen3, OLMo: a
norm after the projection undoes the scale), Multi-head Latent Attention, and the varlen attention path; and under
DeepSpeed, whose optimizer steps fp32 master partitions the rescale of the model's weights would not reach.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from typing_extensions import override

__all__ = ["QKClip"]


def _local_rows(p: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """``(this rank's rows of p, their factors)``: ``scale`` is per row of the rows the layer saw (a
    tensor-parallel rank's heads: its local rows; ZeRO-3 gathered them all: the global rows, cut to this shard)."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.shape[0] == scale.shape[0]:
        return local, scale
    if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements == (Shard(0),) \
            and p.shape[0] == scale.shape[0]:
        size, offset = Shard.local_shard_size_and_offset(p.shape[0], p.device_mesh.size(),
                                                         p.device_mesh.get_local_rank())
        return local, scale[offset:offset + size]
    raise ValueError(f"QK-Clip: cannot match {scale.shape[0]} rows of logits' heads to a parameter {tuple(p.shape)} "
                     f"held as {getattr(p, 'placements', 'a plain tensor')}")


def _scale_rows(linear: nn.Linear, scale: Tensor) -> None:
    for p in (linear.weight, linear.bias):
        if p is not None:
            local, factors = _local_rows(p, scale)
            local.mul_(factors.view(-1, *([1] * (local.dim() - 1))).to(local.dtype))


class _Layer:
    """One attention layer: its running per-head maximum and how its heads' rows sit in W_q / W_k."""

    def __init__(self, name: str, attn: nn.Module) -> None:
        self.name, self.attn = name, attn
        self.max: Tensor | None = None
        if getattr(attn, "q_norm", None) is not None:
            raise ValueError(f"QK-Clip: {name} normalises q and k after their projections, which undoes a rescaled "
                             "W_q/W_k (the logits are bounded by the norms' weights); drop --model.optim.qk_clip_tau")

    def record(self, m: Tensor) -> None:
        self.max = m if self.max is None else torch.maximum(self.max, m)

    def clip(self, gamma: Tensor) -> None:
        """Scale head h's logits by ``gamma[h]`` (1 where not clipped); ``gamma`` [N] over the heads the layer saw."""
        a, d = self.attn, self.attn.head_dim
        if a.W_pack is not None:  # rows [N, 3, D]: q, k and v of each head (as many kv heads as query heads)
            root = gamma.sqrt()
            rows = torch.stack([root, root, torch.ones_like(root)], dim=1)  # [N, 3]
            _scale_rows(a.W_pack, rows.repeat_interleave(d, dim=1).reshape(-1))
            return
        per_head = 2 * d if a.output_gate else d  # with the output gate, q_proj's rows per head are [q_h; gate_h]
        grouped = a.q_proj.weight.shape[0] // per_head != a.k_proj.weight.shape[0] // d  # global shapes: any layout
        q_factor = gamma if grouped else gamma.sqrt()
        q_rows = torch.stack([q_factor, torch.ones_like(q_factor)], dim=1) if a.output_gate else q_factor[:, None]
        _scale_rows(a.q_proj, q_rows.repeat_interleave(d, dim=1).reshape(-1))
        if not grouped:
            _scale_rows(a.k_proj, gamma.sqrt().repeat_interleave(d))


class QKClip(pl.Callback):
    """QK-Clip at threshold ``tau`` for the task's model (see the module doc). ``record``: keep every step's reduced
    per-head maxima on the host (``history``: tests; a host read per step)."""

    def __init__(self, tau: float, *, record: bool = False) -> None:
        if not tau > 0:
            raise ValueError(f"--model.optim.qk_clip_tau={tau}: expected a positive logit bound")
        self.tau = float(tau)
        self.record = record
        self.history: list[dict[str, Tensor]] = []
        self.logged: list[Tensor] = []  # (record) every step's logged [max_logit, heads_clipped]
        self.layers: list[_Layer] = []
        self._hooks: list[Any] = []
        self._step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = getattr(pl_module, "model", pl_module)
        if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in model.parameters()):
            raise ValueError("QK-Clip: not under DeepSpeed (its optimizer steps fp32 master partitions, which rescaling "
                             "the model's W_q/W_k does not reach: the next step would undo it); drop "
                             "--model.optim.qk_clip_tau or use the native preset of the same stage (zero1/zero2/zero3)")
        self.layers = []
        for name, m in model.named_modules():
            core = getattr(m, "core", None)
            if core is None or not hasattr(m, "head_dim"):
                continue
            if not hasattr(m, "q_proj") or getattr(m, "W_pack", None) is None and getattr(m, "k_proj", None) is None:
                raise ValueError(f"QK-Clip: {name} ({type(m).__name__}) is not a q/k/v attention it can rescale "
                                 "(Multi-head Latent Attention is not supported)")
            if not hasattr(core, "max_logits"):
                raise ValueError(f"QK-Clip: {name}'s attention core {type(core).__name__} cannot report its logits")
            layer = _Layer(name, m)
            self.layers.append(layer)
            self._hooks.append(core.register_forward_pre_hook(self._hook(layer, core), with_kwargs=True))
        if not self.layers:
            raise ValueError("QK-Clip: the model has no softmax attention layer")
        caps = pl_module.capabilities
        self._replicas = caps.data_parallel_size
        self._group = (caps.data_parallel_group or dist.group.WORLD) if caps.data_parallel_size > 1 else None
        self._step = trainer.global_step

    def _hook(self, layer: _Layer, core: nn.Module) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if module.training and torch.is_grad_enabled():  # training forwards (and their recomputation) only
                layer.record(core.max_logits(*args, **kwargs))
        return hook

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._step:  # an accumulation micro-batch: no optimizer step yet
            return
        self._step = trainer.global_step
        seen = [layer for layer in self.layers if layer.max is not None]
        if not seen:
            return
        maxima = torch.cat([layer.max for layer in seen])  # type: ignore[misc]
        if self._group is not None:  # each replica saw its rows (a cp rank its queries): the global batch's max
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self._group)
        gamma = torch.where(maxima > self.tau, self.tau / maxima, torch.ones_like(maxima))
        with torch.no_grad():
            for layer, g in zip(seen, gamma.split([layer.max.shape[0] for layer in seen])):  # type: ignore[union-attr]
                layer.clip(g)
        self._log(pl_module, maxima, gamma)
        if self.record:
            self.history.append({layer.name: m.cpu() for layer, m in zip(
                seen, maxima.split([layer.max.shape[0] for layer in seen]))})  # type: ignore[union-attr]
        for layer in self.layers:
            layer.max = None

    def _log(self, pl_module: pl.LightningModule, maxima: Tensor, gamma: Tensor) -> None:
        """The largest logit over every layer and head and the heads clipped, over every rank: pipeline stages and
        tensor-parallel ranks hold other layers and heads; the replicas the same ones (counted once)."""
        stats = torch.stack([maxima.max(), (gamma < 1).sum().float()])
        if dist.is_initialized() and dist.get_world_size() > 1:
            top, count = stats.clone(), stats.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            dist.all_reduce(count)
            stats = torch.stack([top[0], count[1] / self._replicas])
        pl_module.log("qk_clip/max_logit", stats[0], on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("qk_clip/heads_clipped", stats[1], on_step=True, on_epoch=False, batch_size=1)
        if self.record:
            self.logged.append(stats.cpu())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

