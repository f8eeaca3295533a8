"""DeBERTa-v2/v3, ModernBERT and XLM-R against transformers 5 (tiny checkpoints written by transformers in the test).

Per family variant (:data:`VARIANTS`: DeBERTa-v3's shared keys with log buckets and no absolute positions; DeBERTa-v2
with its own relative projections, absolute positions, token types, clamped distances and the convolution beside its
first layer; ModernBERT with global and sliding layers of their own rope theta, cls and mean pooling, with and without
biases; XLM-R), on a batch of an unpadded, a right-padded and a left-padded row, fp32, transformers' eager attention:

* the last hidden states on the real tokens and the logits within 1e-5 (``load_hf`` eager and lazy + materialize);
* the loss (transformers' own) and every parameter's gradient in train mode (dropout 0), the gradients compared in
  transformers' key space (our gradients written through ``save_hf``'s mapping);
* ``save_hf`` writes transformers' own key set (the classification class and the base class), which
  ``from_pretrained`` reloads with the same outputs;
* what ``estimate`` counts: every parameter transformers has;

and: options not built refused in one line naming the file and the option; a lazy read of a fused projection's row
block reads only its rows; DeBERTa refused by pipeline stages in one line. The datamodule's pairs per tokenizer and
ClassificationTask runs: ``tests/tasks/test_encoder_classification.py``; the layouts:
``tests/models/test_encoders_layouts.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from lightning_llm.models import EncoderModel, load_hf, save_hf  # noqa: E402
from lightning_llm.models.init import materialize  # noqa: E402

TOL = 1e-5
VOCAB = 96
SEQ = 12

_DEBERTA = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_MODERNBERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                   max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, global_rope_theta=160000.0,
                   local_rope_theta=100.0)
_XLMR = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=66, type_vocab_size=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

# name -> (config class, config kwargs, classification class, base class, pad id, token types)
VARIANTS: dict[str, tuple[str, dict[str, Any], str, str, int, bool]] = {
    # DeBERTa-v3 / Erlangshen-DeBERTa-v2: shared keys, log buckets (distances past 4 bucketed), no absolute positions
    "deberta_v3": ("DebertaV2Config", dict(_DEBERTA, relative_attention=True, pos_att_type="p2c|c2p",
                                           position_buckets=8, norm_rel_ebd="layer_norm", share_att_key=True,
                                           position_biased_input=False, type_vocab_size=0),
                   "DebertaV2ForSequenceClassification", "DebertaV2Model", 0, False),
    # DeBERTa-v2: own pos_key_proj/pos_query_proj, absolute positions, token types, distances clamped at 5, no norm,
    # the convolution beside the first layer (DeBERTa-v2-xlarge's ConvLayer)
    "deberta_v2": ("DebertaV2Config", dict(_DEBERTA, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                           max_relative_positions=5, share_att_key=False, position_biased_input=True,
                                           type_vocab_size=2, pooler_hidden_act="tanh", conv_kernel_size=3,
                                           conv_act="gelu"),
                   "DebertaV2ForSequenceClassification", "DebertaV2Model", 0, True),
    # ModernBERT: layers full, sliding (2 columns either side), full; local rope theta of its own; cls pooling
    "modernbert": ("ModernBertConfig", dict(_MODERNBERT), "ModernBertForSequenceClassification", "ModernBertModel",
                   0, False),
    "modernbert_mean_biases": ("ModernBertConfig", dict(_MODERNBERT, classifier_pooling="mean", norm_bias=True,
                                                        attention_bias=True, mlp_bias=True, classifier_bias=True,
                                                        hidden_activation="gelu_pytorch_tanh"),
                               "ModernBertForSequenceClassification", "ModernBertModel", 0, False),
    "xlm_roberta": ("XLMRobertaConfig", dict(_XLMR), "XLMRobertaForSequenceClassification", "XLMRobertaModel",
                    1, False),
}


def _perturb(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """N(0, 0.1) noise on every parameter (norm weights ~1 +- 0.1, biases ~ +-0.1), eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _hf(name: str, *, seed: int = 0) -> torch.nn.Module:
    cfg_cls, kw, cls_name, _, _, _ = VARIANTS[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**kw, num_labels=3)
    cfg._attn_implementation = "eager"
    return _perturb(getattr(transformers, cls_name)(cfg), seed + 1)


