"""The record of one Hugging Face model family: everything the tables of :mod:`..hf` read about it.

A family is one file of ``families/`` holding its record (a :class:`Family` instance in the file's ``RECORDS``):
its HF classes and the head each carries, its ``config.json`` <-> :class:`~lightning_llm.models.ModelConfig`
conversion, its weight names, what a peft adapter is called in its checkpoints, its options that are not built
(refused by name), its named debug sizes, the tiny checkpoint ``tools/tiny.py`` writes of it and the named chat
template of its format. As in transformers'
modular files, a family states only its differences: the LLaMA layout is one record (``families/llama.py``) that the
decoders with LLaMA's module names derive from, overriding the attributes and hooks they change; a multimodal class
fine-tuned as text is a :class:`Multimodal` record naming its language model's family.

The tables of ``convert/`` read the records (:mod:`..convert.registry` finds them): :mod:`..convert.architectures`
(the supported classes, the docs' family list), :mod:`..convert.config` (the conversion), :mod:`..convert.weights`
(the weight names), :mod:`..convert.adapters` (peft's names and rows); :mod:`.options` holds the refusals,
``models/sizes.py`` the named sizes, ``tools/tiny.py`` the tiny checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from torch import Tensor

from ...config import ModelConfig
from .entries import Entry, Fused, Stacked
from .options import Unbuilt

__all__ = ["Arch", "Family", "GROUPS", "LLAMA_SIZE", "Multimodal", "NestedLM", "decoder_classes", "encoder_classes"]

GROUPS = {
    "dense": "Dense decoders",
    "moe": "Mixture-of-Experts decoders",
    "hybrid": "Hybrid decoders (Gated DeltaNet and attention layers)",
    "encoder": "Encoders",
    "multimodal": "Multimodal checkpoints fine-tuned as text (the language model trained; the vision tower and "
                  "projector copied byte for byte at export)",
}
"""The docs' groups of families (a record's ``group``), in the order the docs list them."""

LLAMA_SIZE: Mapping[str, Any] = MappingProxyType(dict(family="decoder", norm="rmsnorm", activation="swiglu",
                                                      position="rope", pre_norm=True))
"""The :class:`ModelConfig` fields every LLaMA-layout named size starts from."""


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
    ``model.language_model`` and ``text_config``; the rest copied at export: :mod:`..convert.multimodal`)."""


def decoder_classes(*names: str, classifier: bool = True) -> dict[str, str]:
    """``XForCausalLM``, ``XModel`` and (``classifier``: where transformers has it) ``XForSequenceClassification`` (a
    ``score`` head: reward models) of a decoder family (``names``: the class prefixes), each with its head."""
    heads = (("ForCausalLM", "lm"), ("Model", "base")) + ((("ForSequenceClassification", "cls"),) if classifier else ())
    return {f"{n}{suffix}": head for n in names for suffix, head in heads}


def encoder_classes(name: str, *, pretraining: bool = False) -> dict[str, str]:
    """``XModel``, ``XForSequenceClassification`` and ``XForMaskedLM`` (and, ``pretraining``: BERT's
    ``XForPreTraining``, read as its MLM head) of an encoder family (``name``: the class prefix), each with its head."""
    heads = (("Model", "base"), ("ForSequenceClassification", "cls"), ("ForMaskedLM", "mlm")) + (
        (("ForPreTraining", "mlm"),) if pretraining else ())
    return {f"{name}{suffix}": head for suffix, head in heads}


