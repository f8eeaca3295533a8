"""Conversations and chat templates: rendering and token ids equal transformers' ``apply_chat_template`` for tokenizers
built here with real templates (Qwen2 ChatML, Llama-3, Baichuan2), the learned tokens equal the assistant spans
transformers marks with a ``{% generation %}`` template, the input formats (OpenAI, ShareGPT, alpaca with history)
give the same rows, and what cannot be rendered right is refused naming the file and line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import SHARED_DATA
from tests.chat_fixtures import BAICHUAN2_VLLM, FAMILIES, build_tokenizer, conversation, write_jsonl

from lightning_llm.data import DataError, InstructionDataModule, PreferenceDataModule, PromptDataModule
from lightning_llm.data.chat.messages import ChatColumns
from lightning_llm.generation import GenerationConfig, for_datamodule


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
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
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
        dm = InstructionDataModule(str(write_jsonl(tmp_path / f"{name}.jsonl", [rec])), str(tokenizers["qwen2"]),
                                   columns=cols, cutoff_len=512)
        dm.setup("fit")
        rows.append(dm.datasets["fit"][0])
    assert all(r == rows[0] for r in rows[1:])


def test_alpaca_records_keep_the_legacy_templates(tmp_path: Path) -> None:
    """Alpaca records under the named alpaca / plain templates and format strings render today's prompts (the
    preamble with and without an input, "### Input:" only with one); a system message replaces the preamble."""
    records = [{"instruction": "Sum:", "input": "abc", "output": "xy"}, {"instruction": "Say hi", "output": "hi"},
               {"instruction": "Say hi", "output": "hi", "system": "Be nice."}]
    data, no_system = write_jsonl(tmp_path / "a.jsonl", records), write_jsonl(tmp_path / "b.jsonl", records[:2])
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
    data = write_jsonl(tmp_path / "bad.jsonl", [good, record])
    with pytest.raises(DataError, match=f"^{data}:2: .*{message}".replace("|", r"\|").replace("(", r"\(")):
        InstructionDataModule(str(data), str(tokenizers["qwen2"])).setup("fit")


def test_templates_that_cannot_render_a_conversation_right_are_refused(tokenizers: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """A role the template drops, tools it ignores, a template that rewrites earlier turns so that a reply cannot be
    located, its own errors, and a named template whose tokens the tokenizer lacks."""
    tool_chat = {"messages": [{"role": "user", "content": "weather?"},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"type": "function", "function": {"name": "get_weather", "arguments": {}}}]},
                              {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]}
    data = write_jsonl(tmp_path / "tool.jsonl", [tool_chat])
    with pytest.raises(DataError, match=rf"^{data}:1: the chat template \(tokenizer\) drops the assistant message 2"):
        InstructionDataModule(str(data), str(tokenizers["qwen2"])).setup("fit")  # Qwen2's renders no tool calls
    tools = write_jsonl(tmp_path / "tools.jsonl", [{**conversation_record(), "tools": [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}}]}])
    with pytest.raises(DataError, match=rf"^{tools}:1: the chat template \(tokenizer\) ignores the record's tools"):
        InstructionDataModule(str(tools), str(tokenizers["qwen2"])).setup("fit")
    # Qwen3-style: earlier replies lose their "<think>...</think>" part, the last keeps it.
    rewriting = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' and not "
                 "loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
                 "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
    think = write_jsonl(tmp_path / "think.jsonl", [{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>t</think>b"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>u</think>d"}]}])
    # Every reply is learned as the whole conversation renders it (tests/data/test_chat_rewriting.py: Qwen3, DeepSeek-R1);
    # a template that also rewrites the user's text (here: reversed) leaves a reply that cannot be located.
    every = InstructionDataModule(str(think), str(tokenizers["qwen2"]), template=rewriting)
    every.setup("fit")
    row = every.datasets["fit"][0]
    assert every.tokenizer.decode([row["input_ids"][t] for t in _learned(row)]) == (
        "b<|im_end|><think>u</think>d<|im_end|>")
    reversing = rewriting.replace("{% else %}{{ m['content'] }}", "{% elif m['role'] == 'user' %}{{ m['content'][::-1] }}"
                                  "{% else %}{{ m['content'] }}")
    with pytest.raises(DataError, match=rf"^{think}:1: .* not prefix-stable at message 2 .* cannot be located in the "
                                        r"whole conversation: the template does not render a message's text as given"):
        InstructionDataModule(str(think), str(tokenizers["qwen2"]), template=reversing).setup("fit")
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


# ------------------------------------------------------------------------------------------------ too long
def test_long_conversations_keep_whole_replies_and_the_template_markers(tokenizers: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """cutoff_len: whole replies that fit are kept; a first reply that does not fit shares cutoff_len with its prompt
    (infer_seqlen), the user text losing its end while the template's markers and generation prompt stay.
    max_prompt_len: the oldest turns go first."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers["qwen2"]))
    msgs = conversation()
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}])
    full = hf.apply_chat_template(msgs)["input_ids"]
    first_end = len(hf.apply_chat_template(msgs[:3])["input_ids"]) - 1  # after the first reply's <|im_end|>
    dm = InstructionDataModule(str(data), str(tokenizers["qwen2"]), cutoff_len=first_end + 5)
    dm.setup("fit")
    row = dm.datasets["fit"][0]
    assert row["input_ids"] == full[:first_end] and len(_learned(row)) > 1  # the first exchange, whole
    long = write_jsonl(tmp_path / "l.jsonl", [{"messages": [{"role": "user", "content": "word " * 200},
                                                       {"role": "assistant", "content": "short answer"}]}])
    base = len(hf.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True)["input_ids"])
    dm = InstructionDataModule(str(long), str(tokenizers["qwen2"]), cutoff_len=base + 30, val_path=str(long),
                               max_prompt_len=base + 10)
    dm.setup("fit")
    row, val = dm.datasets["fit"][0], dm.datasets["validate"][0]
    text = hf.decode(row["input_ids"])
    assert base + 25 < len(row["input_ids"]) <= base + 30
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nword word")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\nshort answer<|im_end|>")
    assert base + 5 < len(val["prompt_ids"]) <= base + 10
    assert re.search(r"<\|im_start\|>user\nword[ word]*<\|im_end\|>\n<\|im_start\|>assistant\n$",
                     hf.decode(val["prompt_ids"]))
    ask = InstructionDataModule(str(data), str(tokenizers["qwen2"]), val_path=str(data), max_prompt_len=60)
    ask.setup("fit")
    prompt = hf.decode(ask.datasets["validate"][0]["prompt_ids"])
    assert "Tell me a joke" in prompt and "How are you" not in prompt and prompt.startswith("<|im_start|>system\n"
                                                                                            "You are a helpful assistant. Answer briefly.")


