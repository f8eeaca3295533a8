"""Muon on one device (``--model.optim.name=muon``) against torch's own optimizers run in the test.

The task's optimizer (``CausalLMTask.configure_optimizers``) steps a model with every kind of hidden matrix: dense
projections, Baichuan's fused ``W_pack`` (rows head-interleaved ``[N, 3, D]``: q, k, v), a dense MLP and the routed
experts' stacked ``gate_up_proj`` [E, 2I, H] (gate, up) and ``down_proj``. The reference is ``torch.optim.Muon`` over
one leaf tensor per checkpoint matrix (each expert, each fused part: cut out of the tensors by index arithmetic here,
not by the optimizer's code) plus ``torch.optim.AdamW`` over the same AdamW groups, fed the same gradients: after
every step both sides must be bitwise equal. Also: the split by role, a fused model against the unfused one with the
same weights, the learning-rate choices, the non-finite skip on the device, the optimizer stepped on flat partitions
(DeepSpeed's ZeRO) bitwise equal to it stepped on the parameters, and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_llm.optim import Matrices, MuonWithAdamW, split_parameters
from lightning_llm.optim.orthogonalize import NewtonSchulz
from lightning_llm.tasks import CausalLMTask, OptimConfig

MOE = dict(num_experts=4, top_k=2, intermediate_size=32, norm_topk_prob=True, aux_loss_coef=0.0, dense_layers=[0])
OVERRIDES = dict(num_layers=2, num_kv_heads=4, qkv_packed=True, moe=MOE)
NS = NewtonSchulz((3.4445, -4.7750, 2.0315), 5, 1e-7)


def _task(optim: OptimConfig, **overrides: object) -> CausalLMTask:
    torch.manual_seed(0)
    task = CausalLMTask("debug", dropout=0.0, model_overrides={**OVERRIDES, **overrides}, optim=optim)
    task.configure_model()
    return task


def _matrices(t: torch.Tensor, layout: Matrices, head_dim: int) -> list[torch.Tensor]:
    """The checkpoint's matrices of ``t``, each a copy: experts one by one; W_pack's q, k, v rows gathered head by
    head; gate_up's halves."""
    out = []
    for m in (t.unbind(0) if layout.stack else [t]):
        if layout.parts == 1:
            out.append(m.clone())
        elif layout.inner > 0:  # W_pack: head h's part j is rows (3h + j) D ... (3h + j + 1) D
            heads = m.shape[0] // (3 * head_dim)
            out += [torch.cat([m[(3 * h + j) * head_dim:(3 * h + j + 1) * head_dim] for h in range(heads)])
                    for j in range(3)]
        else:
            out += [p.clone() for p in m.chunk(layout.parts, dim=0)]
    return out


class TorchReference:
    """torch.optim.Muon over one leaf per matrix and torch.optim.AdamW over the AdamW groups of ``opt``."""

    def __init__(self, task: CausalLMTask, opt: MuonWithAdamW, cfg: OptimConfig) -> None:
        self.head_dim = task.model.config.head_dim
        self.muon_groups = [g for g in opt.param_groups if g["muon"]]
        self.leaves = {id(p): [torch.nn.Parameter(m) for m in _matrices(p.detach(), Matrices(*g["matrices"]),
                                                                         self.head_dim)]
                       for g in self.muon_groups for p in g["params"]}
        self.muon = torch.optim.Muon([x for v in self.leaves.values() for x in v], lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                     nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                                     adjust_lr_fn=cfg.muon_adjust_lr)
        self.adam_params = {id(p): torch.nn.Parameter(p.detach().clone()) for g in opt.param_groups if not g["muon"]
                            for p in g["params"]}
        self.adamw = torch.optim.AdamW([{"params": [self.adam_params[id(p)] for p in g["params"]],
                                         "weight_decay": g["weight_decay"]}
                                        for g in opt.param_groups if not g["muon"]],
                                       lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)

    def step(self) -> None:
        for g in self.muon_groups:
            for p in g["params"]:
                for leaf, grad in zip(self.leaves[id(p)], _matrices(p.grad, Matrices(*g["matrices"]),
                                                                      self.head_dim)):
                    leaf.grad = grad
        for pid, leaf in self.adam_params.items():
            leaf.grad = self._grads[pid].clone()
        self.muon.step()
        self.adamw.step()

    def take_grads(self, opt: MuonWithAdamW) -> None:
        self._grads = {id(p): p.grad for g in opt.param_groups if not g["muon"] for p in g["params"]}

    def max_error(self, opt: MuonWithAdamW) -> float:
        err = 0.0
        for g in opt.param_groups:
            for p in g["params"]:
                if g["muon"]:
                    mats = _matrices(p.detach(), Matrices(*g["matrices"]), self.head_dim)
                    err = max(err, *((a - b).abs().max().item() for a, b in zip(mats, self.leaves[id(p)])))
                else:
                    err = max(err, (p.detach() - self.adam_params[id(p)]).abs().max().item())
        return err


