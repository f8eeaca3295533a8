"""Chat records whose ``content`` is a list of OpenAI content parts (``[{"type": "text", "text": ...}]``): a template
that takes strings gets each message's text parts joined by a newline, so such a file trains to exactly the rows and
labels of the same conversations written with string contents (SFT, DPO, RL prompts, shortened ones included); a
template that renders parts itself gets them as transformers hands them over (the rows are its
``apply_chat_template``'s); a part that is not text is refused in one line naming the file, line and type."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from tests.chat_fixtures import build_tokenizer, conversation, write_jsonl

from lightning_llm.cli import main
from lightning_llm.data import DataError, InstructionDataModule, PreferenceDataModule, PromptDataModule
from lightning_llm.data.chat.messages import PART_SEPARATOR, message_text

# A template that renders text parts itself, trimming each (as Gemma 3's does), written for this test; and the same
# with transformers' {% generation %} markers around what a reply generates.
_TEXT = ("{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}{% for part in "
         "message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}{% endfor %}"
         "{% endif %}")
_PROMPT = "{% if add_generation_prompt %}{{ '<turn>assistant\n' }}{% endif %}"
PARTS_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<turn>' + message['role'] + '\n' }}" + _TEXT
                  + "{{ '<end_turn>\n' }}{% endfor %}" + _PROMPT)
PARTS_GENERATION = ("{{ bos_token }}{% for message in messages %}{{ '<turn>' + message['role'] + '\n' }}{% if "
                    "message['role'] == 'assistant' %}{% generation %}" + _TEXT
                    + "{{ '<end_turn>' }}{% endgeneration %}{{ '\n' }}{% else %}" + _TEXT
                    + "{{ '<end_turn>\n' }}{% endif %}{% endfor %}" + _PROMPT)
PARTS_SPEC = {"kind": "bytelevel", "specials": ["<bos>", "<eos>", "<pad>", "<turn>", "<end_turn>"], "eos": "<eos>",
              "pad": "<pad>", "bos": "<bos>", "template": PARTS_TEMPLATE}


def _split(text: str) -> list[dict[str, str]]:
    """A message's text as content parts: cut at its first space, the second part keeping its spaces."""
    head, sep, tail = text.partition(" ")
    return [{"type": "text", "text": head}, *([{"type": "text", "text": sep + tail}] if sep else [])]


def _as_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**m, "content": _split(m["content"])} for m in messages]