# ------------------------------------------------------------------------------------------------ DPO, PPO, GRPO
def test_preference_pairs_in_every_form_render_the_prompt_and_learn_the_reply(tokenizers: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """trl's explicit and implicit prompts, LLaMA-Factory's ShareGPT ranking records, OpenAI messages with string
    replies: the same rows; a row is apply_chat_template's prompt + reply cut after the end-of-turn token, learning
    what return_assistant_tokens_mask marks for that reply."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers["llama3"]))
    msgs = conversation()
    prompt, chosen, rejected = msgs[:-1], msgs[-1], {"role": "assistant", "content": "No idea."}
    sharegpt = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in prompt[1:]]
    forms = [{"prompt": prompt, "chosen": [chosen], "rejected": [rejected]},
             {"chosen": msgs, "rejected": [*prompt, rejected]},
             {"system": prompt[0]["content"], "conversations": sharegpt, "chosen": {"from": "gpt", "value": chosen[
                 "content"]}, "rejected": {"from": "gpt", "value": rejected["content"]}},
             {"messages": prompt, "chosen": chosen["content"], "rejected": rejected["content"]}]
    data = write_jsonl(tmp_path / "pairs.jsonl", forms)
    dm = PreferenceDataModule(str(data), str(tokenizers["llama3"]), cutoff_len=512, max_prompt_len=256,
                              generated_val_pairs=0)
    dm.setup("fit")
    rows = [dm.split_dataset("fit")[i] for i in range(4)]
    assert all((r["chosen"], r["rejected"]) == (rows[0]["chosen"], rows[0]["rejected"]) for r in rows)
    gen = FAMILIES["llama3"]["generation"]
    start = len(hf.apply_chat_template(prompt, add_generation_prompt=True)["input_ids"])
    for key, reply in (("chosen", chosen), ("rejected", rejected)):
        ref = hf.apply_chat_template([*prompt, reply], chat_template=gen, return_assistant_tokens_mask=True)
        learned = [t for t, m in enumerate(ref["assistant_masks"]) if m and t >= start]
        ids, labels = rows[0][key]
        assert ids == ref["input_ids"][: learned[-1] + 1] and ids[-1] == hf.convert_tokens_to_ids("<|eot_id|>")
        assert [t + 1 for t, x in enumerate(labels) if x != -100] == learned
    raw = write_jsonl(tmp_path / "raw.jsonl", [{"prompt": "a", "chosen": [chosen], "rejected": "c"}])
    with pytest.raises(DataError, match=rf"^{raw}:1: field 'chosen' must be a string without a chat template"):
        PreferenceDataModule(str(raw), template="none").setup("fit")


def test_rl_prompts_render_with_the_generation_prompt_and_stop_at_the_end_of_turn(tokenizers: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """PromptDataModule: a string prompt is one user message (with the default system message), a message list or a
    conversation without its reference reply is the prompt; rollouts stop at <|im_end|> and EOS."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizers["qwen2"]))
    msgs = conversation()
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello there!"}, {"prompt": msgs[:-1]}, {"messages": msgs}])
    dm = PromptDataModule(str(data), str(tokenizers["qwen2"]), default_system="Be brief.", max_prompt_len=512)
    dm.setup("fit")
    rows = dm.datasets["fit"].examples
    expect = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}], msgs[:-1],
              msgs[:-1]]
    for row, messages in zip(rows, expect):
        assert row["input_ids"] == hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert row["prompt"] == messages[-1]["content"]
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert dm.stop_token_ids == [im_end] and for_datamodule(GenerationConfig(), dm).eos_ids == [im_end]
    byte = PromptDataModule(template="chatml", generated_prompts=4)
    byte.setup("fit")
    assert byte.stop_token_ids == [260, 258] and byte.vocab_size == 261  # the byte tokenizer gains ChatML's tokens
    assert byte.tokenizer.decode(byte.datasets["fit"][0]["input_ids"], skip_special_tokens=False).startswith(
        "<|im_start|>user\nContinue: ")
    with pytest.raises(ValueError, match="--data.bos=true applies to raw prompts"):
        PromptDataModule(template="chatml", bos=True)


