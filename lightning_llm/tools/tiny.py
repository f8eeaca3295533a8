"""Tiny random checkpoints of the HF families whose record names a tiny size (``Family.tiny``: the MoE and hybrid
families, Gemma, the dense families with layouts of their own, multimodal classes), written by transformers (no
download): what the configs' headers fine-tune and the tests load.

    python -m lightning_llm.tools.tiny gpt_oss OUT_DIR     # GptOssForCausalLM, experts as MXFP4 (as published)
    python -m lightning_llm.tools.tiny deepseek_v3 OUT_DIR # DeepseekV3ForCausalLM (Multi-head Latent Attention)
    python -m lightning_llm.tools.tiny qwen3_5 OUT_DIR     # Qwen3_5ForConditionalGeneration (as published: the
                                                           # language model's Gated DeltaNet + gated attention
                                                           # layers, a tiny vision tower)
    python -m lightning_llm.tools.tiny gemma3 OUT_DIR      # Gemma3ForConditionalGeneration (a tiny SigLIP tower)
    python -m lightning_llm.tools.tiny --help              # every family (its model type)

``OUT_DIR`` gets ``config.json`` and ``model.safetensors`` from ``save_pretrained`` of transformers' model of the
family's debug size (4 layers, hidden 64; the MoE families 8 experts, top-2, the routers' correction biases, which
transformers starts at 0, drawn; the hybrids three Gated DeltaNet layers and one gated attention layer; a multimodal
class's language model of that size beside a one-layer vision tower: its record's ``tiny_config``) and a byte-level
BPE tokenizer of 300 ids trained on the generated corpus (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2). A record may rewrite
the saved checkpoint as its family is published (``tiny_written``: gpt-oss's experts as MXFP4 ``*_blocks`` /
``*_scales`` with a ``quantization_config``; ``--plain`` keeps them in fp32). The directory is built beside
``OUT_DIR`` and swapped in whole.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path

import torch

from lightning_llm.data.text import generated_corpus
from lightning_llm.models import named_config
from lightning_llm.models.hf import config_to_hf
from lightning_llm.models.hf.convert.architectures import DEFAULT_ARCHITECTURE
from lightning_llm.models.hf.families.gpt_oss import quantize_mxfp4, to_mxfp4
from lightning_llm.models.hf.record.family import Multimodal
from lightning_llm.models.hf.convert.registry import FAMILIES as RECORDS
from lightning_llm.reliability import staged_directory

log = logging.getLogger(__name__)

__all__ = ["FAMILIES", "main", "quantize_mxfp4", "to_mxfp4", "write_bpe_tokenizer", "write_tiny"]

FAMILIES = {kind: (record.tiny, record.architecture()) for kind, record in RECORDS.items() if record.tiny}
"""family (its model type) -> (our debug size, the transformers class written), from the family records."""
VOCAB = 304
"""The model's vocabulary: the tokenizer's 300 ids rounded up to a multiple of 8."""


def write_bpe_tokenizer(out: str | Path, texts: list[str], *, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer trained on ``texts`` with ``tokenizers`` and saved by transformers into ``out``
    (``<pad>``=0, ``<s>``=1, ``</s>``=2, the EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
                            ).save_pretrained(str(out))
    return Path(out)


def write_tiny(family: str, out: str | Path, *, mxfp4: bool = True, seed: int = 0) -> Path:
    """Write the tiny checkpoint and tokenizer of ``family`` (see the module docstring) to ``out``."""
    import transformers

    record = RECORDS[family]
    size, arch = FAMILIES[family]
    text = DEFAULT_ARCHITECTURE[record.text_kind] if isinstance(record, Multimodal) else arch
    hf = config_to_hf(named_config(size, family="decoder", vocab_size=VOCAB), text)
    hf.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with staged_directory(out, flag="OUT_DIR") as tmp:
        write_bpe_tokenizer(tmp, generated_corpus(50), vocab_size=300)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(transformers, arch)(record.tiny_config(hf))
            with torch.no_grad():  # a checkpoint's own biases (zeros would not show that they are read)
                for name, buf in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        buf.copy_(torch.randn(buf.shape) * 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(str(tmp))
        record.tiny_written(tmp, plain=not mxfp4)
    log.info("tiny %s written to %s", arch, out)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_llm.tools.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir")
    parser.add_argument("--plain", action="store_true", help="gpt-oss: the experts in fp32, not MXFP4")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    write_tiny(a.family, a.out_dir, mxfp4=not a.plain, seed=a.seed)
    print(f"tiny {FAMILIES[a.family][1]} written to {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