def _batch(name: str) -> dict[str, torch.Tensor]:
    """Rows: unpadded, right-padded (4 pads), left-padded (4 pads); the family's padding id at padded slots."""
    pad, types = VARIANTS[name][4], VARIANTS[name][5]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, :4] = 0
    ids[mask == 0] = pad
    out = {"input_ids": ids, "attention_mask": mask}
    if types:
        tt = torch.zeros(3, SEQ, dtype=torch.long)
        tt[:, SEQ // 2:] = 1
        out["token_type_ids"] = tt * mask
    return out


def _ours(model: EncoderModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [B, S, H], logits [B, L])."""
    kw = {k: v for k, v in batch.items() if k != "input_ids"}
    hidden, _ = model.encode(batch["input_ids"], **kw)
    return hidden, model(batch["input_ids"], **kw)


def _theirs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(**batch, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def _errors(ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor],
            mask: torch.Tensor) -> tuple[float, float]:
    keep = mask.bool()
    assert torch.isfinite(got[0][keep]).all() and torch.isfinite(got[1]).all()
    return (float((ref[0] - got[0])[keep].abs().max()), float((ref[1] - got[1]).abs().max()))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_encoder_family_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = _hf(name)
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    batch = _batch(name)
    with torch.no_grad():
        ref = _theirs(hf, batch)
        assert torch.isfinite(ref[1]).all()

    # what `estimate` counts: every parameter transformers has
    from lightning_llm.tools.estimate import count_parameters, load_config

    assert count_parameters(load_config(str(src), "encoder")) == sum(p.numel() for p in hf.parameters())

    # load_hf, eager and lazy: hidden states on the real tokens and logits
    ours, cfg = load_hf(src)
    assert isinstance(ours, EncoderModel) and cfg.num_labels == 3
    lazy, _ = load_hf(src, lazy=True)
    materialize(lazy, "cpu")
    with torch.no_grad():
        errs = {"eager": _errors(ref, _ours(ours, batch), batch["attention_mask"]),
                "lazy": _errors(ref, _ours(lazy.eval(), batch), batch["attention_mask"])}
    print(f"{name}: max |hidden - transformers| on real tokens, max |logits - transformers|: {errs}")
    assert max(max(e) for e in errs.values()) <= TOL

    # train mode (dropout 0): transformers' loss and every gradient, in transformers' key space. ModernBERT's cls
    # pooling of a left-padded row reads a padding column, which in a sliding layer has no real key in reach: its
    # forward is transformers' eager one (checked above), its gradient differs between transformers' own eager and
    # sdpa paths (and torch's math and flash kernels), so that row is left out of the gradient check there.
    rows = [0, 1] if name == "modernbert" else [0, 1, 2]
    batch = {k: v[rows] for k, v in batch.items()}
    labels = torch.tensor([0, 1, 2])[rows]
    hf.train().zero_grad()
    ours.train().zero_grad()
    hf_loss = hf(**batch, labels=labels).loss
    hf_loss.backward()
    kw = {k: v for k, v in batch.items() if k != "input_ids"}
    loss = F.cross_entropy(ours(batch["input_ids"], **kw), labels)
    loss.backward()
    grads = copy.deepcopy(ours)
    with torch.no_grad():
        for n, p in grads.named_parameters():
            assert ours.get_parameter(n).grad is not None, n
            p.copy_(ours.get_parameter(n).grad)
    save_hf(grads, tmp_path / "grads")
    from safetensors.torch import load_file

    ours_grads = load_file(str(tmp_path / "grads" / "model.safetensors"))
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert set(ours_grads) == set(hf_grads)
    grad_err = max(float((ours_grads[n] - g).abs().max()) for n, g in hf_grads.items())
    scale = max(float(g.abs().max()) for g in hf_grads.values())
    print(f"{name}: loss {loss.item():.6f} vs transformers {hf_loss.item():.6f}; max |grad - transformers| "
          f"{grad_err:.2e} over {len(hf_grads)} tensors (largest gradient {scale:.2e})")
    assert abs(loss.item() - hf_loss.item()) <= TOL and grad_err <= TOL

    # save_hf: transformers' own key set (classification and base class), reloaded with the same outputs
    ours.eval()
    batch = _batch(name)
    save_hf(ours, tmp_path / "ours")
    base_src, base_dst = tmp_path / "hf_base", tmp_path / "ours_base"
    base_hf = getattr(transformers, VARIANTS[name][3])(hf.config)  # the base class itself (XLM-R's has a pooler)
    missing = base_hf.load_state_dict(hf.base_model.state_dict(), strict=False).missing_keys
    assert all(k.startswith("pooler.") for k in missing), missing
    base_hf.save_pretrained(base_src)
    base, _ = load_hf(base_src)
    save_hf(base, base_dst)
    for theirs, mine in ((src, tmp_path / "ours"), (base_src, base_dst)):
        want = set(load_file(str(theirs / "model.safetensors")))
        got = set(load_file(str(mine / "model.safetensors")))
        assert got == want, (sorted(got - want), sorted(want - got))
    back = getattr(transformers, VARIANTS[name][2]).from_pretrained(tmp_path / "ours", attn_implementation="eager")
    back_base = getattr(transformers, VARIANTS[name][3]).from_pretrained(base_dst, attn_implementation="eager")
    assert json.loads((base_dst / "config.json").read_text())["architectures"] == [VARIANTS[name][3]]
    with torch.no_grad():
        again = _errors(ref, _theirs(back.eval(), batch), batch["attention_mask"])
        hidden = back_base.eval()(**batch).last_hidden_state
    base_err = float((hidden - ref[0])[batch["attention_mask"].bool()].abs().max())
    print(f"{name}: exported and reloaded by transformers: {again}, base class hidden {base_err:.2e}")
    assert max(again) <= TOL and base_err <= TOL


# --------------------------------------------------------------------------------------------- refusals, lazy reads
@pytest.mark.parametrize("kind, change, words", [
    ("deberta_v2", {"conv_kernel_size": 4}, "conv_kernel_size=4 is not supported for deberta-v2"),
    ("deberta_v2", {"embedding_size": 16}, "embedding_size=16"),
    ("deberta_v2", {"norm_rel_ebd": "rms"}, "norm_rel_ebd='rms'"),
    ("modernbert", {"mlp_dropout": 0.1}, "mlp_dropout=0.1 is not supported for modernbert"),
    ("modernbert", {"classifier_pooling": "max"}, "classifier_pooling='max'"),
    ("modernbert", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1e4}}}, "rope_type='linear'"),
])
def test_options_not_built_are_refused_by_name(kind: str, change: dict[str, Any], words: str, tmp_path: Path) -> None:
    """One line naming config.json and the option, from the config alone (what a task checks before any data)."""
    from lightning_llm.models import backbone_config

    cfg_cls, kw, cls_name, *_ = VARIANTS[kind]
    src = tmp_path / kind
    getattr(transformers, cfg_cls)(**kw, architectures=[cls_name]).save_pretrained(src)  # no weights: refused first
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    for call in (lambda: load_hf(src), lambda: backbone_config(str(src), family="encoder")):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        print(msg)
        assert "\n" not in msg and str(src / "config.json") in msg and words in msg


def test_fused_projection_rows_are_read_lazily_per_block(tmp_path: Path) -> None:
    """ModernBERT's Wqkv [3H, H] and Wi [2I, H]: a rank's rows of k_proj (a tensor-parallel shard) read only those
    rows of the stored tensor, at the block's offset."""
    _hf("modernbert").save_pretrained(tmp_path)
    model, _ = load_hf(tmp_path, lazy=True)
    source = model.weights_source
    stored = load_file_tensors(tmp_path)
    rows, cols = torch.arange(8, 16), torch.arange(32)
    before = source.bytes_read
    got = source.read("layers.1.self_attn.k_proj.weight", (rows, cols), torch.float32)
    wqkv = stored["model.layers.1.attn.Wqkv.weight"]
    assert torch.equal(got, wqkv[32 + 8:32 + 16])
    assert source.bytes_read - before == 8 * 32 * 4  # the 8 rows only
    up = source.read("layers.0.mlp.up_proj.weight", (torch.arange(48), cols), torch.float32)
    assert torch.equal(up, stored["model.layers.0.mlp.Wi.weight"][48:])  # Wi = [input (activated); gate]


def load_file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_deberta_is_refused_by_pipeline_stages(tmp_path: Path) -> None:
    """Its relative-position table is read by every layer: one line, before any stage is built; ModernBERT splits."""
    from lightning_llm.strategies.pipeline.split import split_layers

    for kind in ("deberta_v3", "modernbert"):
        _hf(kind).save_pretrained(tmp_path / kind)
    deberta, _ = load_hf(tmp_path / "deberta_v3", lazy=True)
    with pytest.raises(ValueError, match=r"pipeline parallelism: DeBERTa's relative-position table") as err:
        split_layers(deberta, 2)
    assert "\n" not in str(err.value)
    modernbert, _ = load_hf(tmp_path / "modernbert", lazy=True)
    assert split_layers(modernbert, 2) == [("0", "1"), ("2",)]