def _loss(task: CausalLMTask, step: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(step))
    logits = task.model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_one_device_equals_torch_muon_and_adamw(adjust: str) -> None:
    cfg = OptimConfig(name="muon", lr=2e-2, weight_decay=0.1, scheduler="constant", muon_adjust_lr=adjust)
    task = _task(cfg)
    opt = task.configure_optimizers()["optimizer"]
    assert isinstance(opt, MuonWithAdamW)
    ref = TorchReference(task, opt, cfg)
    losses = []
    for step in range(5):
        loss = _loss(task, 0)  # one batch: the loss must fall
        loss.backward()
        ref.take_grads(opt)
        ref.step()
        opt.step()
        opt.zero_grad()
        err = ref.max_error(opt)
        losses.append(loss.item())
        print(f"{adjust} step {step}: loss {loss.item():.4f}, max |ours - torch.optim.Muon/AdamW| = {err:.1e}")
        assert err == 0.0
    assert losses[-1] < losses[0] - 0.5  # it learns
    # the states are torch's: a momentum buffer per Muon tensor, AdamW's moments per AdamW tensor
    kinds = {frozenset(s) for s in opt.state.values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}


def test_split_by_role() -> None:
    task = _task(OptimConfig(name="muon"))
    split = split_parameters(task)
    muon = {split.names[id(p)]: m for p, m in split.muon.items()}
    adamw = {split.names[id(p)] for p in split.adamw}
    assert muon["model.layers.0.self_attn.W_pack.weight"] == Matrices(outer=-1, parts=3, inner=16)
    assert muon["model.layers.1.mlp.experts.gate_up_proj"] == Matrices(stack=1, parts=2)
    assert muon["model.layers.1.mlp.experts.down_proj"] == Matrices(stack=1)
    assert muon["model.layers.0.mlp.up_proj.weight"] == Matrices()
    # embeddings and head are matrices too, but not hidden ones; the router is a classifier over the experts
    assert {"model.embed_tokens.weight", "model.lm_head.weight", "model.layers.1.mlp.gate.weight",
            "model.norm.weight"} <= adamw
    assert not set(muon) & adamw and len(muon) + len(adamw) == sum(1 for _ in task.parameters())
    line = split.describe(False)
    print(line)
    # tensors: 2 x (W_pack, o_proj) + the dense MLP's 3 + the experts' 2; matrices: 2 x (q, k, v, o) + 3 + 4 x (gate, up, down)
    assert "Muon on 9 hidden weight tensors (23 matrices" in line


def _fused_twin(plain: CausalLMTask, cfg: OptimConfig) -> CausalLMTask:
    """The dense model with Baichuan's fused W_pack, holding ``plain``'s weights (q, k, v rows head-interleaved)."""
    fused = _task(cfg, moe=None)
    d, n = fused.model.config.head_dim, fused.model.config.num_heads
    with torch.no_grad():
        mine = dict(fused.model.named_parameters())
        for name, p in plain.model.named_parameters():
            if name in mine:
                mine[name].copy_(p)
        for i, layer in plain.model.layers.items():
            w = fused.model.layers[i].self_attn.W_pack.weight.view(n, 3, d, -1)
            for j, proj in enumerate((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)):
                w[:, j].copy_(proj.weight.view(n, d, -1))
    return fused


