"""DeepSeek-V3 / Kimi-K2, DeepSeek-V2 (Multi-head Latent Attention) and GLM-4.5 (partial rotary) against transformers
5: checkpoints written by ``save_pretrained`` in the test, perturbed so every norm, router and correction bias matters;
a batch with right and left padding, fp32.

* logits on real tokens (eager and lazy loads), the training loss (transformers computes no aux loss for these
  families) and every parameter's gradient;
* the exported directory holds transformers' own key set and reloads in transformers with the same logits;
* greedy and beam generation through our ``generate`` (MLA decodes from its cache of compressed latents; the static
  cache too) are token-identical to transformers' ``generate``; the varlen path (the CPU reference of the flash path) equals the mask
  path (MLA's values narrower than its keys, its own softmax scale);
* LoRA on the MLA projections and the fused experts, exported in peft's format, loads with ``PeftModel`` on
  transformers' model with our logits (an adapter on the MLP projections is refused: peft moves those targets to the
  fused experts); QLoRA quantizes the MLA projections;
* options not built are refused in one line naming the file and the option, before any data is prepared; the
  multi-token-prediction layers' keys are ignored as transformers ignores them; the estimate of an MLA layer's
  activations equals what autograd saves.

The layouts (ep, ep x tp, ep x pp, zero3, cp, tp, pp) are in ``tests/parallel/test_moe_layouts.py`` and
``tests/models/test_families_layouts.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import loaded_logits_error, padded_lm_batch  # noqa: E402

transformers = pytest.importorskip("transformers")

from lightning_llm.generation import GenerationConfig, generate  # noqa: E402
from lightning_llm.models import load_hf, save_hf  # noqa: E402
from lightning_llm.models.decoding import KVCache  # noqa: E402
from lightning_llm.models.init import materialize  # noqa: E402

VOCAB = 96
TOL = 1e-5


def _configs() -> dict[str, tuple[str, dict[str, Any]]]:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, pad_token_id=0, max_position_embeddings=64)
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
    return {
        # query low-rank path, interleaved rotary pairs, 2 groups of 4 experts (1 chosen), a correction bias
        "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
            common, **mla, num_key_value_heads=4, q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5)),
        # Kimi-K2's shape of router (one group), no query low-rank path, LLaMA's rotary halves, YaRN with its mscale
        # on the softmax scale and on cos/sin (mscale != mscale_all_dim), positions past the original 16
        "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", dict(
            common, **{**mla, "qk_nope_head_dim": 16, "v_head_dim": 8}, num_key_value_heads=4, q_lora_rank=None,
            rope_interleave=False, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
                beta_slow=1, mscale=1.0, mscale_all_dim=0.7))),
        "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
            common, **mla, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, topk_method="greedy",
            first_k_dense_replace=1, n_shared_experts=2, routed_scaling_factor=1.5)),
        # group-limited greedy: groups ranked by their best softmax score; top-3 of the 2 x 2 kept experts
        "deepseek_v2_group": ("DeepseekV2ForCausalLM", dict(
            common, **mla, q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=3,
            topk_method="group_limited_greedy", n_group=4, topk_group=2, first_k_dense_replace=0)),
        # partial rotary (0.5 of head_dim 16), q/k norms, q/k/v biases, 2 groups
        "glm4_moe": ("Glm4MoeForCausalLM", dict(
            common, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=1.8)),
    }


def _write(name: str, out: Path, seed: int = 0) -> Any:
    cls_name, kw = _configs()[name]
    cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    model = cls(getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out))
    return model.eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return padded_lm_batch(VOCAB, 20)


def _hf_name(ours: str) -> str:
    return "model." + ours.replace("attn_norm", "input_layernorm").replace(
        "mlp_norm", "post_attention_layernorm").replace(".shared_expert.", ".shared_experts.")


def _max_err(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


@pytest.mark.parametrize("name", list(_configs()))
def test_logits_loss_and_gradients_equal_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path)
    ids, mask, labels = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    for lazy in (False, True):
        err = loaded_logits_error(tmp_path, ids, mask, ref, lazy=lazy)
        print(f"{name} ({'lazy' if lazy else 'eager'} load): logits {err:.2e}")
        assert err < TOL
    ours, _ = load_hf(tmp_path)
    biases = [b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")]
    if biases:  # the loaded correction biases choose experts: without them the logits differ
        assert all(b.dtype == torch.float32 and b.abs().max() > 0.01 for b in biases)
        with torch.no_grad():
            for b in biases:
                b.zero_()
            assert _max_err(ours(ids, attention_mask=mask), ref, mask) > 1e-3

    hf.train()
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ours, config = load_hf(tmp_path)
    assert config.moe is not None and config.moe.aux_loss_coef == 0.0  # transformers adds none for these families
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    loss = ours.train()(ids, attention_mask=mask, labels=shifted)
    loss.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    grads = {_hf_name(n) if not n.startswith("lm_head") else n: p.grad for n, p in ours.named_parameters()}
    assert set(grads) == set(hf_grads)
    grad = max(float((hf_grads[n] - g).abs().max()) for n, g in grads.items())
    print(f"{name}: loss {abs(float(loss) - float(out.loss)):.2e}, gradients {grad:.2e}")
    assert abs(float(loss) - float(out.loss)) < 1e-6 and grad < TOL


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group", "glm4_moe"])
def test_export_writes_transformers_key_set_and_reloads(tmp_path: Path, name: str) -> None:
    from safetensors import safe_open

    hf = _write(name, tmp_path / "src")
    ours, _ = load_hf(tmp_path / "src", lazy=True)
    materialize(ours, "cpu")
    save_hf(ours, tmp_path / "out")
    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "src", tmp_path / "out")]
    assert keys[0] == keys[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = type(hf).from_pretrained(str(tmp_path / "out")).eval()
    ids, mask, _ = _batch()
    with torch.no_grad():
        err = _max_err(back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits,
                       mask)
    print(f"{name}: export {len(keys[0])} keys as save_pretrained's, reloaded logits {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_yarn", "glm4_moe"])
def test_generation_matches_transformers_and_caches_latents(tmp_path: Path, name: str) -> None:
    from lightning_llm.data.base import left_pad

    hf = _write(name, tmp_path)
    ours, config = load_hf(tmp_path)
    ids, mask = left_pad([[5, 9, 17, 3, 44, 2, 60], [7, 8], [50, 51, 52, 53]], 0)
    for beams in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams,
                               do_sample=False, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
        got = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=12, num_beams=beams))
        assert got.tolist() == want.tolist(), (beams, got.tolist(), want.tolist())
    static = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=12, cache_implementation="static"))
    assert static.tolist() == generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=12)).tolist()
    cache = KVCache()
    with torch.no_grad():
        ours(ids, attention_mask=mask, kv_cache=cache)
    widths = {tuple(t.shape[1:2]) + tuple(t.shape[3:]) for kv in cache._kv.values() for t in kv}
    if config.mla is not None:  # one latent per token: [B, 1, T, kv_lora_rank] and the rotary key [B, 1, T, Dr]
        assert widths == {(1, config.mla.kv_lora_rank), (1, config.mla.qk_rope_head_dim)}
    else:
        assert widths == {(config.num_kv_heads, config.head_dim)}


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_varlen_path_equals_mask_path(tmp_path: Path, name: str) -> None:
    """``attention=varlen`` (on the CPU the per-sequence reference of the flash varlen kernel: MLA's values zero-padded
    to the keys' width, its softmax scale passed) against the mask path, on padded rows, gradients included."""
    _write(name, tmp_path)
    ids, mask, _ = _batch()
    outs = []
    for attention in ("sdpa", "varlen"):
        model, _ = load_hf(tmp_path, attention=attention)
        logits = model.train()(ids, attention_mask=mask)
        (logits[mask.bool()] ** 2).mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    err = _max_err(outs[0][0], outs[1][0], mask)
    grad = max(float((g - outs[1][1][n]).abs().max()) for n, g in outs[0][1].items())
    print(f"{name}: varlen vs mask path logits {err:.2e}, gradients {grad:.2e}")
    assert err < TOL and grad < TOL


def test_lora_on_mla_projections_loads_in_peft_with_our_logits(tmp_path: Path) -> None:
    from peft import PeftModel

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter

    _write("deepseek_v3", tmp_path / "base")
    ours, _ = load_hf(tmp_path / "base")
    mlp = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_b_proj", "up_proj"]))
    with pytest.raises(ValueError, match=r"\['up_proj'\] of a deepseek_v3 model would not load as trained") as e:
        export_adapter(apply_peft(load_hf(tmp_path / "base")[0], mlp), mlp, tmp_path / "refused")
    assert "\n" not in str(e.value)
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    cfg = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=targets,
                                                  target_parameters=["mlp.experts.gate_up_proj",
                                                                     "mlp.experts.down_proj"]))
    ours = apply_peft(ours, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    assert sum(hasattr(m, "lora_A") for m in ours.modules()) == 3 * len(targets) + 2 * 2  # 2 MoE layers' experts
    export_adapter(ours, cfg, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "base"))
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids, mask, _ = _batch()
    with torch.no_grad():
        adapted_logits = peft_model(input_ids=ids, attention_mask=mask).logits
        err = _max_err(ours.eval()(ids, attention_mask=mask), adapted_logits, mask)
        with peft_model.disable_adapter():
            moved = _max_err(peft_model(input_ids=ids, attention_mask=mask).logits, adapted_logits, mask)
    print(f"LoRA on the MLA projections and experts -> PeftModel on DeepseekV3ForCausalLM: logits {err:.2e} (the "
          f"adapter moves them by {moved:.2e})")
    assert err < TOL and moved > 1e-2