class RecordingReward:
    """A reward (``--model.reward.fn=tests.data.test_chat:RecordingReward``) that keeps the prompts it was given."""

    prompts: list[str] = []

    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        RecordingReward.prompts += prompts
        return [float(len(r)) for r in responses]


def test_grpo_rolls_out_chat_prompts_and_stops_at_the_end_of_turn() -> None:
    """GRPO on ChatML prompts (byte tokenizer): rollouts are generated from the rendered prompt + generation prompt
    and stop at <|im_end|> or EOS; the reward gets the user's text."""
    import lightning.pytorch as pl

    from lightning_llm.rl import GRPOConfig, RewardConfig
    from lightning_llm.tasks import GRPOTask, OptimConfig

    pl.seed_everything(0)
    task = GRPOTask("debug", model_overrides={"num_layers": 1}, reward=RewardConfig(fn="tests.data.test_chat:RecordingReward"),
                    generation=GenerationConfig(max_new_tokens=6, do_sample=True),
                    grpo=GRPOConfig(num_generations=2, epochs=1, num_mini_batches=1),
                    optim=OptimConfig(lr=1e-3, warmup_steps=0, scheduler="constant"))
    dm = PromptDataModule(template="chatml", generated_prompts=8, batch_size=4)
    pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0).fit(task, dm)
    assert task._gen_config().eos_ids == dm.stop_token_ids == [260, 258]
    assert len(RecordingReward.prompts) == 8 and all(p.startswith("Continue: ") for p in RecordingReward.prompts)
    batch = dm.collate(dm.datasets["fit"].examples[:4])
    rendered = dm.tokenizer.decode(batch["input_ids"][0].tolist(), skip_special_tokens=False)
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n") and rendered.replace("<pad>", "").startswith(
        "<|im_start|>user\nContinue: ")