def _qkv_error(fused: CausalLMTask, plain: CausalLMTask) -> float:
    d, n = fused.model.config.head_dim, fused.model.config.num_heads
    err = 0.0
    for i, layer in plain.model.layers.items():
        w = fused.model.layers[i].self_attn.W_pack.weight.view(n, 3, d, -1)
        for j, proj in enumerate((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)):
            err = max(err, (w[:, j].reshape(n * d, -1) - proj.weight).abs().max().item())
    return err


def test_fused_parts_orthogonalised_alone() -> None:
    """W_pack's parts against the q/k/v matrices of the unfused model with the same weights, trained side by side
    (the gradients differ only by fp32 rounding); W_pack orthogonalised whole (the group's matrices forced to one)
    is another update, which the same comparison tells apart."""
    cfg = OptimConfig(name="muon", lr=1.5e-4, scheduler="constant")
    plain = _task(cfg, qkv_packed=False, moe=None)
    fused, whole = _fused_twin(plain, cfg), _fused_twin(plain, cfg)
    tasks = (plain, fused, whole)
    start = [p.detach().clone() for p in plain.parameters()]
    opts = [t.configure_optimizers()["optimizer"] for t in tasks]
    for g in opts[2].param_groups:
        if g["muon"]:
            g["matrices"] = tuple(Matrices())
    for step in range(4):
        for task, opt in zip(tasks, opts):
            _loss(task, step).backward()
            opt.step()
            opt.zero_grad()
    err, err_whole = _qkv_error(fused, plain), _qkv_error(whole, plain)
    moved = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), start))
    print(f"W_pack's q/k/v after 4 Muon steps vs the unfused model's q_proj/k_proj/v_proj: max |diff| = {err:.1e} "
          f"(W_pack orthogonalised whole: {err_whole:.1e}; the weights moved up to {moved:.1e})")
    assert err < 1e-5 and err_whole > 1e-4


def test_found_inf_skips_on_the_device() -> None:
    """A found_inf of 1.0 (the non-finite guard's) leaves weights and every state as they were; 0.0 steps as
    without the flag."""
    cfg = OptimConfig(name="muon", lr=1e-2, scheduler="constant")
    task = _task(cfg)
    opt = task.configure_optimizers()["optimizer"]
    assert opt.skips_on_found_inf  # fused AdamW on the CPU, Muon's own skip
    _loss(task, 0).backward()
    opt.step()
    opt.zero_grad()
    twin = copy.deepcopy(task)
    twin_opt = twin.configure_optimizers()["optimizer"]
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors
    for t in (task, twin):
        _loss(t, 1).backward()
    before = {n: p.detach().clone() for n, p in task.named_parameters()}
    states = copy.deepcopy(opt.state_dict()["state"])
    grads = [p.grad.clone() for p in task.parameters()]
    for p in task.parameters():
        p.grad[0].fill_(float("nan"))  # what a skip protects against
    opt.found_inf = torch.ones(())
    opt.step()
    assert all(torch.equal(p, before[n]) for n, p in task.named_parameters())
    after = opt.state_dict()["state"]
    assert all(torch.equal(v, after[i][k]) for i, s in states.items() for k, v in s.items())
    # 0.0: the same step as twin's without a flag
    for p, g in zip(task.parameters(), grads):
        p.grad = g
    opt.found_inf = torch.zeros(())
    opt.step()
    twin_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(task.parameters(), twin.parameters()))


def test_refusals() -> None:
    with pytest.raises(ValueError, match="muon_momentum"):
        _task(OptimConfig(name="muon", muon_momentum=1.5)).configure_optimizers()
    with pytest.raises(ValueError, match="muon_adjust_lr"):
        _task(OptimConfig(name="muon", muon_adjust_lr="rms")).configure_optimizers()  # type: ignore[arg-type]

    class NoFamily(CausalLMTask):
        def build_model(self) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))

    task = NoFamily("debug", optim=OptimConfig(name="muon"))
    task.configure_model()
    with pytest.raises(ValueError, match="no trainable hidden weight matrix"):
        task.configure_optimizers()


