"""Conversations and chat templates: rendering and token ids equal transformers' ``apply_chat_template`` for tokenizers
built here with real templates (Qwen2 ChatML, Llama-3, Baichuan2), the learned tokens equal the assistant spans
transformers marks with a ``{% generation %}`` template, the input formats (OpenAI, ShareGPT, alpaca with history)
give the same rows, and what cannot be rendered right is refused naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_fixtures import BAICHUAN2_VLLM, FAMILIES, build_tokenizer, conversation

from lightning_llm.data import DataError, InstructionDataModule, PreferenceDataModule, PromptDataModule
from lightning_llm.data.chat import ChatColumns
from lightning_llm.data.chat_template import NAMED_TEMPLATES
from lightning_llm.generation import GenerationConfig, for_datamodule


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {family: build_tokenizer(root / family, family) for family in FAMILIES}


def _learned(row: dict[str, Any]) -> list[int]:
    """Positions of the tokens a row learns (pre-shifted labels: label t is token t + 1)."""
    return [t + 1 for t, label in enumerate(row["labels"]) if label != -100]


# ------------------------------------------------------------------------------------------------ parity with HF
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rendering_ids_and_learned_tokens_equal_transformers(family: str, tokenizers: dict[str, Path],
                                                             tmp_path: Path) -> None:
    """A multi-turn conversation with a system message, through InstructionDataModule on the tokenizer's own template:
    its ids are apply_chat_template's, the learned positions are exactly return_assistant_tokens_mask's under the
    same template with {% generation %} around each reply, and the generation prompt is apply_chat_template's with
    add_generation_prompt=True."""
    from transformers import AutoTokenizer

    msgs = conversation()
    data = _write(tmp_path / "chat.jsonl", [{"messages": msgs}])
    dm = InstructionDataModule(str(data), str(tokenizers[family]), val_path=str(data), cutoff_len=512)
    dm.setup("fit")
    row, val = dm.datasets["fit"][0], dm.datasets["validate"][0]
    hf = AutoTokenizer.from_pretrained(str(tokenizers[family]))
    spec = FAMILIES[family]
    assert hf.apply_chat_template(msgs, tokenize=False) == hf.apply_chat_template(
        msgs, tokenize=False, chat_template=spec["generation"])  # the tagged template renders the same text
    ref = hf.apply_chat_template(msgs, chat_template=spec["generation"], return_assistant_tokens_mask=True)
    mask = [i for i, m in enumerate(ref["assistant_masks"]) if m]
    prompt = hf.apply_chat_template(msgs[:-1], add_generation_prompt=True)["input_ids"]
    eot = hf.convert_tokens_to_ids(spec["end_of_turn"])
    print(f"{family}: {len(row['input_ids'])} tokens, {len(mask)} learned; {dm.chat.template.name} template, stop ids "
          f"{dm.stop_token_ids}")
    assert dm.chat.template.name == "tokenizer" and dm.chat.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)
    assert row["input_ids"] == hf.apply_chat_template(msgs)["input_ids"]
    assert _learned(row) == mask and len(mask) > 3 * 3
    assert sum(row["input_ids"][t] == eot for t in mask) == 3  # every reply learns its end-of-turn token
    assert val["prompt_ids"] == prompt and val["label"] == msgs[-1]["content"]
    assert val["prompt"] == hf.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=False)
    assert dm.stop_token_ids == list(dict.fromkeys([eot, hf.eos_token_id]))
    # Only the last reply with assistant_turns=last: the last span of the mask.
    last = InstructionDataModule(str(data), str(tokenizers[family]), assistant_turns="last", cutoff_len=512)
    last.setup("fit")
    spans = [t for t in mask if t >= len(prompt)]
    assert _learned(last.datasets["fit"][0]) == spans and spans


def test_named_templates_render_as_the_model_families(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """On a tokenizer without a template, the named chatml / llama3 / baichuan2 render what the families' own
    templates render (ChatML = Qwen2's without its default system message)."""
    from transformers import AutoTokenizer

    msgs = conversation()
    for family, name in (("qwen2", "chatml"), ("llama3", "llama3"), ("baichuan2", "baichuan2")):
        bare = build_tokenizer(tmp_path / family, family, chat_template=None)
        dm = InstructionDataModule(tokenizer_dir=str(bare), template=name)
        hf = AutoTokenizer.from_pretrained(str(tokenizers[family]))
        assert dm.chat.template.name == name and AutoTokenizer.from_pretrained(str(bare)).chat_template is None
        assert dm.chat.render(msgs) == hf.apply_chat_template(msgs, tokenize=False)
        assert dm.chat.render(msgs[:-1], generation_prompt=True) == hf.apply_chat_template(
            msgs[:-1], add_generation_prompt=True, tokenize=False)


def test_a_template_without_an_end_of_turn_token_is_refused(tmp_path: Path) -> None:
    """vLLM's Baichuan2 template ends a reply with nothing: a model trained on it could not learn to stop."""
    tok = build_tokenizer(tmp_path / "b", "baichuan2", chat_template=BAICHUAN2_VLLM)
    with pytest.raises(ValueError, match=r"--data.template=tokenizer: an assistant reply is followed by '', which holds "
                                         r"no special token"):
        InstructionDataModule(tokenizer_dir=str(tok))


# ------------------------------------------------------------------------------------------------ formats
def test_openai_sharegpt_and_alpaca_records_give_the_same_rows(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    """One conversation in four forms (OpenAI messages; ShareGPT with its system column; alpaca with system and
    history; custom columns and role names mapped as LLaMA-Factory's dataset_info does): the same rows."""
    msgs = conversation()
    system, turns = msgs[0]["content"], msgs[1:]
    pairs = [[turns[i]["content"], turns[i + 1]["content"]] for i in range(0, len(turns), 2)]
    sharegpt = {"system": system, "conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                                     "value": m["content"]} for m in turns]}
    alpaca = {"system": system, "history": pairs[:-1], "instruction": pairs[-1][0], "output": pairs[-1][1]}
    custom = {"dialog": [{"speaker": {"system": "sys", "user": "client", "assistant": "bot"}[m["role"]],
                          "text": m["content"]} for m in msgs]}
    rows = []
    for name, rec, cols in (("openai", {"messages": msgs}, None), ("sharegpt", sharegpt, None),
                            ("alpaca", alpaca, None),
                            ("custom", custom, ChatColumns(messages="dialog", role_tag="speaker", content_tag="text",
                                                           roles={"sys": "system", "client": "user",
                                                                  "bot": "assistant"}))):
        dm = InstructionDataModule(str(_write(tmp_path / f"{name}.jsonl", [rec])), str(tokenizers["qwen2"]),
                                   columns=cols, cutoff_len=512)
        dm.setup("fit")
        rows.append(dm.datasets["fit"][0])
    assert all(r == rows[0] for r in rows[1:])


def test_alpaca_records_keep_the_legacy_templates(tmp_path: Path) -> None:
    """Alpaca records under the named alpaca / plain templates and format strings render today's prompts (the
    preamble with and without an input, "### Input:" only with one); a system message replaces the preamble."""
    records = [{"instruction": "Sum:", "input": "abc", "output": "xy"}, {"instruction": "Say hi", "output": "hi"},
               {"instruction": "Say hi", "output": "hi", "system": "Be nice."}]
    data, no_system = _write(tmp_path / "a.jsonl", records), _write(tmp_path / "b.jsonl", records[:2])
    texts = {}
    for template in ("alpaca", "plain", "<{instruction}|{input}>="):
        path = no_system if "{" in template else data
        dm = InstructionDataModule(str(path), template=template, val_path=str(path))
        dm.setup("fit")
        texts[template] = [dm.tokenizer.decode(r["input_ids"], skip_special_tokens=False)
                           for r in dm.datasets["validate"]]
        assert all(r["input_ids"][-1] == 258 and r["labels"][-2] == 258 for r in dm.datasets["validate"])
    assert texts["alpaca"][0] == ("Below is an instruction that describes a task, paired with an input that provides "
                                  "further context. Write a response that appropriately completes the request.\n\n"
                                  "### Instruction:\nSum:\n\n### Input:\nabc\n\n### Response:\nxy<eos>")
    assert texts["alpaca"][1] == ("Below is an instruction that describes a task. Write a response that appropriately "
                                  "completes the request.\n\n### Instruction:\nSay hi\n\n### Response:\nhi<eos>")
    assert texts["alpaca"][2] == "Be nice.\n\n### Instruction:\nSay hi\n\n### Response:\nhi<eos>"
    assert texts["plain"][:2] == ["Sum:abc\nxy<eos>", "Say hi\nhi<eos>"]
    assert texts["plain"][2] == "Be nice.\nSay hi\nhi<eos>"
    assert texts["<{instruction}|{input}>="] == ["<Sum:|abc>=xy<eos>", "<Say hi|>=hi<eos>"]
    with pytest.raises(DataError, match=rf"^{data}:3: the chat template \(custom\) cannot render this conversation: "
                                        "this template has no system role"):  # a format string has no place for it
        InstructionDataModule(str(data), template="{instruction}{input}=").setup("fit")


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "turns must alternate user/assistant"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "c"}]},
     "message 2 has role 'wizard', which is not one of"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "system", "content": "s"}, {"role": "user", "content": "c"},
                   {"role": "assistant", "content": "d"}]}, "a system message is only allowed first"),
    ({"messages": [{"role": "user", "content": "a"}]}, "must end with an assistant message"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b<|im_end|>c"}]},
     "assistant message 2 holds the end-of-turn token '<|im_end|>'"),
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "{not json"}]},
     "a function_call is not valid JSON"),
    ({"prompt": "a", "answer": "b"}, "no conversation found"),
])
def test_bad_conversations_name_file_and_line(record: dict[str, Any], message: str, tokenizers: dict[str, Path],
                                              tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    data = _write(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=f"^{data}:2: .*{message}".replace("|", r"\|").replace("(", r"\(")):
        InstructionDataModule(str(data), str(tokenizers["qwen2"])).setup("fit")


def test_templates_that_cannot_render_a_conversation_right_are_refused(tokenizers: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """A role the template drops, tools it ignores, a template that rewrites earlier turns (not prefix-stable: only
    the last reply can be learned), its own errors, and a named template whose tokens the tokenizer lacks."""
    tool_chat = {"messages": [{"role": "user", "content": "weather?"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
                              {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    data = _write(tmp_path / "tool.jsonl", [tool_chat])
    with pytest.raises(DataError, match=rf"^{data}:1: the chat template \(tokenizer\) drops the assistant message 2"):
        InstructionDataModule(str(data), str(tokenizers["qwen2"])).setup("fit")  # Qwen2's renders no tool calls
    tools = _write(tmp_path / "tools.jsonl", [{**conversation_record(), "tools": [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]}])
    with pytest.raises(DataError, match=rf"^{tools}:1: the chat template \(tokenizer\) ignores the record's tools"):
        InstructionDataModule(str(tools), str(tokenizers["qwen2"])).setup("fit")
    # Qwen3-style: earlier replies lose their "<think>...</think>" part, the last keeps it.
    rewriting = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and not "
                 "loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
                 "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
    think = _write(tmp_path / "think.jsonl", [{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>t</think>b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>u</think>d"}]}])
    with pytest.raises(DataError, match=rf"^{think}:1: .* not prefix-stable at message 2"):
        InstructionDataModule(str(think), str(tokenizers["qwen2"]), template=rewriting).setup("fit")
    last = InstructionDataModule(str(think), str(tokenizers["qwen2"]), template=rewriting, assistant_turns="last")
    last.setup("fit")
    row = last.datasets["fit"][0]
    assert last.tokenizer.decode([row["input_ids"][t] for t in _learned(row)]) == "<think>u</think>d<|im_end|>"
    with pytest.raises(DataError, match=rf"^{data}:1: the chat template \(mistral\) cannot render this conversation: "
                                        "Conversation roles must alternate"):
        InstructionDataModule(str(data), template="mistral").setup("fit")
    with pytest.raises(ValueError, match=r"^--data.template=chatml: the tokenizer has no token <\|im_start\|>, "
                                         r"<\|im_end\|>"):
        InstructionDataModule(tokenizer_dir=str(tokenizers["llama3"]), template="chatml")
    with pytest.raises(ValueError, match=r"^--data.template=tokenizer: the tokenizer has no chat_template"):
        InstructionDataModule(template="tokenizer")


def conversation_record() -> dict[str, Any]:
    return {"messages": conversation()}