def test_generation_stops_at_any_stop_id() -> None:
    """generate() ends a row at the first of several stop ids (the end-of-turn token or EOS)."""
    from lightning_llm.generation import generate
    from lightning_llm.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", family="decoder").eval()
    ids = torch.tensor([[5, 9, 17, 3]])
    free = generate(model, ids, config=GenerationConfig(max_new_tokens=6))[0].tolist()
    second = free[1]
    stopped = generate(model, ids, config=GenerationConfig(max_new_tokens=6, eos_token_id=[1000, second]))[0].tolist()
    assert stopped == free[: free.index(second) + 1]


# ------------------------------------------------------------------------------------------------ end to end
def _fit_sft(dm: InstructionDataModule, out: Path, *, steps: int, lr: float = 3e-3, layers: int = 2,
             fused_loss: bool = True, max_new_tokens: int = 24) -> Any:
    import lightning.pytorch as pl

    from lightning_llm.tasks import OptimConfig, SFTTask

    pl.seed_everything(0)
    task = SFTTask("debug", model_overrides={"num_layers": layers}, dropout=0.0, fused_loss=fused_loss,
                   generation=GenerationConfig(max_new_tokens=max_new_tokens), predictions_path=str(out / "pred_{stage}.jsonl"),
                   optim=OptimConfig(lr=lr, warmup_steps=10, weight_decay=0.0))
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=pl.loggers.CSVLogger(str(out)), log_every_n_steps=10,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         check_val_every_n_epoch=None, val_check_interval=steps, default_root_dir=str(out),
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True)])
    trainer.fit(task, dm)
    return task, trainer


def _hf_generate(export: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers on the export, with its generation_config.json (its stop ids)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers import GenerationConfig as HFGenerationConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(export)).eval()
        gen = HFGenerationConfig.from_pretrained(str(export))
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def test_export_carries_the_template_and_stop_ids_and_generates_as_the_run(tmp_path: Path) -> None:
    """A run on a tokenizer without a template, rendering with the named chatml: the export's tokenizer renders the
    run's generation prompts with apply_chat_template, its generation_config.json stops at <|im_end|>, and
    transformers' greedy generate on it writes the run's predictions."""
    from transformers import AutoTokenizer

    from lightning_llm.data.chat.messages import make_conversations
    from lightning_llm.export import export_checkpoint

    tok = build_tokenizer(tmp_path / "tok", "qwen2", chat_template=None)
    data = write_jsonl(tmp_path / "chat.jsonl", make_conversations(32, seed=1))
    val = write_jsonl(tmp_path / "val.jsonl", make_conversations(4, seed=1))  # the first 4 training conversations
    dm = InstructionDataModule(str(data), str(tok), template="chatml", val_path=str(val), cutoff_len=96,
                               batch_size=16, eval_batch_size=4)
    _fit_sft(dm, tmp_path / "run", steps=30)
    export = export_checkpoint(tmp_path / "run" / "ckpt" / "last.ckpt", tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(export))
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert (export / "chat_template.jinja").is_file() and hf.chat_template == NAMED_CHATML
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] in (im_end, [im_end])
    predictions = [json.loads(line) for line in (tmp_path / "run" / "pred_val.jsonl").read_text().splitlines()]
    stopped = 0
    for i, line in enumerate(val.read_text().splitlines()):
        row, msgs = dm.datasets["validate"][i], json.loads(line)["messages"]
        assert hf.apply_chat_template(msgs[:-1], add_generation_prompt=True)["input_ids"] == row["prompt_ids"]
        hf_tokens = _hf_generate(export, row["prompt_ids"], 24)
        stopped += im_end in hf_tokens
        cut = hf_tokens[: hf_tokens.index(im_end)] if im_end in hf_tokens else hf_tokens
        assert hf.decode(cut, skip_special_tokens=True).strip() == predictions[i]["prediction"]
    assert stopped >= 3  # transformers stops where the run stopped: at <|im_end|>


