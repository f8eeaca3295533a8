"""A dependency-free byte-level tokenizer for runs without a tokenizer directory (debug models, tests), and its
files for ``transformers.AutoTokenizer`` (:meth:`ByteTokenizer.save_pretrained`: an export carries it)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
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

    def settings(self) -> dict[str, Any]:
        """Plain data that rebuilds this tokenizer (``ByteTokenizer(**settings)``): a checkpoint records it."""
        return {"added_tokens": list(self.added_tokens), "split_special_tokens": self.split_special_tokens}

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

    def __call__(self, texts: str | list[str], text_pair: str | list[str] | None = None, *,
                 add_special_tokens: bool = False, truncation: bool | str = False, max_length: int | None = None,
                 **_: Any) -> dict[str, Any]:
        """``{"input_ids"}`` of a text or a list of texts (bytes only); with ``text_pair``, sentence pairs as BERT
        encodes them (see :meth:`encode_pair`), with ``token_type_ids``."""
        if text_pair is not None:
            if truncation not in (False, True, "longest_first", "do_not_truncate"):
                raise ValueError(f"truncation={truncation!r}: the byte tokenizer cuts sentence pairs longest_first "
                                 "only (as BERT's default)")
            pairs = [(texts, text_pair)] if isinstance(texts, str) else list(zip(texts, text_pair, strict=True))
            limit = max_length if truncation not in (False, "do_not_truncate") else None
            encoded = [self.encode_pair(a, b, max_length=limit) for a, b in pairs]
            ids, types = [e[0] for e in encoded], [e[1] for e in encoded]
            return {"input_ids": ids[0], "token_type_ids": types[0]} if isinstance(texts, str) else \
                {"input_ids": ids, "token_type_ids": types}
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    def encode_pair(self, first: str, second: str, *, max_length: int | None = None) -> tuple[list[int], list[int]]:
        """``(ids, token_type_ids)`` of a sentence pair laid out as BERT lays it out, ``<bos>`` and ``<eos>`` in the
        places of ``[CLS]`` and ``[SEP]``: ``<bos> first <eos> second <eos>``, type 0 up to the first ``<eos>``, 1
        after. Longer than ``max_length``: cut as transformers' ``truncation="longest_first"`` cuts a pair."""
        a, b = self.encode(first), self.encode(second)
        if max_length is not None:
            n_a, n_b = longest_first(len(a), len(b), max(max_length - 3, 0))
            a, b = a[:n_a], b[:n_b]
        ids = [self.bos_token_id, *a, self.eos_token_id, *b, self.eos_token_id]
        return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)

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

    def save_pretrained(self, directory: str | Path, *, token_type_ids: bool = False) -> None:
        """Write ``tokenizer.json`` (a ``tokenizers`` byte-fallback BPE without merges: the UTF-8 bytes of a text are
        ids 0-255, the special and added tokens follow as here) and ``tokenizer_config.json``, which
        ``AutoTokenizer.from_pretrained`` loads to give the same ids as this tokenizer: texts, sentence pairs
        (``<bos> a <eos> b <eos>``) and special tokens read from text or not as here. ``token_type_ids``: the loaded
        tokenizer returns them too (an encoder's export: BERT reads a pair's segments from them; a decoder's model
        would refuse the argument). Decoding is the same for valid UTF-8 (each invalid byte decodes to U+FFFD there,
        each invalid sequence here)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors

        tok = Tokenizer(models.BPE(vocab={f"<0x{i:02X}>": i for i in range(256)}, merges=[], byte_fallback=True))
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        names = sorted(self._special, key=self._special.__getitem__)  # ids 256, 257, ... in order
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
        tok.post_processor = processors.TemplateProcessing(
            single="$A", pair=f"{self.bos_token} $A:0 {self.eos_token}:0 $B:1 {self.eos_token}:1",
            special_tokens=[(self.bos_token, self.bos_token_id), (self.eos_token, self.eos_token_id)])
        directory = Path(directory)
        tok.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens_map,
                  "split_special_tokens": self.split_special_tokens, "padding_side": self.padding_side,
                  "clean_up_tokenization_spaces": False,
                  "model_input_names": ["input_ids", *(["token_type_ids"] if token_type_ids else []),
                                        "attention_mask"]}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

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


def longest_first(n_a: int, n_b: int, budget: int) -> tuple[int, int]:
    """How many tokens of each text of a pair stay within ``budget``, as the ``tokenizers`` library's
    ``LongestFirst`` truncation keeps them: the shorter text whole when the longer can take the rest, else half each
    (the odd token to the longer)."""
    if n_a + n_b <= budget:
        return n_a, n_b
    short, long = sorted((n_a, n_b))
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short = budget // 2
        long = short + budget % 2
    return (long, short) if n_a > n_b else (short, long)
