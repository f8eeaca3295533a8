"""The Muon tests' fit and what they compare (``tests/parallel/test_muon*.py``).

The model has every kind of hidden matrix: Baichuan's fused ``W_pack`` (q, k, v), a dense MLP (layer 0) and the routed
experts' stacked ``gate_up_proj`` / ``down_proj`` (layer 1: 4 experts, top-2). :class:`MuonProbe` records what a
wrong gradient or a wrong update would change: every step's full gradients (before the optimizer step: Muon's
orthogonalisation and Adam's normalisation would hide a gradient's scale in the weights), the weights after the last
step, and which tensors each optimizer took on this rank.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_llm.data import TextDataModule
from lightning_llm.optim import orthogonalize
from lightning_llm.tasks import CausalLMTask, OptimConfig
from lightning_llm.testing import LoggedLoss, full_gradients, full_parameters, gathered, launch, table_trainer, wait

__all__ = ["LR", "MODEL", "MomentumAt", "MuonProbe", "QKClipRecord", "check_layout", "compare_runs", "fit_layouts",
           "merged", "muon_fit", "newton_schulz_calls", "optimizer_tensors", "reference_then_launch"]

MOE = dict(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True, aux_loss_coef=0.01, dense_layers=[0])
MODEL = dict(num_layers=2, num_kv_heads=4, qkv_packed=True, moe=MOE)
"""``debug`` overrides: fused W_pack in both layers, a dense MLP, then an MoE layer."""
LR = 3e-5
"""Muon's bf16 Newton-Schulz turns fp32 rounding of the gradients (another reduction order) into bf16 rounding of the
update (~0.4% of an element where it flips): at this learning rate 6 steps stay within 1e-5 of one device, while an
update computed on shards or from a wrong gradient would be off by ~the update (~6e-5 per step)."""


def optimizer_tensors(optimizer: Any) -> dict[str, list[int]]:
    """ids of the tensors each kind of group holds on this rank: ``muon``, ``adamw`` (ZeRO-1/2: the partitioned
    optimizer's full groups)."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    opt = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizer wraps the task's
    if hasattr(opt, "held_parameters"):  # what its groups (DeepSpeed's flat partitions) hold
        return {k: [id(p) for p in v] for k, v in opt.held_parameters().items()}
    out: dict[str, list[int]] = {"muon": [], "adamw": []}
    for g in opt.param_groups:
        out["muon" if g.get("muon") else "adamw"] += [id(p) for p in g["params"]]
    return out


class MuonProbe(pl.Callback):
    """Every step's full gradients before the optimizer step, the full weights after the last step, and the names
    of the tensors on each optimizer (a collective under sharding: every rank records)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.params: dict[str, torch.Tensor] = {}
        self.first: dict[str, torch.Tensor] = {}  # the weights after the first step
        self.first_step = 0
        self.ns_calls: list[Counter[tuple[int, ...]]] = []  # per step: Newton-Schulz calls on this rank by shape
        self._restore: Any = None
        self.groups: dict[str, list[str]] = {}

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: g.float().cpu() for n, g in full_gradients(pl_module).items()})
        self.ns_calls.append(Counter())  # the calls of the step that follows
        if not self.groups:
            names = {id(p): n for n, p in pl_module.named_parameters()}
            self.groups = {k: sorted(names[i] for i in v if i in names)
                           for k, v in optimizer_tensors(optimizer).items()}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.first_step + 1:  # the first step's update alone
            self.first = _full_weights(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first_step = trainer.global_step
        newton_schulz, batched = orthogonalize._zeropower_via_newtonschulz, orthogonalize._newton_schulz_batched

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.ns_calls[-1][tuple(args[0].shape)] += 1
            return newton_schulz(*args, **kwargs)

        def counted_batch(*args: Any, **kwargs: Any) -> torch.Tensor:  # [B, R, C]: B matrices' iterations
            self.ns_calls[-1][tuple(args[0].shape[1:])] += args[0].shape[0]
            return batched(*args, **kwargs)

        def restore() -> None:
            orthogonalize._zeropower_via_newtonschulz, orthogonalize._newton_schulz_batched = newton_schulz, batched

        self._restore = restore
        orthogonalize._zeropower_via_newtonschulz, orthogonalize._newton_schulz_batched = counted, counted_batch

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()
        self.params = _full_weights(pl_module)


def _full_weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    """Every weight in full, fp32 (DeepSpeed's ZeRO-3 partitions gathered: a collective)."""
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {n: t.float() for n, t in full_parameters(module).items()}
    return {n: t.float() for n, t in full_parameters(module).items()}


def muon_fit(strategy: Any, devices: int, out: Path, *, batch: int, steps: int = 6, save: bool = False,
             ckpt_path: Path | str | None = None, optim: dict[str, Any] | None = None,
             callbacks: tuple[pl.Callback, ...] = ()) -> dict[str, Any]:
    """``steps`` Muon steps of :data:`MODEL` on the generated corpus (8 rows of 32 tokens per step in all; fp32,
    constant LR); ``save``: ``out/ckpt/last.ckpt`` after every step. Returns this rank's losses, start step,
    per-step gradients, final weights and optimizer split."""
    pl.seed_everything(7)
    task = CausalLMTask("debug", dropout=0.0, model_overrides=MODEL,
                        optim=OptimConfig(**{"name": "muon", "lr": LR, "weight_decay": 0.1, "scheduler": "constant",
                                             **(optim or {})}))
    dm = TextDataModule(block_size=32, batch_size=batch, cache_dir=str(out.parent / "cache"), generated_docs=100,
                        val_fraction=0.0)
    rec, probe = LoggedLoss(), MuonProbe()
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps,
                            callbacks=[rec, probe, *callbacks], save_every_step=save)
    trainer.log_every_n_steps = 1
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    return {"losses": rec.losses, "start": rec.start, "grads": probe.grads, "params": probe.params, "first": probe.first,
            "groups": probe.groups, "note": task.optimizer_note,
            "ns_calls": probe.ns_calls}


def merged(every: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' records as one: losses per rank, gradients and weights by name (pipeline stages and ZeRO-2 owners
    hold some each), every rank's optimizer split."""
    steps = max(len(r["grads"]) for r in every)
    return {"losses": [r["losses"] for r in every], "start": every[0]["start"],
            "grads": [{n: g for r in every if i < len(r["grads"]) for n, g in r["grads"][i].items()}
                      for i in range(steps)],
            "params": {n: t for r in every for n, t in r["params"].items()},
            "first": {n: t for r in every for n, t in r["first"].items()},
            "groups": [r["groups"] for r in every], "note": every[0]["note"], "ns_calls": [r["ns_calls"] for r in every]}


def compare_runs(run: dict[str, Any], ref: dict[str, Any], *, start: int = 0) -> dict[str, float]:
    """``loss`` (max |train_loss - one device's| over every rank and step), ``params`` (max |weight - one device's|
    after the last step), ``first`` (the same after the first step: one update, from gradients equal up to fp32
    rounding) and ``grads0`` / ``grads`` (at the first step / over every step, the max over tensors of |gradient - one
    device's| / max |one device's|: a gradient off by a factor is off by ~1). Raises when a tensor is missing on
    either side."""
    assert set(run["params"]) == set(ref["params"]), set(run["params"]) ^ set(ref["params"])
    loss = max(abs(a - b) for curve in run["losses"] for a, b in zip(curve, ref["losses"][start:], strict=True))
    params = max((run["params"][n] - t).abs().max().item() for n, t in ref["params"].items())
    first = max((run["first"][n] - t).abs().max().item() for n, t in ref["first"].items()) if not start else 0.0
    grads = []
    for got, want in zip(run["grads"], ref["grads"][start:], strict=True):
        assert set(got) == set(want), set(got) ^ set(want)
        grads.append(max((got[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-12) for n, g in want.items()))
    return {"loss": loss, "params": params, "first": first, "grads0": grads[0], "grads": max(grads)}


def newton_schulz_calls(run: dict[str, Any], ref: dict[str, Any]) -> tuple[list[int], list[float], int]:
    """``(steps, per_rank, total)``: the steps at which the ranks' Newton-Schulz calls, summed, are not one device's
    (per matrix shape: a matrix left to AdamW, or orthogonalised twice or on pieces, changes them), each rank's calls
    per step on average, and one device's per step."""
    wrong = []
    for step, want in enumerate(ref["ns_calls"]):
        summed: Counter[tuple[int, ...]] = Counter()
        for calls in run["ns_calls"]:
            summed.update(calls[step] if step < len(calls) else {})
        if summed != want:
            wrong.append(step)
    per_rank = [sum(sum(c.values()) for c in calls) / max(len(calls), 1) for calls in run["ns_calls"]]
    return wrong, per_rank, sum(ref["ns_calls"][0].values())


class MomentumAt(pl.Callback):
    """Every Muon tensor's momentum buffer by name after each optimizer step in ``steps`` (``buffers[step]``): one
    device's optimizer state, or under DeepSpeed its partitions gathered by its own
    ``deepspeed.utils.safe_get_full_optimizer_state`` (a collective: every rank records)."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step not in self.steps:
            return
        names = {id(p): n for n, p in pl_module.named_parameters()}
        opt = trainer.optimizers[0]
        inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizer wraps the task's
        if getattr(inner, "flat_partitions", None):
            from deepspeed.utils import safe_get_full_optimizer_state

            muon = {id(p) for f in inner.flat_partitions.values() if inner.param_groups[f.index]["muon"]
                    for p, _, _ in f.pieces}
            buffers = {n: safe_get_full_optimizer_state(p, "momentum_buffer").detach().cpu().clone()
                       for n, p in pl_module.named_parameters() if id(p) in muon}
        else:
            buffers = {names[id(p)]: opt.state[p]["momentum_buffer"].detach().clone()
                       for g in opt.param_groups if g.get("muon") for p in g["params"]}
        self.buffers[trainer.global_step] = buffers


class QKClipRecord(pl.Callback):
    """Makes the task's :class:`~lightning_llm.optim.qk_clip.QKClip` keep every step's reduced per-head maxima; after
    fit ``history`` holds them (this rank's heads: a tensor-parallel rank's own) and ``tau`` the threshold."""

    def __init__(self) -> None:
        self.history: list[dict[str, torch.Tensor]] = []
        self.logged: list[list[float]] = []  # every step's logged qk_clip/max_logit, qk_clip/heads_clipped
        self.tau = float("nan")
        self._clip: Any = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_llm.optim.qk_clip import QKClip

        (self._clip,) = [cb for cb in trainer.callbacks if isinstance(cb, QKClip)]
        self._clip.record, self.tau = True, self._clip.tau

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.history, self.logged = self._clip.history, [t.tolist() for t in self._clip.logged]


def reference_then_launch(script: str, out: Path, worker: Any, mode: str, *, nproc: int = 2) -> Path:
    """The Muon tables' pattern: ``worker("reference", out)`` trains one device in this process first, then
    ``script mode out`` runs on ``nproc`` ranks with the cores to themselves; returns ``out``."""
    worker("reference", out)
    wait(launch(script, nproc, mode, str(out)), timeout=1800)
    return out


def fit_layouts(mode: str, out: Path, layouts: list[str], strategy_of: Any, *, devices: int, steps: int) -> None:
    """A layout table's worker: ``reference`` trains one device (8 rows a step) into ``reference.pt``; else every
    layout (``strategy_of(layout)``: its strategy and per-rank batch) on ``devices`` ranks into ``layouts.pt``."""
    if mode == "reference":
        torch.save(muon_fit("auto", 1, out / "ref", batch=8, steps=steps), out / "reference.pt")
        return
    results = {}
    for layout in layouts:
        strategy, batch = strategy_of(layout)
        results[layout] = merged(gathered(muon_fit(strategy, devices, out / layout, batch=batch, steps=steps)))
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / "layouts.pt")


def check_layout(runs: Path, layout: str, *, tol: float, first_tol: float,
                 grad_tol: float) -> tuple[dict[str, Any], dict[str, Any], list[int], list[float], int]:
    """Asserts ``layout``'s run of a table equals one device's (``train_loss``, the weights after the last and the
    first step, every step's gradients, within the tolerances; the weights moved well beyond ``tol``) and that the
    ranks' optimizers put exactly one device's hidden matrices on Muon; returns ``(run, reference)`` and
    :func:`newton_schulz_calls`' figures, printed, for the caller's count check."""
    ref = torch.load(runs / "reference.pt")
    run = torch.load(runs / "layouts.pt")[layout]
    err = compare_runs(run, ref)
    moved = max((ref["params"][n] - t).abs().max().item() for n, t in ref["first"].items())
    steps = len(ref["losses"])
    print(f"{layout} vs one device over {steps} Muon steps: train_loss {err['loss']:.1e}, weights after the first step "
          f"{err['first']:.1e} and the last {err['params']:.1e} (they moved {moved:.1e} in between), gradients "
          f"(relative) at the first step {err['grads0']:.1e}, at any step {err['grads']:.1e}; {run['note']}")
    assert moved > 10 * tol  # the updates are what is compared
    assert err["loss"] <= tol and err["params"] <= tol and err["first"] <= first_tol
    assert err["grads0"] <= tol and err["grads"] <= grad_tol
    muon = set(ref["groups"]["muon"])  # every rank: the hidden matrices it holds on Muon, nothing else there
    for rank in run["groups"]:
        assert set(rank["muon"]) <= muon and not set(rank["adamw"]) & muon, rank
    assert set().union(*(r["muon"] for r in run["groups"])) == muon
    wrong, per_rank, total = newton_schulz_calls(run, ref)
    print(f"{layout}: Newton-Schulz calls per step on each rank {per_rank} (one device: {total})")
    return run, ref, wrong, per_rank, total