NAMED_CHATML = __import__("lightning_llm.data.chat.template", fromlist=["x"]).NAMED_TEMPLATES["chatml"][0]


def _csl_tokenizer(out: Path) -> Path:
    """bert-base-chinese's WordPiece vocabulary (its duplicate lines dropped) plus ChatML's two tokens, with Qwen2's
    template, built with ``tokenizers`` and saved by transformers: a Chinese chat tokenizer."""
    from tests.chat_fixtures import QWEN2
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    lines = (SHARED / "tokenizers" / "bert-base-chinese" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = {t: i for i, t in enumerate(dict.fromkeys(lines))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=QWEN2)
    fast.save_pretrained(str(out))
    return out


SHARED = SHARED_DATA


@pytest.mark.recipe
@pytest.mark.skipif(not (SHARED / "csl_title" / "dev.json").is_file(), reason="needs ../shared/data/csl_title")
def test_csl_in_messages_form_trains_generates_and_scores_with_the_template(tmp_path: Path) -> None:
    """The shared CSL title set converted to OpenAI messages (a system message, the instruction + abstract as the
    user message, the title as the reply), rendered by the tokenizer's Qwen2 ChatML template: the run learns the
    titles (ROUGE-L on the 16 records it trained on), generation stops at <|im_end|>, and the exported tokenizer
    renders the run's prompts."""
    import csv

    from transformers import AutoTokenizer

    from lightning_llm.export import export_checkpoint
    from lightning_llm.files import read_records
    from lightning_llm.generation import generate, strip_after_eos

    recs = read_records(SHARED / "csl_title" / "dev.json")[:16]
    chats = [{"messages": [{"role": "system", "content": "你是论文标题助手。"},
                           {"role": "user", "content": r["instruction"] + r["input"][:40]},
                           {"role": "assistant", "content": r["output"]}]} for r in recs]
    data = write_jsonl(tmp_path / "csl_messages.jsonl", chats)
    tok = _csl_tokenizer(tmp_path / "tok")
    dm = InstructionDataModule(str(data), str(tok), val_path=str(data), cutoff_len=128, batch_size=16,
                               eval_batch_size=16)
    # Logits, not the fused loss: at hidden size 64 a 21k vocabulary makes the fused loss's chunks ~20 tokens long.
    task, _ = _fit_sft(dm, tmp_path / "run", steps=80, lr=5e-3, fused_loss=False, max_new_tokens=64)
    rows = list(csv.DictReader(next((tmp_path / "run").rglob("metrics.csv")).open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    rouge = next(float(r["val_rouge-l"]) for r in rows if r.get("val_rouge-l"))
    batch = dm.collate([dm.datasets["validate"][i] for i in range(16)])
    cfg = task._gen_config()
    with torch.no_grad():
        tokens = generate(task.model.eval(), batch["gen_input_ids"], batch["gen_attention_mask"], config=cfg)
    im_end = dm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stopped = sum(im_end in row for row in tokens.tolist())
    print(f"CSL messages: train_loss {losses[0]:.2f} -> {losses[-1]:.2f}, val_rouge-l {rouge:.1f}, "
          f"{stopped}/16 generations end at <|im_end|>; stop ids {dm.stop_token_ids}; first prediction "
          f"{strip_after_eos(tokens, cfg.eos_ids)[0]}")
    assert dm.chat.template.name == "tokenizer" and cfg.eos_ids == [im_end]
    assert losses[-1] < losses[0] / 3 and rouge >= 50 and stopped >= 14
    export = export_checkpoint(tmp_path / "run" / "ckpt" / "last.ckpt", tmp_path / "hf")
    hf = AutoTokenizer.from_pretrained(str(export))
    for i in range(3):
        prompt = hf.apply_chat_template(chats[i]["messages"][:-1], add_generation_prompt=True)["input_ids"]
        assert prompt == dm.datasets["validate"][i]["prompt_ids"]