@pytest.mark.parametrize("kind", ["w_pack", "gqa", "mha"])
def test_qk_clip_brings_each_clipped_head_to_tau(kind: str) -> None:
    """After a step's clip, the same batch's largest logit of every clipped head is tau, the others' unchanged: fused
    W_pack and separate q/k with as many kv heads (sqrt(gamma) on both), grouped kv heads (gamma on W_q)."""
    from types import SimpleNamespace

    from lightning_llm.optim.qk_clip import QKClip

    overrides = {"w_pack": {"moe": None}, "gqa": {"qkv_packed": False, "num_kv_heads": 2, "moe": None},
                 "mha": {"qkv_packed": False, "moe": None}}[kind]
    task = _task(OptimConfig(name="muon"), **overrides)
    task.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    clip = QKClip(1.0, record=True)
    clip.on_train_start(SimpleNamespace(global_step=0), task)  # type: ignore[arg-type]
    with torch.no_grad():  # larger logits than the init's
        for layer in clip.layers:
            for lin in (layer.attn.W_pack, layer.attn.q_proj, layer.attn.k_proj):
                if lin is not None:
                    lin.weight.mul_(torch.linspace(1.0, 12.0, lin.weight.shape[0])[:, None])

    def maxima() -> list[torch.Tensor]:
        with torch.enable_grad():
            _loss(task, 0)
        out = [layer.max.clone() for layer in clip.layers]
        for layer in clip.layers:
            layer.max = None
        return out

    before = maxima()
    clip.tau = float(torch.cat(before).median())
    _loss(task, 0)  # the step's forward: the maxima the clip reads
    clip.on_train_batch_end(SimpleNamespace(global_step=1), task)  # type: ignore[arg-type]
    after = maxima()
    for b, a in zip(before[:1], after[:1]):  # the first layer: its input (the embeddings) is the same after the clip
        clipped = b > clip.tau
        print(f"{kind}: tau {clip.tau:.3f}, heads' max before {b.tolist()}, after {a.tolist()}")
        assert clipped.any() and (~clipped).any()
        assert torch.allclose(a[clipped], torch.full_like(a[clipped], clip.tau), rtol=1e-5)
        assert torch.allclose(a[~clipped], b[~clipped], rtol=1e-6)


