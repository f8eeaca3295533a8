"""Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 (``Gemma3ForCausalLM``) against transformers 5.24: checkpoints written by
``save_pretrained`` in the test (tiny fp32 models, perturbed so that the ``(1 + weight)`` norms, the four norms per
layer and the soft-caps matter), batches with right and left padding.

* logits on the real tokens of padded rows, eager and lazy loads; the export (transformers' own key set) reloaded by
  transformers with the same logits;
* the loss through the fused LM-head loss (the head never called as a module: no ``[B, S, V]`` logits, Gemma 2's
  final soft-cap taken in the chunks) and every gradient;
* greedy and beam generation token for token (the soft-caps in the KV-cache path, past the sliding window);
* the scaled embedding in bf16 equals transformers' (the scale rounded to bf16 before the product);
* options not built, refused in one line naming the file and the option.

Gemma 2's caps here are small (attention 2, logits 3) so that they change the numbers. The multimodal class
(``Gemma3ForConditionalGeneration``) is ``tests/models/test_multimodal.py``; the layouts
``tests/models/test_families_layouts.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.conftest import loaded_logits_error, padded_lm_batch  # noqa: E402
from tests.models.family_parity import write_perturbed  # noqa: E402

from lightning_llm.data.base import left_pad  # noqa: E402
from lightning_llm.generation import GenerationConfig, generate, strip_after_eos  # noqa: E402
from lightning_llm.models import load_hf, save_hf  # noqa: E402

VOCAB = 96
FAMILIES = ["gemma2", "gemma3"]
_NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
          "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}


def _model(name: str) -> Any:
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=24,
                  attn_implementation="eager")
    if name == "gemma2":  # sliding, full, sliding; both soft-caps
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, attn_logit_softcapping=2.0, final_logit_softcapping=3.0))
    # two sliding layers (local base 1e4) and a full one (1e6, linearly scaled); q/k norms; untied head
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **common, sliding_window_pattern=3, tie_word_embeddings=False,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))


def _write(name: str, out: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return write_perturbed(_model(name), out, seed + 1)


def _hf_name(ours: str) -> str:
    for a, b in _NORMS.items():
        ours = ours.replace(f".{a}.", f".{b}.")
    return ours if ours.startswith("lm_head") else f"model.{ours}"


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_export_equal_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path / "hf")
    ids, mask, _ = padded_lm_batch(VOCAB, 12)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    errs = [loaded_logits_error(tmp_path / "hf", ids, mask, ref, lazy=lazy) for lazy in (False, True)]
    ours, cfg = load_hf(tmp_path / "hf")
    assert cfg.sliding_layers == ((0, 2) if name == "gemma2" else (0, 1)) and cfg.norm_offset == 1.0
    out = save_hf(ours, tmp_path / "ours")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    from safetensors import safe_open

    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "hf", out)]
    with torch.no_grad():
        err_back = float((back(input_ids=ids, attention_mask=mask).logits - ref)[mask.bool()].abs().max())
    print(f"{name}: logits of padded rows {errs[0]:.2e} (lazy {errs[1]:.2e}) from transformers; export reloaded "
          f"as {type(back).__name__} {err_back:.2e}")
    assert max(errs) < 1e-5 and err_back < 1e-5 and keys[0] == keys[1] and type(back) is type(hf)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(hf).__name__]


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_through_the_fused_head_and_gradients_equal_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path).train()
    ids, mask, labels = padded_lm_batch(VOCAB, 12)
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ours = load_hf(tmp_path)[0].train()

    def no_logits(*_: Any) -> None:
        raise AssertionError("the head was called as a module: [B, S, V] logits")

    ours.lm_head.forward = no_logits  # the fused loss reads the weight; calling the head would raise
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    loss = ours(ids, attention_mask=mask, labels=shifted)
    loss.backward()
    hf_grads = dict(hf.named_parameters())
    worst = max(float((hf_grads[_hf_name(n)].grad - p.grad).abs().max()) for n, p in ours.named_parameters())
    loss_err = abs(float(loss.detach()) - float(out.loss.detach()))
    print(f"{name}: loss {float(loss):.5f}, {loss_err:.2e} from transformers; gradients {worst:.2e}")
    assert loss_err < 1e-5 and worst < 1e-5
    if name == "gemma2":  # the caps bind: without them the loss differs
        ours.config.final_logit_softcap = None
        with torch.no_grad():
            assert abs(float(ours(ids, attention_mask=mask, labels=shifted)) - float(out.loss)) > 1e-2


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_beam_generation_match_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path)
    ours, _ = load_hf(tmp_path)
    ids, mask = left_pad([[5, 9, 17, 3, 44, 2, 60], [7, 8], [50, 51, 52, 53]], 0)
    eos = 2
    for beams in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams,
                               do_sample=False, pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:]
        got = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=10, num_beams=beams, eos_token_id=eos))
        rows = [strip_after_eos(x, [eos]) for x in (want, got)]
        print(f"{name} beams={beams}: ours={rows[1]} transformers={rows[0]}")
        assert rows[0] == rows[1]


def test_scaled_embedding_rounds_the_scale_to_bf16_as_transformers() -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from lightning_llm.models.layers.block import ScaledEmbedding

    theirs = Gemma3TextScaledWordEmbedding(50, 40, 0, embed_scale=40 ** 0.5).to(torch.bfloat16)
    ours = ScaledEmbedding(50, 40, scale=40 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
    ids = torch.arange(50).view(5, 10)
    exact = (theirs.weight.float()[ids] * 40 ** 0.5).to(torch.bfloat16)  # the unrounded scale: other values
    assert torch.equal(ours(ids), theirs(ids)) and not torch.equal(ours(ids), exact)


def _edit_config(src: Path, out: Path, **changes: Any) -> Path:
    out.mkdir()
    (out / "model.safetensors").symlink_to(src / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **changes}))
    return out


def test_options_not_built_are_refused_in_one_line(tmp_path: Path) -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.parallel_spec import PARALLEL_SPECS
    from lightning_llm.tasks import CausalLMTask

    _write("gemma3", tmp_path / "gemma3")
    bidirectional = _edit_config(tmp_path / "gemma3", tmp_path / "bi", use_bidirectional_attention=True)
    config = json.loads((tmp_path / "gemma3" / "config.json").read_text())
    local = _edit_config(tmp_path / "gemma3", tmp_path / "local", rope_parameters={
        **config["rope_parameters"], "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})
    cases = [(lambda: CausalLMTask(str(bidirectional)),
              f"{bidirectional / 'config.json'}: use_bidirectional_attention=True is not supported for gemma3_text"),
             (lambda: CausalLMTask(str(local)), f"{local / 'config.json'}: rope_parameters.sliding_attention."
                                                "rope_type='linear' is not supported"),
             (lambda: build_model("debug-gemma2", family="decoder", lazy=True, attention="varlen"),
              "attention=varlen with attn_logit_softcap=5.0: no varlen kernel soft-caps the scores")]
    for build, text in cases:
        with pytest.raises(ValueError) as e:
            build()
        assert text in str(e.value) and "\n" not in str(e.value), str(e.value)
    model = build_model("debug-gemma2", family="decoder", lazy=True, sliding_window=None)
    assert "soft-capping (attn_logit_softcap=5.0, Gemma 2) is not supported under context parallelism" in str(
        PARALLEL_SPECS[type(model)].context_parallel_blocker(model))
