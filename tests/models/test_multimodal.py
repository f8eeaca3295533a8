"""Multimodal checkpoints fine-tuned as text (``models/hf/convert/multimodal.py``): ``Gemma3ForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``, ``Mistral3ForConditionalGeneration``,
``Qwen3_5ForConditionalGeneration`` (tied, as Qwen3.5-0.8B to 4B) and ``Qwen3_5MoeForConditionalGeneration`` (a Gated
DeltaNet and a gated attention layer, interleaved M-RoPE sections) written by transformers 5.24's ``save_pretrained``
in the test (tiny vision towers, in each class's own on-disk key layout: ``language_model.model.*`` for Gemma 3 and
Mistral 3, ``model.*`` + ``visual.*`` for Qwen2.5-VL, ``model.language_model.*`` + ``model.visual.*`` for Qwen3-VL and
Qwen3.5).

* the language model's text logits on padded rows equal the class's own (eager attention); a lazy load reads the
  language model's bytes only (the vision tower and projector are never read, so never on a device);
* ``save_hf`` writes the source's ``config.json`` byte for byte, the same key set, every tensor outside the language
  model byte for byte; transformers' ``AutoModelForImageTextToText`` loads it as the original class with no missing or
  unexpected key and the same text logits;
* ``lightning_llm estimate`` counts the language model's parameters and names the bytes it never loads;
* a LoRA fit of ``tools.tiny``'s Gemma 3 and Qwen3.5 (Qwen3.5's on ``linear_attn.in_proj_qkv``, whose ``lora_B`` rows
  are permuted to transformers' order, ``out_proj``, ``q_proj``), exported merged and adapter-only: the merged export
  and peft's ``PeftModel`` on the adapter-only export's base give the trained model's logits, its towers are the
  source's bytes; a source changed after the run is refused in one line naming the file (the language model alone,
  ``--architecture Gemma3ForCausalLM``, still exports).

The layouts (tp, tp + sequence parallel, pp, zero3) are ``tests/models/test_families_layouts.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.conftest import padded_lm_batch  # noqa: E402
from tests.models.family_parity import write_perturbed  # noqa: E402

from lightning_llm.models import load_hf, save_hf  # noqa: E402
from lightning_llm.models.init import materialize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                    spatial_merge_size=1, temporal_patch_size=1)
_QWEN_IDS = dict(image_token_id=95, video_token_id=94, vision_start_token_id=93, vision_end_token_id=92)


def _config(name: str) -> Any:
    if name == "gemma3":  # tied head; a sliding and a full layer
        return transformers.Gemma3Config(
            text_config=dict(_TEXT, head_dim=8, sliding_window=4, query_pre_attn_scalar=8,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                               image_size=16, patch_size=4),
            mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94)
    if name == "qwen2_5_vl":  # untied; M-RoPE sections
        return transformers.Qwen2_5_VLConfig(
            text_config=dict(_TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                     "rope_theta": 10000.0}),
            vision_config=dict(_QWEN_VISION, fullatt_block_indexes=[0]), **_QWEN_IDS)
    if name == "qwen3_vl":  # interleaved M-RoPE, q/k norms, deepstack mergers
        return transformers.Qwen3VLConfig(
            text_config=dict(_TEXT, head_dim=8, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                                 "rope_theta": 10000.0, "mrope_interleaved": True}),
            vision_config=dict(_QWEN_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16), **_QWEN_IDS)
    if name in ("qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet + gated attention; interleaved M-RoPE on partial rotary
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        text = dict(_TEXT, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                     "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                    **(moe if name == "qwen3_5_moe" else {}))
        vision = dict(_QWEN_VISION, num_position_embeddings=16)
        if name == "qwen3_5_moe":  # untied, as Qwen3.5-35B-A3B
            return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **_QWEN_IDS)
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                          **_QWEN_IDS)  # tied, as Qwen3.5-0.8B to 4B
    return transformers.Mistral3Config(  # a Mistral language model (tied by the class's default), Pixtral tower
        text_config=dict(_TEXT, model_type="mistral", head_dim=8, sliding_window=None),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=4, head_dim=8), spatial_merge_size=1, image_token_index=95)


CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "mistral3": "Mistral3ForConditionalGeneration",
           "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def write_multimodal(name: str, out: Path, seed: int = 0) -> Any:
    """A perturbed tiny ``name`` model saved by transformers into ``out``; returned in eval mode, eager attention."""
    torch.manual_seed(seed)
    model = write_perturbed(getattr(transformers, CLASSES[name])(_config(name)), out, seed + 1)
    model.config._attn_implementation = "eager"
    for sub in (model.config.text_config, getattr(model.config, "vision_config", None)):
        if sub is not None:
            sub._attn_implementation = "eager"
    return model.eval()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


def _reload(path: Path) -> tuple[Any, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = transformers.AutoModelForImageTextToText.from_pretrained(
            str(path), attn_implementation="eager", output_loading_info=True)
    return model.eval(), info


def _text_logits(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("name", list(CLASSES))
def test_text_logits_and_the_whole_checkpoint_written_back(tmp_path: Path, name: str) -> None:
    hf = write_multimodal(name, tmp_path / "src")
    if name.startswith("qwen3_5"):  # Qwen3.5's published files carry multi-token-prediction weights: kept, not built
        from safetensors.torch import save_file

        save_file({**_tensors(tmp_path / "src"), "mtp.fc.weight": torch.randn(32, 64).to(torch.bfloat16)},
                  str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    ids, mask, _ = padded_lm_batch(90, 12)
    keep = mask.bool()
    ref = _text_logits(hf, ids, mask)
    ours, cfg = load_hf(tmp_path / "src", lazy=True)
    materialize(ours, "cpu")
    src = _tensors(tmp_path / "src")
    lm_bytes = sum(t.numel() * t.element_size() for k, t in src.items() if "language_model" in k
                   or k.startswith(("model.layers", "model.embed", "model.norm", "lm_head")))
    assert ours.weights_source.bytes_read == lm_bytes  # the towers were never read
    ours.weights_source = None
    err = float((_text_logits(ours.eval(), ids, mask) - ref)[keep].abs().max())

    out = save_hf(ours, tmp_path / "out")
    written = _tensors(out)
    towers = [k for k in src if not _is_lm_key(name, k)]
    assert towers and all(_same_bytes(src[k], written[k]) for k in towers)
    assert (out / "config.json").read_bytes() == (tmp_path / "src" / "config.json").read_bytes()
    back, info = _reload(out)
    err_back = float((_text_logits(back, ids, mask) - _text_logits(ours, ids, mask))[keep].abs().max())
    print(f"{name}: text logits {err:.2e} from {CLASSES[name]}; {len(towers)} tower tensors copied byte for byte; "
          f"reloaded as {type(back).__name__}: {err_back:.2e}")
    assert set(written) == set(src) and type(back).__name__ == CLASSES[name]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert err < 1e-5 and err_back < 1e-5
    # estimate counts the language model, and names the bytes it never loads
    from lightning_llm.tools.estimate import main as estimate

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert estimate(["--model", str(tmp_path / "src"), "--json"]) == 0
    report = json.loads(printed.getvalue())
    assert report["parameters"] == sum(p.numel() for p in ours.parameters())
    assert report["not_loaded_bytes"] == sum(src[k].numel() * src[k].element_size() for k in towers)


def _is_lm_key(name: str, key: str) -> bool:
    if name == "qwen2_5_vl":
        return not key.startswith("visual.")
    return "language_model" in key or key.startswith("lm_head")


def _lora_fit_and_export(tmp_path: Path, family: str, targets: list[str], moved_key: str) -> tuple[Any, ...]:
    """A LoRA fit (3 steps) of ``tools.tiny``'s ``family``, exported merged and adapter-only: the merged export and
    peft's ``PeftModel`` on the adapter-only export's base give the trained model's logits, the adapted ``moved_key``
    weights moved, the towers are the source's bytes, config.json the source's."""
    import peft

    from lightning_llm.data import TextDataModule
    from lightning_llm.export import export_checkpoint, read_checkpoint, rebuild_model
    from lightning_llm.peft import LoraArgs, merge_peft
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.testing import table_trainer
    from lightning_llm.tools.tiny import FAMILIES, write_tiny

    src = write_tiny(family, tmp_path / "src")
    task = CausalLMTask(str(src), dropout=0.0, lora=LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=targets))
    dm = TextDataModule(tokenizer_dir=str(src), block_size=32, batch_size=4, cache_dir=str(tmp_path / "cache"),
                        generated_docs=40)
    table_trainer(tmp_path, strategy="auto", devices=1, max_steps=3, callbacks=[], save_every_step=True).fit(task, dm)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    merged = export_checkpoint(ckpt, tmp_path / "merged")
    adapter = export_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)
    trained = merge_peft(rebuild_model(read_checkpoint(ckpt))[0]).eval()

    ids, mask, _ = padded_lm_batch(300, 16)
    keep = mask.bool()
    want = _text_logits(trained, ids, mask)
    back, info = _reload(merged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on_base = peft.PeftModel.from_pretrained(_reload(adapter / "base")[0], str(adapter)).eval()
    errs = [float((_text_logits(m, ids, mask) - want)[keep].abs().max()) for m in (back, on_base)]
    before, after = _tensors(src), _tensors(merged)
    towers = [k for k in before if not _is_lm_key(family, k)]
    moved = max(float((before[k] - after[k]).abs().max()) for k in before if moved_key in k)
    print(f"{family} LoRA: merged export {errs[0]:.2e}, peft on the adapter-only export {errs[1]:.2e} from the trained "
          f"model's logits; {moved_key} moved by {moved:.2e}; {len(towers)} tower tensors the source's bytes")
    assert type(back).__name__ == FAMILIES[family][1]
    assert max(errs) < 1e-5 and moved > 1e-4 and not info["missing_keys"] and not info["unexpected_keys"]
    assert towers and set(after) == set(before) and all(_same_bytes(before[k], after[k]) for k in towers)
    assert (merged / "config.json").read_bytes() == (src / "config.json").read_bytes()
    return src, ckpt, before, towers, want, ids, mask


def test_qwen3_5_lora_fit_exports_whole(tmp_path: Path) -> None:
    """Qwen3.5 as published: LoRA on a DeltaNet layer's in_proj_qkv (its lora_B rows permuted to transformers'
    [q; k; v]) and out_proj (``linear_attn`` under ``model.language_model``) and the attention's q_proj."""
    _lora_fit_and_export(tmp_path, "qwen3_5", ["in_proj_qkv", "out_proj", "q_proj"], "linear_attn.in_proj_qkv")


