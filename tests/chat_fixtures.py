"""Tokenizers with real chat templates, built by the tests with ``tokenizers`` and saved by ``transformers`` (what a
user's Qwen2 / Llama-3 / Baichuan2 checkpoint directory holds), and conversations to render with them."""

from __future__ import annotations

import json

from pathlib import Path
from typing import Any

# Qwen/Qwen2-7B-Instruct tokenizer_config.json "chat_template" (JSON-decoded: real newlines in the string literals).
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
         "You are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
         "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant"
         "\n' }}{% endif %}")
# The same with transformers' {% generation %} markers around what a reply generates (content + <|im_end|>).
QWEN2_GENERATION = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
                    "'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{% if message['role'] "
                    "== 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + "
                    "'<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}{{'<|im_start|>' + message['role'] + '\n' + "
                    "message['content'] + '<|im_end|>' + '\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# meta-llama/Meta-Llama-3-8B-Instruct tokenizer_config.json "chat_template".
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 "
          "== 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if "
          "add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3_GENERATION = ("{% for message in messages %}{% set header = '<|start_header_id|>' + message['role'] + "
                     "'<|end_header_id|>\n\n' %}{% if loop.index0 == 0 %}{% set header = bos_token + header %}{% endif "
                     "%}{{ header }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim "
                     "+ '<|eot_id|>' }}{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}"
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                     "<|end_header_id|>\n\n' }}{% endif %}")
# baichuan-inc/Baichuan2-*-Chat ship no chat_template; vLLM's examples/template_baichuan2.jinja (the system text first,
# <reserved_106> before a user message, <reserved_107> before a reply and as the generation prompt):
BAICHUAN2_VLLM = ("{{ (messages|selectattr('role', 'equalto', 'system')|list|last).content|trim if "
                  "(messages|selectattr('role', 'equalto', 'system')|list) else '' }}{%- for message in messages -%}"
                  "{%- if message['role'] == 'user' -%}{{- '<reserved_106>' + message['content'] -}}{%- elif "
                  "message['role'] == 'assistant' -%}{{- '<reserved_107>' + message['content'] -}}{%- endif -%}"
                  "{%- endfor -%}{%- if add_generation_prompt and messages[-1]['role'] != 'assistant' -%}"
                  "{{- '<reserved_107>' -}}{% endif %}")
# ... with EOS after each reply, as Baichuan2's fine-tune.py learns it (and as inference stops): what a trained
# Baichuan2 chat model's template must render; our named `baichuan2`.
BAICHUAN2 = ("{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% set loop_messages = messages[1:] "
             "%}{% else %}{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if "
             "message['role'] == 'user' %}{{ '<reserved_106>' + message['content'] }}{% elif message['role'] == "
             "'assistant' %}{{ '<reserved_107>' + message['content'] + eos_token }}{% endif %}{% endfor %}{% if "
             "add_generation_prompt %}{{ '<reserved_107>' }}{% endif %}")
BAICHUAN2_GENERATION = BAICHUAN2.replace("{{ '<reserved_107>' + message['content'] + eos_token }}",
                                         "{{ '<reserved_107>' }}{% generation %}{{ message['content'] + eos_token }}"
                                         "{% endgeneration %}")

FAMILIES: dict[str, dict[str, Any]] = {
    # family: byte-level BPE (Qwen2, Llama-3) or SentencePiece-style BPE (Baichuan2), its special tokens, its template
    "qwen2": {"kind": "bytelevel", "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>",
              "pad": "<|endoftext|>", "bos": None, "template": QWEN2, "generation": QWEN2_GENERATION,
              "end_of_turn": "<|im_end|>"},
    "llama3": {"kind": "bytelevel", "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                 "<|end_header_id|>", "<|eot_id|>"],
               "eos": "<|end_of_text|>", "pad": None, "bos": "<|begin_of_text|>", "template": LLAMA3,
               "generation": LLAMA3_GENERATION, "end_of_turn": "<|eot_id|>"},
    "baichuan2": {"kind": "metaspace", "specials": ["<unk>", "<s>", "</s>", "<reserved_106>", "<reserved_107>"],
                  "eos": "</s>", "pad": "<unk>", "bos": "<s>", "template": BAICHUAN2,
                  "generation": BAICHUAN2_GENERATION, "end_of_turn": "</s>"},
}

CORPUS = [
    "Hello there! How are you today? I am fine, thank you.", "What is the capital of France? Paris is.",
    "Tell me a joke about cats and dogs.", "The quick brown fox jumps over the lazy dog.",
    "你好，今天天气怎么样？天气很好。", "请把这句话翻译成英文：我爱自然语言处理。", "Answer briefly: two plus two is four.",
    "Write a haiku about the sea, the wind and the moon.", "You are a helpful assistant.",
    "Thanks! Goodbye, see you tomorrow.", "Summarize: transformers use attention over tokens.",
]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    """``records`` as a UTF-8 JSONL file at ``path`` (as a user's data file)."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def conversation() -> list[dict[str, str]]:
    """Multi-turn, with a system message, leading/trailing spaces and Chinese text."""
    return [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Hello there! How are you today?"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "请把这句话翻译成英文：我爱自然语言处理。"},
        {"role": "assistant", "content": "I love natural language processing."},
        {"role": "user", "content": " Tell me a joke about cats. "},
        {"role": "assistant", "content": "Cats and dogs: the quick brown fox jumps over the lazy dog!"},
    ]


def build_tokenizer(out: Path, family: str, *, chat_template: str | None = "default",
                    spec: dict[str, Any] | None = None) -> Path:
    """Train a small BPE tokenizer of ``family``'s kind with ``tokenizers``, wrap it in transformers'
    ``PreTrainedTokenizerFast`` with the family's special tokens and chat template (``None``: no template), save it
    to ``out`` and return ``out``. ``spec``: a family not in :data:`FAMILIES` (same keys)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family] if spec is None else spec
    if spec["kind"] == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        alphabet = sorted(set("".join(CORPUS + [m["content"] for m in conversation()])) | set(" \n:?!.,"))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["specials"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], pad_token=spec["pad"],
                                   bos_token=spec["bos"], unk_token="<unk>" if spec["kind"] == "metaspace" else None)
    fast.add_special_tokens({"additional_special_tokens": [t for t in spec["specials"]
                                                           if t not in (spec["eos"], spec["pad"], spec["bos"])]})
    if chat_template is not None:
        fast.chat_template = spec["template"] if chat_template == "default" else chat_template
    fast.save_pretrained(str(out))
    return out
