"""gpt-oss and OLMoE against transformers 5.24: checkpoints written by ``save_pretrained`` in the test (tiny fp32
models, perturbed so that sinks, routers, biases and norms matter), batches with right and left padding.

* logits on the real tokens of padded rows, the loss with transformers' load-balancing term
  (``output_router_logits=True``) and every gradient, eager and lazy loads;
* gpt-oss's MXFP4 experts (``*_blocks``/``*_scales`` written by ``tools/tiny.py``'s quantizer in the published
  layout): loading equals transformers loading the same files with ``Mxfp4Config(dequantize=True)`` (its own reader
  of the layout), and a read of some experts reads only their blocks;
* the export: transformers' own key set (gpt-oss's experts dequantized, no ``quantization_config``), reloaded by
  transformers with the same logits;
* greedy and beam generation token for token (sliding windows and sinks in the KV-cache path);
* the sink attention's paths (the CPU flash kernel corrected by its log-sum-exp, the per-sequence varlen reference,
  the eager scores) against each other in float64, forward and backward;
* LoRA on the projections equals peft's on transformers' model; the adapter loads in peft;
* options not built, refused in one line.

The layouts (ep, ep x tp, ep x pp, zero3, cp) are ``tests/parallel/test_moe_layouts.py``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.conftest import loaded_logits_error, peft_twin  # noqa: E402
from tests.models.test_moe import _batch  # noqa: E402 (ids, mask with right and left padding, HF labels)

from lightning_llm.models import build_model, load_hf, save_hf  # noqa: E402
from lightning_llm.models.hf.record.entries import deinterleave  # noqa: E402
from lightning_llm.models.init import materialize  # noqa: E402

VOCAB = 96
FAMILIES = ["gpt_oss", "olmoe"]


def _model(name: str) -> Any:
    common = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, num_experts_per_tok=2, router_aux_loss_coef=0.1, output_router_logits=True,
                  max_position_embeddings=64)
    if name == "gpt_oss":  # sliding (window 4), full, sliding; YaRN; head_dim 16 != 64 / 4
        cfg = transformers.GptOssConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=3, head_dim=16, num_local_experts=4,
            sliding_window=4, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                               "truncate": False, "original_max_position_embeddings": 16,
                                               "rope_theta": 150000.0}, **common)
        return transformers.GptOssForCausalLM(cfg)
    cfg = transformers.OlmoeConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_experts=6,
                                   norm_topk_prob=False, **common)
    return transformers.OlmoeForCausalLM(cfg)


def _write(name: str, out: Path, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = _model(name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (1.0 if n.endswith("sinks") else 0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out))
    return model.eval()


def _hf_grad(name: str, ours: str, hf_grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' gradient of our parameter ``ours``, in our layout."""
    hn = ours.replace("attn_norm", "input_layernorm").replace("mlp_norm", "post_attention_layernorm")
    hn = hn.replace("sinks.weight", "sinks")
    if name == "gpt_oss":
        hn = hn.replace("mlp.gate.", "mlp.router.")
    g = hf_grads[hn]
    if name == "gpt_oss" and ".experts." in ours:
        g = g.transpose(1, 2) if g.dim() == 3 else g  # [E, H, 2I] -> [E, 2I, H]
        g = deinterleave(g, 1) if "gate_up" in ours else g
    return g


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_loss_aux_and_gradients_equal_transformers(tmp_path: Path, name: str) -> None:
    hf = _write(name, tmp_path)
    ids, mask, labels = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    for lazy in (False, True):
        err = loaded_logits_error(tmp_path, ids, mask, ref, lazy=lazy)
        print(f"{name} (lazy={lazy}): logits of padded rows {err:.2e} from transformers")
        assert err < 1e-5

    hf.train()
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ours = load_hf(tmp_path)[0].train()
    ours.routing.begin()
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    ce = ours(ids, attention_mask=mask, labels=shifted)
    aux = ours.routing.aux_loss()
    loss_err = abs(float(ce.detach() + ours.config.moe.aux_loss_coef * aux) - float(out.loss.detach()))
    assert abs(float(aux) - float(out.aux_loss.detach())) < 1e-6 and loss_err < 1e-5
    ce.backward()
    hf_grads = {n.removeprefix("model."): p.grad for n, p in hf.named_parameters()}
    worst = max(float((_hf_grad(name, n, hf_grads) - p.grad).abs().max()) for n, p in ours.named_parameters())
    print(f"{name}: loss with aux {loss_err:.2e}, gradients {worst:.2e} from transformers")
    assert worst < 1e-5
    if name == "gpt_oss":  # the sinks and the router's bias are trained
        assert float(ours.layers["0"].self_attn.sinks.weight.grad.abs().max()) > 1e-4
        assert float(ours.layers["0"].mlp.gate.bias.grad.abs().max()) > 1e-4


