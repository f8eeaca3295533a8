"""BLEU-4 / ROUGE-1/2/L parity with the packages LLaMA-Factory uses (rouge_chinese, nltk sentence_bleu method3)."""

from __future__ import annotations

import pytest
import torch

from lightning_llm.metrics import TextSimilarity, tokenize_text
from lightning_llm.metrics.text import pair_scores

# (prediction, label): exact, partial, reordered, repeated characters, shorter than 4 tokens, mixed scripts,
# punctuation that rouge_chinese splits sentences on, empty prediction, no overlap.
PAIRS = [
    ("基于深度学习的中文文本摘要方法", "基于深度学习的中文文本摘要方法"),
    ("一种改进的卷积神经网络图像分类算法", "基于卷积神经网络的图像分类方法研究"),
    ("文本分类的研究", "中文文本分类方法研究"),
    ("哈哈哈哈哈", "哈哈"),
    ("摘要", "文本摘要"),
    ("深度", "深"),
    ("BERT模型在NER任务中的应用2023", "基于BERT的命名实体识别(NER)研究"),
    ("研究。方法！结果？结论", "研究方法。结果！"),
    ("", "非空的参考标题"),
    ("完全不同", "毫无交集的句子"),
    ("面向 低资源 语言 的 机器 翻译", "低资源语言机器翻译方法"),
]


def _reference_scores(pred_tokens: list[str], label_tokens: list[str]) -> dict[str, float]:
    """LLaMA-Factory's ComputeSimilarity body with the tokens given (x100, unrounded)."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from rouge_chinese import Rouge

    if len(" ".join(pred_tokens).split()) == 0 or len(" ".join(label_tokens).split()) == 0:
        result = {"rouge-1": {"f": 0.0}, "rouge-2": {"f": 0.0}, "rouge-l": {"f": 0.0}}
    else:
        result = Rouge().get_scores(" ".join(pred_tokens), " ".join(label_tokens))[0]
    out = {k: v["f"] * 100 for k, v in result.items()}
    out["bleu-4"] = sentence_bleu([label_tokens], pred_tokens, smoothing_function=SmoothingFunction().method3) * 100
    return out


@pytest.mark.parametrize("tokenization", ["char", "jieba"])
def test_scores_match_rouge_chinese_and_nltk(tokenization: str) -> None:
    pytest.importorskip("rouge_chinese")
    pytest.importorskip("nltk")
    if tokenization == "jieba":
        pytest.importorskip("jieba")
    worst = 0.0
    for pred, label in PAIRS:
        ours = pair_scores(pred, label, tokenization)  # type: ignore[arg-type]
        ref = _reference_scores(tokenize_text(pred, tokenization), tokenize_text(label, tokenization))  # type: ignore[arg-type]
        for key in ("bleu-4", "rouge-1", "rouge-2", "rouge-l"):
            err = abs(ours[key] - ref[key])
            worst = max(worst, err)
            assert err <= 1e-6, (pred, label, key, ours[key], ref[key])
    print(f"tokenization={tokenization}: max |ours - reference| over {len(PAIRS)} pairs x 4 metrics = {worst:.3e}")


def test_char_bleu_equals_llamafactory_list_of_characters() -> None:
    """On Chinese text without spaces our char tokens are exactly LLaMA-Factory's ``list(text)`` for BLEU."""
    pytest.importorskip("nltk")
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    for pred, label in PAIRS[:6]:
        ref = sentence_bleu([list(label)], list(pred), smoothing_function=SmoothingFunction().method3) * 100
        assert abs(pair_scores(pred, label)["bleu-4"] - ref) <= 1e-6


def test_known_values() -> None:
    """Hand-checked numbers, independent of any package."""
    s = pair_scores("文本分类的研究", "中文文本分类方法研究")
    # distinct unigrams: hyp {文,本,分,类,的,研,究}=7, ref {中,文,本,分,类,方,法,研,究}=9, overlap 6
    p, r = 6 / 7, 6 / 9
    assert s["rouge-1"] == pytest.approx(100 * 2 * p * r / (p + r + 1e-8), abs=1e-9)
    # LCS(文本分类的研究, 中文文本分类方法研究) = 文本分类研究 = 6 (hyp len 7, ref len 10)
    p, r = 6 / 7, 6 / 10
    assert s["rouge-l"] == pytest.approx(100 * 2 * p * r / (p + r + 1e-8), abs=1e-9)
    exact = pair_scores("基于深度学习", "基于深度学习")
    assert exact["bleu-4"] == pytest.approx(100.0) and exact["rouge-l"] == pytest.approx(100.0, abs=1e-5)
    assert pair_scores("", "参考")["rouge-1"] == 0.0 and pair_scores("", "参考")["bleu-4"] == 0.0


def test_metric_object_averages_and_resets() -> None:
    m = TextSimilarity(prefix="predict_")
    m.update([p for p, _ in PAIRS[:5]], [l for _, l in PAIRS[:5]])
    m.update([p for p, _ in PAIRS[5:]], [l for _, l in PAIRS[5:]])
    out = m.compute()
    assert set(out) == {"predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l"}
    per = [pair_scores(p, l) for p, l in PAIRS]
    for key in ("bleu-4", "rouge-1", "rouge-2", "rouge-l"):
        mean = sum(s[key] for s in per) / len(per)
        assert float(out[f"predict_{key}"]) == pytest.approx(mean, abs=1e-9)
    m.reset()
    assert float(m.count) == 0
    with pytest.raises(ValueError, match="tokenization"):
        TextSimilarity(tokenization="words")  # type: ignore[arg-type]
    assert torch.isfinite(m.sums).all()
