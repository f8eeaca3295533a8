"""The chat templates Phi-3, Phi-4 and OLMo 2 ship (in their tokenizer_config.json) train as transformers renders them:
a multi-turn conversation's ids are ``apply_chat_template``'s, the learned positions are exactly what
``return_assistant_tokens_mask`` marks under the same template with ``{% generation %}`` around each reply (content and
end-of-turn token), the generation prompt is transformers', and generation stops at the end-of-turn token.

Phi-3's template appends EOS after the last turn when no generation prompt is asked for (the rendering of a
conversation up to a reply is not a prefix of the whole one); OLMo 2's (Tülu 3's) writes the reply's EOS before its
newline except in the last turn. Tokenizers are built here with ``tokenizers`` (tests/chat_fixtures.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.chat_fixtures import build_tokenizer, conversation, write_jsonl

from lightning_llm.data import InstructionDataModule

# microsoft/Phi-3.5-mini-instruct tokenizer_config.json "chat_template" (also Phi-3-mini's since its June 2024 update)
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + "
        "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + "
        "'<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ "
        "eos_token }}{% endif %}")
# microsoft/phi-4 tokenizer_config.json "chat_template"
PHI4 = ("{% for message in messages %}{% if (message['role'] == 'system') %}{{'<|im_start|>system<|im_sep|>' + "
        "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + "
        "message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}{{'<|im_start|>assistant"
        "<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ "
        "'<|im_start|>assistant<|im_sep|>' }}{% endif %}")
# allenai/OLMo-2-1124-7B-Instruct tokenizer_config.json "chat_template" (Tülu 3's)
OLMO2 = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
         "message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' "
         "}}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] "
         "+ eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif "
         "%}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}")

SPECS: dict[str, dict[str, Any]] = {
    "phi3": {"kind": "metaspace", "specials": ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>",
                                               "<|assistant|>", "<|end|>"],
             "eos": "<|endoftext|>", "pad": "<|endoftext|>", "bos": "<s>", "template": PHI3,
             "generation": PHI3.replace("{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
                                        "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>' }}"
                                        "{% endgeneration %}{{ '\n' }}"),
             "end_of_turn": "<|end|>"},
    "phi4": {"kind": "bytelevel", "specials": ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"],
             "eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None, "template": PHI4,
             "generation": PHI4.replace("{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}",
                                        "{{'<|im_start|>assistant<|im_sep|>'}}{% generation %}{{ message['content'] + "
                                        "'<|im_end|>' }}{% endgeneration %}"),
             "end_of_turn": "<|im_end|>"},
    "olmo2": {"kind": "bytelevel", "specials": ["<|endoftext|>", "<|pad|>"], "eos": "<|endoftext|>", "pad": "<|pad|>",
              "bos": "<|endoftext|>", "template": OLMO2,
              "generation": OLMO2.replace("{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}",
                                          "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}"
                                          "{% endgeneration %}{{ '\n' }}").replace(
                  "{{ '<|assistant|>\n'  + message['content'] + eos_token }}",
                  "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"),
              "end_of_turn": "<|endoftext|>"},
}


def _learned(row: dict[str, Any]) -> list[int]:
    return [t + 1 for t, label in enumerate(row["labels"]) if label != -100]


@pytest.mark.parametrize("family", list(SPECS))
def test_family_template_trains_as_transformers_renders_it(family: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    spec = SPECS[family]
    tok = build_tokenizer(tmp_path / "tok", family, spec=spec)
    msgs = conversation()
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    dm = InstructionDataModule(str(data), str(tok), val_path=str(data), cutoff_len=512)
    dm.setup("fit")
    row, val = dm.datasets["fit"][0], dm.datasets["validate"][0]
    hf = AutoTokenizer.from_pretrained(str(tok))
    assert hf.apply_chat_template(msgs, tokenize=False) == hf.apply_chat_template(
        msgs, tokenize=False, chat_template=spec["generation"])  # the tagged template renders the same text
    ref = hf.apply_chat_template(msgs, chat_template=spec["generation"], return_assistant_tokens_mask=True)
    mask = [i for i, m in enumerate(ref["assistant_masks"]) if m]
    eot = hf.convert_tokens_to_ids(spec["end_of_turn"])
    print(f"{family}: {len(row['input_ids'])} tokens, {len(mask)} learned, stop ids {dm.stop_token_ids}")
    assert row["input_ids"] == hf.apply_chat_template(msgs)["input_ids"]
    assert _learned(row) == mask and sum(row["input_ids"][t] == eot for t in mask) == 3
    assert val["prompt_ids"] == hf.apply_chat_template(msgs[:-1], add_generation_prompt=True)["input_ids"]
    assert dm.stop_token_ids == list(dict.fromkeys([eot, hf.eos_token_id]))
