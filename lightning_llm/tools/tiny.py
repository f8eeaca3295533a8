"""Tiny random checkpoints of the Mixture-of-Experts families, the hybrid families, Gemma and the dense families with
layouts of their own, written by transformers (no download): what the configs' headers fine-tune and the tests load.

    python -m lightning_llm.tools.tiny gpt_oss OUT_DIR     # GptOssForCausalLM, experts as MXFP4 (as published)
    python -m lightning_llm.tools.tiny olmoe OUT_DIR       # OlmoeForCausalLM
    python -m lightning_llm.tools.tiny deepseek_v3 OUT_DIR # DeepseekV3ForCausalLM (Multi-head Latent Attention)
    python -m lightning_llm.tools.tiny glm4_moe OUT_DIR    # Glm4MoeForCausalLM
    python -m lightning_llm.tools.tiny phi3 OUT_DIR        # Phi3ForCausalLM (LongRoPE, partial rotary)
    python -m lightning_llm.tools.tiny glm4 OUT_DIR        # Glm4ForCausalLM
    python -m lightning_llm.tools.tiny olmo3 OUT_DIR       # Olmo3ForCausalLM
    python -m lightning_llm.tools.tiny smollm3 OUT_DIR     # SmolLM3ForCausalLM
    python -m lightning_llm.tools.tiny qwen3_5 OUT_DIR     # Qwen3_5ForConditionalGeneration (as published: the
                                                           # language model's Gated DeltaNet + gated attention
                                                           # layers, a tiny vision tower)
    python -m lightning_llm.tools.tiny qwen3_5_text OUT_DIR  # Qwen3_5ForCausalLM (the language model alone)
    python -m lightning_llm.tools.tiny qwen3_next OUT_DIR  # Qwen3NextForCausalLM (the same, MoE)
    python -m lightning_llm.tools.tiny gemma2 OUT_DIR      # Gemma2ForCausalLM (soft-capped scores and logits)
    python -m lightning_llm.tools.tiny gemma3 OUT_DIR      # Gemma3ForConditionalGeneration (a tiny SigLIP tower)

``OUT_DIR`` gets ``config.json`` and ``model.safetensors`` from ``save_pretrained`` of transformers' model of the
family's debug size (``debug-gpt-oss`` / ``debug-olmoe`` / ``debug-deepseek-v3`` / ``debug-glm4-moe``: 4 layers,
hidden 64, 8 experts, top-2; the routers' correction biases, which transformers starts at 0, drawn; ``debug-phi3`` /
``debug-glm4`` / ``debug-olmo3`` / ``debug-smollm3``: 4 dense layers, hidden 64; ``debug-qwen3.5`` /
``debug-qwen3-next``: three Gated DeltaNet layers and one gated attention layer; the multimodal classes' language
model of that size beside a one-layer vision tower) and a byte-level BPE
tokenizer of 300 ids trained on the generated corpus (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2). gpt-oss's experts are then
stored as openai/gpt-oss-20b is published: their matrices as MXFP4 ``*_blocks``/``*_scales`` (:func:`quantize_mxfp4`)
with a ``quantization_config`` (``--plain`` keeps them in fp32). The directory is built beside ``OUT_DIR`` and swapped
in whole.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_llm.data.text import generated_corpus
from lightning_llm.models import named_config
from lightning_llm.models.hf import config_to_hf
from lightning_llm.models.hf.architectures import DEFAULT_ARCHITECTURE, SUPPORTED_ARCHITECTURES
from lightning_llm.reliability import staged_directory

log = logging.getLogger(__name__)

__all__ = ["FAMILIES", "main", "quantize_mxfp4", "to_mxfp4", "write_bpe_tokenizer", "write_tiny"]

FAMILIES = {"gpt_oss": ("debug-gpt-oss", "GptOssForCausalLM"), "olmoe": ("debug-olmoe", "OlmoeForCausalLM"),
            "deepseek_v3": ("debug-deepseek-v3", "DeepseekV3ForCausalLM"),
            "glm4_moe": ("debug-glm4-moe", "Glm4MoeForCausalLM"), "phi3": ("debug-phi3", "Phi3ForCausalLM"),
            "glm4": ("debug-glm4", "Glm4ForCausalLM"), "olmo3": ("debug-olmo3", "Olmo3ForCausalLM"),
            "smollm3": ("debug-smollm3", "SmolLM3ForCausalLM"), "qwen3_5_text": ("debug-qwen3.5", "Qwen3_5ForCausalLM"),
            "qwen3_next": ("debug-qwen3-next", "Qwen3NextForCausalLM"), "gemma2": ("debug-gemma2", "Gemma2ForCausalLM"),
            "gemma3": ("debug-gemma3", "Gemma3ForConditionalGeneration"),
            "qwen3_5": ("debug-qwen3.5", "Qwen3_5ForConditionalGeneration")}
"""family -> (our debug size, the transformers class written)."""
VOCAB = 304
"""The model's vocabulary: the tokenizer's 300 ids rounded up to a multiple of 8."""
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


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


def quantize_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """[E, R, C] -> MXFP4 blocks [E, R, C/32, 16] uint8 (two FP4 codes per byte, the low nibble first) and scales
    [E, R, C/32] uint8 (one power of two per 32 values, its exponent + 127): each block divided by the smallest power
    of two that brings it within +-6, rounded to the nearest FP4 value."""
    e, r, c = w.shape
    x = w.float().reshape(e, r, c // 32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = ((x / torch.pow(2.0, exp)[..., None])[..., None] - _FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def to_mxfp4(out: Path) -> None:
    """Rewrite a saved gpt-oss checkpoint's expert matrices as MXFP4 (the matrix transposed: [E, 2I, H] with the gate
    and up rows alternating, [E, H, I]) and add the ``quantization_config`` the published checkpoints carry."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))
    for key in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        sd[f"{key}_blocks"], sd[f"{key}_scales"] = quantize_mxfp4(sd.pop(key).transpose(1, 2))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tiny(family: str, out: str | Path, *, mxfp4: bool = True, seed: int = 0) -> Path:
    """Write the tiny checkpoint and tokenizer of ``family`` (see the module docstring) to ``out``."""
    import transformers

    size, arch = FAMILIES[family]
    nested = SUPPORTED_ARCHITECTURES[arch].nested
    hf = config_to_hf(named_config(size, family="decoder", vocab_size=VOCAB),
                      DEFAULT_ARCHITECTURE[nested] if nested else arch)
    hf.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cls = getattr(transformers, arch)
    config = cls.config_class(**{k: v for k, v in hf.items() if k not in ("model_type", "dtype")}) if not nested \
        else _MULTIMODAL[arch]({k: v for k, v in hf.items() if k not in ("architectures", "dtype")})
    with staged_directory(out, flag="OUT_DIR") as tmp:
        write_bpe_tokenizer(tmp, generated_corpus(50), vocab_size=300)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(config)
            with torch.no_grad():  # a checkpoint's own biases (zeros would not show that they are read)
                for name, buf in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        buf.copy_(torch.randn(buf.shape) * 0.05)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(str(tmp))
        if family == "gpt_oss" and mxfp4:
            to_mxfp4(tmp)
    log.info("tiny %s written to %s", arch, out)
    return Path(out)


def _gemma3_multimodal(text: dict) -> Any:
    """A ``Gemma3Config`` around the text config ``text``: a one-layer SigLIP tower of 16x16 images in 4x4 patches,
    pooled to 4 image tokens (ids inside the vocabulary)."""
    import transformers

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                     image_token_index=VOCAB - 1, tie_word_embeddings=text["tie_word_embeddings"])


def _qwen3_5_multimodal(text: dict) -> Any:
    """A ``Qwen3_5Config`` around the text config ``text`` (its rotary given the interleaved M-RoPE sections the
    published configs carry): a one-layer vision tower of 2x2 patches, unmerged (ids inside the vocabulary)."""
    import transformers

    rope = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}  # 2 rotary frequencies
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=2, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
    return transformers.Qwen3_5Config(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                                      image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
                                      vision_start_token_id=VOCAB - 4, vision_end_token_id=VOCAB - 3,
                                      tie_word_embeddings=text["tie_word_embeddings"])


_MULTIMODAL = {"Gemma3ForConditionalGeneration": _gemma3_multimodal,
               "Qwen3_5ForConditionalGeneration": _qwen3_5_multimodal}
"""multimodal class -> its config around a text config dict."""


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