def test_qlora_quantizes_the_mla_projections(tmp_path: Path) -> None:
    """nf4: every MLA projection of the blocks is held quantized; the forward equals the model holding the
    dequantized weights."""
    pytest.importorskip("torchao")
    from lightning_llm.models.quantize import QuantizationConfig, load_quantized, quantized_linears

    _write("deepseek_v3", tmp_path)
    model, _ = load_hf(tmp_path, lazy=True)
    model = load_quantized(model, "nf4", QuantizationConfig(block_size=8, scaler_block_size=8))
    names = {path.rsplit(".", 1)[-1] for path, _ in quantized_linears(model)}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= names
    plain, _ = load_hf(tmp_path)
    with torch.no_grad():
        for path, lin in quantized_linears(model):
            plain.get_submodule(path).weight.copy_(lin.weight.get_original_weight())
        ids, mask, _ = _batch()
        err = _max_err(model.eval()(ids, attention_mask=mask), plain.eval()(ids, attention_mask=mask), mask)
    assert err < TOL


# ---------------------------------------------------------------------------------------------------- refusals


def _config_dir(tmp_path: Path, name: str, **changes: Any) -> Path:
    d = tmp_path / name
    _write(name, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))
    return d


@pytest.mark.parametrize(("name", "option", "value"), [
    ("deepseek_v2", "norm_topk_prob", True), ("deepseek_v2", "topk_method", "noaux_tc"),
    ("deepseek_v3", "scoring_func", "softmax"), ("deepseek_v3", "topk_method", "greedy"),
    ("glm4_moe", "quantization_config", {"quant_method": "fp8", "weight_block_size": [128, 128]})])
