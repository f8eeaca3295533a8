"""Mixture-of-Experts models against transformers: Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints written by
``save_pretrained`` in the test, their routers, the load-balancing loss and its gradient, the grouped expert GEMMs
against the loop over experts, and the HF export.

Tiny fp32 models, perturbed so that norms, routers and experts are non-trivial; batches with left and right padding.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import padded_lm_batch  # noqa: E402
from tests.models.family_parity import write_perturbed  # noqa: E402

transformers = pytest.importorskip("transformers")

from tests.conftest import peft_twin  # noqa: E402

from lightning_llm.models import build_model, load_hf, save_hf  # noqa: E402
from lightning_llm.models.layers.configs import MoEConfig  # noqa: E402
from lightning_llm.models.init import materialize  # noqa: E402
from lightning_llm.models.layers.moe import expert_ffn, route_scores  # noqa: E402

VOCAB = 96


def _configs() -> dict[str, tuple[Any, Any]]:
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
    return {
        "mixtral": (MixtralForCausalLM, MixtralConfig(intermediate_size=24, num_hidden_layers=2, num_local_experts=4,
                                                      **common)),
        # a dense layer (mlp_only_layers) between MoE layers, a gated shared expert, top-k not renormalised
        "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig(
            intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_hidden_layers=3,
            num_experts=6, mlp_only_layers=[1], norm_topk_prob=False, **common)),
        "qwen3_moe_norm": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_experts=6, norm_topk_prob=True,
            **common)),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_experts=6, norm_topk_prob=False,
            **common)),
    }


def _write(name: str, out: Path, seed: int = 0) -> Any:
    cls, cfg = _configs()[name]
    torch.manual_seed(seed)
    return write_perturbed(cls(cfg), out, seed, scale=0.05)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return padded_lm_batch(VOCAB, 12)


def _ours(path: Path, *, lazy: bool) -> Any:
    model, _ = load_hf(path, lazy=lazy)
    if lazy:
        materialize(model, "cpu")
    return model


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_loss_aux_and_gradients_equal_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path)
    ids, mask, labels = _batch()
    keep = mask.bool()
    with torch.no_grad():
        ref = hf.eval()(input_ids=ids, attention_mask=mask).logits
    for lazy in (False, True):
        ours = _ours(tmp_path, lazy=lazy).eval()
        with torch.no_grad():
            logits = ours(ids, attention_mask=mask)
        assert (logits - ref)[keep].abs().max() < 1e-5, (name, lazy)

    # Training: transformers' loss with output_router_logits=True (CE + coef * aux) and its gradients. Ours: the
    # fused CE plus the load-balancing loss of the recorded routing, whose gradient is injected at the routers.
    hf.train()
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ours = _ours(tmp_path, lazy=False).train()
    assert ours.routing is not None
    ours.routing.begin()
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]  # our labels are next-token ids already
    ce = ours(ids, attention_mask=mask, labels=shifted)
    aux = ours.routing.aux_loss()
    coef = ours.config.moe.aux_loss_coef
    assert coef == pytest.approx(0.1)
    assert abs(float(aux) - float(out.aux_loss.detach())) < 1e-6
    assert abs(float(ce.detach() + coef * aux) - float(out.loss.detach())) < 1e-6
    ce.backward()
    hf_grads = {n.removeprefix("model."): p.grad for n, p in hf.named_parameters()}
    worst = 0.0
    for n, p in ours.named_parameters():
        hn = n.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
        assert hn in hf_grads, hn
        worst = max(worst, float((hf_grads[hn] - p.grad).abs().max()))
    assert worst < 1e-6, worst
    # the aux loss's gradient is really there: without it the routers' gradients differ
    ours.zero_grad()
    ours.routing.begin()
    ours.routing.aux_loss_coef = 0.0
    ce = ours(ids, attention_mask=mask, labels=shifted)
    ce.backward()
    router = "layers.0.mlp.gate.weight"
    assert float((dict(ours.named_parameters())[router].grad - hf_grads[router]).abs().max()) > 1e-4


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe_norm"])
def test_export_writes_transformers_key_set_and_reloads(tmp_path: Path, name: str) -> None:
    from safetensors import safe_open

    hf = _write(name, tmp_path / "src")
    ours = _ours(tmp_path / "src", lazy=True)
    save_hf(ours, tmp_path / "out")
    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "src", tmp_path / "out")]
    assert keys[0] == keys[1]
    cls = type(hf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = cls.from_pretrained(str(tmp_path / "out")).eval()
    ids, mask, _ = _batch()
    with torch.no_grad():
        diff = back(input_ids=ids, attention_mask=mask).logits - hf.eval()(input_ids=ids, attention_mask=mask).logits
    assert diff[mask.bool()].abs().max() < 1e-5


def test_crafted_checkpoints_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _write("qwen3_moe", tmp_path / "src")
    sd = load_file(str(tmp_path / "src" / "model.safetensors"))
    config = (tmp_path / "src" / "config.json").read_text()
    for case, change in {
        "missing": lambda d: d.pop("model.layers.1.mlp.experts.5.up_proj.weight"),
        "shape": lambda d: d.__setitem__("model.layers.0.mlp.experts.2.gate_proj.weight", torch.zeros(8, 32)),
        "extra": lambda d: d.__setitem__("model.layers.0.mlp.experts.6.gate_proj.weight", torch.zeros(16, 32)),
    }.items():
        d = tmp_path / case
        d.mkdir()
        (d / "config.json").write_text(config)
        bad = dict(sd)
        change(bad)
        save_file(bad, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match="experts"):
            load_hf(d)


# ---------------------------------------------------------------------------------------------------- routers


def _same_choice(ids_a: torch.Tensor, w_a: torch.Tensor, ids_b: torch.Tensor, w_b: torch.Tensor) -> None:
    """The same experts with the same weights per token (in any order)."""
    oa, ob = ids_a.sort(-1), ids_b.sort(-1)
    assert torch.equal(oa.values, ob.values)
    assert torch.allclose(w_a.gather(1, oa.indices), w_b.float().gather(1, ob.indices), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_moe_norm"])
def test_softmax_routers_choose_as_transformers(name: str) -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = _configs()[name][1]
    torch.manual_seed(0)
    ref = (MixtralTopKRouter if name == "mixtral" else Qwen3MoeTopKRouter)(cfg)
    torch.nn.init.normal_(ref.weight, std=0.5)
    x = torch.randn(64, cfg.hidden_size)
    _, w_ref, ids_ref = ref(x)
    ours = MoEConfig(num_experts=ref.weight.shape[0], top_k=cfg.num_experts_per_tok,
                     norm_topk_prob=True if name == "mixtral" else cfg.norm_topk_prob)
    ids, w = route_scores(x @ ref.weight.t(), ours, None)
    _same_choice(ids, w, ids_ref, w_ref)


def test_sigmoid_group_limited_router_with_bias_chooses_as_deepseek_v3() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(ref.weight, std=0.5)
    ref.e_score_correction_bias.copy_(torch.randn(16) * 0.3)  # a bias that changes the choice
    x = torch.randn(128, 32)
    _, w_ref, ids_ref = ref(x)
    ours = MoEConfig(num_experts=16, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2, norm_topk_prob=True,
                     routed_scaling_factor=2.5, score_bias=True)
    logits = x @ ref.weight.t()
    ids, w = route_scores(logits, ours, ref.e_score_correction_bias)
    _same_choice(ids, w, ids_ref, w_ref)
    unbiased, _ = route_scores(logits, ours, None)
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)  # the bias mattered


# ---------------------------------------------------------------------------------------------------- experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_forward_and_backward_with_empty_experts(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    e, h, i = 6, 16, 8
    counts = torch.tensor([5, 0, 7, 0, 3, 9])  # experts 1 and 3 get no token
    tokens = torch.randn(int(counts.sum()), h, dtype=dtype, requires_grad=True)
    gate_up = (torch.randn(e, 2 * i, h) * 0.3).to(dtype).requires_grad_()
    down = (torch.randn(e, h, i) * 0.3).to(dtype).requires_grad_()
    grad = torch.randn(int(counts.sum()), h, dtype=dtype)
    results = []
    for impl in ("grouped", "loop"):
        out = expert_ffn(tokens, counts, gate_up, down, act="swiglu", impl=impl)
        results.append((out, *torch.autograd.grad(out, (tokens, gate_up, down), grad)))
    tol = 0.0 if dtype == torch.float32 else 1e-2
    for a, b in zip(*results):
        assert (a.float() - b.float()).abs().max() <= tol
    assert results[0][2][1].abs().max() == 0 and results[0][3][3].abs().max() == 0  # no token, zero gradient


def test_named_moe_size_trains_on_one_device() -> None:
    torch.manual_seed(0)
    model = build_model("debug-moe", family="decoder").train()
    ids = torch.randint(0, 256, (2, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        model.routing.begin()
        loss = model(ids, labels=ids.roll(-1, 1))
        (loss).backward()
        losses.append(float(loss) + model.config.moe.aux_loss_coef * float(model.routing.aux_loss()))
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    loads = model.routing.loads()
    assert loads.shape == (4, 8) and float(loads.sum()) == 4 * 2 * 64  # every layer routed every token top-2


class _Rows(__import__("lightning").pytorch.LightningDataModule):
    """Fixed batches (already-shifted labels), in order."""

    def __init__(self, batches: list[dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.batches = batches

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.batches, batch_size=None)


def test_task_training_step_equals_transformers_with_aux_loss_and_accumulation(tmp_path: Path) -> None:
    """The whole task path on one device (the Trainer, gradient accumulation 2, the aux loss's gradient injected with
    the factor read from the returned loss): one optimizer step's gradients equal transformers' (loss with
    output_router_logits=True, each micro-batch's loss / 2), and the logged train_loss is transformers' loss."""
    import lightning.pytorch as pl

    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import MetricRows

    hf = _write("qwen3_moe", tmp_path / "hf").train()
    hf.router_aux_loss_coef = 0.5  # what its forward reads
    (tmp_path / "hf" / "config.json").write_text(
        (tmp_path / "hf" / "config.json").read_text().replace('"router_aux_loss_coef": 0.1', '"router_aux_loss_coef": 0.5'))
    ids, mask, labels = _batch()
    micro = [(ids[:2], mask[:2], labels[:2]), (ids[1:], mask[1:], labels[1:])]
    ref_losses = []
    for i, m, lab in micro:
        out = hf(input_ids=i, attention_mask=m, labels=lab)
        (out.loss / 2).backward()
        ref_losses.append(float(out.loss.detach()))
    shifted = [torch.cat([lab[:, 1:], torch.full((lab.shape[0], 1), -100)], 1) for _, _, lab in micro]
    batches = [{"input_ids": i, "attention_mask": m, "labels": s} for (i, m, _), s in zip(micro, shifted)]

    grads: dict[str, torch.Tensor] = {}

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            grads.update({n: p.grad.clone() for n, p in pl_module.model.named_parameters()})

    rows = MetricRows()
    task = CausalLMTask(str(tmp_path / "hf"), dropout=0.0, optim=OptimConfig(lr=0.0, weight_decay=0.0))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, callbacks=[Grads(), rows], default_root_dir=str(tmp_path))
    trainer.fit(task, _Rows(batches))
    assert [r["train_loss"] for r in rows.rows] == pytest.approx(ref_losses, abs=1e-6)
    hf_grads = {n.removeprefix("model."): p.grad for n, p in hf.named_parameters()}
    worst = max(float((hf_grads[n.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")]
                       - g).abs().max()) for n, g in grads.items())
    assert worst < 1e-6, worst


def test_lora_on_attention_and_experts_equals_peft_on_transformers_and_exports(tmp_path: Path) -> None:
    """LoRA on q/v and on the fused experts (peft's target_parameters) of our Qwen3-MoE equals peft's on
    transformers' model with the same adapter weights; the exported adapter loads with ``PeftModel.from_pretrained``
    on the HF checkpoint and gives the same logits."""
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter

    hf = _write("qwen3_moe_norm", tmp_path / "hf").eval()
    ours = _ours(tmp_path / "hf", lazy=False).eval()
    args = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    cfg = PeftConfig(method="lora", lora=args)
    ours = apply_peft(ours, cfg)
    ref = peft_twin(ours, hf, cfg)
    theirs = dict(ref.named_parameters())
    ids, mask, _ = _batch()
    keep = mask.bool()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        assert (ours(ids, attention_mask=mask) - want)[keep].abs().max() < 1e-5
    assert any("experts" in n and "lora_B" in n for n in theirs)  # the experts are adapted, not only q/v
    export_adapter(ours, cfg, tmp_path / "adapter")
    fresh = _configs()["qwen3_moe_norm"][0].from_pretrained(str(tmp_path / "hf")).eval()
    loaded = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids, attention_mask=mask).logits - want)[keep].abs().max() < 1e-5


def test_expert_parallel_settings_are_refused_in_one_line() -> None:
    """Degrees and combinations expert parallelism cannot run, refused before anything is built."""
    from lightning_llm.peft import LoraArgs, PeftConfig
    from lightning_llm.strategies.engine.layout import LayoutArgs
    from lightning_llm.strategies.expert import expert_blocker
    from lightning_llm.strategies.mesh import ParallelDims
    from lightning_llm.tasks.decoder import check_expert_adapter_layout

    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide the 4 data x context parallel ranks"):
        ParallelDims(dp=-1, ep=3).resolved(4)
    assert ParallelDims(dp=2, cp=2, ep=-1).resolved(4).ep == 4
    with pytest.raises(ValueError, match="zero_stage=1 is not supported"):
        LayoutArgs(dims=ParallelDims(dp=-1, ep=2), zero_stage=1)
    model = build_model("debug-moe", family="decoder", lazy=True)
    assert "does not divide the model's 8 experts" in str(expert_blocker(model, 3))
    assert "no Mixture-of-Experts layers" in str(expert_blocker(build_model("debug", family="decoder", lazy=True), 2))
    lora = PeftConfig(lora=LoraArgs(dropout=0.0, target_parameters=["mlp.experts.gate_up_proj"]))

    class EP2:
        dims = ParallelDims(dp=2, ep=2)

    with pytest.raises(ValueError, match="not supported under expert parallelism"):
        check_expert_adapter_layout(lora, EP2())
    with pytest.raises(ValueError, match="needs lora.dropout=0"):
        PeftConfig(lora=LoraArgs(target_parameters=["mlp.experts.gate_up_proj"]))


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputed_blocks_give_the_load_balancing_gradient_once(reentrant: bool) -> None:
    """Activation checkpointing recomputes each block in backward: the recompute records no routing twice and the
    load-balancing loss's gradient reaches the routers exactly as without recompute (torch's non-reentrant
    checkpoint must see the same saved tensors; the reentrant one backpropagates the recomputed graph)."""
    from lightning_llm.peft import enable_gradient_checkpointing

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    grads, loads = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model("debug-moe", family="decoder", moe={**vars(MoEConfig(
            num_experts=8, top_k=2, intermediate_size=32)), "aux_loss_coef": 1.0}).train()
        if recompute:
            enable_gradient_checkpointing(model, use_reentrant=reentrant)
        model.routing.begin()
        model(ids, labels=ids.roll(-1, 1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        loads.append(model.routing.loads().clone())
    assert torch.equal(loads[0], loads[1])
    worst = max(float((grads[0][n] - g).abs().max()) for n, g in grads[1].items())
    assert worst < 1e-6, worst
    assert float(grads[1]["layers.0.mlp.gate.weight"].abs().max()) > 0


def test_expert_ffn_compiles_in_fp32_on_the_cpu() -> None:
    """torch.compile traces with the grouped GEMM's meta kernel, which takes bf16 only: an fp32 graph on the CPU
    (a compiled decoding step of an fp32 MoE model) takes the loop and gives the eager result (it raised
    'Expected inputs of BF16 type' when tracing)."""
    torch.manual_seed(0)
    tokens, counts = torch.randn(6, 8), torch.tensor([2, 0, 3, 1])
    gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)  # sizes the grouped kernel takes

    def ffn(x: torch.Tensor) -> torch.Tensor:
        return expert_ffn(x, counts, gate_up, down, act="silu", impl="auto")

    torch._dynamo.reset()
    got = torch.compile(ffn, backend="eager")(tokens)
    torch.testing.assert_close(got, ffn(tokens), rtol=1e-5, atol=1e-5)
