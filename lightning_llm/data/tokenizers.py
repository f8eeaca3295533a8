"""A dependency-free byte-level tokenizer for runs without a tokenizer directory (debug models, tests)."""

from __future__ import annotations

from typing import Any


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then ``<pad>``=256, ``<bos>``=257, ``<eos>``=258.

    Implements the small subset of the HF tokenizer interface our datamodules use
    (``__call__``/``encode``/``decode``/``get_vocab``/special token ids).
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    pad_token, bos_token, eos_token = "<pad>", "<bos>", "<eos>"
    padding_side = "right"

    def __len__(self) -> int:
        return 259

    def get_vocab(self) -> dict[str, int]:
        vocab = {f"<0x{i:02X}>": i for i in range(256)}
        vocab.update({self.pad_token: 256, self.bos_token: 257, self.eos_token: 258})
        return vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, texts: str | list[str], add_special_tokens: bool = False, **_: Any) -> dict[str, Any]:
        if isinstance(texts, str):
            return {"input_ids": self.encode(texts)}
        return {"input_ids": [self.encode(t) for t in texts]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")

    def batch_decode(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]
