"""The tokenizer a run trains with and vocabulary extension (``lightning_llm.vocab``).

* An HF backbone directory's own tokenizer is the command line's default: the token stream a ``fit`` caches is the
  tokenizer's encoding of the corpus (ids above the byte tokenizer's 258); a backbone without tokenizer files and no
  ``--data.tokenizer_dir`` is refused naming both parameters; ``--data.tokenizer_dir=byte`` opts in to byte ids; a
  task built in Python refuses the byte tokenizer it fell back to.
* ``--model.resize_embeddings``: a tokenizer larger than the checkpoint is refused naming the flag; with it the new
  rows are drawn as transformers' ``resize_token_embeddings(mean_resizing=True)`` draws them (statistics compared
  with transformers' own sample), seed-deterministic, tied and untied.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_llm.cli import main  # noqa: E402
from lightning_llm.data.text import generated_corpus  # noqa: E402
from lightning_llm.data.corpus.token_store import TokenStore  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
FILLER = 300  # tokens before the corpus words: the words' ids lie above the byte tokenizer's 0-258


def corpus_words(docs: int = 40) -> list[str]:
    return sorted({w for d in generated_corpus(docs) for w in d.replace(".", " .").split()})


def write_tokenizer(directory: Path, words: list[str], *, filler: int = FILLER) -> int:
    """A word-level ``PreTrainedTokenizerFast`` saved by transformers (``tokenizer.json`` + config); returns its size.
    Words it lacks encode as ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"filler{i}" for i in range(filler)] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(directory))
    return len(vocab)


def write_llama(directory: Path, vocab: int, *, tie: bool = False, seed: int = 0) -> Path:
    """A tiny random ``LlamaForCausalLM`` saved by transformers."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                   pad_token_id=3, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(directory))
    return directory


def fit_args(tmp: Path, backbone: Path, *extra: str, data: tuple[str, ...] = ()) -> list[str]:
    return ["fit", "--model=lightning_llm.tasks.CausalLMTask", f"--model.backbone={backbone}", *extra,
            "--data=lightning_llm.data.TextDataModule", *data, "--data.generated_docs=40", "--data.block_size=16",
            "--data.batch_size=4", f"--data.cache_dir={tmp / 'cache'}", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.max_steps=1", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp / 'run'}"]


def _prepared_tokens(cache: Path) -> np.ndarray:
    """The token stream of the one corpus prepared under ``cache``."""
    (store,) = [TokenStore.open(p) for p in cache.iterdir() if p.is_dir()]
    return np.asarray(store.tokens)


# ------------------------------------------------------------------------------------------------ tokenizer default


def test_backbone_tokenizer_is_the_default(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = tmp_path / "hf"
    n = write_tokenizer(hf, corpus_words())
    write_llama(hf, n)
    with caplog.at_level(logging.INFO, logger="lightning_llm"):
        assert main(fit_args(tmp_path, hf)) == 0
    assert "using the tokenizer of --model.backbone" in caplog.text
    stream = _prepared_tokens(tmp_path / "cache")
    tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    want = [i for d in generated_corpus(40) for i in [*tok(d, add_special_tokens=False)["input_ids"],
                                                       tok.eos_token_id]]
    assert stream.tolist() == want and int(stream.max()) > 258 and tok.unk_token_id not in want


def test_backbone_without_tokenizer_is_refused_and_byte_is_opt_in(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bare = write_llama(tmp_path / "bare", 264)
    assert main(fit_args(tmp_path, bare)) == 2
    err = capsys.readouterr().err
    assert "--model.backbone" in err and "--data.tokenizer_dir" in err and "byte" in err
    assert main(fit_args(tmp_path, bare, data=("--data.tokenizer_dir=byte",))) == 0
    assert int(_prepared_tokens(tmp_path / "cache").max()) <= 258


def test_python_api_refuses_an_implicit_byte_tokenizer(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    bare = write_llama(tmp_path / "bare", 264)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0)
    dm = TextDataModule(generated_docs=10, block_size=16, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"--data.tokenizer_dir=byte"):
        trainer.fit(CausalLMTask(str(bare)), dm)


# ------------------------------------------------------------------------------------------------ resizing


def test_larger_tokenizer_is_refused_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    words = corpus_words()
    base = tmp_path / "base"
    write_llama(base, write_tokenizer(base, words[:10]))
    write_tokenizer(tmp_path / "ext", words)
    assert main(fit_args(tmp_path, base, data=(f"--data.tokenizer_dir={tmp_path / 'ext'}",))) == 2
    assert "--model.resize_embeddings=true" in capsys.readouterr().err
    # with PEFT the new rows must train
    lora = ("--model.resize_embeddings=true", "--model.lora.r=2")
    assert main(fit_args(tmp_path, base, *lora, data=(f"--data.tokenizer_dir={tmp_path / 'ext'}",))) == 2
    assert "modules_to_save" in capsys.readouterr().err


def _stats(old: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """(max |mean(new) - mean(old)| / std(old), max |cov(new) - 1e-9 cov(old)| / max |1e-9 cov(old)|)."""
    from lightning_llm.vocab import MEAN_RESIZING_EPS

    old, new = old.double(), new.double()
    want_cov = MEAN_RESIZING_EPS * torch.cov(old.T, correction=0)
    mean_err = ((new.mean(0) - old.mean(0)).abs().max() / old.std()).item()
    cov_err = ((torch.cov(new.T, correction=0) - want_cov).abs().max() / want_cov.abs().max()).item()
    return mean_err, cov_err


@pytest.mark.parametrize("tie", [False, True])
def test_resized_rows_match_transformers_mean_resizing(tie: bool, tmp_path: Path) -> None:
    from lightning_llm.models import load_hf
    from lightning_llm.vocab import resize_embeddings

    old_vocab, new_vocab = 512, 4608  # 4096 new rows of H=32: enough samples to estimate a covariance
    src = write_llama(tmp_path / "hf", old_vocab, tie=tie)
    ours, _ = load_hf(src)
    ours.init_seed = 1234
    assert resize_embeddings(ours, new_vocab) == new_vocab - old_vocab
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(src))
    theirs.resize_token_embeddings(new_vocab, mean_resizing=True)
    assert ours.config.vocab_size == new_vocab and ours(torch.tensor([[new_vocab - 1]])).shape[-1] == new_vocab
    pairs = {"embed_tokens": (ours.embed_tokens.weight, theirs.model.embed_tokens.weight),
             "lm_head": (ours.lm_head.weight, theirs.lm_head.weight)}
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tie
    for name, (a, b) in pairs.items():
        assert torch.equal(a[:old_vocab], b[:old_vocab])  # old rows kept
        ours_err = _stats(a[:old_vocab], a[old_vocab:])
        ref_err = _stats(b[:old_vocab], b[old_vocab:])
        print(f"tie={tie} {name}: ours mean err {ours_err[0]:.2e} cov err {ours_err[1]:.3f} | transformers mean err "
              f"{ref_err[0]:.2e} cov err {ref_err[1]:.3f}")
        assert ours_err[0] < 1e-4 and ours_err[1] < max(0.2, 2 * ref_err[1])

    again, _ = load_hf(src)
    again.init_seed = 1234
    resize_embeddings(again, new_vocab)
    assert torch.equal(again.embed_tokens.weight, ours.embed_tokens.weight)  # seed-deterministic
    assert torch.equal(again.lm_head.weight, ours.lm_head.weight)