# ---------------------------------------------------------------------------------------------------- MXFP4


def _write_mxfp4(out: Path) -> None:
    """A gpt-oss checkpoint as published: its experts' matrices as MXFP4 blocks and scales (the matrix transposed:
    [E, 2I, H] with alternating gate/up rows, [E, H, I]) and a ``quantization_config`` (``tools/tiny.py``)."""
    from lightning_llm.tools.tiny import to_mxfp4

    _write("gpt_oss", out, seed=3)
    to_mxfp4(out)


def _dequantized_by_transformers(path: Path) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GptOssForCausalLM.from_pretrained(
            str(path), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()


def test_mxfp4_experts_dequantize_as_transformers_and_read_by_expert(tmp_path: Path) -> None:
    _write_mxfp4(tmp_path)
    ref = _dequantized_by_transformers(tmp_path)
    ids, mask, _ = _batch()
    ours, _ = load_hf(tmp_path)
    with torch.no_grad():
        err = float((ours(ids, attention_mask=mask) - ref(input_ids=ids, attention_mask=mask).logits)[mask.bool()]
                    .abs().max())
    print(f"gpt-oss MXFP4 checkpoint: logits {err:.2e} from transformers' dequantize=True load")
    assert err < 1e-5
    # experts 2 and 3 of 4 (an ep2 rank's): only their blocks and scales are read
    lazy, _ = load_hf(tmp_path, lazy=True)
    source = lazy.weights_source
    name = "layers.1.mlp.experts.gate_up_proj"
    shape = lazy.get_parameter(name).shape
    part = source.read(name, (torch.tensor([2, 3]), torch.arange(shape[1]), torch.arange(shape[2])), torch.float32)
    assert torch.equal(part, ours.get_parameter(name)[2:].detach())
    stored = sum(source.files.meta(f"model.{name}_{kind}").numel() for kind in ("blocks", "scales"))  # uint8
    assert source.bytes_read == stored // 2, (source.bytes_read, stored)


# ---------------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", [*FAMILIES, "gpt_oss_mxfp4"])
def test_export_writes_transformers_key_set_and_reloads(tmp_path: Path, name: str) -> None:
    from safetensors import safe_open

    family = name.removesuffix("_mxfp4")
    if name.endswith("mxfp4"):
        _write_mxfp4(tmp_path / "src")
        hf = _dequantized_by_transformers(tmp_path / "src")
    else:
        hf = _write(family, tmp_path / "src")
    ours = load_hf(tmp_path / "src", lazy=True)[0]
    materialize(ours, "cpu")
    save_hf(ours.eval(), tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        type(hf)(hf.config).save_pretrained(str(tmp_path / "own"))  # transformers' own key set of the plain model
        back = type(hf).from_pretrained(str(tmp_path / "out")).eval()
    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "out", tmp_path / "own")]
    assert keys[0] == keys[1]
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    ids, mask, _ = _batch()
    with torch.no_grad():
        err = float((back(input_ids=ids, attention_mask=mask).logits - ours(ids, attention_mask=mask))[mask.bool()]
                    .abs().max())
    print(f"{name}: export -> {type(hf).__name__} ({len(keys[0])} keys as save_pretrained's), logits {err:.2e}")
    assert err < 1e-5


# ---------------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_beam_generation_match_transformers(tmp_path: Path, name: str) -> None:
    """Left-padded prompts, 10 new tokens: the KV-cache path runs past gpt-oss's sliding window (4), with its sinks."""
    from lightning_llm.data.base import left_pad
    from lightning_llm.generation import GenerationConfig, generate, strip_after_eos

    hf = _write(name, tmp_path)
    hf.config.output_router_logits = False  # (transformers' generate cannot pool router logits over its steps)
    ours = load_hf(tmp_path)[0].eval()
    ids, mask = left_pad([[5, 9, 17, 3, 44, 7, 60], [7, 8], [50, 51, 52, 53]], 0)
    eos = 2
    for beams in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams,
                               do_sample=False, pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:]
        got = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=10, num_beams=beams, eos_token_id=eos))
        rows = [strip_after_eos(t, [eos]) for t in (got, want)]
        print(f"{name} beams={beams}: ours={rows[0]} transformers={rows[1]}")
        assert rows[0] == rows[1] and max(len(r) for r in rows[0]) > 4


