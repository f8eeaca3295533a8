"""Tools in multi-turn rollouts: the policy's calls parsed in each template's format (Qwen2.5, Qwen3 / Hermes
``<tool_call>``, Llama 3.1's JSON), run, their results appended as ``tool`` messages; a scripted policy's episode token
by token against transformers' rendering of the same conversation with the template's ``{% generation %}`` variant
(the learned-token mask: ``return_assistant_tokens_mask``); calls that fail to parse, name no tool, raise or time out
become error messages; bad tools are refused naming them."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data.chat.encode import ChatEncoder
from lightning_llm.data.chat.template import resolve_template
from lightning_llm.rl import RewardConfig
from lightning_llm.rl.multiturn.env import EnvConfig
from lightning_llm.rl.multiturn.episodes import Episode, pack_episodes
from lightning_llm.rl.multiturn.tools import ToolEnv, Tools, parse_tool_calls, template_tool_format
from lightning_llm.rl.multiturn.turns import EpisodeEnvs, TurnRenderer
from lightning_llm.tasks import GRPOTask
from lightning_llm.testing.rl import ScriptedPolicy, check_against_template, check_prefills, scripted_run
from tests.chat_fixtures import build_tokenizer
from tests.rewriting_templates import QWEN3, QWEN3_GENERATION, QWEN25, QWEN25_GENERATION, REWRITING


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide one number by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def untyped(a, b):  # noqa: ANN001, ANN201 - the bad input under test
    """Add.

    Args:
        a: One.
        b: Two.
    """
    return a + b


# meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json "chat_template" (JSON-decoded; the builtin-tools branches
# left out), and its {% generation %} variant: what an assistant turn generates (its text and <|eot_id|>).
_LLAMA31_HEAD = """{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
"""
_LLAMA31_TAIL = """    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA31 = _LLAMA31_HEAD + """        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
""" + _LLAMA31_TAIL
LLAMA31_GENERATION = _LLAMA31_HEAD + """        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {%- if message['role'] == 'assistant' %}
            {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
        {%- else %}
            {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endif %}
""" + _LLAMA31_TAIL
_LLAMA31_SPEC = {"kind": "bytelevel", "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                   "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                 "eos": "<|end_of_text|>", "pad": None, "bos": "<|begin_of_text|>", "template": LLAMA31}

TOOLS = [f"tests.tasks.test_rl_tools:{name}" for name in ("add", "divide", "nap")]
QUESTION = "What is 2 plus 3, and 1 over 0?"
# Per template: (tokenizer spec, the {% generation %} variant, the policy's turns). Qwen3's replies after the last user
# query carry their reasoning (a multi-step tool loop keeps it; an empty one Qwen3's template drops from earlier replies,
# where the episode keeps the tokens the policy wrote and saw).
_THINK = "<think>\nI will use the tools.\n</think>\n\n"
_HERMES_TURNS = ['<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n'
                 '{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 0}"}\n</tool_call>',
                 '<tool_call>\n{"name": "nap", "arguments": {"seconds": 5}}\n</tool_call>\n<tool_call>\n{"name": '
                 '"mul", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n'
                 '</tool_call>', "The answer is 5; 1 over 0 has none."]
CASES: dict[str, tuple[dict[str, Any], str, list[str]]] = {
    "qwen25": (REWRITING["qwen25"], QWEN25_GENERATION, _HERMES_TURNS),
    "qwen3": (REWRITING["qwen3"], QWEN3_GENERATION, [_THINK + t for t in _HERMES_TURNS]),
    "llama31": (_LLAMA31_SPEC, LLAMA31_GENERATION,
                ['{"name": "add", "parameters": {"a": 2, "b": 3}}', '{"name": "divide", "parameters": {"a": 1, "b": 0',
                 '<|python_tag|>{"name": "mul", "parameters": {}}', "The answer is 5; 1 over 0 has none."]),
}


def _not_json(text: str) -> str:
    """The error message of a call whose JSON does not parse (json's own words)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return f"error: the tool call is not JSON ({e})"
    raise AssertionError(text)


def _tool_results(case: str) -> list[list[str]]:
    """The tool messages each scripted turn gets (the last turn, the answer, none)."""
    unknown = "error: mul raised LookupError: no tool named 'mul' (tools: add, divide, nap)"
    if case == "llama31":
        return [["5"], [_not_json('{"name": "divide", "parameters": {"a": 1, "b": 0')], [unknown], []]
    return [["5", "error: divide raised ZeroDivisionError: division by zero"],
            ["error: nap raised TimeoutError: no answer within 0.5 s", unknown,
             _not_json('{"name": "add", "arguments": {"a": 1,}}')], []]


def _episode(case: str, tmp_path: Path) -> tuple[Any, Episode, Tools, ScriptedPolicy]:
    """A scripted policy's tool episode on ``case``'s template: (tokenizer, episode, tools, policy)."""
    from transformers import AutoTokenizer

    spec, _, turns = CASES[case]
    tok = AutoTokenizer.from_pretrained(str(build_tokenizer(tmp_path / case, case, spec={**spec, "generation": None})))
    chat = ChatEncoder(tok, resolve_template("tokenizer", tok, fallback=None), eos_token_id=tok.eos_token_id)
    tools = Tools(TOOLS)
    fmt = template_tool_format(chat.template.source)
    assert fmt == ("llama3_json" if case == "llama31" else "hermes")
    cfg = EnvConfig(max_turns=len(turns), step_timeout=0.5)
    envs = EpisodeEnvs(cfg, None, ToolEnv(tools, fmt=fmt, timeout=cfg.step_timeout))
    record = {"prompt": QUESTION, "messages": [{"role": "user", "content": QUESTION}]}
    header = "<|start_header_id|>assistant<|end_header_id|>\n\n" if case == "llama31" else "<|im_start|>assistant\n"
    (episode,), policy = scripted_run(tok, chat, envs, TurnRenderer(chat, tools.schemas), [turns], [record], env=cfg,
                                      header=header)
    return tok, episode, tools, policy


@pytest.mark.parametrize("case", list(CASES))
def test_tool_episode_token_by_token_against_transformers(case: str, tmp_path: Path) -> None:
    """Each turn's calls are parsed in the template's format and run: their results (or errors: a call that raises,
    times out, names no tool, or is not JSON) appended as tool messages, turn by turn; the episode's tokens are
    transformers' rendering of the final conversation with the tools, and the learned tokens exactly the
    ``{% generation %}`` variant's assistant mask (each reply and its end-of-turn token; the tool messages, the
    headers and the markers around them are context); each turn prefilled only what was appended."""
    tok, episode, tools, policy = _episode(case, tmp_path)
    _, generation, turns = CASES[case]
    want = [{"role": "user", "content": QUESTION}]
    for text, tool_texts in zip(turns, _tool_results(case)):
        want.append({"role": "assistant", "content": text})
        want += [{"role": "tool", "content": t} for t in tool_texts]
    got = [{"role": m["role"], "content": m["content"]} for m in episode.conversation]
    print(f"{case}: " + " | ".join(f"{m['role']}: {m['content'][:40]!r}" for m in got[1:]))
    assert got == want and episode.stopped and episode.turns == len(turns)
    counts = check_against_template(tok, episode, generation, tools=tools.schemas)
    prefills = check_prefills(episode, policy.fed)
    print(f"{case}: {counts}; prefill widths {prefills}, {sum(policy.fed)} columns fed")
    packed = pack_episodes([episode], pad_id=0, device=torch.device("cpu"))
    assert packed.response_mask[0, :len(episode.tokens)].tolist() == episode.learned


def test_calls_parse_in_each_format() -> None:
    hermes = parse_tool_calls('Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
                              '<tool_call>{"name": "x", "arguments": "{\\"k\\": [1]}"}</tool_call><tool_call>{"name":',
                              "hermes")
    assert [(c.name, c.arguments, c.error) for c in hermes] == [
        ("add", {"a": 1, "b": 2}, None), ("x", {"k": [1]}, None),
        (None, {}, "<tool_call> without its closing </tool_call>")]
    assert parse_tool_calls("The answer is 3.", "hermes") == []
    bad = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "hermes")
    assert bad[0].error == "the arguments of 'add' are not a JSON object"
    llama = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3_json")
    assert [(c.name, c.arguments) for c in llama] == [("add", {"a": 1, "b": 2})]
    assert parse_tool_calls(' {"name": "add", "arguments": {"a": 1}} ', "llama3_json")[0].arguments == {"a": 1}
    assert parse_tool_calls("It is 3.", "llama3_json") == []
    assert parse_tool_calls('{"nam": "add"}', "llama3_json")[0].error.startswith("a tool call is a JSON object")
    assert template_tool_format(QWEN25) == template_tool_format(QWEN3) == "hermes"
    assert template_tool_format(LLAMA31) == "llama3_json"
    assert template_tool_format("{{ messages }}") is None


def test_a_tool_past_its_timeout_leaves_the_run_going(caplog: pytest.LogCaptureFixture) -> None:
    tools = Tools(TOOLS)
    env = ToolEnv(tools, fmt="hermes", timeout=0.2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        out = env.step([{"role": "assistant", "content": '<tool_call>{"name": "nap", "arguments": {"seconds": 3}}'
                                                         '</tool_call><tool_call>{"name": "nap", "arguments": '
                                                         '{"seconds": 0}}</tool_call>'}])
    took = time.monotonic() - start
    print(f"two calls, one past the 0.2 s timeout: {took:.2f} s; {[m['content'] for m in out.messages]}")
    assert [m["content"] for m in out.messages] == ["error: nap raised TimeoutError: no answer within 0.2 s", "awake"]
    assert not out.done and took < 1.0


def test_bad_tools_are_refused_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    digits = RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", kwargs={"chars": "digits"})
    for paths, message in [
        (["tests.tasks.test_rl_tools:untyped"], r"--model.tools\[0\]=tests.tasks.test_rl_tools:untyped: its schema "
                                                r"cannot be read \(Argument a is missing a type hint"),
        ([TOOLS[0], "tests.tasks.test_rl_tools:nothing"], r"--model.tools\[1\]='tests.tasks.test_rl_tools:nothing': "
                                                          "cannot import it"),
        ([TOOLS[0], TOOLS[0]], r"--model.tools\[1\]=.*: a second tool named 'add'"),
        (["tests.tasks.test_rl_tools:QUESTION"], r"--model.tools\[0\]=tests.tasks.test_rl_tools:QUESTION is not a "
                                                 "function")]:
        with pytest.raises(ValueError, match=message):
            GRPOTask("debug", reward=digits, tools=paths)
    assert main(["fit", "--model=lightning_llm.tasks.GRPOTask", "--model.reward.fn=lightning_llm.rl.rewards:FormatReward",
                 "--model.tools=[tests.tasks.test_rl_tools:untyped]",
                 "--data=lightning_llm.data.PromptDataModule"]) == 2
    err = capsys.readouterr().err
    print(err.strip().splitlines()[-1])
    assert "--model.tools[0]=tests.tasks.test_rl_tools:untyped: its schema cannot be read" in err
