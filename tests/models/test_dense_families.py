"""Phi-3/Phi-4, GLM-4, OLMo 2, OLMo 3 and SmolLM3 against transformers 5.24: checkpoints written by
``save_pretrained`` in the test (tiny fp32 models, perturbed so that norms, biases and every rope parameter matter),
batches with right and left padding.

* logits on the real tokens of padded rows (eager and lazy loads), the loss and every gradient;
* what each family adds, shown to matter: Phi-3's LongRoPE switching factors with the forward's length (its fused
  ``qkv_proj``/``gate_up_proj`` split on load), GLM-4's rotary pairs and its norms on both sides of each branch,
  OLMo 2/3's output norms and q/k norms over the projection, OLMo 3's sliding layers with their own rope (YaRN on the
  full ones only), SmolLM3's layers without rotary embedding;
* the export: transformers' own key set, reloaded by transformers with the same logits;
* greedy and beam generation token for token (Phi-3: a prompt past the short factors' range; a generation that would
  cross it is refused);
* LoRA on the projections equals peft's on transformers' model and its adapter loads in peft where transformers'
  module is ours; a LoRA on a projection transformers fuses is refused for adapter-only export (the merged export
  reloads exactly);
* options not built, refused in one line naming the file and the option;
* ``estimate`` counts the parameters of the published sizes as transformers builds them.

The layouts are ``tests/models/test_families_layouts.py``.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.conftest import padded_lm_batch, peft_twin  # noqa: E402
from tests.models.family_parity import (  # noqa: E402
    check_against_transformers,
    estimated_parameters,
    generation_equal,
    write_perturbed,
)

from lightning_llm.models import load_hf, save_hf  # noqa: E402

VOCAB = 96
HALF = 16 * 3 // 4 // 2  # Phi-3's rotary frequencies: head_dim 16, partial_rotary_factor 0.75
FAMILIES = ["phi3", "glm4", "olmo2", "olmo3", "smollm3"]


def _model(name: str) -> Any:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
    if name == "phi3":  # Phi-4-mini-like partial rotary; LongRoPE whose short range (8) the 12-token batch passes
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(
            **base, original_max_position_embeddings=8, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                "long_factor": [2.0 + 0.5 * i for i in range(HALF)]}))
    if name == "glm4":  # partial rotary 0.5 (its default), q/k/v biases (default), head_dim 16 = 64 / 4
        return transformers.Glm4ForCausalLM(transformers.Glm4Config(**base, head_dim=16))
    if name == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**base, attention_bias=True))
    if name == "olmo3":  # sliding (window 4) and full layers; YaRN on the full layers only
        return transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
            **base, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters={
                "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                   "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))
    # layers 1 and 3 without rotary embedding, sliding (window 4) there; tied head
    return transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        **base, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=4))


def _write(name: str, out: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return write_perturbed(_model(name), out, seed)


_NORMS = {"glm4": {"input_layernorm": "attn_norm", "post_self_attn_layernorm": "attn_out_norm",
                   "post_attention_layernorm": "mlp_norm", "post_mlp_layernorm": "mlp_out_norm"},
          "olmo2": {"post_attention_layernorm": "attn_out_norm", "post_feedforward_layernorm": "mlp_out_norm"}}
_NORMS["olmo3"] = _NORMS["olmo2"]


def _in_our_layout(name: str, hf: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' tensors (parameters or their gradients) under our names: fused projections split by their rows
    (q, k, v; gate, up), norms renamed."""
    c = hf.config
    q, kv = c.num_attention_heads * 16, c.num_key_value_heads * 16
    norms = _NORMS.get(name, {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"})
    out: dict[str, torch.Tensor] = {}
    for n, t in tensors.items():
        n = n.removeprefix("model.")
        module, _, leaf = n.rpartition(".")
        parent, _, last = module.rpartition(".")
        if last == "qkv_proj":
            for part, x in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[f"{parent}.{part}.{leaf}"] = x
        elif last == "gate_up_proj":
            for part, x in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[f"{parent}.{part}.{leaf}"] = x
        else:
            out[f"{parent}.{norms.get(last, last)}.{leaf}" if parent else n] = t
    return out


def _generate(hf: Any, ours: Any, prompts: list[list[int]], beams: int, cache: str = "dynamic") -> str:
    return f"beams={beams} {cache}: {generation_equal(hf, ours, prompts, beams=beams, cache=cache)} tokens as " \
        "transformers'"


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_loss_gradients_export_and_generation_equal_transformers(tmp_path: Path, name: str) -> None:
    """Logits of padded rows (eager and lazy loads; Phi-3 also within its short range), loss and every gradient; the
    export's key set and its logits reloaded by transformers; greedy (and for Phi-3 beam) generation from
    left-padded prompts, 10 new tokens past the sliding windows of 4 (Phi-3's prompt of 9 columns passes its short
    range of 8, so every step takes the long factors as transformers does; a generation crossing it is refused)."""
    hf = _write(name, tmp_path / "src")
    err = check_against_transformers(hf, tmp_path, in_our_layout=lambda hf, t: _in_our_layout(name, hf, t))
    print(f"{name}: {', '.join(f'{k} {v:.1e}' for k, v in err.items())} from transformers (export: "
          f"{type(hf).__name__}'s key set)")
    ids, _, _ = padded_lm_batch(VOCAB, 12)
    ours = load_hf(tmp_path / "src")[0].eval()
    with torch.no_grad():  # a forward within the short factors' range: Phi-3 switches factors, the others do not
        short = ours(ids[:1, :6])
        err_short = float((hf(input_ids=ids[:1, :6]).logits - short).abs().max())
        switched = float((short - ours(ids[:1])[:, :6]).abs().max())
    assert err_short < 1e-5 and (switched > 1e-3) == (name == "phi3"), (err_short, switched)

    prompts = [[5, 9, 17, 3, 44, 7, 60, 11, 12], [7, 8], [50, 51, 52, 53]]
    said = [_generate(hf, ours, prompts, beams=1)]
    if name == "phi3":
        said += [_generate(hf, ours, prompts, beams=3), _generate(hf, ours, prompts, beams=1, cache="static")]
        with pytest.raises(ValueError, match="LongRoPE generation across original_max_position_embeddings=8"):
            _generate(hf, ours, [[5, 9, 17], [7, 8]], beams=1)
    print(f"{name}: generation {'; '.join(said)}")


def test_each_family_switch_matters(tmp_path: Path) -> None:
    """The parity above could fail: each family's own switch turned off moves the logits far from transformers'."""
    ids, mask, _ = padded_lm_batch(VOCAB, 12)
    switches = {"glm4": dict(rope_interleave=False), "olmo2": dict(branch_input_norm=True),
                "olmo3": dict(sliding_rope=None), "smollm3": dict(nope_layers=[]),
                "phi3": dict(rope_scaling=None)}
    for name, change in switches.items():
        hf = _write(name, tmp_path / name)
        wrong, _ = load_hf(tmp_path / name, **change)
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask).logits
            moved = float((wrong.eval()(ids, attention_mask=mask) - ref)[mask.bool()].abs().max())
        print(f"{name}: without {change}: logits {moved:.2e} from transformers")
        assert moved > 1e-3


def test_lazy_read_of_a_fused_projection_reads_its_rows_only(tmp_path: Path) -> None:
    """A tensor-parallel rank's half of Phi-3's k_proj reads those rows of ``qkv_proj`` and no others."""
    _write("phi3", tmp_path)
    whole = load_hf(tmp_path)[0]
    lazy = load_hf(tmp_path, lazy=True)[0]
    source, name = lazy.weights_source, "layers.2.self_attn.k_proj.weight"
    rows, cols = torch.arange(16, 32), torch.arange(64)
    part = source.read(name, (rows, cols), torch.float32)
    assert torch.equal(part, whole.get_parameter(name)[16:32].detach())
    assert source.bytes_read == 16 * 64 * 4


# ---------------------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("name,targets", [("glm4", ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                          ("olmo3", ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
                                          ("phi3", ["o_proj", "down_proj"])])
