"""Evaluation metrics shared by tasks."""

from lightning_llm.metrics.text import TextSimilarity, rouge_l, rouge_n, sentence_bleu, tokenize_text

__all__ = ["TextSimilarity", "rouge_l", "rouge_n", "sentence_bleu", "tokenize_text"]