@pytest.mark.parametrize("rows", ["padded", "packed"])
def test_sink_attention_paths_agree_in_float64(rows: str) -> None:
    """debug-gpt-oss in float64: the mask path (the CPU flash kernel corrected by its log-sum-exp; the eager scores
    for a 4-D mask) and the varlen path (the per-sequence reference with the sink column) give the same logits and
    gradients, sliding and full layers alike."""
    from lightning_llm.models.layers.sinks import cpu_sink_attention, eager_sink_attention

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    kw: dict[str, Any] = {}
    if rows == "padded":
        mask = torch.ones_like(ids)
        mask[0, 18:] = 0
        mask[1, :5] = 0
        kw["attention_mask"] = mask
    else:
        kw["segment_ids"] = torch.tensor([[1] * 10 + [2] * 14, [1] * 7 + [2] * 9 + [0] * 8])
    real = (kw.get("attention_mask", kw.get("segment_ids")) > 0)
    results = []
    for attention in ("sdpa", "varlen"):
        torch.manual_seed(0)
        model = build_model("debug-gpt-oss", family="decoder", attention=attention).double()
        sinks = torch.Generator().manual_seed(5)  # sinks that matter, the same in both models
        with torch.no_grad():
            for layer in model.layers.values():
                layer.self_attn.sinks.weight.normal_(0, 1, generator=sinks)
        logits = model(ids, **kw)
        logits[real].sin().mean().backward()  # padding outputs differ between the paths: nothing reads them
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    err = float((a - b)[real].abs().max())
    grad = max(float((ga[n] - gb[n]).abs().max()) for n in ga)
    print(f"{rows}: sdpa vs varlen paths with sinks, logits {err:.1e}, gradients {grad:.1e}")
    assert err < 1e-10 and grad < 1e-10
    # the kernel-level paths: the CPU flash kernel and the eager scores, GQA and a padding mask, float64
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    m = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6]).bool()[
        :, None, None, :]
    m = m | torch.eye(6, dtype=torch.bool)
    outs = []
    for f in (cpu_sink_attention, eager_sink_attention):
        o = f(q, k, v, sinks, attn_mask=m, is_causal=False)
        outs.append([o, *torch.autograd.grad(o.sin().sum(), (q, k, v, sinks))])
    assert max(float((x - y).abs().max()) for x, y in zip(*outs)) < 1e-12


