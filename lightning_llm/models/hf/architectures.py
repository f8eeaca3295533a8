"""The one table of Hugging Face classes this package loads and writes.

Every ``architectures[0]`` of a ``config.json`` that :func:`~lightning_llm.models.hf.load_hf` accepts is a key of
:data:`SUPPORTED_ARCHITECTURES`; a checkpoint without ``architectures`` is read by its ``model_type`` as
:data:`DEFAULT_ARCHITECTURE` names it. The docs' family list (``docs/models.md``, between the ``families`` markers) is
generated from :data:`FAMILY_GROUPS` by :func:`families_markdown` (``python -m lightning_llm.models.hf.architectures
--write docs/models.md``); ``tests/house/test_readme.py`` fails when the two differ.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Arch", "SUPPORTED_ARCHITECTURES", "DEFAULT_ARCHITECTURE", "FAMILY_GROUPS", "architecture_name",
           "families_markdown", "layout_kind", "num_labels_of"]


@dataclass(frozen=True)
class Arch:
    """One HF class: its weight layout and the head it carries."""

    kind: str
    """The ``model_type`` whose weight layout it has (llama, qwen2, ..., gpt2, bert, ...)."""
    head: str
    """``base`` (no head), ``lm`` (a language-model head), ``cls`` (a sequence classifier) or ``mlm`` (a load source
    only: its head is ignored, it is never written)."""
    nested: str | None = None
    """A multimodal class fine-tuned as text: the model type of its language model (nested under
    ``model.language_model`` and ``text_config``; the rest copied at export: :mod:`.multimodal`)."""


def _decoder(kind: str, *names: str, classifier: bool = True) -> dict[str, Arch]:
    """``XForCausalLM``, ``XModel`` and (``classifier``: where transformers has it) ``XForSequenceClassification``
    (a ``score`` head: reward models) of a decoder family (``names``: the class prefixes)."""
    heads = (("ForCausalLM", "lm"), ("Model", "base")) + ((("ForSequenceClassification", "cls"),) if classifier else ())
    return {f"{n}{suffix}": Arch(kind, head) for n in names for suffix, head in heads}


SUPPORTED_ARCHITECTURES: dict[str, Arch] = {
    **_decoder("llama", "Llama"),
    **_decoder("qwen2", "Qwen2"),
    **_decoder("qwen3", "Qwen3"),
    **_decoder("mistral", "Mistral"),
    "BaichuanForCausalLM": Arch("baichuan", "lm"),  # Baichuan2-7B (trust_remote_code; not in transformers)
    **_decoder("mixtral", "Mixtral"),
    **_decoder("qwen2_moe", "Qwen2Moe"),
    **_decoder("qwen3_moe", "Qwen3Moe"),
    **_decoder("olmoe", "Olmoe", classifier=False),  # transformers has no OlmoeForSequenceClassification
    **_decoder("gpt_oss", "GptOss"),
    **_decoder("deepseek_v2", "DeepseekV2"),
    **_decoder("deepseek_v3", "DeepseekV3"),  # DeepSeek-V3/R1, Kimi-K2
    **_decoder("glm4_moe", "Glm4Moe", classifier=False),  # GLM-4.5/4.6 (no Glm4MoeForSequenceClassification)
    **_decoder("phi3", "Phi3"),  # Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini
    **_decoder("glm4", "Glm4"),  # GLM-4-0414
    **_decoder("olmo2", "Olmo2"),
    **_decoder("olmo3", "Olmo3"),
    **_decoder("smollm3", "SmolLM3"),
    "Qwen3_5ForCausalLM": Arch("qwen3_5_text", "lm"),  # hybrids: Gated DeltaNet and gated attention layers
    "Qwen3_5TextModel": Arch("qwen3_5_text", "base"),
    "Qwen3_5MoeForCausalLM": Arch("qwen3_5_moe_text", "lm"),
    "Qwen3_5MoeTextModel": Arch("qwen3_5_moe_text", "base"),
    **_decoder("qwen3_next", "Qwen3Next"),
    **_decoder("gemma2", "Gemma2"),
    "Gemma3ForCausalLM": Arch("gemma3_text", "lm"),  # Gemma 3 1B/270M; 4B+ are Gemma3ForConditionalGeneration
    "Gemma3TextModel": Arch("gemma3_text", "base"),
    # multimodal checkpoints whose language model is one of the above (trained as text; the rest copied at export)
    "Gemma3ForConditionalGeneration": Arch("gemma3", "lm", nested="gemma3_text"),  # Gemma 3 4B, 12B, 27B
    "Qwen2_5_VLForConditionalGeneration": Arch("qwen2_5_vl", "lm", nested="qwen2"),
    "Qwen3VLForConditionalGeneration": Arch("qwen3_vl", "lm", nested="qwen3"),
    "Mistral3ForConditionalGeneration": Arch("mistral3", "lm", nested="mistral"),  # Mistral Small 3.1/3.2
    "Qwen3_5ForConditionalGeneration": Arch("qwen3_5", "lm", nested="qwen3_5_text"),  # Qwen3.5 as published
    "Qwen3_5MoeForConditionalGeneration": Arch("qwen3_5_moe", "lm", nested="qwen3_5_moe_text"),
    "GPT2LMHeadModel": Arch("gpt2", "lm"),
    "GPT2Model": Arch("gpt2", "base"),
    "GPT2ForSequenceClassification": Arch("gpt2", "cls"),
    "BertModel": Arch("bert", "base"),
    "BertForSequenceClassification": Arch("bert", "cls"),
    "BertForMaskedLM": Arch("bert", "mlm"),
    "BertForPreTraining": Arch("bert", "mlm"),
    "MegatronBertModel": Arch("megatron-bert", "base"),
    "MegatronBertForSequenceClassification": Arch("megatron-bert", "cls"),
    "MegatronBertForMaskedLM": Arch("megatron-bert", "mlm"),
    "MegatronBertForPreTraining": Arch("megatron-bert", "mlm"),
    "RobertaModel": Arch("roberta", "base"),
    "RobertaForSequenceClassification": Arch("roberta", "cls"),
    "RobertaForMaskedLM": Arch("roberta", "mlm"),
    "XLMRobertaModel": Arch("xlm-roberta", "base"),
    "XLMRobertaForSequenceClassification": Arch("xlm-roberta", "cls"),
    "XLMRobertaForMaskedLM": Arch("xlm-roberta", "mlm"),
    "DebertaV2Model": Arch("deberta-v2", "base"),
    "DebertaV2ForSequenceClassification": Arch("deberta-v2", "cls"),
    "DebertaV2ForMaskedLM": Arch("deberta-v2", "mlm"),
    "ModernBertModel": Arch("modernbert", "base"),
    "ModernBertForSequenceClassification": Arch("modernbert", "cls"),
    "ModernBertForMaskedLM": Arch("modernbert", "mlm"),
}
"""HF class name -> :class:`Arch`."""

DEFAULT_ARCHITECTURE: dict[str, str] = {
    **{a.kind: name for name, a in SUPPORTED_ARCHITECTURES.items() if a.head == "lm"},
    "bert": "BertModel",
    "megatron-bert": "MegatronBertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "deberta-v2": "DebertaV2Model",
    "modernbert": "ModernBertModel",
}
"""``model_type`` -> the class a checkpoint without ``architectures`` is read as (and a model of that type is
written as by default)."""

FAMILY_GROUPS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Dense decoders", (("llama", "Llama 1-3"), ("qwen2", "Qwen2, Qwen2.5"), ("qwen3", "Qwen3"),
                        ("mistral", "Mistral"), ("baichuan", "Baichuan2-7B"), ("gpt2", "GPT-2"),
                        ("phi3", "Phi-3, Phi-4"), ("glm4", "GLM-4 (0414)"), ("olmo2", "OLMo 2"), ("olmo3", "OLMo 3"),
                        ("smollm3", "SmolLM3"), ("gemma2", "Gemma 2"), ("gemma3_text", "Gemma 3 (1B, 270M: text only)"))),
    ("Mixture-of-Experts decoders", (("mixtral", "Mixtral"), ("qwen2_moe", "Qwen2-MoE"), ("qwen3_moe", "Qwen3-MoE"),
                                     ("olmoe", "OLMoE"), ("gpt_oss", "gpt-oss"), ("deepseek_v2", "DeepSeek-V2"),
                                     ("deepseek_v3", "DeepSeek-V3/R1, Kimi-K2"), ("glm4_moe", "GLM-4.5/4.6"))),
    ("Hybrid decoders (Gated DeltaNet and attention layers)", (("qwen3_5_text", "Qwen3.5"),
                                                               ("qwen3_5_moe_text", "Qwen3.5-MoE"),
                                                               ("qwen3_next", "Qwen3-Next"))),
    ("Encoders", (("bert", "BERT"), ("megatron-bert", "MegatronBERT (Erlangshen)"), ("roberta", "RoBERTa"),
                  ("xlm-roberta", "XLM-R"), ("deberta-v2", "DeBERTa-v2/v3 (Erlangshen-DeBERTa-v2)"),
                  ("modernbert", "ModernBERT"))),
    ("Multimodal checkpoints fine-tuned as text (the language model trained; the vision tower and projector "
     "copied byte for byte at export)",
     (("gemma3", "Gemma 3 4B/12B/27B"), ("qwen2_5_vl", "Qwen2.5-VL"), ("qwen3_vl", "Qwen3-VL"),
      ("mistral3", "Mistral Small 3.1/3.2"), ("qwen3_5", "Qwen3.5"), ("qwen3_5_moe", "Qwen3.5-MoE"))),
)
"""The docs' family list: a title and its model types with the models they are, in the order the docs list them."""


