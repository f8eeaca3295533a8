"""An export of a run on the built-in byte tokenizer carries it (issue 60): ``tokenizer.json`` +
``tokenizer_config.json`` that ``transformers.AutoTokenizer`` loads with the same ids as ``ByteTokenizer`` (non-ASCII
text, special tokens written in a text, a chat template's added tokens, sentence pairs), so ``lightning_llm eval``
scores the export as it scores the checkpoint, and ``byte`` is taken wherever a tokenizer directory is."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.cli import main as cli_main
from lightning_llm.data import ByteTokenizer
from lightning_llm.testing import table_trainer

TEXTS = ["Hello, world!", "蚂蚁借呗怎么还款？ naïve café", "a<eos>b <pad><bos>", "x<|im_start|>user\nhi<|im_end|>\n",
         "<0x41> \t\n  emoji 🙂 end", ""]


def _auto(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@pytest.mark.parametrize("added", [(), ("<|im_start|>", "<|im_end|>")], ids=["plain", "chatml"])
def test_auto_tokenizer_gives_the_byte_tokenizers_ids(tmp_path: Path, added: tuple[str, ...]) -> None:
    ours = ByteTokenizer(added)
    ours.save_pretrained(tmp_path, token_type_ids=True)
    theirs = _auto(tmp_path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == ids, text
        assert theirs.decode(ids, skip_special_tokens=False) == ours.decode(ids, skip_special_tokens=False)
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    # specials in a text: bytes for the plain tokenizer, their ids once a chat template added tokens (as here)
    assert (258 in ours.encode("a<eos>b")) == bool(added)
    pair = theirs("蚂蚁 a", "b<eos>")
    assert pair["input_ids"] == ours("蚂蚁 a", "b<eos>")["input_ids"]
    assert pair["token_type_ids"] == ours("蚂蚁 a", "b<eos>")["token_type_ids"]
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (257, 258, 256)
    assert len(theirs) == len(ours) and theirs.get_vocab() == ours.get_vocab()


def test_load_tokenizer_takes_byte() -> None:
    from lightning_llm.data import load_tokenizer

    assert isinstance(load_tokenizer("byte", param="--tokenizer"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match=r"--tokenizer=nowhere: directory not found \(or byte"):
        load_tokenizer("nowhere", param="--tokenizer")


def _fit_chat(out: Path) -> Path:
    """Two steps of chat SFT on the byte tokenizer with ChatML (it gains <|im_start|>, <|im_end|>)."""
    import lightning.pytorch as pl

    from lightning_llm.data import InstructionDataModule
    from lightning_llm.tasks import SFTTask

    pl.seed_everything(0)
    task = SFTTask("debug", model_overrides={"num_layers": 1}, dropout=0.0)
    dm = InstructionDataModule(tokenizer_dir="byte", template="chatml", generated_conversations=32, batch_size=4)
    trainer = table_trainer(out, strategy="auto", devices=1, max_steps=2, callbacks=[])
    trainer.fit(task, dm)
    trainer.save_checkpoint(out / "chat.ckpt")
    return out / "chat.ckpt"


def test_chat_export_carries_added_tokens_and_template(tmp_path: Path) -> None:
    ckpt = _fit_chat(tmp_path)
    assert cli_main(["export", str(ckpt), "--to", str(tmp_path / "hf")]) == 0
    theirs = _auto(tmp_path / "hf")
    ours = ByteTokenizer(("<|im_start|>", "<|im_end|>"), split_special_tokens=False)
    chat = [{"role": "user", "content": "你好 hello"}, {"role": "assistant", "content": "world"}]
    text = theirs.apply_chat_template(chat, tokenize=False)
    assert "<|im_start|>" in text
    assert theirs(text)["input_ids"] == ours.encode(text) and 259 in ours.encode(text)


def _write_task(out: Path) -> Path:
    tasks = out / "tasks"
    tasks.mkdir()
    rows = [{"text": "the cat sees a tree."}, {"text": "今天天气很好。"}]
    (tasks / "ppl.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    (tasks / "ppl_bytes.yaml").write_text(
        f"task: ppl_bytes\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'ppl.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n",
        encoding="utf-8")
    return tasks


def _eval(path: Path, tasks: Path, results: Path, *extra: str) -> list[float]:
    """``lightning_llm eval`` in this process (the environment put back: Lightning's one-process set-up leaves
    MASTER_ADDR & co.); the per-document log-likelihoods."""
    env = dict(os.environ)
    try:
        assert cli_main(["eval", str(path), "--tasks", "ppl_bytes", "--include_path", str(tasks), "--output_path",
                         str(results), "--log_samples", "--bootstrap_iters", "0", *extra]) == 0
    finally:
        os.environ.clear()
        os.environ.update(env)
    (f,) = results.rglob("samples_ppl_bytes_*.jsonl")
    rows = sorted(map(json.loads, f.read_text(encoding="utf-8").splitlines()), key=lambda r: r["doc_id"])
    return [float(r["resps"][0][0] if not isinstance(r["resps"][0][0], list) else r["resps"][0][0][0]) for r in rows]


@pytest.mark.multiprocess  # lm-eval's results gather the environment (pip list, compilers: processes)
def test_eval_scores_the_export_as_the_checkpoint(tmp_path: Path) -> None:
    """The README's path: a byte run exported, then ``lightning_llm eval`` on the export (its tokenizer files),
    with ``--tokenizer byte``, and on the checkpoint: the same log-likelihoods."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(1)
    task = CausalLMTask("debug", model_overrides={"num_layers": 1}, dropout=0.0)
    dm = TextDataModule(tokenizer_dir="byte", block_size=32, batch_size=4, cache_dir=str(tmp_path / "cache"),
                        generated_docs=50)
    trainer = table_trainer(tmp_path, strategy="auto", devices=1, max_steps=2, callbacks=[])
    trainer.fit(task, dm)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert cli_main(["export", str(tmp_path / "model.ckpt"), "--to", str(tmp_path / "hf")]) == 0
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    tasks = _write_task(tmp_path)
    on_export = _eval(tmp_path / "hf", tasks, tmp_path / "r-hf")
    with_byte = _eval(tmp_path / "hf", tasks, tmp_path / "r-byte", "--tokenizer", "byte")
    on_ckpt = _eval(tmp_path / "model.ckpt", tasks, tmp_path / "r-ckpt")
    print(f"log-likelihoods: export {on_export}, --tokenizer byte {with_byte}, checkpoint {on_ckpt}")
    assert on_export == pytest.approx(on_ckpt, abs=1e-4) and with_byte == pytest.approx(on_ckpt, abs=1e-4)
    assert all(ll < -1 for ll in on_ckpt)  # real scores of whole texts


