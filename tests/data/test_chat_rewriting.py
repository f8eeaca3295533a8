"""Templates that rewrite earlier turns (Qwen3, DeepSeek-R1) or inject a system message (Qwen2.5), written out in
``tests/rewriting_templates.py`` and set on tokenizers built here: every row is ``apply_chat_template`` of the whole
conversation and the learned tokens are exactly what transformers' ``return_assistant_tokens_mask`` marks under a
``{% generation %}`` variant of the same template, for every reply, unpacked, packed, cut to ``cutoff_len``, in DPO
pairs; rollout prompts are the template's generation prompt. Where both methods apply (prefix-stable templates),
locating a reply in the whole rendering gives the prefix path's span."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.chat_fixtures import FAMILIES, build_tokenizer, conversation, write_jsonl
from tests.rewriting_templates import REWRITING, reasoning_conversation, tool_conversation

from lightning_llm.data import DataError, InstructionDataModule, PreferenceDataModule, PromptDataModule
from lightning_llm.data.chat.messages import Conversation
from lightning_llm.data.chat.spans import TurnLocator


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {family: build_tokenizer(root / family, family, spec=spec) for family, spec in REWRITING.items()}


def _records(family: str) -> list[dict[str, Any]]:
    """With a system message, without one (Qwen2.5 injects its own), and with tools (not DeepSeek-R1's: its template
    concatenates arguments as strings)."""
    out = [{"messages": reasoning_conversation()}, {"messages": reasoning_conversation()[1:]}, _angled()]
    return out if family == "deepseek_r1" else [*out, tool_conversation()]


def _angled() -> dict[str, Any]:
    """Replies whose answers start with "<" (markup, an emoticon): DeepSeek-R1's generation prompt ends with
    "<think>\\n", which such a history turn shares its first characters with; they are the reply's, not its header's."""
    msgs = reasoning_conversation()
    msgs[2] = {"role": "assistant", "content": "<think>\nPolite.\n</think>\n\n<thank you> I am fine."}
    msgs[4] = {"role": "assistant", "content": "<b>I love</b> natural language processing."}
    # and one that is the header's own word (Qwen's "<|im_start|>assistant\n"): it must not start inside the header
    msgs[6] = {"role": "assistant", "content": "<think>\nEcho.\n</think>\n\nassistant"}
    return {"messages": msgs}


def _reference(hf: Any, family: str, rec: dict[str, Any]) -> tuple[list[int], list[list[int]]]:
    """(ids, the learned positions of each reply) by transformers under the {% generation %} variant."""
    gen = REWRITING[family]["generation"]
    msgs, tools = rec["messages"], rec.get("tools")
    assert hf.apply_chat_template(msgs, tools=tools, tokenize=False) == hf.apply_chat_template(
        msgs, tools=tools, tokenize=False, chat_template=gen)  # the variant renders the same text
    ref = hf.apply_chat_template(msgs, tools=tools, chat_template=gen, return_assistant_tokens_mask=True,
                                 return_dict=True)
    runs: list[list[int]] = []
    for t, m in enumerate(ref["assistant_masks"]):
        if m and (not runs or runs[-1][-1] != t - 1):
            runs.append([])
        if m:
            runs[-1].append(t)
    assert len(runs) == sum(m["role"] == "assistant" for m in msgs)
    return ref["input_ids"], runs


def _learned(row: dict[str, Any]) -> list[int]:
    return [t + 1 for t, label in enumerate(row["labels"]) if label != -100]


def _prefix_stable(dm: Any, rec: dict[str, Any]) -> bool:
    """Whether the prefix path alone would locate every reply of ``rec`` (before this, anything else was refused)."""
    conv = Conversation(rec["messages"], rec.get("tools"), "rec")
    text = dm.chat.render(conv.messages, conv.tools)
    ids = dm.chat.tokenize(text)
    return all(dm.chat._prefix_span(conv, i, text, ids) is not None
               for i, m in enumerate(conv.messages) if m["role"] == "assistant")


@pytest.mark.parametrize("family", list(REWRITING))
def test_every_reply_is_learned_as_the_whole_conversation_renders_it(family: str, tokenizers: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers[family]))
    recs = _records(family)
    data = write_jsonl(tmp_path / "chat.jsonl", recs)
    dm = InstructionDataModule(str(data), str(tokenizers[family]), cutoff_len=1024)
    dm.setup("fit")
    last = InstructionDataModule(str(data), str(tokenizers[family]), cutoff_len=1024, assistant_turns="last")
    last.setup("fit")
    packed = InstructionDataModule(str(data), str(tokenizers[family]), cutoff_len=1024, packing=True)
    packed.setup("fit")
    eot = hf.convert_tokens_to_ids(REWRITING[family]["end_of_turn"])
    examples = []
    for k, rec in enumerate(recs):
        ids, runs = _reference(hf, family, rec)
        row = dm.datasets["fit"][k]
        assert row["input_ids"] == hf.apply_chat_template(rec["messages"], tools=rec.get("tools"))["input_ids"] == ids
        assert _learned(row) == [t for run in runs for t in run]
        assert all(ids[run[-1]] == eot for run in runs)  # every reply learns its end-of-turn token
        assert _learned(last.datasets["fit"][k]) == runs[-1]
        examples.append((row["input_ids"], row["labels"]))
        print(f"{family} record {k + 1}: {len(ids)} tokens, {len(runs)} replies, {len(_learned(row))} learned, "
              f"prefix-stable: {_prefix_stable(dm, rec)}")
    assert family == "qwen25" or not any(_prefix_stable(dm, rec) for rec in recs)  # the new path is what runs
    # Packed: each segment is one example's ids and labels.
    segments = []
    for row in packed.datasets["fit"]:
        for seg in sorted(set(row["segment_ids"])):
            at = [t for t, s in enumerate(row["segment_ids"]) if s == seg]
            assert [row["position_ids"][t] for t in at] == list(range(len(at)))
            segments.append(([row["input_ids"][t] for t in at], [row["labels"][t] for t in at]))
    assert sorted(segments) == sorted(examples)


@pytest.mark.parametrize("family", ["qwen3", "deepseek_r1"])
def test_cut_rows_keep_whole_replies_as_rendered(family: str, tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """cutoff_len between the first and second reply: the row is the whole conversation's tokens up to the end of the
    first reply, as the whole conversation renders it (Qwen3: without the think block it has when last)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers[family]))
    rec = {"messages": reasoning_conversation()}
    ids, runs = _reference(hf, family, rec)
    dm = InstructionDataModule(str(write_jsonl(tmp_path / "c.jsonl", [rec])), str(tokenizers[family]),
                               cutoff_len=runs[0][-1] + 5)
    dm.setup("fit")
    row = dm.datasets["fit"][0]
    assert row["input_ids"] == ids[: runs[0][-1] + 1] and _learned(row) == runs[0]
    assert "<think>" not in hf.decode([ids[t] for t in runs[0]])


