"""Gated DeltaNet (``models/layers/deltanet.py``, ``kernels/delta_rule.py``) and the hybrid decoders against transformers.

* The chunked delta rule and its recurrent step equal transformers' torch fallbacks (``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule``) in fp32: outputs, final states and gradients, 3 chunks with a padded tail,
  grouped value heads; the causal convolution equals ``causal_conv1d_fn`` / ``causal_conv1d_update``.
* Packed rows: the state and the convolution restart at every document: the packed outputs and gradients equal the
  documents run one by one.
* Checkpoints written by transformers 5.24 in the test (``Qwen3_5ForCausalLM``, ``Qwen3NextForCausalLM``,
  ``Qwen3_5MoeForCausalLM``, every weight drawn at std 0.2 so the (1 + weight) norms and gates matter) load with
  transformers' logits on left- and right-padded rows, eagerly and lazily (1e-5), and the gradients of the loss
  (relative 5e-5: A_log's and dt_bias' sum over every token and head, 1e-5 apart in fp32); the export
  has transformers' key set and values and reloads with the same logits.
* A LoRA on every projection, exported in peft's format, loads in ``PeftModel`` on transformers' model with our logits
  and merges back.
* Greedy decoding from the recurrent states equals transformers' ``generate`` on left-padded prompts: the dynamic
  cache, the static cache, the static cache's step compiled (Qwen3.5), and the static cache reused by a second
  generation of the same shapes; beam search (the states reordered with the rows) equals its beam search.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lightning_llm.kernels.delta_rule import (
    causal_conv1d,
    causal_conv1d_torch,
    chunk_gated_delta_rule_torch,
    gated_delta_rule,
    recurrent_gated_delta_rule_step,
)
from lightning_llm.models import load_hf, save_hf

M = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

pytestmark = pytest.mark.usefixtures("one_thread")

B, HK, HV, DK, DV = 2, 2, 4, 8, 6


def _inputs(s: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, s, HK, DK, generator=g).requires_grad_(), torch.randn(B, s, HK, DK, generator=g)
            .requires_grad_(), torch.randn(B, s, HV, DV, generator=g).requires_grad_(),
            (-F.softplus(torch.randn(B, s, HV, generator=g))).detach().requires_grad_(),
            torch.rand(B, s, HV, generator=g).requires_grad_()]


def test_chunked_rule_and_step_equal_transformers() -> None:
    ins = _inputs(150)  # chunks of 64: 150 = 2 whole + a padded tail
    h0 = torch.randn(B, HV, DK, DV)
    ref, ref_state = M.torch_chunk_gated_delta_rule(*ins, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    out, state = chunk_gated_delta_rule_torch(*ins, initial_state=h0, output_final_state=True)
    grad = torch.randn_like(out)
    errs = [(out - ref).abs().max(), (state - ref_state).abs().max()]
    errs += [(a - b).abs().max() for a, b in zip(torch.autograd.grad((out * grad).sum(), ins),
                                                 torch.autograd.grad((ref * grad).sum(), ins))]
    q, k, v, g, beta = (t.detach()[:, :1] for t in ins)
    ref_step = M.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    errs += [(a - b).abs().max() for a, b in zip(recurrent_gated_delta_rule_step(q, k, v, g, beta, h0), ref_step)]
    x, w = torch.randn(B, 12, 40), torch.randn(12, 1, 4)
    conv, tail = causal_conv1d(x, w)  # on the CPU: the torch form (no fla)
    errs += [(conv - M.causal_conv1d_fn(x, w[:, 0], None, activation="silu")).abs().max(),
             (tail - x[..., -3:]).abs().max()]
    state4, x1 = torch.randn(B, 12, 4), torch.randn(B, 12, 1)
    step, _ = causal_conv1d_torch(x1, w, state=state4[..., 1:])
    errs.append((step - M.causal_conv1d_update(x1, state4.clone(), w[:, 0], None, "silu")).abs().max())
    errs = [e.detach() for e in errs]
    print("max |ours - transformers| (outputs, state, grads q k v g beta, step, conv, step conv):",
          [f"{float(e):.1e}" for e in errs])
    assert max(errs) <= 1e-5
    with pytest.raises(RuntimeError, match="fla-core"):
        gated_delta_rule(*ins, backend="fla")
    with pytest.raises(RuntimeError, match="fla-core"):
        causal_conv1d(x, w, backend="fla")


def test_packed_rows_restart_the_state_and_the_convolution() -> None:
    s, cuts = 150, [0, 30, 100, 140, 150]
    seg = torch.zeros(B, s, dtype=torch.long)
    for i in range(4):
        seg[:, cuts[i]:cuts[i + 1]] = i + 1
    ins = _inputs(s, seed=1)
    out, _ = chunk_gated_delta_rule_torch(*ins, segment_ids=seg)
    x = torch.randn(B, 12, s, requires_grad=True)
    w = torch.randn(12, 1, 4)
    conv, _ = causal_conv1d_torch(x, w, segment_ids=seg)
    g_out, g_conv = torch.randn_like(out), torch.randn_like(conv)
    packed = torch.autograd.grad((out * g_out).sum() + (conv * g_conv).sum(), [*ins, x])
    alone_out, alone_conv = torch.zeros_like(out), torch.zeros_like(conv)
    for a, b in zip(cuts, cuts[1:]):
        o, _ = M.torch_chunk_gated_delta_rule(*(t[:, a:b] for t in ins), use_qk_l2norm_in_kernel=True)
        alone_out[:, a:b] = o
        alone_conv[:, :, a:b] = M.causal_conv1d_fn(x[:, :, a:b], w[:, 0], None, activation="silu")
    alone = torch.autograd.grad((alone_out * g_out).sum() + (alone_conv * g_conv).sum(), [*ins, x])
    errs = [(out - alone_out).abs().max(), (conv - alone_conv).abs().max()]
    errs += [(a - b).abs().max() for a, b in zip(packed, alone)]
    errs = [e.detach() for e in errs]
    print("packed vs one by one (delta rule, conv, grads):", [f"{float(e):.1e}" for e in errs])
    assert max(errs) <= 1e-5


# ------------------------------------------------------------------------------------------------ checkpoints

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=8, max_position_embeddings=128, pad_token_id=0, eos_token_id=2)
FAMILIES = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(intermediate_size=48)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, mlp_only_layers=[1])),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
                    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16)),
}


def write_hybrid(family: str, out: Path, **overrides: object) -> tuple[torch.nn.Module, Path]:
    """A tiny random checkpoint of ``family`` written by transformers, every weight drawn at std 0.2."""
    import transformers

    arch, config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(str(out))
    return model, out


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 96, (3, 70), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 70, dtype=torch.long)
    mask[0, :6] = 0  # left-padded
    mask[1, -9:] = 0  # right-padded
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_logits_gradients_and_export_equal_transformers(family: str, tmp_path: Path) -> None:
    from tests.conftest import loaded_logits_error

    hf, path = write_hybrid(family, tmp_path / "hf")
    ids, mask = _rows()
    ref = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    labels = torch.full_like(ids, -100)  # a real token predicted from a real one (padding's logits are anyone's)
    labels[:, 1:] = torch.where(real[:, 1:] & real[:, :-1], ids[:, 1:], -100)
    loss_ref = F.cross_entropy(ref[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss_ref.backward()
    ours, config = load_hf(path)
    logits = ours(ids, attention_mask=mask)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    loss.backward()
    keep = mask.bool()
    err = float((logits - ref)[keep].abs().max())
    lazy = loaded_logits_error(path, ids, mask, ref.detach(), lazy=True)
    pairs = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
             "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "layers.0.self_attn.out_proj.weight": "model.layers.0.linear_attn.out_proj.weight",
             "layers.0.self_attn.A_log.weight": "model.layers.0.linear_attn.A_log",
             "layers.0.self_attn.dt_bias.weight": "model.layers.0.linear_attn.dt_bias",
             "layers.0.self_attn.norm.weight": "model.layers.0.linear_attn.norm.weight",
             "layers.3.self_attn.q_proj.weight": "model.layers.3.self_attn.q_proj.weight",
             "layers.3.self_attn.q_norm.weight": "model.layers.3.self_attn.q_norm.weight"}
    ours_p, hf_p = dict(ours.named_parameters()), dict(hf.named_parameters())
    grad = max(float((ours_p[a].grad - hf_p[b].grad).abs().max() / hf_p[b].grad.abs().max()) for a, b in pairs.items())
    save_hf(ours, tmp_path / "export")
    written, exported = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "export" /
                                                                                   "model.safetensors"))
    assert written.keys() == exported.keys()
    weights = max(float((written[k] - exported[k]).abs().max()) for k in written)
    back = type(hf).from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        reload = float((back(input_ids=ids, attention_mask=mask).logits - ref)[keep].abs().max())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["layer_types"] == hf.config.layer_types
    print(f"{family}: logits {err:.1e} (lazy {lazy:.1e}), loss {abs(loss.item() - loss_ref.item()):.1e}, relative "
          f"gradients {grad:.1e}, export weights {weights:.1e}, transformers' reload {reload:.1e} "
          f"(logits up to {ref.abs().max():.1f})")
    assert max(err, lazy, reload) <= 1e-5 and grad <= 5e-5 and weights == 0.0


def test_packed_rows_equal_the_documents_alone(tmp_path: Path) -> None:
    _, path = write_hybrid("qwen3_5", tmp_path / "hf")
    ours, _ = load_hf(path)
    ids = torch.randint(3, 96, (2, 80), generator=torch.Generator().manual_seed(1))
    seg = torch.zeros(2, 80, dtype=torch.long)
    cuts = [(0, 30), (30, 71)]  # row 0: two documents and 9 padding; row 1: one document of 80
    for i, (a, b) in enumerate(cuts):
        seg[0, a:b] = i + 1
    seg[1] = 1
    with torch.no_grad():
        packed = ours(ids, segment_ids=seg)
        alone = [ours(ids[:1, a:b]) for a, b in cuts] + [ours(ids[1:])]
    err = max(float((packed[0, a:b] - x[0]).abs().max()) for (a, b), x in zip(cuts, alone))
    err = max(err, float((packed[1] - alone[-1][0]).abs().max())) / float(packed.abs().max())
    # fp32 rounding only (the convolution's taps summed in another order), through 4 layers of std-0.2 weights
    print(f"packed rows vs each document alone: max |logits diff| / max |logits| = {err:.1e}")
    assert err <= 1e-5


# ------------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("family", [pytest.param("qwen3_5", marks=pytest.mark.multiprocess),  # inductor's C++
                                    "qwen3_next"])  # compiler runs as processes (the compiled step)
def test_greedy_decoding_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    from lightning_llm.generation import GenerationConfig, generate

    hf, path = write_hybrid(family, tmp_path / "hf", num_hidden_layers=2, layer_types=["linear_attention",
                                                                                       "full_attention"])
    ours, _ = load_hf(path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 96, (3, 6), generator=g), torch.randint(3, 96, (3, 4), generator=g)]
    masks = [torch.ones(3, 6, dtype=torch.long), torch.ones(3, 4, dtype=torch.long)]
    masks[0][0, :3] = 0
    masks[1][2, :2] = 0
    # 6 new tokens: 5 steps from the recurrent state, past the convolution's window of 4. The compiled step is one
    # graph (tens of seconds on a cold CPU, whatever the lengths), the second prompt's generation reusing it
    impls = [("dynamic", False), ("static", False)] + ([("static", True)] if family == "qwen3_5" else [])
    for ids, mask in zip(prompts, masks):  # the second generation reuses the static cache's buffers
        with torch.no_grad():
            ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
        for impl, compiled in impls:
            cfg = GenerationConfig(max_new_tokens=6, cache_implementation=impl, compile=compiled)
            out = generate(ours, ids, mask, config=cfg)
            print(f"{family} {impl}{' compiled' if compiled else ''}: {out.tolist()} (transformers {ref.tolist()})")
            assert torch.equal(out, ref)
    with torch.no_grad():  # beam search reorders the recurrent states with the rows
        ref = hf.generate(input_ids=prompts[0], attention_mask=masks[0], max_new_tokens=8, num_beams=3,
                          do_sample=False, pad_token_id=0, eos_token_id=None, early_stopping=True)[:, 6:]
    out = generate(ours, prompts[0], masks[0], config=GenerationConfig(max_new_tokens=8, num_beams=3))
    print(f"{family} beam search: {out.tolist()} (transformers {ref.tolist()})")
    assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------ memory


def test_activation_estimate_equals_what_autograd_saves() -> None:
    from lightning_llm.memory import activation_bytes_per_sample, deltanet_bytes
    from lightning_llm.models import DecoderLM, named_config
    from lightning_llm.testing import saved_tensor_bytes

    for heads, fused, n in (((2, 4, 16, 16), False, 256), ((1, 4, 8, 24), True, 100), ((2, 2, 32, 16), False, 200)):
        hk, hv, dk, dv = heads
        config = named_config("debug-qwen3.5", family="decoder", num_layers=1, layer_types=["linear_attention"],
                              linear_attention=dict(num_key_heads=hk, num_value_heads=hv, key_head_dim=dk,
                                                    value_head_dim=dv, fused_projections=fused))
        layer = DecoderLM(config).layers["0"].self_attn
        x = torch.randn(1, n, 64, requires_grad=True)
        got = saved_tensor_bytes(lambda: layer(x), [x, *layer.parameters()])
        est = deltanet_bytes(config, tokens=n, precision="32-true")
        print(f"DeltaNet layer {heads} fused={fused}, {n} tokens: saved {got:,} B, estimate {est:,} B")
        assert abs(est / got - 1) <= 0.08  # the chunks' matmuls copy their keys more or less often
    hybrid = named_config("debug-qwen3.5", family="decoder")
    dense = named_config("debug-qwen3", family="decoder", head_dim=16, attention_output_gate=True)
    per_layer, whole = activation_bytes_per_sample(hybrid, seq_len=256, precision="32-true")
    attention_layer, _ = activation_bytes_per_sample(dense, seq_len=256, precision="32-true")
    assert whole > 3 * per_layer and per_layer > attention_layer  # the DeltaNet layers are counted as such


# ------------------------------------------------------------------------------------------------ adapters


def test_lora_adapter_loads_in_peft_on_transformers_model(tmp_path: Path) -> None:
    """A LoRA on Qwen3.5's projections (``in_proj_qkv``'s rows held per key head) exported in peft's format: peft's
    ``PeftModel`` on transformers' model gives our logits; loading it back into ours (``merge --adapter``) too."""
    from peft import PeftModel

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft
    from lightning_llm.peft.adapters import export_adapter, load_adapter, merge_peft

    hf, path = write_hybrid("qwen3_5", tmp_path / "hf")
    targets = ["in_proj_qkv", "in_proj_z", "in_proj_b", "out_proj", "q_proj", "o_proj", "down_proj"]
    cfg = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=targets))
    ours = apply_peft(load_hf(path)[0], cfg)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    export_adapter(ours, cfg, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids, mask = _rows()
    keep = mask.bool()
    with torch.no_grad():
        got = ours.eval()(ids, attention_mask=mask)
        ref = peft_model(input_ids=ids, attention_mask=mask).logits
        moved = float((got - load_hf(path)[0](ids, attention_mask=mask))[keep].abs().max())
        back, _ = load_adapter(load_hf(path)[0], tmp_path / "adapter")
        merged = merge_peft(back).eval()(ids, attention_mask=mask)
    err = float((got - ref)[keep].abs().max())
    merge_err = float((merged - got)[keep].abs().max() / got[keep].abs().max())  # W + BA rounded in fp32
    print(f"LoRA on Qwen3.5: peft on transformers' model vs ours {err:.1e}, merged back {merge_err:.1e} relative (the "
          f"adapter moved the logits by {moved:.2f})")
    assert moved > 0.1 and err <= 1e-5 and merge_err <= 1e-5


def test_refusals_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from safetensors.torch import save_file

    from lightning_llm.models import ModelConfig, build_model, named_config
    from lightning_llm.peft.prompt import PrefixTuningLM

    model = build_model("debug-qwen3.5", family="decoder", num_layers=2,
                        layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="prefix_tuning: layers \\[0\\] are Gated DeltaNet layers"):
        PrefixTuningLM(model, 4)
    with pytest.raises(ValueError, match="not a 4-D mask"):
        model(torch.zeros(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 1, 5, 5, dtype=torch.bool))
    fields = named_config("debug-qwen3.5", family="decoder").to_dict()
    with pytest.raises(ValueError, match="go together"):
        ModelConfig.from_dict({**fields, "layer_types": None})
    _, path = write_hybrid("qwen3_5", tmp_path / "hf", num_hidden_layers=2, layer_types=["linear_attention",
                                                                                         "full_attention"])
    sd = load_file(str(path / "model.safetensors"))  # Qwen3.5's published checkpoints carry mtp.* (not built)
    save_file({**sd, "mtp.fc.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    with caplog.at_level("WARNING"):
        load_hf(path)
    assert "multi-token-prediction" in caplog.text


def _fake_fla(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """flash-linear-attention (CUDA only, not installed here) as this package calls it, computed by the torch forms,
    each call recorded; its requirements (CUDA, bf16/fp16) waived."""
    import sys
    import types

    from lightning_llm.kernels import delta_rule

    def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, **varlen: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        calls.append("chunk_gated_delta_rule")
        assert use_qk_l2norm_in_kernel and not varlen
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state)

    def conv(rows: torch.Tensor, weight: torch.Tensor, *, activation: str, **varlen: object) -> tuple[torch.Tensor, None]:
        calls.append("causal_conv1d")
        assert activation == "silu" and not varlen
        return causal_conv1d_torch(rows.transpose(1, 2), weight[:, None])[0].transpose(1, 2), None

    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules",
                                                         "fla.modules.causal_conv1d")}
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk
    modules["fla.modules.causal_conv1d"].causal_conv1d = conv
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(delta_rule, "_fla_missing", lambda device, dtype: None)
    monkeypatch.setattr(delta_rule, "_SAID", set())


def test_kernel_choice_is_fla_or_one_line_and_auto_says_which(caplog: pytest.LogCaptureFixture) -> None:
    """On this CPU (no fla, fp32): ``auto`` takes the torch form and says why (once per device and dtype); ``fla`` is
    refused in one line, also under ``torch.compile`` (the choice is made while tracing), never the torch loop
    without a word."""
    from lightning_llm.kernels import delta_rule

    delta_rule._SAID.discard(("cpu", torch.float32))
    with caplog.at_level("INFO", logger="lightning_llm.kernels.delta_rule"):
        assert delta_rule.kernel_choice("auto", "cpu", torch.float32) == "torch"
        assert delta_rule.kernel_choice("auto", "cpu", torch.float32) == "torch"
    said = [r.getMessage() for r in caplog.records if "kernels=auto" in r.getMessage()]
    print(said)
    assert len(said) == 1 and said[0].startswith("Gated DeltaNet kernels=auto on cpu float32: the chunked torch form (")
    assert delta_rule.kernel_choice("torch", "cuda", torch.bfloat16) == "torch"
    ins = [t.detach() for t in _inputs(20)]
    for run in (gated_delta_rule, torch.compile(gated_delta_rule, backend="eager", fullgraph=False)):
        torch._dynamo.reset()
        with pytest.raises(RuntimeError) as error:
            run(*ins, backend="fla")
        assert str(error.value) == ("Gated DeltaNet kernels='fla': flash-linear-attention is not installed (pip install "
                                    "fla-core); use kernels='auto' or 'torch'"), str(error.value)


@pytest.mark.parametrize("kernels", ["fla", "auto", "torch"])
def test_fla_runs_under_compile(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                kernels: str) -> None:
    """``--model.compile=true`` (each block compiled) with fla present: ``fla`` and ``auto`` run fla's kernels at every
    forward (between the compiled regions), ``auto`` saying so, ``torch`` never; the logits equal the eager torch
    form's (the stand-in fla computes the same)."""
    from torch._dynamo.utils import counters

    from lightning_llm.models import build_model
    from lightning_llm.models.compile import compile_blocks

    calls: list[str] = []
    _fake_fla(monkeypatch, calls)
    la = dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, conv_kernel_size=4,
              fused_projections=False)
    torch.manual_seed(0)
    model = build_model("debug-qwen3.5", family="decoder", num_layers=2, linear_attention={**la, "kernels": kernels},
                        layer_types=["linear_attention", "full_attention"]).eval()
    ref = build_model("debug-qwen3.5", family="decoder", num_layers=2, linear_attention={**la, "kernels": "torch"},
                      layer_types=["linear_attention", "full_attention"]).eval()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(model, backend="eager") == 2
    with caplog.at_level("INFO", logger="lightning_llm.kernels.delta_rule"), torch.no_grad():
        got = [model(ids) for _ in range(2)]
        want = ref(ids)
    assert counters["stats"]["unique_graphs"] >= 2  # the blocks ran compiled (graphs around fla's calls)
    err = max(float((g - want).abs().max()) for g in got)
    print(f"kernels={kernels} under compile: fla calls {calls}; max |logits - eager torch form| {err:.1e}")
    assert err <= 1e-5
    fla = kernels != "torch"
    assert calls == (["causal_conv1d", "chunk_gated_delta_rule"] * 2 if fla else [])  # every forward, at run time
    said = [r.getMessage() for r in caplog.records if "kernels=auto" in r.getMessage()]
    assert said == (["Gated DeltaNet kernels=auto on cpu float32: flash-linear-attention's kernels"]
                    if kernels == "auto" else [])
