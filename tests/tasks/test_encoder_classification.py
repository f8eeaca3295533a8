"""ClassificationTask on DeBERTa-v2/v3, ModernBERT and XLM-R directories with their own tokenizers (both written by
transformers here), as a user brings them:

* the sentence-pair datamodule encodes a pair exactly as the family's tokenizer does (its separators; DeBERTa's token
  types 0/1, none from XLM-R's and ModernBERT's tokenizers), including Erlangshen-DeBERTa-v2's BERT vocabulary;
* a short fit, then ``lightning_llm export``: ``...ForSequenceClassification`` with transformers' own key set and
  the run's labels, whose logits under transformers equal the trained model's (1e-5, fp32) (not repeated for the
  sentencepiece-style DeBERTa tokenizer: the model is the BERT-vocabulary one's);
* on the real AFQMC rows (``../shared/data``; skipped without them) with the Chinese BERT vocabulary: a tiny
  Erlangshen-DeBERTa-v2-shaped checkpoint scores real pairs as transformers does, then fits.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llm.data import SentencePairDataModule  # noqa: E402
from lightning_llm.data.base import tokenizer_vocab_size  # noqa: E402
from lightning_llm.export.to_hf import main as export_main  # noqa: E402
from lightning_llm.tasks import ClassificationTask, OptimConfig  # noqa: E402

_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)
# family -> (config class, config kwargs, classification class)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "deberta_bert_vocab": ("DebertaV2Config", dict(_SMALL, relative_attention=True, pos_att_type="p2c|c2p",
                                                   position_buckets=16, norm_rel_ebd="layer_norm", share_att_key=True,
                                                   position_biased_input=False, type_vocab_size=0),
                           "DebertaV2ForSequenceClassification"),
    "deberta_spm": ("DebertaV2Config", dict(_SMALL, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                            position_buckets=16, norm_rel_ebd="layer_norm", share_att_key=True,
                                            position_biased_input=False, type_vocab_size=0),
                    "DebertaV2ForSequenceClassification"),
    "modernbert": ("ModernBertConfig", dict(_SMALL, num_hidden_layers=3, intermediate_size=48, local_attention=8,
                                            global_attn_every_n_layers=2),
                   "ModernBertForSequenceClassification"),
    "xlm_roberta": ("XLMRobertaConfig", dict(_SMALL, max_position_embeddings=80, type_vocab_size=1),
                    "XLMRobertaForSequenceClassification"),
}


def _tokenizer(family: str, alphabet: list[str], vocab_txt: Path) -> Any:
    """The family's tokenizer over the generated pairs' characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    if family == "deberta_bert_vocab":  # Erlangshen-DeBERTa-v2: a BERT WordPiece vocabulary
        return transformers.BertTokenizer(str(vocab_txt))
    pieces = [(c, -2.0) for c in alphabet] + [("▁", -1.0)]
    if family == "deberta_spm":
        specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
        return transformers.DebertaV2Tokenizer(vocab=[(s, 0.0) for s in specials] + pieces)
    if family == "xlm_roberta":
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        return transformers.XLMRobertaTokenizer(vocab=[(s, 0.0) for s in specials] + pieces)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ModernBERT: a tokenizer.json without token types
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + alphabet)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                                model_input_names=["input_ids", "attention_mask"])


