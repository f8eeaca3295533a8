"""Data: sentence pairs, prepared corpora, packing, conversations and chat templates, tokenizers and vocabularies."""