def layout_kind(architecture: str) -> str:
    """The model type whose weight layout and config conversion a class's (language) model has."""
    a = SUPPORTED_ARCHITECTURES[architecture]
    return a.nested or a.kind


def architecture_name(hf: dict[str, Any], where: str = "config") -> str:
    """The supported class a ``config.json`` dict names (``architectures[0]``, else by its ``model_type``); a
    one-line ``ValueError`` naming ``where`` otherwise."""
    archs = hf.get("architectures") or []
    if archs:
        arch = archs[0]
    else:
        mt = hf.get("model_type")
        if mt not in DEFAULT_ARCHITECTURE:
            raise ValueError(f"{where}: unsupported model_type {mt!r} and no 'architectures'; supported model types: "
                             f"{', '.join(sorted(DEFAULT_ARCHITECTURE))}")
        arch = DEFAULT_ARCHITECTURE[mt]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def num_labels_of(hf: dict[str, Any]) -> int:
    """The classes of a ``...ForSequenceClassification`` ``config.json`` dict: ``id2label``'s size, else
    ``num_labels`` (2, transformers' default)."""
    if hf.get("id2label"):
        return len(hf["id2label"])
    return int(hf.get("num_labels", 2))


def families_markdown() -> str:
    """The docs' family list: per group, each model type with its classes (written by ``--write``)."""
    lines = []
    grouped = {kind for _, kinds in FAMILY_GROUPS for kind, _ in kinds}
    missing = sorted({a.kind for a in SUPPORTED_ARCHITECTURES.values()} - grouped)
    if missing:
        raise ValueError(f"FAMILY_GROUPS lacks the model types {missing}")
    for title, kinds in FAMILY_GROUPS:
        lines.append(f"- **{title}**:")
        for kind, label in kinds:
            names = [f"`{n}`" + (" (load only)" if a.head == "mlm" else "")
                     for n, a in SUPPORTED_ARCHITECTURES.items() if a.kind == kind]
            lines.append(f"  - {label} (`{kind}`): {', '.join(names)}")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- families:begin (generated: python -m lightning_llm.models.hf.architectures --write docs/models.md) -->", \
    "<!-- families:end -->"


def replace_block(text: str) -> str:
    """``text`` with the block between the family markers replaced by :func:`families_markdown`."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no family block ({BEGIN} ... {END}) found")
    return pattern.sub(lambda _: f"{BEGIN}\n{families_markdown()}{END}", text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print the supported HF families, or rewrite a doc's family block.")
    p.add_argument("--write", metavar="MARKDOWN", help="rewrite the block between the family markers of this file")
    a = p.parse_args(argv)
    if a.write is None:
        print(families_markdown(), end="")
        return
    path = Path(a.write)
    path.write_text(replace_block(path.read_text()))


if __name__ == "__main__":
    main()