def test_gemma3_lora_fit_exports_whole_and_refuses_a_changed_source(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from lightning_llm.export import export_checkpoint

    src, ckpt, before, towers, want, ids, mask = _lora_fit_and_export(
        tmp_path, "gemma3", ["q_proj", "v_proj", "gate_proj"], "self_attn.q_proj")
    keep = mask.bool()

    # the source's towers changed after the run: refused in one line naming the file
    changed = dict(before)
    key = towers[0]
    changed[key] = changed[key] + 1
    save_file(changed, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        export_checkpoint(ckpt, tmp_path / "again")
    assert f"{src / 'model.safetensors'}: changed since the run loaded it" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "again").exists()
    # the language model alone needs none of the towers
    text_only = export_checkpoint(ckpt, tmp_path / "text", architecture="Gemma3ForCausalLM")
    assert json.loads((text_only / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        causal = transformers.AutoModelForCausalLM.from_pretrained(str(text_only), attn_implementation="eager")
    assert float((_text_logits(causal.eval(), ids, mask) - want)[keep].abs().max()) < 1e-5


def test_options_not_built_are_refused_in_one_line(tmp_path: Path) -> None:
    """Before any data is prepared (the task's constructor reads config.json only): a language model of another
    family, a quantized checkpoint, a class without text_config."""
    from lightning_llm.tasks import CausalLMTask

    config = _config("mistral3").to_dict()
    cases = {"ministral": ({**config, "text_config": {**config["text_config"], "model_type": "ministral"}},
                           "text_config.model_type='ministral' is not supported for Mistral3ForConditionalGeneration"),
             "quantized": ({**config, "quantization_config": {"quant_method": "fp8"}},
                           "quantization_config={'quant_method': 'fp8'} is not supported for Mistral3"),
             "flat": ({k: v for k, v in config.items() if k != "text_config"},
                      "Mistral3ForConditionalGeneration without a text_config")}
    for name, (body, text) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**body, "architectures": [CLASSES["mistral3"]]}))
        with pytest.raises(ValueError) as e:
            CausalLMTask(str(tmp_path / name))
        assert f"{tmp_path / name / 'config.json'}: {text}" in str(e.value) and "\n" not in str(e.value), str(e.value)
