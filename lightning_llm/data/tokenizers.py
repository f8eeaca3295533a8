"""A dependency-free byte-level tokenizer for runs without a tokenizer directory (debug models, tests)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then ``<pad>``=256, ``<bos>``=257, ``<eos>``=258, then ``added_tokens`` (259, ...).

    Implements the small subset of the HF tokenizer interface our datamodules use
    (``__call__``/``encode``/``decode``/``get_vocab``/special token ids, ``apply_chat_template`` rendering text).

    ``added_tokens`` are a chat template's control tokens (e.g. ``<|im_start|>``, ``<|im_end|>``): a chat datamodule
    adds them (:func:`lightning_llm.data.chat.template.resolve_template`). With ``split_special_tokens=False`` (set
    whenever tokens are added, as a chat template needs its ``<eos>`` read as the EOS id) the special tokens written
    in a text are read as their ids, like a Hugging Face tokenizer reads them; by default a text is bytes only.
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    pad_token, bos_token, eos_token = "<pad>", "<bos>", "<eos>"
    padding_side = "right"
    chat_template = None

    def __init__(self, added_tokens: Sequence[str] = (), *, split_special_tokens: bool | None = None) -> None:
        self.added_tokens = tuple(dict.fromkeys(t for t in added_tokens if t not in self._base_specials()))
        self.split_special_tokens = not self.added_tokens if split_special_tokens is None else split_special_tokens
        self._special = {**self._base_specials(), **{t: 259 + i for i, t in enumerate(self.added_tokens)}}
        longest_first = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    @classmethod
    def _base_specials(cls) -> dict[str, int]:
        return {cls.pad_token: cls.pad_token_id, cls.bos_token: cls.bos_token_id, cls.eos_token: cls.eos_token_id}

    def __len__(self) -> int:
        return 259 + len(self.added_tokens)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return dict(self._special)

    def get_vocab(self) -> dict[str, int]:
        vocab = {f"<0x{i:02X}>": i for i in range(256)}
        vocab.update(self._special)
        return vocab

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._special.get(token)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        names = {v: k for k, v in self._special.items()}
        return names.get(token_id, f"<0x{token_id:02X}>")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.split_special_tokens:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for i, piece in enumerate(self._special_re.split(text)):
            ids.extend([self._special[piece]] if i % 2 else piece.encode("utf-8"))
        return ids

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        names = {v: k for k, v in self._special.items()}
        out, data = [], bytearray()
        for i in ids:
            if i < 256:
                data.append(i)
                continue
            out.append(data.decode("utf-8", errors="replace") + names.get(i, ""))
            data = bytearray()
        out.append(data.decode("utf-8", errors="replace"))
        return "".join(out)

    def batch_decode(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, chat_template: str,
                            tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = False, **kwargs: Any) -> str:
        """The text of ``conversation`` rendered by ``chat_template`` with transformers' own Jinja renderer (the one
        ``PreTrainedTokenizerBase.apply_chat_template`` uses), given this tokenizer's special tokens."""
        from transformers.utils.chat_template_utils import render_jinja_template

        if tokenize:
            raise ValueError("ByteTokenizer.apply_chat_template renders text only (tokenize=False)")
        rendered, _ = render_jinja_template(conversations=[conversation], tools=tools, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens_map, **kwargs})
        return rendered[0]
