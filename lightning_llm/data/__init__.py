"""Datamodules and data utilities."""

from lightning_llm.data.base import LLMDataModule, load_tokenizer
from lightning_llm.data.instruction import InstructionDataModule
from lightning_llm.data.packing import pack_examples
from lightning_llm.data.pairs import SentencePairDataModule
from lightning_llm.data.preference import PreferenceDataModule, make_preference_pairs
from lightning_llm.data.prompts import PromptDataModule
from lightning_llm.data.synthetic import SyntheticPairDataModule, generate_pair_dataset
from lightning_llm.data.text import TextDataModule, generated_corpus
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.data.unpaired import UnpairedPreferenceDataModule, make_unpaired_records
from lightning_llm.files import DataError, atomic_open, read_records, write_jsonl_atomic

__all__ = [
    "ByteTokenizer", "InstructionDataModule", "DataError", "TextDataModule", "generated_corpus", "LLMDataModule", "PreferenceDataModule", "PromptDataModule", "SentencePairDataModule", "SyntheticPairDataModule", "atomic_open",
    "generate_pair_dataset", "make_preference_pairs", "load_tokenizer", "pack_examples", "read_records", "write_jsonl_atomic",
    "UnpairedPreferenceDataModule", "make_unpaired_records",
]