def _checkpoint(family: str, tok: Any, out: Path, *, seed: int = 0) -> Path:
    """The family's classification checkpoint sized to ``tok`` (special token ids from it), with ``tok`` saved beside."""
    cfg_cls, kw, cls_name = FAMILIES[family]
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    if family == "modernbert":
        ids.update(cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_cls)(**kw, **ids, vocab_size=tokenizer_vocab_size(tok),
                                                                           num_labels=2))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _alphabet(pair_data: Path) -> list[str]:
    special = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    return [t for t in (pair_data / "tokenizer" / "vocab.txt").read_text(encoding="utf-8").split() if t not in special]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_directory_trains_and_exports(family: str, pair_data: Path, tmp_path: Path) -> None:
    tok = _tokenizer(family, _alphabet(pair_data), pair_data / "tokenizer" / "vocab.txt")
    backbone = _checkpoint(family, tok, tmp_path / "backbone")

    # the datamodule with the directory's own tokenizer (what the command line gives it): the pair as the tokenizer
    # lays it out
    dm = SentencePairDataModule(str(pair_data), str(backbone), batch_size=8, max_length=40)
    dm.setup("fit")
    first = json.loads((pair_data / "train.json").read_text(encoding="utf-8").splitlines()[0])
    want = dm.tokenizer(first["sentence1"], first["sentence2"])
    got = dm.datasets["fit"][0]
    assert got["input_ids"] == want["input_ids"]
    seps = got["input_ids"].count(dm.tokenizer.sep_token_id)
    assert got["input_ids"][0] == dm.tokenizer.cls_token_id and got["input_ids"][-1] == dm.tokenizer.sep_token_id
    assert seps == (3 if family == "xlm_roberta" else 2)  # <s> A </s></s> B </s>; [CLS] A [SEP] B [SEP]
    if family.startswith("deberta"):
        n_a = got["input_ids"].index(dm.tokenizer.sep_token_id) + 1
        assert got["token_type_ids"] == [0] * n_a + [1] * (len(got["input_ids"]) - n_a)
    else:
        assert "token_type_ids" not in want and set(got["token_type_ids"]) == {0}
    print(f"{family}: {type(dm.tokenizer).__name__}, pair {got['input_ids']}, token types {got['token_type_ids']}")
    if family == "deberta_spm":
        return  # the same model as deberta_bert_vocab's below: only the tokenizer differs

    # fit, export, reload by transformers: the trained model's logits
    pl.seed_everything(1)
    task = ClassificationTask(str(backbone), dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(tmp_path))
    trainer.fit(task, dm)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    batch = next(iter(dm.val_dataloader()))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        ours = task.model.eval()(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                 token_type_ids=inputs["token_type_ids"])
    assert export_main([str(tmp_path / "run.ckpt"), "--to", str(tmp_path / "hf")]) == 0
    cls_name = FAMILIES[family][2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = getattr(transformers, cls_name).from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert keys == set(load_file(str(backbone / "model.safetensors")))  # transformers' own key set
    hf_inputs = inputs if family.startswith("deberta") else {k: inputs[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        err = float((hf(**hf_inputs).logits - ours).abs().max())
    print(f"{family}: exported {hf.config.architectures}, labels {hf.config.id2label}, max |logits - trained| "
          f"{err:.2e}")
    assert hf.config.architectures == [cls_name] and hf.config.id2label == {0: "0", 1: "1"}
    assert err <= 1e-5


def test_erlangshen_deberta_on_real_afqmc(tmp_path: Path) -> None:
    """A tiny Erlangshen-DeBERTa-v2-shaped checkpoint with the real Chinese BERT vocabulary (21,128 ids) on real
    AFQMC rows: the datamodule's padded batch scores as transformers scores it, then a short fit on it learns."""
    from lightning_llm.models import load_hf
    from lightning_llm.testing import LoggedLoss
    from tests.conftest import SHARED_DATA

    data, vocab = SHARED_DATA / "afqmc", SHARED_DATA / "tokenizers" / "bert-base-chinese"
    if not (data / "train.json").is_file() or not (vocab / "vocab.txt").is_file():
        pytest.skip(f"real AFQMC data not found under {SHARED_DATA} (the repository runs without it)")
    tok = transformers.BertTokenizer(str(vocab / "vocab.txt"))
    backbone = _checkpoint("deberta_bert_vocab", tok, tmp_path / "erlangshen-deberta", seed=3)
    rows = tmp_path / "afqmc"  # the first real rows of each split (the datamodule would encode all of dev.json)
    rows.mkdir()
    for split in ("train.json", "dev.json"):
        with (data / split).open(encoding="utf-8") as f:
            (rows / split).write_text("".join(next(f) for _ in range(16)), encoding="utf-8")
    dm = SentencePairDataModule(str(rows), str(backbone), batch_size=8, max_length=64, max_train_samples=8)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    hf = transformers.DebertaV2ForSequenceClassification.from_pretrained(backbone).eval()
    ours, _ = load_hf(backbone)
    with torch.no_grad():
        err = float((hf(**inputs).logits - ours(inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                                token_type_ids=inputs["token_type_ids"])).abs().max())

    pl.seed_everything(1)
    task = ClassificationTask(str(backbone), dropout=0.0, optim=OptimConfig(lr=1e-2, scheduler="constant"))
    rec = LoggedLoss()
    pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
               callbacks=[rec], default_root_dir=str(tmp_path)).fit(task, dm)
    print(f"AFQMC (real rows, bert-base-chinese vocab): padded batch {tuple(batch['input_ids'].shape)}, max |logits - "
          f"transformers| {err:.2e}; train_loss per step on the same 8 rows {[round(x, 4) for x in rec.losses]}")
    assert err <= 1e-5 and int(inputs["attention_mask"].sum()) < inputs["attention_mask"].numel()  # padded rows
    assert rec.losses[-1] < rec.losses[0]


def test_sentencepiece_only_tokenizer_is_refused_by_name_without_sentencepiece(tmp_path: Path) -> None:
    """A DeBERTa-v3 directory as published (``spm.model`` and ``tokenizer_config.json``, no ``tokenizer.json``):
    transformers reads it only with the sentencepiece package; without it, one line naming the parameter and the fix
    (transformers' own error speaks of tiktoken)."""
    import importlib.util

    from lightning_llm.data.base import load_tokenizer

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed: transformers reads spm.model itself")
    (tmp_path / "spm.model").write_bytes(b"\x0a\x05\x0a\x01a\x15\x00\x00\x00\x00")  # a one-piece ModelProto
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "DebertaV2Tokenizer"}))
    with pytest.raises(ValueError) as err:
        load_tokenizer(str(tmp_path))
    print(err.value)
    assert str(err.value).startswith(f"--data.tokenizer_dir={tmp_path}: its tokenizer is a sentencepiece model "
                                     "(spm.model)") and "pip install sentencepiece" in str(err.value)
