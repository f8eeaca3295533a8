"""Which chat template renders a conversation: the tokenizer's own ``chat_template``, a named one, or the user's.

Every template is a Jinja string rendered by transformers' ``apply_chat_template`` (our byte tokenizer calls the same
renderer), so there is one renderer. The named templates are the model families' own formats:

====================  ==================================================================================
``chatml``            ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (Qwen2/Qwen3's format, without a default system)
``llama3``            Meta-Llama-3-Instruct's template (``<|start_header_id|>``, ``<|eot_id|>``)
``llama2``            Llama-2-chat's template (``[INST]``, ``<<SYS>>``)
``mistral``           Mistral-7B-Instruct-v0.2's template (user/assistant only)
``baichuan2``         Baichuan2-Chat's format (``<reserved_106>`` user, ``<reserved_107>`` assistant, the system text
                      first) with EOS after each reply, as Baichuan2's own fine-tuning learns it (its tokenizer ships
                      no template; inference stops at EOS)
``gemma``             Gemma 2/3-it's turns (``<start_of_turn>user`` / ``<start_of_turn>model`` ... ``<end_of_turn>``,
                      BOS first); Gemma has no system role: a system message is written at the start of the first
                      user turn, then a blank line, as Gemma 3's own template does (Gemma 2's own template refuses
                      it: ``--data.template=auto`` on a Gemma 2 tokenizer refuses such a record, naming it)
``alpaca``            the Stanford Alpaca prompt (``### Instruction:`` / ``### Input:`` / ``### Response:``); a system
                      message replaces its preamble; replies end with EOS
``plain``             ``{instruction}{input}\\n`` then the reply and EOS
====================  ==================================================================================

``--data.template`` may also be ``auto`` (the tokenizer's template, else the datamodule's fallback), ``tokenizer``
(the tokenizer's, required), a Jinja string, a ``.jinja`` file, or a format string with ``{instruction}`` and
``{input}`` (one user turn's text; the reply and EOS follow it).

A named template's control tokens must be single tokens of the tokenizer (refused otherwise, naming them); the byte
tokenizer gets them added (:func:`chat_tokenizer`).
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_llm.data.tokenizers import ByteTokenizer

__all__ = ["NAMED_TEMPLATES", "ChatTemplate", "chat_tokenizer", "format_string_template", "resolve_template"]

_ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\\n\\n")
_ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\\n\\n")
# The user turn of alpaca-style templates reads the record's own fields when it has them (alpaca records).
_INSTRUCTION = "(message['instruction'] if message['instruction'] is defined else message['content'])"
_INPUT = "(message['input'] if message['input'] is defined and message['input'] else '')"
_SYSTEM_SPLIT = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
                 "{% set loop_messages = messages[1:] %}{% else %}{% set system = none %}"
                 "{% set loop_messages = messages %}{% endif %}")
_NOT_SUPPORTED = "{% else %}{{ raise_exception('this template has no ' + message['role'] + ' role') }}{% endif %}"

NAMED_TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (Jinja source, control tokens the tokenizer must hold as single tokens)
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
        " + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ("<|im_start|>", "<|im_end|>")),
    "llama3": (  # Meta-Llama-3-8B-Instruct tokenizer_config.json
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == "
        "0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "llama2": (  # Llama-2-7b-chat-hf tokenizer_config.json
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
        "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}",
        ()),
    "mistral": (  # Mistral-7B-Instruct-v0.2 tokenizer_config.json
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] "
        "== 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
        "roles are supported!') }}{% endif %}{% endfor %}",
        ()),
    "baichuan2": (
        _SYSTEM_SPLIT + "{% if system is not none %}{{ system }}{% endif %}{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{{ '<reserved_106>' + message['content'] }}{% elif message['role'] == "
        "'assistant' %}{{ '<reserved_107>' + message['content'] + eos_token }}" + _NOT_SUPPORTED + "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<reserved_107>' }}{% endif %}",
        ("<reserved_106>", "<reserved_107>")),
    "gemma": (  # Gemma 3-it's text turns (gemma-2-it's, but for a system message: folded into the first user turn)
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
        "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}"
        "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}{{ '<start_of_turn>' + role + "
        "'\\n' + (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
        ("<start_of_turn>", "<end_of_turn>")),
    "alpaca": (
        _SYSTEM_SPLIT + "{% for message in loop_messages %}{% if message['role'] == 'user' %}{% if loop.first %}"
        "{% if system is not none %}{{ system + '\\n\\n' }}{% elif " + _INPUT + " %}{{ '" + _ALPACA_INPUT + "' }}"
        "{% else %}{{ '" + _ALPACA + "' }}{% endif %}{% else %}{{ '\\n\\n' }}{% endif %}"
        "{{ '### Instruction:\\n' + " + _INSTRUCTION + " + '\\n\\n' }}{% if " + _INPUT + " %}"
        "{{ '### Input:\\n' + " + _INPUT + " + '\\n\\n' }}{% endif %}{{ '### Response:\\n' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}" + _NOT_SUPPORTED
        + "{% endfor %}",
        ()),
    "plain": (
        _SYSTEM_SPLIT + "{% if system is not none %}{{ system + '\\n' }}{% endif %}{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{{ " + _INSTRUCTION + " + " + _INPUT + " + '\\n' }}{% elif message['role'] "
        "== 'assistant' %}{{ message['content'] + eos_token }}" + _NOT_SUPPORTED + "{% endfor %}",
        ()),
}


@dataclass(frozen=True)
class ChatTemplate:
    """A resolved template: ``name`` (``tokenizer``, a named one, ``custom``), its Jinja ``source``, the control
    tokens it needs as single tokens, and whether it is the tokenizer's own (an export then need not write it)."""

    name: str
    source: str
    control_tokens: tuple[str, ...] = ()
    own: bool = False


