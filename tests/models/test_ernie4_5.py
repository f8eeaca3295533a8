"""ERNIE 4.5 (Baidu's dense ``Ernie4_5ForCausalLM``: ``models/hf/families/ernie4_5.py``) against transformers: tiny fp32
checkpoints written by ``save_pretrained`` here, batches with right and left padding.

* logits (eager and lazy loads), the loss and every gradient, the export's key set and its logits reloaded by
  transformers (``family_parity``), with every projection biased and without, tied and untied, a scaled rope;
* what the family adds, shown to matter: its rotary pairs;
* greedy generation token for token;
* the config both ways (the debug size, transformers' defaults: ``estimate`` counts its parameters), a model the
  family cannot write refused in one line, a quantized checkpoint refused naming the file, the tiny checkpoint
  ``tools/tiny.py`` writes.

Its layouts (tp x2 = one device) are ``tests/models/test_families_layouts.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.conftest import padded_lm_batch  # noqa: E402
from tests.models.family_parity import (  # noqa: E402
    TINY,
    VOCAB,
    check_and_generate,
    estimated_parameters,
    logits_error,
    write_perturbed,
)

from lightning_llm.models import load_hf, save_hf  # noqa: E402


def _write(out: Path, **changes: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.Ernie4_5Config(**{**TINY, "use_bias": True, **changes})
    return write_perturbed(transformers.Ernie4_5ForCausalLM(config), out)


VARIANTS = {
    "biased_tied": {},
    "plain_untied_linear_rope": dict(use_bias=False, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_loss_gradients_export_and_generation_equal_transformers(tmp_path: Path, variant: str) -> None:
    hf = _write(tmp_path / "src", **VARIANTS[variant])
    check_and_generate(hf, tmp_path, f"ernie4_5 {variant}")


def test_rotary_pairs_matter(tmp_path: Path) -> None:
    """The parity above could fail: rotary dims in halves (LLaMA's) instead of pairs move the logits."""
    hf = _write(tmp_path)
    ids, mask, _ = padded_lm_batch(VOCAB, 12)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    moved = logits_error(load_hf(tmp_path, rope_interleave=False)[0].eval(), ref, ids, mask)
    print(f"ernie4_5 with LLaMA's rotary halves: logits {moved:.2e} from transformers")
    assert moved > 1e-3


def test_config_both_ways_refusals_and_the_tiny_checkpoint(tmp_path: Path) -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.hf import config_from_hf, config_to_hf
    from lightning_llm.models.hf.convert.architectures import DEFAULT_ARCHITECTURE
    from lightning_llm.tools.tiny import write_tiny

    model = build_model("debug-ernie4.5", family="decoder")
    hf = config_to_hf(model.config, "Ernie4_5ForCausalLM")
    assert hf["use_bias"] is True and "attention_dropout" not in hf and DEFAULT_ARCHITECTURE["ernie4_5"] == \
        "Ernie4_5ForCausalLM"
    theirs = transformers.Ernie4_5Config(**{k: v for k, v in hf.items() if k not in ("model_type", "dtype")})
    back = config_from_hf(theirs.to_dict() | {"architectures": ["Ernie4_5ForCausalLM"]})
    assert back.rope_interleave and back.attention_bias and back.o_bias and back.mlp_bias and back.tie_embeddings
    with pytest.raises(ValueError) as e:  # one use_bias: q/k/v/o biased, the MLP not, is not an ERNIE 4.5
        save_hf(build_model("debug-ernie4.5", family="decoder", mlp_bias=False), tmp_path / "never",
                architecture="Ernie4_5ForCausalLM")
    assert "mlp_bias: ours=False" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="ernie4_5 sequence classifier .* cannot be saved"):
        save_hf(build_model("debug-ernie4.5", family="decoder", num_labels=1), tmp_path / "never")

    write_tiny("ernie4_5", tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "quantized").mkdir()
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path / "quantized")
    assert str(tmp_path / "quantized" / "config.json") in str(e.value) and "quantization_config=" in str(e.value)
    ids, mask, _ = padded_lm_batch(300, 12)
    with torch.no_grad():
        ref = transformers.Ernie4_5ForCausalLM.from_pretrained(str(tmp_path / "tiny")).eval()(
            input_ids=ids, attention_mask=mask).logits
    assert logits_error(load_hf(tmp_path / "tiny")[0].eval(), ref, ids, mask) < 1e-5

    ours, reference = estimated_parameters(transformers.Ernie4_5ForCausalLM, tmp_path / "published")
    print(f"ERNIE-4.5-0.3B (its config class's default): {ours:,} parameters (transformers: {reference:,})")
    assert ours == reference