def test_unbuilt_options_are_refused_in_one_line(tmp_path: Path, name: str, option: str, value: Any) -> None:
    d = _config_dir(tmp_path, name, **{option: value})
    with pytest.raises(ValueError) as e:
        load_hf(d)
    line = str(e.value)
    assert "\n" not in line and str(d / "config.json") in line and f"{option}={value!r}" in line


def test_unbuilt_option_stops_the_cli_before_data_is_prepared(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lightning_llm.cli import main

    from lightning_llm.data.text import generated_corpus
    from lightning_llm.testing import write_bpe_tokenizer

    d = _config_dir(tmp_path, "deepseek_v3", scoring_func="softmax")
    write_bpe_tokenizer(d, generated_corpus(20), vocab_size=VOCAB - 4)
    rc = main(["fit", "--model=lightning_llm.tasks.CausalLMTask", f"--model.backbone={d}",
               "--data=lightning_llm.data.TextDataModule", f"--data.cache_dir={tmp_path / 'cache'}",
               "--trainer.max_steps=1", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "scoring_func='softmax' is not supported for deepseek_v3" in err
    assert not (tmp_path / "cache").exists()


def test_multi_token_prediction_layer_keys_are_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A DeepSeek-V3 checkpoint with its MTP layer (``model.layers.<num_hidden_layers>.*``) loads as transformers loads
    it: those keys ignored (with a warning), every other key still checked."""
    from safetensors.torch import load_file, save_file

    _write("deepseek_v3", tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    extra = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in sd.items() if k.startswith("model.layers.2.")}
    save_file({**sd, **extra, "model.layers.3.eh_proj.weight": torch.zeros(32, 64)},
              str(tmp_path / "model.safetensors"))
    with caplog.at_level("WARNING"):
        load_hf(tmp_path)
    assert "multi-token-prediction" in caplog.text
    save_file({**sd, "model.layers.1.self_attn.q_proj.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected keys"):
        load_hf(tmp_path)


# ---------------------------------------------------------------------------------------------------- memory


def test_mla_activation_estimate_equals_what_autograd_saves() -> None:
    from lightning_llm.memory import attention_elements_per_token
    from lightning_llm.models import DecoderLM, ModelConfig
    from lightning_llm.testing import saved_tensor_bytes

    for mla in (dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                dict(kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                     rope_interleave=False)):
        config = ModelConfig(vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=48,
                             max_position_embeddings=256, mla=mla)
        model = DecoderLM(config)
        attn, n = model.layers["0"].self_attn, 256
        x = torch.randn(1, n, 64, requires_grad=True)
        rope = (model.rope_cos[:n][None], model.rope_sin[:n][None])
        got = saved_tensor_bytes(lambda: attn(x, rope=rope, is_causal=True), [x, *attn.parameters(), *rope])
        est = attention_elements_per_token(config)[0] * 4 * n
        print(f"MLA layer {mla}: saved {got:,} B, estimate {est:,} B")
        assert abs(est / got - 1) <= 0.01