@pytest.mark.parametrize("backbone", ["debug-qwen2", "debug-gemma2"])
def test_byte_run_exports_whatever_autotokenizer_makes_of_the_copy(tmp_path: Path, backbone: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Issue 64: beside a ``qwen2`` config.json transformers 5.24 loads any tokenizer files as ``Qwen2Tokenizer``,
    which encodes the byte tokenizer's files otherwise: the export of the good weights succeeds without them, one
    warning saying why (it failed whole before). Beside a Gemma config the copy loads as the run's tokenizer and is
    written."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(0)
    task = CausalLMTask(backbone, dropout=0.0)
    dm = TextDataModule(tokenizer_dir="byte", block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"),
                        generated_docs=20)
    trainer = table_trainer(tmp_path, strategy="auto", devices=1, max_steps=1, callbacks=[])
    trainer.fit(task, dm)
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    assert cli_main(["export", str(tmp_path / "model.ckpt"), "--to", str(tmp_path / "hf")]) == 0
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    if backbone == "debug-qwen2":
        assert not names & {"tokenizer.json", "tokenizer_config.json"}
        (line,) = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
        assert "the byte tokenizer not written" in line and "Qwen2Tokenizer" in line and "\n" not in line
    else:
        ours = ByteTokenizer()
        assert all(_auto(tmp_path / "hf")(t)["input_ids"] == ours.encode(t) for t in TEXTS)