class Family:
    """One HF family. Class attributes are its data, methods its conversions; a record is an instance (the file's
    ``RECORDS``), and a family derived from another overrides what differs."""

    model_type: ClassVar[str] = ""
    """HF ``model_type`` (a record's key)."""
    label: ClassVar[str] = ""
    """The models it is, as the docs name them."""
    group: ClassVar[str] = "dense"
    """The docs' group (a key of :data:`GROUPS`)."""
    family: ClassVar[str] = "decoder"
    """:attr:`ModelConfig.family` of what it builds."""
    classes: ClassVar[Mapping[str, str]] = MappingProxyType({})
    """HF class name -> the head it carries (``base``, ``lm``, ``cls``, ``mlm``: :class:`Arch`)."""
    default_class: ClassVar[str | None] = None
    """The class a checkpoint without ``architectures`` is read as, and a model of this type is written as by
    default; None: its ``lm`` class, else its ``base`` class."""
    base_prefix: ClassVar[str] = "model."
    """The base model's prefix of its keys in the head classes (``model.layers.0...``)."""
    head_keys: ClassVar[re.Pattern[str]] = re.compile(r"^(score|lm_head)\.")
    """Head weights of other tasks in its checkpoints: dropped with a warning (an MLM head when loading a backbone;
    the LM head of a ``...ForCausalLM`` a reward model starts from)."""
    unbuilt: ClassVar[tuple[Unbuilt, ...]] = ()
    """Options of its ``config.json`` that are not built: refused in one line naming the file and the option."""
    fused_in_hf: ClassVar[Mapping[str, tuple[str, ...]]] = MappingProxyType({})
    """Its HF projections that fuse several of ours (Phi-3's ``qkv_proj`` = q/k/v): a peft adapter on them is not
    the one on ours."""
    module_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    """``(our module path piece, the HF one)`` where its HF names differ from ours below the block (a peft adapter's
    keys name them so)."""
    peft_reroutes_mlp: ClassVar[bool] = False
    """peft (``convert_peft_config_for_transformers``) loads its LoRA adapters with the targets ``gate_proj`` /
    ``up_proj`` / ``down_proj`` moved to the fused experts of transformers 5: a LoRA on a dense or shared MLP of
    these names would not load as trained."""
    sizes: ClassVar[Mapping[str, Mapping[str, Any]]] = MappingProxyType({})
    """Named sizes of this family (``debug-...``): the :class:`ModelConfig` fields (``extra["hf_model_type"]`` is
    added: a model of that size is written as this family by default). Not inherited."""
    tiny: ClassVar[str | None] = None
    """The named size ``tools/tiny.py`` writes a tiny checkpoint of (as :meth:`architecture`'s class), if any. Not
    inherited."""
    chat_template: ClassVar[str | None] = None
    """The named chat template (``--data.template``: ``data/chat/template.py``) of its chat models' format, if one is;
    the docs' family list names it. Not inherited."""
    guess_rank: ClassVar[int | None] = None
    """A model of no recorded family is written as the first family, by this rank, whose :meth:`guess` accepts its
    config; None: never guessed. Not inherited (a derived family is guessed only where it says so)."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.guess_rank = cls.__dict__.get("guess_rank")
        cls.sizes = cls.__dict__.get("sizes", MappingProxyType({}))
        cls.tiny = cls.__dict__.get("tiny")
        cls.chat_template = cls.__dict__.get("chat_template")

    def __repr__(self) -> str:
        return f"<family {self.model_type}>"

    # ------------------------------------------------------------------------------------------------ classes

    def arches(self) -> dict[str, Arch]:
        """Its classes as :class:`Arch` rows."""
        return {name: Arch(self.model_type, head) for name, head in self.classes.items()}

    def architecture(self) -> str:
        """:attr:`default_class`, resolved."""
        if self.default_class is not None:
            return self.default_class
        for want in ("lm", "base"):
            for name, head in self.classes.items():
                if head == want:
                    return name
        raise ValueError(f"{self.model_type} has no class to write")

    # ------------------------------------------------------------------------------------------------ config

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        """:class:`ModelConfig` of a ``config.json`` dict of class ``arch`` (its options not built are already
        refused; ``where`` names the file in errors). A decoder's classifier gets its ``num_labels`` from the
        caller."""
        raise NotImplementedError(self.model_type)

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        """The architecture fields of its ``config.json`` (the caller adds the common ones and checks that the
        result reads back as ``c``)."""
        raise NotImplementedError(self.model_type)

    def guess(self, c: ModelConfig) -> bool:
        """Whether a model of no recorded family (``c`` of :attr:`family`) is written as this one (:attr:`guess_rank`
        orders the families asked)."""
        return False

    # ------------------------------------------------------------------------------------------------ weights

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        """The mapping of its keys (without :attr:`base_prefix`, but for ``top`` entries) to ours, for a class
        carrying ``head``."""
        raise NotImplementedError(self.model_type)

    def ignored_key(self, c: ModelConfig, key: str) -> bool:
        """A checkpoint key (prefix removed) of weights transformers does not build either (multi-token-prediction
        layers): ignored on load, with a warning."""
        return False

    # ------------------------------------------------------------------------------------------------ adapters

    def module_name_to_hf(self, c: ModelConfig, name: str) -> str:
        """Our module path inside the decoder -> the HF model's (``model.`` not added)."""
        for ours, hf in self.module_renames:
            name = name.replace(ours, hf)
        return name

    def module_name_from_hf(self, c: ModelConfig, name: str) -> str:
        """Inverse of :meth:`module_name_to_hf`."""
        for ours, hf in self.module_renames:
            name = name.replace(hf, ours)
        return name

    def adapter_tensor_to_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        """An adapter tensor of ours (peft state-dict name) in the checkpoint's row order."""
        return t

    def adapter_tensor_from_hf(self, c: ModelConfig, name: str, t: Tensor) -> Tensor:
        """Inverse of :meth:`adapter_tensor_to_hf`."""
        return t

    # ------------------------------------------------------------------------------------------------ tiny

    def tiny_config(self, hf: dict[str, Any]) -> Any:
        """The transformers config object :attr:`tiny`'s checkpoint is written with, from our ``config.json`` dict
        of it."""
        import transformers

        cls = getattr(transformers, self.architecture())
        return cls.config_class(**{k: v for k, v in hf.items() if k not in ("model_type", "dtype")})

    def tiny_written(self, directory: Path, *, plain: bool) -> None:
        """Rewrite the tiny checkpoint just saved in ``directory`` as the family is published (``plain``: leave it
        as saved)."""


@dataclass(frozen=True)
class NestedLM:
    """How a multimodal class nests its language model."""

    text_types: tuple[str, ...]
    """``text_config.model_type`` values this class's language model may have."""
    tie_default: bool
    """The outer config class's ``tie_word_embeddings`` default (transformers ties the head by the outer value)."""
    text_defaults: dict[str, Any] = field(default_factory=dict)
    """The text config class's defaults where they differ from the language model's own class."""
    flat: bool = False
    """A config without ``text_config`` holds the text keys at its top level (pre-v5 Qwen2.5-VL)."""
    tie_from_text: bool = False
    """An untied outer config is tied when ``text_config.tie_word_embeddings`` is true (Qwen's pre-v5 saves)."""
    logit_softcap: bool = True
    """The class applies ``text_config.final_logit_softcapping`` (Gemma3ForConditionalGeneration does not)."""


class Multimodal(Family):
    """A multimodal class fine-tuned as text (:mod:`..convert.multimodal`): its language model is a record of
    :attr:`text_kind`, which converts its config and names its weights; the rest of the checkpoint is copied at
    export."""

    group = "multimodal"
    text_kind: ClassVar[str] = ""
    """The language model's model type (a record: its weight layout and config conversion)."""
    nested: ClassVar[NestedLM]

    def arches(self) -> dict[str, Arch]:
        return {name: Arch(self.model_type, head, nested=self.text_kind) for name, head in self.classes.items()}