def format_string_template(fmt: str, *, param: str = "--data.template") -> str:
    """A ``{instruction}``/``{input}`` format string (one user turn's text) as a Jinja template: user turns are the
    format filled with the message's fields (its text as ``instruction`` when it has none), replies end with EOS."""
    parts = []
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise ValueError(f"{param}={fmt!r}: not a valid format string ({e})") from None
    for literal, name, spec, conv in parsed:
        if literal:
            parts.append(json.dumps(literal, ensure_ascii=False))
        if name is None:
            continue
        if name not in ("instruction", "input") or spec or conv:
            raise ValueError(f"{param}: unknown placeholder {{{name}}} (use {{instruction}} and {{input}})")
        parts.append(_INSTRUCTION if name == "instruction" else _INPUT)
    user = " + ".join(parts) or "''"
    return ("{% for message in messages %}{% if message['role'] == 'user' %}{{ " + user + " }}{% elif message['role'] "
            "== 'assistant' %}{{ message['content'] + eos_token }}" + _NOT_SUPPORTED + "{% endfor %}")


def _own_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one, as apply_chat_template picks it
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def resolve_template(spec: str, tokenizer: Any, *, fallback: str | None, param: str = "--data.template"
                     ) -> ChatTemplate | None:
    """The template ``spec`` names for ``tokenizer`` (see the module docstring). ``auto`` falls back to the named
    ``fallback`` when the tokenizer has no template, or to ``None`` (no template: raw strings) when it is ``None``."""
    own = _own_template(tokenizer)
    if spec == "auto":
        if own is not None:
            return ChatTemplate("tokenizer", own, own=True)
        return None if fallback is None else resolve_template(fallback, tokenizer, fallback=None, param=param)
    if spec == "tokenizer":
        if own is None:
            raise ValueError(f"{param}=tokenizer: the tokenizer has no chat_template; name one of "
                             f"{', '.join(NAMED_TEMPLATES)} or give a Jinja template")
        return ChatTemplate("tokenizer", own, own=True)
    if spec in NAMED_TEMPLATES:
        source, tokens = NAMED_TEMPLATES[spec]
        return ChatTemplate(spec, source, tokens, own=source == own)
    if spec.endswith(".jinja"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{param}={spec}: no such file")
        return ChatTemplate("custom", path.read_text(encoding="utf-8"), own=False)
    if "{%" in spec or "{{" in spec:
        return ChatTemplate("custom", spec, own=spec == own)
    if "{instruction}" in spec:
        return ChatTemplate("custom", format_string_template(spec, param=param), own=False)
    raise ValueError(f"{param}={spec!r}: auto, tokenizer, a template name ({', '.join(NAMED_TEMPLATES)}), a Jinja "
                     "template (string or .jinja file) or a format string containing {instruction} (and optionally "
                     "{input})")


def chat_tokenizer(tokenizer: Any, template: ChatTemplate, *, param: str = "--data.template") -> Any:
    """The tokenizer to render ``template`` with: the byte tokenizer with the template's control tokens added and
    special tokens read from text (as a Hugging Face tokenizer reads them); a Hugging Face tokenizer as it is, after
    checking that it holds each control token as one token (``ValueError`` naming the missing ones)."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteTokenizer(template.control_tokens, split_special_tokens=False)
    missing = [t for t in template.control_tokens
               if len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1]
    if missing:
        raise ValueError(f"{param}={template.name}: the tokenizer has no token {', '.join(missing)} (it encodes each "
                         "as several tokens): use the tokenizer's own template (--data.template=auto), or a "
                         "template made for this tokenizer")
    return tokenizer
