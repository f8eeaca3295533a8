"""Numerical parity with Hugging Face transformers: HF -> load_hf -> ours, and ours -> save_hf -> HF.

Tiny random fp32 HF models are built from configs (no downloads), their parameters perturbed so that norms and
biases are non-trivial, saved to tmp_path, and compared on batches with right and left padding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llm.models import DecoderLM, EncoderModel, build_model, load_hf, save_hf  # noqa: E402
from lightning_llm.models.hf import config_from_hf  # noqa: E402

TOL = 1e-5
VOCAB = 96
SEQ = 12


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Add N(0, 0.1) noise to every parameter (norm weights ~1 +- 0.1, biases ~ +- 0.1) and switch to eval."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # shared (tied) parameters are visited once
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _batch(seed: int = 0, token_types: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    ids[1, 8:] = 0
    ids[2, :4] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if token_types:
        tt = torch.zeros(3, SEQ, dtype=torch.long)
        tt[:, SEQ // 2:] = 1
        out["token_type_ids"] = tt
    return out


def _hf_out(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.last_hidden_state


def _our_out(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kw = {k: v for k, v in batch.items() if k != "input_ids"}
    with torch.no_grad():
        return model(batch["input_ids"], **kw)


def _err(ref: torch.Tensor, ours: torch.Tensor, mask: torch.Tensor) -> float:
    assert ref.shape == ours.shape, (ref.shape, ours.shape)
    assert torch.isfinite(ours).all()
    if ref.dim() == 3:  # per-token outputs: compare real tokens only (padded rows are don't-care)
        keep = mask.bool()
        return (ref[keep] - ours[keep]).abs().max().item()
    return (ref - ours).abs().max().item()


def _roundtrip(
    name: str, hf_model: torch.nn.Module, tmp_path: Path, auto_cls: Any, *, token_types: bool = False,
    save: str = "safetensors", expect_cls: type = DecoderLM,
) -> torch.nn.Module:
    """HF -> ours -> HF, asserting parity at both steps. Returns our model."""
    src = tmp_path / "hf"
    if save == "safetensors":
        hf_model.save_pretrained(src)
    elif save == "sharded":
        hf_model.save_pretrained(src, max_shard_size="20KB")
        assert (src / "model.safetensors.index.json").exists()
    else:  # pytorch_model.bin
        hf_model.config.save_pretrained(src)
        torch.save(hf_model.state_dict(), src / "pytorch_model.bin")
    ours, cfg = load_hf(src)
    assert isinstance(ours, expect_cls)
    ours.eval()
    batch = _batch(token_types=token_types)
    ref = _hf_out(hf_model, batch)
    err = _err(ref, _our_out(ours, batch), batch["attention_mask"])
    print(f"{name} HF->ours ({save}) max_abs_err={err:.2e}")
    assert err <= TOL

    dst = tmp_path / "ours"
    save_hf(ours, dst)
    assert not list(dst.glob("*.tmp")), "temporary files left behind"
    back = auto_cls.from_pretrained(dst).eval()
    assert type(back).__name__ == type(hf_model).__name__
    err2 = _err(_hf_out(back, batch), _our_out(ours, batch), batch["attention_mask"])
    print(f"{name} ours->HF max_abs_err={err2:.2e}")
    assert err2 <= TOL
    return ours


# ----------------------------------------------------------------------------------------------------------- decoders


def _llama(**kw: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0, **kw,
    )
    return _perturb(transformers.LlamaForCausalLM(cfg), seed=1)


def test_llama_gqa_parity(tmp_path: Path) -> None:
    # eager attention: an independent reference (explicit repeat_kv + softmax), not the same SDPA call as ours
    ours = _roundtrip("LlamaForCausalLM[eager]", _llama(attn_implementation="eager"), tmp_path,
                      transformers.AutoModelForCausalLM)
    attn = ours.layers["0"].self_attn
    assert attn.q_proj.out_features == 32 and attn.k_proj.out_features == 16  # 4 heads, 2 kv heads, head_dim 8


def test_llama_sharded_parity(tmp_path: Path) -> None:
    _roundtrip("LlamaForCausalLM", _llama(), tmp_path, transformers.AutoModelForCausalLM, save="sharded")


def test_llama3_rope_scaling_parity(tmp_path: Path) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    ours = _roundtrip("LlamaForCausalLM+llama3-rope", _llama(rope_parameters=rope), tmp_path,
                      transformers.AutoModelForCausalLM)
    assert ours.config.rope_scaling["rope_type"] == "llama3" and ours.config.rope_theta == 500000.0


def test_llama_model_weights_get_fresh_lm_head(tmp_path: Path) -> None:
    hf = _llama()
    hf.model.save_pretrained(tmp_path / "base")  # LlamaModel checkpoint: no lm_head
    ours, _ = load_hf(tmp_path / "base")
    batch = _batch()
    with torch.no_grad():
        ref = hf.model(**batch).last_hidden_state
        ours.lm_head = None  # hidden states after the final norm
        hid = ours(batch["input_ids"], attention_mask=batch["attention_mask"])
    err = _err(ref, hid, batch["attention_mask"])
    print(f"LlamaModel hidden max_abs_err={err:.2e}")
    assert err <= TOL


def _gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=1, eos_token_id=2)
    return _perturb(transformers.GPT2LMHeadModel(cfg), seed=2)


def test_gpt2_tied_parity(tmp_path: Path) -> None:
    ours = _roundtrip("GPT2LMHeadModel", _gpt2(), tmp_path, transformers.AutoModelForCausalLM)
    assert ours.lm_head.weight is ours.embed_tokens.weight
    assert ours.embed_positions is not None and ours.norm is not None


def test_gpt2_pytorch_bin_parity(tmp_path: Path) -> None:
    _roundtrip("GPT2LMHeadModel", _gpt2(), tmp_path, transformers.AutoModelForCausalLM, save="bin")


# ----------------------------------------------------------------------------------------------------------- encoders


def _bert_cfg(cls: Any, **kw: Any) -> Any:
    kw = {"max_position_embeddings": 64, **kw}
    return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               **kw)


def test_bert_classification_parity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = _bert_cfg(transformers.BertConfig, num_labels=3, attn_implementation="eager")
    hf = _perturb(transformers.BertForSequenceClassification(cfg), 3)
    ours = _roundtrip("BertForSequenceClassification[eager]", hf, tmp_path, transformers.AutoModelForSequenceClassification,
                      token_types=True, expect_cls=EncoderModel)
    assert ours.classifier.out_features == 3 and ours.embed_norm is not None and ours.final_norm is None


def test_bert_model_hidden_parity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _perturb(transformers.BertModel(_bert_cfg(transformers.BertConfig)), 4)
    ours = _roundtrip("BertModel", hf, tmp_path, transformers.AutoModel, token_types=True, expect_cls=EncoderModel)
    batch = _batch(token_types=True)
    with torch.no_grad():
        ref = hf(**batch).pooler_output
        _, pooled = ours.encode(batch["input_ids"], attention_mask=batch["attention_mask"],
                                token_type_ids=batch["token_type_ids"])
    err = (ref - pooled).abs().max().item()
    print(f"BertModel pooled max_abs_err={err:.2e}")
    assert err <= TOL


def test_bert_base_checkpoint_with_new_classifier(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _perturb(transformers.BertModel(_bert_cfg(transformers.BertConfig)), 4)
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf(tmp_path, num_labels=5)
    assert not ours.training  # load_hf returns the model in eval mode, as from_pretrained
    assert cfg.num_labels == 5 and ours.classifier.out_features == 5
    batch = _batch(token_types=True)
    with torch.no_grad():
        hid, _ = ours.encode(batch["input_ids"], attention_mask=batch["attention_mask"],
                             token_type_ids=batch["token_type_ids"])
        assert _err(hf(**batch).last_hidden_state, hid, batch["attention_mask"]) <= TOL
        assert ours(batch["input_ids"], attention_mask=batch["attention_mask"]).shape == (3, 5)


def test_megatron_bert_model_parity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = _perturb(transformers.MegatronBertModel(_bert_cfg(transformers.MegatronBertConfig)), 5)
    ours = _roundtrip("MegatronBertModel", hf, tmp_path, transformers.AutoModel, token_types=True,
                      expect_cls=EncoderModel)
    assert ours.embed_norm is None and ours.final_norm is not None and ours.config.pre_norm


def test_megatron_bert_classification_parity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = _bert_cfg(transformers.MegatronBertConfig, num_labels=4)
    hf = _perturb(transformers.MegatronBertForSequenceClassification(cfg), 6)
    _roundtrip("MegatronBertForSequenceClassification", hf, tmp_path,
               transformers.AutoModelForSequenceClassification, token_types=True, expect_cls=EncoderModel)


def test_roberta_classification_parity(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = _bert_cfg(transformers.RobertaConfig, num_labels=2, max_position_embeddings=66, type_vocab_size=1)
    hf = _perturb(transformers.RobertaForSequenceClassification(cfg), 7)
    # RoBERTa pads with pad_token_id=1; _batch uses 0 at padded slots, so remap them.
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    ours, c = load_hf(src)
    ours.eval()
    assert c.position_offset == 2
    batch = _batch()
    batch["input_ids"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], torch.ones_like(batch["input_ids"]))
    err = _err(_hf_out(hf, batch), _our_out(ours, batch), batch["attention_mask"])
    print(f"RobertaForSequenceClassification HF->ours max_abs_err={err:.2e}")
    assert err <= TOL
    save_hf(ours, tmp_path / "ours")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours").eval()
    err2 = _err(_hf_out(back, batch), _our_out(ours, batch), batch["attention_mask"])
    print(f"RobertaForSequenceClassification ours->HF max_abs_err={err2:.2e}")
    assert err2 <= TOL


# ------------------------------------------------------------------------------------------------------------- errors


def _save_llama(tmp_path: Path) -> Path:
    d = tmp_path / "llama"
    _llama().save_pretrained(d)
    return d


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf(tmp_path / "nope")


def test_missing_weights_file(tmp_path: Path) -> None:
    d = _save_llama(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=str(d)):
        load_hf(d)


def test_unknown_architecture(tmp_path: Path) -> None:
    d = _save_llama(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_hf(d)
    with pytest.raises(ValueError, match="unsupported"):
        config_from_hf({"model_type": "t5"})


def test_missing_and_unexpected_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = _save_llama(tmp_path)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    sd["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing keys.*layers\.1\.mlp\.up_proj\.weight.*unexpected keys.*layers\.7"):
        load_hf(d)


def test_family_mismatch_and_build_model_from_path(tmp_path: Path) -> None:
    d = _save_llama(tmp_path)
    with pytest.raises(ValueError, match="family"):
        load_hf(d, family="encoder")
    m = build_model(str(d), family="decoder", dropout=0.0)
    assert isinstance(m, DecoderLM) and m.config.num_kv_heads == 2
    m16, cfg = load_hf(d, dtype=torch.bfloat16)
    assert m16.lm_head.weight.dtype == torch.bfloat16


def test_save_unrepresentable_config_fails(tmp_path: Path) -> None:
    m = build_model("debug", family="decoder", norm="layernorm")
    with pytest.raises(ValueError, match="not representable"):
        save_hf(m, tmp_path / "x", architecture="LlamaForCausalLM")
