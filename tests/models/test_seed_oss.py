"""Seed-OSS (ByteDance's dense ``SeedOssForCausalLM``: ``models/hf/families/seed_oss.py``) against transformers: tiny
fp32 checkpoints written by ``save_pretrained`` here, batches with right and left padding.

* logits (eager and lazy loads), the loss and every gradient, the export's key set and its logits reloaded by
  transformers (``family_parity``), with its biases as published (q/k/v) and switched the other way (o_proj and the
  MLP); greedy generation token for token;
* ``SeedOssForSequenceClassification`` (a reward model's class): its scores on right- and left-padded rows;
* its two dropouts read as our one dropout (unequal ones refused naming the file), written back; the debug size's
  config both ways; its config class's default shape counted by ``estimate``.

Its layouts (tp x2 = one device) are ``tests/models/test_families_layouts.py``'s.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.models.family_parity import (  # noqa: E402
    TINY,
    check_and_generate,
    estimated_parameters,
    write_perturbed,
)

from lightning_llm.models import save_hf  # noqa: E402


def _config(**changes: Any) -> Any:
    return transformers.SeedOssConfig(**{**TINY, "attention_dropout": 0.0, "residual_dropout": 0.0,
                                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, **changes})


VARIANTS = {
    "published_biases": {},  # q/k/v biased, o_proj and the MLP not
    "o_and_mlp_biased": dict(attention_bias=False, attention_out_bias=True, mlp_bias=True, tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_loss_gradients_export_and_generation_equal_transformers(tmp_path: Path, variant: str) -> None:
    torch.manual_seed(0)
    hf = write_perturbed(transformers.SeedOssForCausalLM(_config(**VARIANTS[variant])), tmp_path / "src")
    ours = check_and_generate(hf, tmp_path, f"seed_oss {variant}")
    assert ours.config.o_bias == hf.config.attention_out_bias and ours.config.mlp_bias == hf.config.mlp_bias


def test_sequence_classifier_scores_equal_transformers_on_padded_rows(tmp_path: Path) -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.scores import sequence_scores

    torch.manual_seed(0)
    hf = write_perturbed(transformers.SeedOssForSequenceClassification(_config(num_labels=2)), tmp_path / "cls")
    ours = build_model(str(tmp_path / "cls"), family="decoder").eval()
    assert ours.lm_head is None and ours.score.weight.shape == (2, 64)
    rows = [[5, 17, 50, 2], [9, 3, 77, 12, 44, 6, 2], [31, 32]]
    for side in ("right", "left"):
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r) if side == "right" else 0
            if side == "left":
                ids[i, width - len(r):] = torch.tensor(r)
        mask = (ids != 0).long()
        with torch.no_grad():
            err = float((sequence_scores(ours(ids, attention_mask=mask), ids, 0)
                         - hf(input_ids=ids, attention_mask=mask).logits).abs().max())
        print(f"SeedOssForSequenceClassification {side}-padded: max |ours - transformers| = {err:.1e}")
        assert err < 1e-5
    save_hf(ours, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [
        "SeedOssForSequenceClassification"]


def test_dropouts_config_both_ways_and_the_published_shape(tmp_path: Path) -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.hf import config_from_hf, config_to_hf
    from lightning_llm.tasks import CausalLMTask

    hf = config_to_hf(build_model("debug-seed-oss", family="decoder", dropout=0.05).config, "SeedOssForCausalLM")
    assert (hf["attention_dropout"], hf["residual_dropout"], hf["attention_bias"], hf["attention_out_bias"]) == (
        0.05, 0.05, True, False)
    back = config_from_hf(_config(**{k: v for k, v in hf.items() if k not in ("model_type", "dtype")}).to_dict()
                          | {"architectures": ["SeedOssForCausalLM"]})
    assert back.dropout == 0.05 and back.attention_bias and not back.o_bias

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.SeedOssForCausalLM(_config(attention_dropout=0.1, residual_dropout=0.0)).save_pretrained(
            str(tmp_path / "unequal"))
    with pytest.raises(ValueError) as e:
        CausalLMTask(str(tmp_path / "unequal"))
    message = str(e.value)
    assert str(tmp_path / "unequal" / "config.json") in message and "residual_dropout=0.0" in message, message
    assert "\n" not in message

    ours, reference = estimated_parameters(transformers.SeedOssForCausalLM, tmp_path / "published")
    print(f"SeedOssConfig(): {ours:,} parameters (transformers: {reference:,})")
    assert ours == reference