# ---------------------------------------------------------------------------------------------------- LoRA


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_on_projections_equals_peft_on_transformers_and_exports(tmp_path: Path, name: str) -> None:
    """LoRA on q/k/v/o: our adapted logits equal peft's on transformers' model with the same adapter weights; the
    exported adapter loads with ``PeftModel.from_pretrained`` on the checkpoint with the same logits."""
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter

    hf = _write(name, tmp_path / "hf")
    ours = apply_peft(load_hf(tmp_path / "hf")[0].eval(), cfg := PeftConfig(method="lora", lora=LoraArgs(
        r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])))
    ref = peft_twin(ours, hf, cfg)
    ids, mask, _ = _batch()
    keep = mask.bool()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        err = float((ours(ids, attention_mask=mask) - want)[keep].abs().max())
    export_adapter(ours, cfg, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(type(hf).from_pretrained(str(tmp_path / "hf")),
                                                str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        err_loaded = float((loaded(input_ids=ids, attention_mask=mask).logits - want)[keep].abs().max())
    print(f"{name}: LoRA q/k/v/o vs peft on transformers {err:.2e}, exported adapter in peft {err_loaded:.2e}")
    assert err < 1e-5 and err_loaded < 1e-5


# ---------------------------------------------------------------------------------------------------- refusals


def _edit_config(src: Path, out: Path, **changes: Any) -> Path:
    out.mkdir()
    (out / "model.safetensors").symlink_to(src / "model.safetensors")
    config = {**json.loads((src / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_options_not_built_are_refused_in_one_line(tmp_path: Path) -> None:
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft
    from lightning_llm.tasks import CausalLMTask

    _write("olmoe", tmp_path / "olmoe")
    _write("gpt_oss", tmp_path / "gpt_oss")
    clip = _edit_config(tmp_path / "olmoe", tmp_path / "clip", clip_qkv=8.0)
    bnb = _edit_config(tmp_path / "gpt_oss", tmp_path / "bnb", quantization_config={"quant_method": "bitsandbytes"})
    experts = LoraArgs(dropout=0.0, target_parameters=["mlp.experts.gate_up_proj"])
    cases = [(lambda: CausalLMTask(str(clip)), f"{clip / 'config.json'}: OLMoE config: clip_qkv=8.0"),
             (lambda: CausalLMTask(str(bnb)), "quant_method='bitsandbytes' is not supported"),
             (lambda: CausalLMTask(str(tmp_path / "gpt_oss"), lora=experts), "--model.lora.target_parameters="),
             (lambda: apply_peft(build_model("debug-gpt-oss", family="decoder"), PeftConfig(lora=experts)),
              "LoRA on gpt-oss's fused experts is not supported"),
             (lambda: CausalLMTask("debug-gpt-oss", dropout=0.1), "backbone=debug-gpt-oss: ModelConfig: dropout=0.1 "
              "with attention_sinks (gpt-oss) is not supported")]
    for build, text in cases:
        with pytest.raises(ValueError) as e:
            build()
        assert text in str(e.value) and "\n" not in str(e.value), str(e.value)
    from lightning_llm.models.parallel_spec import PARALLEL_SPECS

    model = build_model("debug-gpt-oss", family="decoder", lazy=True, sliding_window=None)
    assert "attention sinks (gpt-oss) are not supported under context parallelism" in str(
        PARALLEL_SPECS[type(model)].context_parallel_blocker(model))


def test_estimate_counts_gpt_oss_20b_and_olmoe_1b_7b_as_published() -> None:
    """``lightning_llm estimate`` on the published configs (written here, no weights): the parameters transformers'
    models of those configs hold, 20.9B (3.61B active) for gpt-oss-20b and 6.9B (1.3B active) for OLMoE-1B-7B."""
    import contextlib
    import io
    import tempfile

    from lightning_llm.cli import main

    published = {
        "gpt_oss": (transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32, vocab_size=201088), 20.9,
                    3.61),
        "olmoe": (transformers.OlmoeConfig(intermediate_size=1024), 6.9, 1.3)}
    for name, (cfg, total, active) in published.items():
        with tempfile.TemporaryDirectory() as d:
            cfg.architectures = [{"gpt_oss": "GptOssForCausalLM", "olmoe": "OlmoeForCausalLM"}[name]]
            cfg.save_pretrained(d)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert main(["estimate", f"--model={d}", "--seq-len=4096", "--json"]) == 0
        r = json.loads(out.getvalue())
        with torch.device("meta"):
            reference = sum(p.numel() for p in type(_model(name))(cfg).parameters())
        print(f"{name}: {r['parameters']:,} parameters (transformers: {reference:,}), {r['active_parameters']:,} "
              f"active ({r['embedding_parameters']:,} in the embedding); model states {r['bytes']['model_states']:,} "
              "bytes")
        assert r["parameters"] == reference and round(r["parameters"] / 1e9, 1) == total
        # gpt-oss's model card counts the active parameters without the input embedding table (its rows are looked
        # up), the OLMoE paper with it
        lookup = r["embedding_parameters"] if name == "gpt_oss" else 0
        assert round((r["active_parameters"] - lookup) / 1e9, 2 if name == "gpt_oss" else 1) == active


def _fit_lora(tmp: Path, backbone: Path, *, steps: int = 2, **task_kw: Any) -> tuple[list[float], Any]:
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.peft import LoraArgs
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import StepRecorder

    pl.seed_everything(0)
    task = CausalLMTask(str(backbone), optim=OptimConfig(lr=2e-2, weight_decay=0.0), lora=LoraArgs(
        r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), **task_kw)
    dm = TextDataModule(tokenizer_dir=str(backbone), generated_docs=40, block_size=32, batch_size=4, val_fraction=0.0,
                        cache_dir=str(tmp / "cache"))
    rec = StepRecorder(str(tmp / "steps.json"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp), callbacks=[rec],
                         enable_checkpointing=False)
    trainer.fit(task, dm)
    return rec.losses, task


def test_qlora_on_gpt_oss_trains_like_lora_on_the_dequantized_projections(tmp_path: Path) -> None:
    """QLoRA (nf4 q/k/v/o, LoRA on them) on the tiny MXFP4 gpt-oss checkpoint of ``tools/tiny.py``: its losses equal
    LoRA's on a checkpoint whose projections are torchao's NF4 round trip of them (and differ from LoRA's on the
    original weights: the comparison could fail)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from lightning_llm.models.quantize import QuantizationConfig, quantized_linears
    from lightning_llm.tools.tiny import write_tiny

    src = write_tiny("gpt_oss", tmp_path / "tiny")
    model, _ = load_hf(src)
    with torch.no_grad():
        for _, lin in quantized_linears(model):
            lin.weight.copy_(to_nf4(lin.weight.detach(), 64, 16).get_original_weight())
    deq = save_hf(model, tmp_path / "deq")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (deq / name).write_bytes((src / name).read_bytes())
    quantized, task = _fit_lora(tmp_path / "q", src, quantize="nf4",
                                quantization=QuantizationConfig(block_size=64, scaler_block_size=16))
    reference, _ = _fit_lora(tmp_path / "r", deq)
    original, _ = _fit_lora(tmp_path / "o", src)
    err, effect = max(abs(a - b) for a, b in zip(quantized, reference)), max(
        abs(a - b) for a, b in zip(quantized, original))
    print(f"gpt-oss QLoRA vs LoRA on the dequantized projections: {err:.2e} over {len(quantized)} steps (vs the "
          f"original weights: {effect:.2e})")
    assert len(quantized) == 2 and err <= 1e-5 < effect
    assert len(quantized_linears(task.model)) == 4 * 4  # q, k, v, o of the 4 layers
