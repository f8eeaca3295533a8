"""Chat templates that rewrite earlier turns or inject a system message, written out as the model families publish them
(``tokenizer_config.json`` ``chat_template``, JSON-decoded), each with a ``{% generation %}`` variant that renders the
same text and marks what an assistant turn generates (transformers' ``return_assistant_tokens_mask``): the tests'
independent reference for the learned tokens. Tokenizers are built by :func:`chat_fixtures.build_tokenizer`."""

from __future__ import annotations

from typing import Any

_QWEN_TOOLS = (
    "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n")

# Qwen/Qwen3-8B: the reasoning of replies before the last user query is dropped; replies after it (the last one always)
# are rendered with a think block, empty when the reply has no reasoning.
_QWEN3_HEAD = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    """ + _QWEN_TOOLS + """{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
"""
_QWEN3_REPLY = """        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
"""
_QWEN3_CALLS = """        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
"""
_QWEN3_TAIL = """    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3 = _QWEN3_HEAD + _QWEN3_REPLY + _QWEN3_CALLS + "        {{- '<|im_end|>\\n' }}\n" + _QWEN3_TAIL
# The same rendering; {% generation %} opens after the "<|im_start|>assistant\n" header and closes after <|im_end|>.
QWEN3_GENERATION = _QWEN3_HEAD + """        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
""" + _QWEN3_CALLS + "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n" + _QWEN3_TAIL

# deepseek-ai/DeepSeek-R1 (the template with "<think>\n" in the generation prompt): every reply loses the reasoning
# before its "</think>"; the system messages are joined and written first, without markers.
_R1_HEAD = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = "
    "namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for "
    "message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = "
    "ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = "
    "ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ "
    "ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false "
    "-%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and 'tool_calls' in "
    "message %}{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if "
    "message['content'] is none %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' "
    "+ '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{'<｜Assistant｜>' + message['content'] + "
    "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif "
    "%}{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + "
    "'<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- "
    "if message['role'] == 'assistant' and 'tool_calls' not in message %}")
_R1_REPLY = (
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set "
    "ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if '</think>' in content %}{% set "
    "content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}"
    "{%- endif %}")
_R1_GENERATION_REPLY = (
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% generation %}{{message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{% endgeneration %}{%- set ns.is_tool = false -%}{%- else %}{% set content = "
    "message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>'}}{% generation %}{{content + '<｜end▁of▁sentence｜>'}}{% endgeneration %}{%- endif %}")
_R1_TAIL = (
    "{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set "
    "ns.is_output_first = false %}{%- else %}{{'<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}"
    "{% endif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")
DEEPSEEK_R1 = _R1_HEAD + _R1_REPLY + _R1_TAIL
DEEPSEEK_R1_GENERATION = _R1_HEAD + _R1_GENERATION_REPLY + _R1_TAIL

# Qwen/Qwen2.5-7B-Instruct: a default system message when the conversation has none.
_QWEN25_HEAD = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n" }}
    """ + _QWEN_TOOLS + """{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
"""
_QWEN25_TAIL = """    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
QWEN25 = _QWEN25_HEAD + """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
""" + _QWEN25_TAIL
QWEN25_GENERATION = _QWEN25_HEAD + """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
""" + _QWEN25_TAIL

_QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"]
REWRITING: dict[str, dict[str, Any]] = {  # build_tokenizer specs (see chat_fixtures.FAMILIES)
    "qwen3": {"kind": "bytelevel", "specials": _QWEN_SPECIALS, "eos": "<|im_end|>", "pad": "<|endoftext|>",
              "bos": None, "template": QWEN3, "generation": QWEN3_GENERATION, "end_of_turn": "<|im_end|>"},
    "deepseek_r1": {"kind": "bytelevel", "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                                                      "<｜Assistant｜>", "<think>", "</think>"],
                    "eos": "<｜end▁of▁sentence｜>", "pad": "<｜end▁of▁sentence｜>", "bos": "<｜begin▁of▁sentence｜>",
                    "template": DEEPSEEK_R1, "generation": DEEPSEEK_R1_GENERATION,
                    "end_of_turn": "<｜end▁of▁sentence｜>"},
    "qwen25": {"kind": "bytelevel", "specials": _QWEN_SPECIALS[:5], "eos": "<|im_end|>", "pad": "<|endoftext|>",
               "bos": None, "template": QWEN25, "generation": QWEN25_GENERATION, "end_of_turn": "<|im_end|>"},
}


def reasoning_conversation() -> list[dict[str, Any]]:
    """Multi-turn with a system message and replies that carry their reasoning (``<think>...</think>``), one without."""
    return [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Hello there! How are you today?"},
        {"role": "assistant", "content": "<think>\nA greeting; answer politely.\n</think>\n\nI am fine, thank you."},
        {"role": "user", "content": "请把这句话翻译成英文：我爱自然语言处理。"},
        {"role": "assistant", "content": "I love natural language processing."},
        {"role": "user", "content": " Tell me a joke about cats. "},
        {"role": "assistant", "content": "<think>\nSomething short about cats and dogs.\n</think>\n\n"
                                         "Cats and dogs: the quick brown fox jumps over the lazy dog!"},
    ]


def tool_conversation() -> dict[str, Any]:
    """An OpenAI record with tools: a call, its result, the answer, then a second question and answer."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    return {"tools": [weather], "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 25 C"},
        {"role": "assistant", "content": "<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris."},
        {"role": "user", "content": "Thanks! Goodbye."},
        {"role": "assistant", "content": "Goodbye, see you tomorrow."},
    ]}