@pytest.mark.parametrize("on_muon", [False, True])
def test_peft_adapters(on_muon: bool, caplog: pytest.LogCaptureFixture) -> None:
    """LoRA: the frozen base weights take no optimizer; the adapters train on AdamW, said in one line, or their
    matrices on Muon behind the switch."""
    import logging

    from lightning_llm.optim import build_muon

    cfg = OptimConfig(name="muon", muon_adapters=on_muon)
    task = CausalLMTask("debug", dropout=0.0, model_overrides={**OVERRIDES, "moe": None, "qkv_packed": False},
                        optim=cfg, lora={"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    task.configure_model()
    with caplog.at_level(logging.INFO, logger="lightning_llm.optim.build"):
        opt, split = build_muon(task, cfg)
    lines = [r.getMessage() for r in caplog.records if "PEFT adapter" in r.getMessage()]
    print(lines[0], "|", split.describe(on_muon))
    assert len(lines) == 1 and ("on Muon" if on_muon else "AdamW (--model.optim.muon_adapters=true") in lines[0]
    names = {id(p): n for n, p in task.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    lora = {n for n, p in task.named_parameters() if "lora_" in n and p.requires_grad}
    assert lora and (lora <= muon if on_muon else lora <= adamw and not muon & lora)
    assert not any(p.requires_grad is False for g in opt.param_groups for p in g["params"])


def test_fsdp1_refused() -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_llm.optim import build_muon

    cfg = OptimConfig(name="muon")
    with pytest.raises(ValueError, match="not under") as e:
        build_muon(_task(cfg), cfg, strategy=FSDPStrategy())
    assert "--trainer.strategy=zero3" in str(e.value) and "\n" not in str(e.value)


def _flat_twin(opt: MuonWithAdamW, pad: int) -> tuple[MuonWithAdamW, list[tuple[torch.Tensor, list[torch.Tensor]]]]:
    """The optimizer as DeepSpeed's ZeRO hands it over on one rank: each param group one flat fp32 tensor, its
    parameters end to end with ``pad`` elements of padding after each (alignment), declared with
    ``hold_flat_partition``. Returns the twin and each flat tensor with its parameters."""
    groups, flats = [], []
    for index, group in enumerate(opt.param_groups):
        params = group["params"]
        pieces, chunks, offset = [], [], 0
        for p in params:
            pieces.append((p, offset, (p.numel(),)))
            chunks += [p.detach().reshape(-1), torch.zeros(pad)]
            offset += p.numel() + pad
        flat = torch.cat(chunks) if chunks else torch.zeros(pad)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [flat]})
        flats.append((flat, params, pieces, index))
    twin = MuonWithAdamW(groups, lr=opt.defaults["lr"])
    for flat, _, pieces, index in flats:
        twin.hold_flat_partition(flat, pieces, group=None, param_group=index)
    return twin, [(flat, params) for flat, params, _, _ in flats]


def test_flat_partitions_equal_the_parameters() -> None:
    """DeepSpeed's ZeRO steps the task's optimizer on flat partitions of runs of the parameters' elements: declared
    (``hold_flat_partition``), each Muon parameter is orthogonalised whole and every element updated as on the
    parameters themselves (bitwise, with padding between them); undeclared, a Muon group refuses its flat tensor."""
    cfg = OptimConfig(name="muon", lr=2e-2, weight_decay=0.1, scheduler="constant")
    task = _task(cfg)
    opt = task.configure_optimizers()["optimizer"]
    twin, flats = _flat_twin(opt, pad=3)
    held = twin.held_parameters()
    assert {id(p) for p in held["muon"]} == {id(p) for g in opt.param_groups if g["muon"] for p in g["params"]}
    torch.manual_seed(1)
    for _ in range(3):
        for flat, params in flats:
            grads = [torch.randn_like(p) for p in params]
            for p, g in zip(params, grads):
                p.grad = g
            flat.grad = torch.cat([t for g in grads for t in (g.reshape(-1), torch.zeros(3))]) if grads else \
                torch.zeros(3)
        opt.step()
        twin.step()
        for flat, params in flats:
            mine = flat.detach().split([n for p in params for n in (p.numel(), 3)] or [3])
            for p, got, padding in zip(params, mine[::2], mine[1::2]):
                assert torch.equal(got.view_as(p), p.detach()), p.shape
                assert not padding.any()
    undeclared = MuonWithAdamW([{**g, "params": [flat]} for g, (flat, _) in zip(twin.param_groups, flats)],
                               lr=cfg.lr)
    with pytest.raises(RuntimeError, match="not declared with hold_flat_partition"):
        undeclared.step()


def test_deepspeed_optimizer_overrides_refused() -> None:
    from lightning_llm.strategies.zero.deepspeed_partitions import refuse_optimizer_override

    task = _task(OptimConfig(name="muon"))
    muon = task.configure_optimizers()["optimizer"]
    with pytest.raises(ValueError, match="optimizer=adamw replaces the task's Muon optimizer"):
        refuse_optimizer_override(named="adamw", config_section=False, optimizer=muon, task=None)
    with pytest.raises(ValueError, match="config's optimizer section replaces the task's Muon optimizer"):
        refuse_optimizer_override(named=None, config_section=True, optimizer=None, task=task)
    adamw = _task(OptimConfig())
    refuse_optimizer_override(named="adamw", config_section=False, optimizer=adamw.configure_optimizers()[
        "optimizer"], task=None)
    refuse_optimizer_override(named=None, config_section=True, optimizer=None, task=adamw)


def test_qk_clip_refused_under_deepspeed() -> None:
    """DeepSpeed's optimizer steps its fp32 master partitions: a rescale of the model's W_q/W_k would be undone."""
    from lightning_llm.optim.qk_clip import QKClip

    task = _task(OptimConfig(name="muon", qk_clip_tau=10.0), qkv_packed=False, moe=None)
    next(task.parameters()).ds_id = 0  # what DeepSpeed's ZeRO-3 marks its partitioned parameters with
    with pytest.raises(ValueError, match="QK-Clip: not under DeepSpeed") as e:
        QKClip(10.0).on_train_start(None, task)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)