def test_lora_equals_peft_on_transformers_and_adapter_loads(tmp_path: Path, name: str, targets: list[str]) -> None:
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter

    hf = _write(name, tmp_path / "hf")
    cfg = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=targets))
    ours = apply_peft(load_hf(tmp_path / "hf")[0].eval(), cfg)
    ids, mask, _ = padded_lm_batch(VOCAB, 12)
    keep = mask.bool()
    with torch.no_grad():
        base = hf(input_ids=ids, attention_mask=mask).logits
    ref = peft_twin(ours, hf, cfg)  # (peft wraps hf's modules in place)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        err = float((ours(ids, attention_mask=mask) - want)[keep].abs().max())
        moved = float((base - want)[keep].abs().max())
    export_adapter(ours, cfg, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(type(hf).from_pretrained(str(tmp_path / "hf")),
                                                str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        err_loaded = float((loaded(input_ids=ids, attention_mask=mask).logits - want)[keep].abs().max())
    print(f"{name}: LoRA {targets} vs peft on transformers {err:.2e} (it moves logits by {moved:.2e}), exported "
          f"adapter in peft {err_loaded:.2e}")
    assert err < 1e-5 and err_loaded < 1e-5 and moved > 1e-3


def test_lora_on_a_fused_projection_exports_merged_not_as_adapter(tmp_path: Path) -> None:
    """Phi-3's q/k/v and gate/up are one tensor each in transformers: an adapter-only export of a LoRA on them is
    refused in one line; the merged model exports and transformers reloads it with our adapted logits."""
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter, merge_peft

    _write("phi3", tmp_path / "hf")
    for targets in (["q_proj", "o_proj"], ["up_proj"]):
        cfg = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=targets))
        ours = apply_peft(load_hf(tmp_path / "hf")[0].eval(), cfg)
        with pytest.raises(ValueError) as e:
            export_adapter(ours, cfg, tmp_path / "never")
        assert "fuses them" in str(e.value) and "\n" not in str(e.value), str(e.value)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ids, mask, _ = padded_lm_batch(VOCAB, 12)
    with torch.no_grad():
        want = ours(ids, attention_mask=mask)
    save_hf(merge_peft(ours), tmp_path / "merged")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.Phi3ForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        err = float((back(input_ids=ids, attention_mask=mask).logits - want)[mask.bool()].abs().max())
    print(f"phi3: LoRA on up_proj merged and exported, reloaded by transformers: logits {err:.2e}")
    assert err < 1e-5
    import peft  # an adapter peft trained on transformers' fused qkv_proj is refused by name, not mis-loaded

    from lightning_llm.peft import load_adapter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = peft.get_peft_model(transformers.Phi3ForCausalLM.from_pretrained(str(tmp_path / "hf")),
                                     peft.LoraConfig(r=2, target_modules=["qkv_proj"]))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    with pytest.raises(ValueError, match=r"targets \['qkv_proj'\], which this model holds apart"):
        load_adapter(load_hf(tmp_path / "hf")[0], tmp_path / "theirs")


