"""A generated preference dataset for training a reward model with our classification task (no outside files).

Rows are CLUE-format sentence pairs ``{"sentence1": prompt, "sentence2": response, "label": "1" | "0"}`` where the
label says whether at least ``threshold`` of the response's characters belong to a target set (default digits) --
the same preference :class:`~lightning_llm.rl.rewards.CharShareReward` scores, but learned by a classifier from
examples. A WordPiece ``tokenizer/vocab.txt`` covering printable ASCII and Latin-1 (each character as a word start
and as a ``##`` continuation) is written alongside, so byte-level policy outputs tokenize character by character.

    python -m lightning_llm.rl.examples.synthetic OUT_DIR        # then configs/ppo_reward_model.yaml's header
"""

from __future__ import annotations

import argparse
import logging
import random
import string
from pathlib import Path

from lightning_llm.data.prompts import make_prompts
from lightning_llm.files import atomic_open, write_jsonl_atomic
from lightning_llm.rl.rewards.verifiers import CHAR_SETS

log = logging.getLogger(__name__)

__all__ = ["write_reward_pairs"]

_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _alphabet() -> list[str]:
    chars = [c for c in string.printable if not c.isspace()]
    chars += [chr(i) for i in range(0xA1, 0x100) if chr(i).isprintable()]
    return sorted({c.lower() for c in chars})


def write_reward_pairs(out_dir: str | Path, *, n_train: int = 2000, n_val: int = 200, chars: str = "digits",
                       threshold: float = 0.5, max_len: int = 16, seed: int = 0) -> Path:
    """Write ``train.json`` / ``dev.json`` / ``test.json`` (CLUE pairs) and ``tokenizer/vocab.txt``; returns
    ``out_dir``. Each response draws target characters with a per-row probability uniform in [0, 1] and other
    printable characters otherwise; about one row in 20 is empty (label 0)."""
    out = Path(out_dir)
    rng = random.Random(seed)
    target = sorted(set(CHAR_SETS.get(chars, chars)))
    others = [c for c in _alphabet() + list(string.ascii_uppercase) if c not in target]

    def rows(n: int, prompts: list[str]) -> list[dict[str, str]]:
        data = []
        for i in range(n):
            p = rng.random()
            length = 0 if rng.random() < 0.05 else rng.randint(1, max_len)
            resp = "".join(rng.choice(target) if rng.random() < p else rng.choice(others) for _ in range(length))
            if length and rng.random() < 0.2:  # a space now and then: several words
                cut = rng.randint(0, length)
                resp = resp[:cut] + " " + resp[cut:]
            share = sum(c in target for c in resp) / len(resp) if resp else 0.0
            data.append({"sentence1": prompts[i % len(prompts)], "sentence2": resp,
                         "label": "1" if share >= threshold else "0", "id": str(i)})
        return data

    prompts = make_prompts(256, seed=seed)
    write_jsonl_atomic(out / "train.json", rows(n_train, prompts))
    dev = rows(n_val, prompts)
    write_jsonl_atomic(out / "dev.json", dev)
    write_jsonl_atomic(out / "test.json", dev)
    alphabet = _alphabet()
    vocab = _SPECIAL + alphabet + ["##" + c for c in alphabet]
    with atomic_open(out / "tokenizer" / "vocab.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    log.info("reward pairs written to %s (%d train / %d dev, target %r, threshold %.2f)", out, n_train, n_val,
             chars, threshold)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_llm.rl.examples.synthetic", description=write_reward_pairs.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--n_train", type=int, default=2000)
    parser.add_argument("--n_val", type=int, default=200)
    parser.add_argument("--chars", default="digits")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    write_reward_pairs(a.out_dir, n_train=a.n_train, n_val=a.n_val, chars=a.chars, threshold=a.threshold, seed=a.seed)
    print(f"reward pairs written to {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