@pytest.mark.parametrize("family", list(REWRITING))
def test_preference_pairs_and_rollout_prompts(family: str, tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """DPO: prompt (with history whose replies carry reasoning) + chosen / rejected: the row is the whole pair
    conversation's tokens through the reply's end-of-turn token, learning what the reference marks for the reply.
    Rollouts: the prompt is apply_chat_template's with the generation prompt (DeepSeek-R1's ends with <think>\\n)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers[family]))
    msgs = reasoning_conversation()
    prompt = msgs[:-1]
    chosen, rejected = msgs[-1], {"role": "assistant", "content": "<think>\nNo.\n</think>\n\nNo idea."}
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}])
    dm = PreferenceDataModule(str(data), str(tokenizers[family]), cutoff_len=1024, max_prompt_len=512,
                              generated_val_pairs=0)
    dm.setup("fit")
    pair = dm.split_dataset("fit")[0]
    for key, reply in (("chosen", chosen), ("rejected", rejected)):
        ids, runs = _reference(hf, family, {"messages": [*prompt, reply]})
        got, labels = pair[key]
        assert got == ids[: runs[-1][-1] + 1] and [t + 1 for t, x in enumerate(labels) if x != -100] == runs[-1]
    rollouts = PromptDataModule(str(data), str(tokenizers[family]), max_prompt_len=512)
    rollouts.setup("fit")
    gen = hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rollouts.datasets["fit"][0]["input_ids"] == hf.apply_chat_template(prompt, add_generation_prompt=True)[
        "input_ids"]
    assert gen.endswith("<｜Assistant｜><think>\n" if family == "deepseek_r1" else "<|im_start|>assistant\n")
    eot = hf.convert_tokens_to_ids(REWRITING[family]["end_of_turn"])
    assert rollouts.stop_token_ids == list(dict.fromkeys([eot, hf.eos_token_id]))


def test_locating_agrees_with_the_prefix_path_where_both_apply(tmp_path: Path) -> None:
    """On prefix-stable templates (the tokenizers' own Qwen2, Llama-3, Baichuan2, Qwen2.5; the named templates on the
    byte tokenizer) a reply located in the whole rendering has the span the prefix path gives, for every reply."""
    encoders = [(family, InstructionDataModule(tokenizer_dir=str(build_tokenizer(tmp_path / family, family, spec=spec))))
                for family, spec in [*FAMILIES.items(), ("qwen25", REWRITING["qwen25"])]]
    encoders += [(name, InstructionDataModule(template=name))
                 for name in ("chatml", "llama3", "llama2", "mistral", "baichuan2", "alpaca", "plain")]
    checked = 0
    for name, dm in encoders:
        for msgs in (conversation(), conversation()[1:], reasoning_conversation()):
            if name == "mistral" and msgs[0]["role"] == "system":
                continue
            text = dm.chat.render(msgs)
            ids = dm.chat.tokenize(text)
            conv = Conversation(msgs, None, "rec")
            locator = TurnLocator(msgs, text, ids, render=dm.chat.render, tokenize=dm.chat.tokenize,
                                  stop_texts=dm.chat._stop_texts(), template=name, where="rec")
            for i in (i for i, m in enumerate(msgs) if m["role"] == "assistant"):
                assert locator.span(i) == dm.chat._prefix_span(conv, i, text, ids), (name, i)
                checked += 1
    assert checked == (len(encoders) * 3 - 2) * 3


def test_a_located_reply_holding_the_end_of_turn_token_is_refused(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    msgs = reasoning_conversation()
    msgs[2] = {"role": "assistant", "content": "I am fine<|im_end|> thank you."}
    data = write_jsonl(tmp_path / "bad.jsonl", [{"messages": msgs}])
    with pytest.raises(DataError, match=rf"^{data}:1: assistant message 3 holds the end-of-turn token '<\|im_end\|>'"):
        InstructionDataModule(str(data), str(tokenizers["qwen3"])).setup("fit")


def test_generation_blocks_locate_replies_where_nothing_else_can(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """A template with {% generation %} blocks is located by them: Qwen3's tagged variant as the tokenizer's template
    gives Qwen3's rows; a rewriting template that also reads inside the user's text (reversed) is refused without
    blocks and learns what the blocks mark with them."""
    from transformers import AutoTokenizer

    tagged = build_tokenizer(tmp_path / "tagged", "qwen3", chat_template=REWRITING["qwen3"]["generation"],
                             spec=REWRITING["qwen3"])
    recs = _records("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", recs)
    rows = []
    for tok in (tagged, tokenizers["qwen3"]):
        dm = InstructionDataModule(str(data), str(tok), cutoff_len=1024)
        dm.setup("fit")
        rows.append(list(dm.datasets["fit"]))
    assert rows[0] == rows[1]
    hf = AutoTokenizer.from_pretrained(str(tokenizers["qwen3"]))
    blocks = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
              "{% generation %}{% if not loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}"
              "{{ m['content'] }}{% endif %}{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
              "{{ m['content'][::-1] + '<|im_end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<|im_start|>assistant\n' }}{% endif %}")
    plain = blocks.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>t</think>b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>u</think>d"}]
    think = write_jsonl(tmp_path / "think.jsonl", [{"messages": msgs}])
    dm = InstructionDataModule(str(think), str(tokenizers["qwen3"]), template=blocks)
    dm.setup("fit")
    ref = hf.apply_chat_template(msgs, chat_template=blocks, return_assistant_tokens_mask=True, return_dict=True)
    assert dm.datasets["fit"][0]["input_ids"] == ref["input_ids"]
    assert _learned(dm.datasets["fit"][0]) == [t for t, m in enumerate(ref["assistant_masks"]) if m]
    with pytest.raises(DataError, match=rf"^{think}:1: .* not prefix-stable at message 2 .* cannot be located"):
        InstructionDataModule(str(think), str(tokenizers["qwen3"]), template=plain).setup("fit")


def test_a_template_failing_on_a_record_names_file_and_line(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """DeepSeek-R1's template concatenates tool-call arguments as strings: arguments given as an object are refused
    with the record's file and line, not a traceback from inside Jinja."""
    data = write_jsonl(tmp_path / "tools.jsonl", [tool_conversation()])
    with pytest.raises(DataError, match=rf"^{data}:1: the chat template \(tokenizer\) cannot render this conversation: "
                                        "can only concatenate str"):
        InstructionDataModule(str(data), str(tokenizers["deepseek_r1"])).setup("fit")


def test_a_located_tool_call_holding_the_end_of_turn_token_is_refused(tokenizers: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """The end-of-turn text inside a tool call's arguments would end the located turn there: a cut call would be
    learned without a word (it was, before the check covered every string of the message)."""
    record = tool_conversation()
    record["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris<|im_end|>x"}
    data = write_jsonl(tmp_path / "bad_tool.jsonl", [record])
    with pytest.raises(DataError, match=rf"^{data}:1: assistant message 2 holds the end-of-turn token '<\|im_end\|>'"):
        InstructionDataModule(str(data), str(tokenizers["qwen3"])).setup("fit")


def test_a_type_error_outside_the_template_is_not_blamed_on_the_record(tokenizers: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """Only a TypeError raised while the template runs is the record's; one of our own call (a library's changed
    signature) propagates as itself."""
    dm = InstructionDataModule(str(write_jsonl(tmp_path / "plain.jsonl", [{"messages": reasoning_conversation()}])),
                               str(tokenizers["deepseek_r1"]))
    dm.setup("fit")

    def wrong_call(*args: Any, **kwargs: Any) -> str:
        raise TypeError("apply_chat_template() got an unexpected keyword argument")

    dm.chat.tokenizer.apply_chat_template = wrong_call
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        dm.chat.render(reasoning_conversation(), where="x")