# ---------------------------------------------------------------------------------------------------- refusals


def _edit_config(src: Path, out: Path, **changes: Any) -> Path:
    out.mkdir()
    (out / "model.safetensors").symlink_to(src / "model.safetensors")
    config = {**json.loads((src / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_options_not_built_are_refused_in_one_line(tmp_path: Path) -> None:
    from lightning_llm.models.hf import config_from_hf
    from lightning_llm.tasks import CausalLMTask

    for name in ("phi3", "olmo3", "smollm3"):
        _write(name, tmp_path / name)
    cases = {
        _edit_config(tmp_path / "phi3", tmp_path / "drop", resid_pdrop=0.1): "resid_pdrop=0.1",
        _edit_config(tmp_path / "phi3", tmp_path / "q", quantization_config={"quant_method": "bitsandbytes"}):
            "quantization_config=",
        _edit_config(tmp_path / "olmo3", tmp_path / "flat", rope_parameters={"rope_type": "default"}):
            "is not nested by layer type",
        _edit_config(tmp_path / "olmo3", tmp_path / "dyn", rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0}, "sliding_attention": {}}):
            "rope_type='dynamic' is not supported for olmo3",
        _edit_config(tmp_path / "smollm3", tmp_path / "nope", no_rope_layers=[1, 0]): "no_rope_layers=[1, 0]",
    }
    for path, text in cases.items():
        with pytest.raises(ValueError) as e:
            CausalLMTask(str(path))
        message = str(e.value)
        assert text in message and str(path / "config.json") in message and "\n" not in message, message
    from lightning_llm.models import build_model

    never = {"debug-glm4": "partial_rotary_factor=0.5", "debug-olmo3": "branch_input_norm: ours=False",
             "debug-smollm3": "nope_layers: ours=[3]", "debug-phi3": "rope_type='longrope' for llama"}
    for size, text in never.items():  # never written as another family
        with pytest.raises(ValueError, match=re.escape(text)):
            save_hf(build_model(size, family="decoder"), tmp_path / "never", architecture="LlamaForCausalLM")
    for change, text in ((dict(branch_output_norm=True), "branch_output_norm: ours=True"),
                         (dict(rope_interleave=True), "rope_interleave: ours=True"),
                         (dict(norm_weight_fp32=True), "norm_weight_fp32: ours=True")):
        with pytest.raises(ValueError, match=re.escape(text)):
            save_hf(build_model("debug", family="decoder", **change), tmp_path / "never")
    from lightning_llm.models.parallel_spec import PARALLEL_SPECS
    from lightning_llm.strategies.context import slice_step

    phi3 = build_model("debug-phi3", family="decoder")  # LongRoPE's factors follow the whole row's longest position
    assert PARALLEL_SPECS[type(phi3)].position_limit(phi3) == 16
    row = {"input_ids": torch.zeros(1, 32, dtype=torch.long), "labels": torch.zeros(1, 32, dtype=torch.long)}
    with pytest.raises(ValueError, match="rows of 32 tokens .* LongRoPE the limit is its original_max_position_embedd"):
        slice_step("training_step", (row, 0), {}, cp=2, rank=0, model=phi3)
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8, "hidden_size": 8,
             "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}
    with pytest.raises(ValueError, match="rope_type='longrope' for llama"):
        config_from_hf({**llama, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})


def test_estimate_counts_the_published_sizes() -> None:
    """``lightning_llm estimate`` on the published configs (transformers' defaults: Phi-3-mini, GLM-4-9B-0414,
    OLMo-2-7B, OLMo-3-7B, SmolLM3-3B; written here, no weights): the parameters transformers' models hold."""
    import tempfile

    for cls in (transformers.Phi3ForCausalLM, transformers.Glm4ForCausalLM, transformers.Olmo2ForCausalLM,
                transformers.Olmo3ForCausalLM, transformers.SmolLM3ForCausalLM):
        with tempfile.TemporaryDirectory() as d:
            ours, reference = estimated_parameters(cls, Path(d))
        print(f"{cls.__name__}: {ours:,} parameters (transformers: {reference:,})")
        assert ours == reference