def _as_strings(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a template that takes strings is given for :func:`_as_parts`: the parts joined by a newline."""
    return [{**m, "content": PART_SEPARATOR.join(p["text"] for p in _split(m["content"]))} for m in messages]


def _rows(dataset: Any) -> list[dict[str, Any]]:
    """The dataset's rows; an RL prompt's fitted ``conversation`` (what a decoder reward model renders with its own
    template, parts as it takes them) as each message's role and text; a preference row's ``where`` by its
    line."""
    rows = [dict(dataset[i]) for i in range(len(dataset))]
    for row in rows:
        if "where" in row:  # the record's file and line (files of parts and of strings differ by name only)
            row["where"] = row["where"].rsplit(":", 1)[-1]
        if "conversation" in row:
            row["conversation"] = [(m["role"], message_text(m)) for m in row["conversation"].messages]
    return rows


@pytest.mark.parametrize("tokenizer", ["qwen2", "byte"])
def test_content_parts_train_to_the_rows_of_string_contents(tokenizer: str, tmp_path: Path) -> None:
    """SFT (every turn learned; the last turn only; conversations shortened to cutoff_len and prompts to
    max_prompt_len), DPO and RL prompts: a file of text parts gives exactly the rows, labels, prompts and reference
    texts of the same conversations with each message's parts joined by a newline, on Qwen2's template (a tokenizer
    directory) and on the named chatml (byte tokenizer)."""
    tok = str(build_tokenizer(tmp_path / "tok", "qwen2")) if tokenizer == "qwen2" else "byte"
    kw: dict[str, Any] = {"template": "chatml"} if tokenizer == "byte" else {}
    # Token limits that shorten rows and prompts (the conversation is 210 Qwen2 tokens, 351 bytes; its system
    # message 39 / 65): (SFT cutoff_len, max_prompt_len), (DPO cutoff_len, max_prompt_len), RL max_prompt_len.
    sft_len, dpo_len, rl_len = ((100, 80), (200, 150), 52) if tokenizer == "qwen2" else ((170, 135), (330, 250), 100)
    msgs = conversation()
    files = {}
    for name, form in (("parts", _as_parts), ("strings", _as_strings)):
        convs = [form(msgs), form(msgs[:3]), form(msgs[:5])]
        pairs = [{"prompt": form(msgs[:-1]), "chosen": form(msgs[-1:]), "rejected": form([{
            "role": "assistant", "content": "No idea, sorry."}])}]
        files[name] = (write_jsonl(tmp_path / f"sft_{name}.jsonl", [{"messages": c} for c in convs]),
                       write_jsonl(tmp_path / f"dpo_{name}.jsonl", pairs),
                       write_jsonl(tmp_path / f"rl_{name}.jsonl", [{"prompt": c[:-1]} for c in convs]))
    seen: dict[str, list[Any]] = {}
    for name, (sft, dpo, rl) in files.items():
        got = []
        for turns, cutoff, prompt_len in (("all", 1024, None), ("last", 1024, None), ("all", *sft_len)):
            dm = InstructionDataModule(str(sft), tok, val_path=str(sft), test_path=str(sft), assistant_turns=turns,
                                       cutoff_len=cutoff, max_prompt_len=prompt_len, **kw)
            dm.setup("fit")
            dm.setup("test")
            got += [_rows(dm.datasets[split]) for split in ("fit", "validate", "test")]
        pref = PreferenceDataModule(str(dpo), tok, cutoff_len=dpo_len[0], max_prompt_len=dpo_len[1],
                                    generated_val_pairs=0, **kw)
        pref.setup("fit")
        prompts = PromptDataModule(str(rl), tok, max_prompt_len=rl_len, **kw)
        prompts.setup("fit")
        seen[name] = [*got, _rows(pref.split_dataset("fit")), _rows(prompts.datasets["fit"])]
        assert not dm.chat.takes_parts
    assert seen["parts"] == seen["strings"]
    shortened = seen["parts"][6]  # the short cutoff_len: rows shortened, the last user message's parts cut
    assert max(len(r["input_ids"]) for r in shortened) <= sft_len[0] and seen["parts"][7][0]["label"] == \
        PART_SEPARATOR.join(p["text"] for p in _split(msgs[-1]["content"]))
    assert seen["parts"][-1][1]["prompt"] == "Hello\n there! How are you today?"  # a reward reads the joined text


# Parts rendered for the user only: the assistant's content is printed as it is (a list would print as its repr).
USER_PARTS_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<turn>' + message['role'] + '\n' }}{% if "
                       "message['role'] == 'user' %}" + _TEXT + "{% else %}{{ message['content'] }}{% endif %}"
                       "{{ '<end_turn>\n' }}{% endfor %}" + _PROMPT)


def test_a_template_rendering_parts_for_some_roles_gets_them_there_only(tmp_path: Path) -> None:
    """A template that loops over the user's parts but prints the assistant's content as a string: the user's
    messages are given as parts, the assistant's joined into a string, so the learned reply is its text (not the
    list's repr): the rows equal those of the conversation given that way, and no part structure is rendered."""
    from transformers import AutoTokenizer

    tok = build_tokenizer(tmp_path / "tok", "user-parts", spec={**PARTS_SPEC, "template": USER_PARTS_TEMPLATE})
    hf = AutoTokenizer.from_pretrained(str(tok))
    msgs = _as_parts(conversation())
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    dm = InstructionDataModule(str(data), str(tok), cutoff_len=512)
    dm.setup("fit")
    row = dm.datasets["fit"][0]
    assert dm.chat.takes_parts == {"user"}
    given = [m if m["role"] == "user" else {**m, "content": PART_SEPARATOR.join(p["text"] for p in m["content"])}
             for m in msgs]
    assert row["input_ids"] == hf.apply_chat_template(given)["input_ids"]
    learned = hf.decode([t for t in row["labels"] if t != -100])
    assert "'type'" not in hf.decode(row["input_ids"]) and PART_SEPARATOR.join(
        p["text"] for p in msgs[-1]["content"]) in learned


def test_a_template_that_renders_parts_gets_them(tmp_path: Path) -> None:
    """A template that renders text parts itself (each trimmed, as Gemma 3's) is given the parts: the row's ids are
    transformers' apply_chat_template of the parts, the learned tokens what its return_assistant_tokens_mask marks,
    the generation prompt its add_generation_prompt rendering; not the newline-joined text."""
    from transformers import AutoTokenizer

    tok = build_tokenizer(tmp_path / "tok", "parts", spec=PARTS_SPEC)
    hf = AutoTokenizer.from_pretrained(str(tok))
    msgs = _as_parts(conversation())
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    dm = InstructionDataModule(str(data), str(tok), val_path=str(data), cutoff_len=512)
    dm.setup("fit")
    row, val = dm.datasets["fit"][0], dm.datasets["validate"][0]
    ref = hf.apply_chat_template(msgs, chat_template=PARTS_GENERATION, return_assistant_tokens_mask=True)
    assert hf.apply_chat_template(msgs, tokenize=False) == hf.apply_chat_template(
        msgs, tokenize=False, chat_template=PARTS_GENERATION)
    assert dm.chat.takes_parts and row["input_ids"] == hf.apply_chat_template(msgs)["input_ids"]
    assert [t + 1 for t, x in enumerate(row["labels"]) if x != -100] == [
        t for t, m in enumerate(ref["assistant_masks"]) if m]
    assert val["prompt_ids"] == hf.apply_chat_template(msgs[:-1], add_generation_prompt=True)["input_ids"]
    assert "<turn>user\nHellothere!" in val["prompt"]  # each part trimmed by the template, not joined by a newline


@pytest.mark.parametrize(("part", "kind"), [({"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                                              "has type 'image_url'"),
                                             ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                              "has type 'input_audio'"),
                                             ({"text": "no type"}, 'is not {"type": "text", "text": str}')])
def test_a_part_that_is_not_text_is_refused_naming_file_line_and_type(part: dict[str, Any], kind: str,
                                                                     tmp_path: Path, capsys) -> None:
    """SFT from the command line: exit 2, one line naming the file, the line and the part's type, before training;
    DPO and RL prompts refuse the same record the same way."""
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
                        {"role": "assistant", "content": "A cat."}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [ok, bad])
    want = f"{data}:2: message 1 'content' part 2 {kind}: only text parts can be trained on"
    config = Path(__file__).resolve().parents[2] / "configs" / "sft_chat.yaml"
    rc = main(["fit", "--config", str(config), f"--data.train_path={data}", "--trainer.logger=false",
               f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "training" not in err.lower()
    assert [ln for ln in err.splitlines() if "error" in ln] == [
        f"lightning_llm: error: {want} (a text model takes no images or audio)"]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": bad["messages"][:1], "chosen": "x", "rejected": "y"}])
    with pytest.raises(DataError, match=f"^{re.escape(str(pairs))}:1: message 1 'content' part 2 {re.escape(kind)}"):
        PreferenceDataModule(str(pairs), template="chatml").setup("fit")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": bad["messages"][:1]}])
    with pytest.raises(DataError, match=f"^{re.escape(str(prompts))}:1: message 1 'content' part 2 {re.escape(kind)}"):
        PromptDataModule(str(prompts), template="chatml").setup("fit")


@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_a_run_refused_for_its_data_leaves_no_run_directory(logger: str, tmp_path: Path, capsys) -> None:
    """Lightning makes ``runs/NAME/version_N`` before the datamodule reads the data: the refused run removes what it
    made (an empty CSV directory, TensorBoard's header-only event file), and leaves an earlier run's directory."""
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                        {"role": "assistant", "content": "A cat."}]}
    data = write_jsonl(tmp_path / "chat.jsonl", [bad])
    config = Path(__file__).resolve().parents[2] / "configs" / "sft_chat.yaml"
    flags = {"csv": [f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}"],
             "tensorboard": ["--trainer.logger=true", f"--trainer.default_root_dir={tmp_path / 'runs'}"]}[logger]
    earlier = tmp_path / "runs" / "earlier"
    earlier.mkdir(parents=True)
    for _ in range(2):
        assert main(["fit", "--config", str(config), f"--data.train_path={data}", *flags]) == 2
        assert "has type 'image_url'" in capsys.readouterr().err
    assert [p.relative_to(tmp_path).as_posix() for p in sorted((tmp_path / "runs").rglob("*"))] == ["runs/earlier"]
