"""Decoder families beyond LLaMA/GPT-2: Qwen2, Qwen3, Mistral, Baichuan2-7B, and LLaMA with dynamic / YaRN rope and
the gelu_pytorch_tanh activation.

Per family, against an independent reference (transformers' own class, eager attention; for Baichuan, which is
trust_remote_code and not in transformers, a ``LlamaForCausalLM`` holding ``W_pack`` split into q/k/v and the
``NormHead`` rows pre-normalised, read from the Baichuan-format files by :func:`baichuan_reference`):

* ``load_hf`` logits on a batch with right and left padding (fp32, <= 1e-5 on real tokens);
* ``save_hf`` and reload by the reference reader, logits again;
* (transformers' families) family_parity's checks: the loss and every gradient of a training forward, lazy loads, the
  export's key set transformers' own;
* greedy and beam generation token-identical to ``transformers`` ``generate`` (sequences run past the sliding window
  and, for dynamic rope, past ``max_position_embeddings``);
* LoRA on Baichuan's fused ``W_pack``: our adapted logits equal peft's LoRA on a real fused ``W_pack`` Linear of the
  reference with the same adapter weights, and merged + saved weights too.

The multi-process table (each family's debug size under tp, tp + sequence parallel, pp and zero3 against one device)
is ``tests/models/test_families_layouts.py``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from tests.models.family_parity import check_against_transformers, perturbed  # noqa: E402

from lightning_llm.data.base import left_pad  # noqa: E402
from lightning_llm.generation import GenerationConfig, generate, strip_after_eos  # noqa: E402
from lightning_llm.models import DecoderLM, load_hf, save_hf  # noqa: E402
from lightning_llm.models.hf.convert.adapters import adapter_tensor_to_hf  # noqa: E402
from lightning_llm.models.hf.families.baichuan import wpack_from_hf, wpack_to_hf  # noqa: E402

TOL = 1e-5
VOCAB = 96
SEQ = 12


def _randomize_lora(model: torch.nn.Module, *, seed: int, scale: float) -> None:
    """Give every LoRA tensor random values (B starts at zero: an adapter that changes nothing tests nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _err(ref: torch.Tensor, ours: torch.Tensor, mask: torch.Tensor) -> float:
    assert ref.shape == ours.shape and torch.isfinite(ours).all()
    keep = mask.bool()
    return (ref[keep] - ours[keep]).abs().max().item()


def _logits(model: nn.Module, batch: dict[str, torch.Tensor], *, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        if hf:
            return model(**batch).logits
        return model(batch["input_ids"], attention_mask=batch["attention_mask"])


# ------------------------------------------------------------------------------------------------ Baichuan reference


def baichuan_reference(directory: Path) -> nn.Module:
    """A ``LlamaForCausalLM`` computing what Baichuan2-7B's modeling code computes for the Baichuan-format checkpoint
    in ``directory`` (``W_pack`` rows = [q; k; v] split into q/k/v; ``lm_head`` rows L2-normalised as NormHead does;
    RoPE base 10000). Reads the files directly: independent of our HF mapping."""
    from safetensors.torch import load_file

    c = json.loads((directory / "config.json").read_text())
    assert c["architectures"] == ["BaichuanForCausalLM"] and c["model_type"] == "baichuan"
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"], max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"], hidden_act=c["hidden_act"], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="eager",
    )
    sd: dict[str, torch.Tensor] = {}
    for k, v in load_file(str(directory / "model.safetensors")).items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k.endswith("W_pack.weight"):
            for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                sd[k.replace("W_pack", name)] = part
        elif k == "lm_head.weight":
            sd[k] = F.normalize(v, dim=-1)  # NormHead
        else:
            sd[k] = v
    ref = transformers.LlamaForCausalLM(cfg)
    ref.load_state_dict(sd, strict=True)
    return ref.eval()


def write_baichuan(directory: Path, *, vocab: int = VOCAB, seed: int = 11) -> Path:
    """A random Baichuan2-7B-layout checkpoint written in Baichuan's own key names and config (as its
    ``save_pretrained`` writes them, including the persisted ``rotary_emb.inv_freq`` buffers)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6)
    sd = perturbed(transformers.LlamaForCausalLM(cfg), seed).state_dict()
    out: dict[str, torch.Tensor] = {}
    for i in range(2):
        a = f"model.layers.{i}.self_attn"
        out[f"{a}.W_pack.weight"] = torch.cat([sd.pop(f"{a}.{n}.weight") for n in ("q_proj", "k_proj", "v_proj")])
        out[f"{a}.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    g = torch.Generator().manual_seed(seed)
    sd["lm_head.weight"] = sd["lm_head.weight"] * (0.5 + 2 * torch.rand(vocab, 1, generator=g))  # rows of any norm
    out.update({k: v.contiguous() for k, v in sd.items()})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["BaichuanForCausalLM"], "model_type": "baichuan",
        "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                     "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu", "hidden_size": 32,
        "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 64, "model_max_length": 64,
        "num_attention_heads": 4, "num_hidden_layers": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "tokenizer_class": "BaichuanTokenizer", "torch_dtype": "float32", "transformers_version": "4.29.2",
        "use_cache": True, "vocab_size": vocab, "z_loss_weight": 0,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


# ------------------------------------------------------------------------------------------------ the families


def _cfg(cls: Any, **kw: Any) -> Any:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                attn_implementation="eager")
    return cls(**{**base, **kw})


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]  # the perturbed transformers reference
    arch: str  # the HF class name our save_hf must write
    seed: int = 1


FAMILIES: dict[str, Family] = {
    # Qwen2.5-style: q/k/v biases, o without, tied head
    "qwen2": Family(lambda: transformers.Qwen2ForCausalLM(_cfg(transformers.Qwen2Config, tie_word_embeddings=True,
                                                                  max_position_embeddings=64)), "Qwen2ForCausalLM"),
    # untied, and a sliding window of 4 on layer 1 only (max_window_layers=1)
    "qwen2_sliding": Family(lambda: transformers.Qwen2ForCausalLM(_cfg(
        transformers.Qwen2Config, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
        max_window_layers=1)), "Qwen2ForCausalLM", seed=2),
    # head_dim 16 != hidden/heads = 8, q_norm/k_norm
    "qwen3": Family(lambda: transformers.Qwen3ForCausalLM(_cfg(transformers.Qwen3Config, head_dim=16,
                                                                  max_position_embeddings=64)), "Qwen3ForCausalLM", 3),
    # sliding window 4 on every layer, sequences of 12 (generation: up to 22)
    "mistral": Family(lambda: transformers.MistralForCausalLM(_cfg(transformers.MistralConfig, sliding_window=4,
                                                                      max_position_embeddings=64)),
                      "MistralForCausalLM", 4),
    # NTK-aware dynamic rope: max_position_embeddings 8 < the 12 tokens of the batch
    "llama_dynamic": Family(lambda: transformers.LlamaForCausalLM(_cfg(
        transformers.LlamaConfig, max_position_embeddings=8,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})), "LlamaForCausalLM", 5),
    # YaRN with its attention factor (0.1 ln 4 + 1 on cos/sin)
    "llama_yarn": Family(lambda: transformers.LlamaForCausalLM(_cfg(
        transformers.LlamaConfig, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16})), "LlamaForCausalLM", 6),
    # gated MLP with gelu_pytorch_tanh
    "llama_gelu_tanh": Family(lambda: transformers.LlamaForCausalLM(_cfg(
        transformers.LlamaConfig, max_position_embeddings=64, hidden_act="gelu_pytorch_tanh")),
        "LlamaForCausalLM", 7),
}
ALL = [*FAMILIES, "baichuan2"]


def _source(name: str, directory: Path) -> tuple[Path, nn.Module]:
    """(HF-format checkpoint directory, reference model) of family ``name``."""
    if name == "baichuan2":
        d = write_baichuan(directory / "src")
        return d, baichuan_reference(d)
    torch.manual_seed(0)
    fam = FAMILIES[name]
    ref = perturbed(fam.build(), fam.seed)
    ref.save_pretrained(directory / "src")
    return directory / "src", ref


def _reload(name: str, directory: Path) -> nn.Module:
    """What the reference reads back from our ``save_hf`` output."""
    if name == "baichuan2":
        return baichuan_reference(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ALL)
def test_load_and_save_match_reference(name: str, tmp_path: Path) -> None:
    src, ref = _source(name, tmp_path)
    ours, cfg = load_hf(src)
    assert isinstance(ours, DecoderLM) and not ours.training  # eval mode, as from_pretrained
    batch = _batch()
    err = _err(_logits(ref, batch, hf=True), _logits(ours, batch, hf=False), batch["attention_mask"])
    print(f"{name}: load logits max_abs_err={err:.2e}")
    assert err <= TOL

    out = save_hf(ours, tmp_path / "ours")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [FAMILIES[name].arch if name in FAMILIES else "BaichuanForCausalLM"]
    back = _reload(name, out)
    err2 = _err(_logits(back, batch, hf=True), _logits(ours, batch, hf=False), batch["attention_mask"])
    print(f"{name}: save_hf -> reference reload max_abs_err={err2:.2e}")
    assert err2 <= TOL
    again, cfg2 = load_hf(out)
    assert cfg2.to_dict() | {"extra": {}} == cfg.to_dict() | {"extra": {}}
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_gradients_and_export_key_set_equal_transformers(name: str, tmp_path: Path) -> None:
    """family_parity's checks: logits (eager and lazy loads), the loss and every gradient of a training forward, the
    export's key set (transformers' own) and its logits reloaded by transformers."""
    _, ref = _source(name, tmp_path)
    err = check_against_transformers(ref, tmp_path)
    print(f"{name}: {', '.join(f'{k} {v:.1e}' for k, v in err.items())} from transformers")


@pytest.mark.parametrize("name", ALL)
def test_greedy_and_beam_generation_match_transformers(name: str, tmp_path: Path) -> None:
    src, ref = _source(name, tmp_path)
    ours, _ = load_hf(src)
    # left-padded prompts; 10 new tokens: past the sliding window (4) and past dynamic rope's 8 positions
    ids, mask = left_pad([[5, 9, 17, 3, 44, 2, 60], [7, 8], [50, 51, 52, 53]], 0)
    eos = 2
    for beams in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=beams,
                                do_sample=False, pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:]
        got = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=10, num_beams=beams, eos_token_id=eos))
        want_rows = [r + ([eos] if eos in full else []) for r, full in zip(strip_after_eos(want, [eos]), want.tolist())]
        got_rows = [r + ([eos] if eos in full else []) for r, full in zip(strip_after_eos(got, [eos]), got.tolist())]
        print(f"{name} beams={beams}: ours={got_rows} transformers={want_rows}")
        assert got_rows == want_rows


# ------------------------------------------------------------------------------------------------ LoRA on W_pack


class _PackSlice(nn.Module):
    """Stands in for q_proj / k_proj / v_proj of the reference: part ``i`` of ``owner.W_pack(x)`` (looked up at call
    time, so after peft wrapped W_pack the LoRA is included). ``owner`` is not registered as a child."""

    def __init__(self, owner: nn.Module, i: int) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        self.i = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner.W_pack(x).chunk(3, dim=-1)[self.i]


def fused_reference(directory: Path) -> nn.Module:
    """:func:`baichuan_reference` with a real fused ``W_pack`` Linear [3H, H] (Baichuan's rows) in every attention,
    so that peft's ``target_modules=["W_pack"]`` adapts exactly the module LLaMA-Factory's Baichuan2 recipe adapts."""
    ref = baichuan_reference(directory)
    for layer in ref.model.layers:
        attn = layer.self_attn
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        attn.W_pack = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            attn.W_pack.weight.copy_(w)
        attn.q_proj, attn.k_proj, attn.v_proj = (_PackSlice(attn, i) for i in range(3))
    return ref.eval()


def test_lora_on_w_pack_equals_peft_on_the_fused_linear(tmp_path: Path) -> None:
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, merge_peft

    src = write_baichuan(tmp_path / "src")
    ours, cfg = load_hf(src)
    lora = LoraArgs(r=4, alpha=8.0, dropout=0.0, target_modules=["W_pack"])
    ours = apply_peft(ours, PeftConfig(method="lora", lora=lora)).eval()
    adapted = [n for n, _ in ours.named_parameters() if "lora_" in n]
    assert len(adapted) == 2 * cfg.num_layers and all(".self_attn.W_pack." in n for n in adapted)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)  # lora_B nonzero: the update matters

    ref = peft.get_peft_model(fused_reference(src), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                     target_modules=["W_pack"])).eval()
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:  # layers.0.self_attn.W_pack.lora_B.default.weight -> peft's name on the reference
                hf = "base_model.model.model." + n
                ref_params[hf].copy_(adapter_tensor_to_hf(cfg, n, p))  # lora_B rows back to [q; k; v]
    batch = _batch()
    base = _logits(baichuan_reference(src), batch, hf=True)
    want = _logits(ref, batch, hf=True)
    got = _logits(ours, batch, hf=False)
    assert _err(base, want, batch["attention_mask"]) > 1e-2  # the adapter changes the outputs
    err = _err(want, got, batch["attention_mask"])
    print(f"baichuan2 LoRA(W_pack) vs peft on the fused reference: max_abs_err={err:.2e}")
    assert err <= TOL

    merged = merge_peft(ours)
    out = save_hf(merged, tmp_path / "merged")
    err2 = _err(want, _logits(baichuan_reference(out), batch, hf=True), batch["attention_mask"])
    print(f"baichuan2 LoRA(W_pack) merged + save_hf vs peft: max_abs_err={err2:.2e}")
    assert err2 <= TOL


def test_w_pack_adapter_export_loads_in_peft_on_the_fused_reference(tmp_path: Path) -> None:
    """``export_adapter`` of a LoRA on ``W_pack`` writes lora_B in Baichuan's ``[q; k; v]`` rows: peft's own
    ``PeftModel.from_pretrained`` on the HF-style model (a real fused ``W_pack`` Linear) gives our adapted logits, and
    ``load_adapter`` reads it back into ours (head-interleaved again)."""
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter, load_adapter

    src = write_baichuan(tmp_path / "src")
    cfg = PeftConfig(method="lora", lora=LoraArgs(r=4, alpha=8.0, dropout=0.0, target_modules=["W_pack"]))
    ours = apply_peft(load_hf(src)[0], cfg).eval()
    _randomize_lora(ours, seed=7, scale=0.3)
    export_adapter(ours, cfg, tmp_path / "adapter")
    ref = peft.PeftModel.from_pretrained(fused_reference(src), str(tmp_path / "adapter")).eval()
    batch = _batch()
    got = _logits(ours, batch, hf=False)
    err = _err(_logits(ref, batch, hf=True), got, batch["attention_mask"])
    moved = _err(_logits(baichuan_reference(src), batch, hf=True), got, batch["attention_mask"])
    back, _ = load_adapter(load_hf(src)[0], tmp_path / "adapter")
    err_back = _err(got, _logits(back.eval(), batch, hf=False), batch["attention_mask"])
    print(f"baichuan2 W_pack adapter export -> peft PeftModel on the fused reference: max_abs_err={err:.2e} "
          f"(adapter moves logits by {moved:.2e}); load_adapter back: {err_back:.2e}")
    assert moved > 1e-2 and err <= TOL and err_back <= TOL


def test_w_pack_rows_are_head_interleaved() -> None:
    n, d, h = 4, 3, 5
    hf = torch.arange(3 * n * d * h, dtype=torch.float32).view(3 * n * d, h)  # rows [q; k; v]
    ours = wpack_from_hf(hf, n)
    q, k, v = hf.view(3, n, d, h)
    assert torch.equal(ours.view(n, 3, d, h)[1, 0], q[1]) and torch.equal(ours.view(n, 3, d, h)[2, 2], v[2])
    assert torch.equal(wpack_to_hf(ours, n), hf)
    # a tensor-parallel row shard over whole heads holds each of its heads' q, k, v
    rank1 = ours.chunk(2, dim=0)[1].view(n // 2, 3, d, h)
    assert torch.equal(rank1[:, 0], q[2:]) and torch.equal(rank1[:, 1], k[2:]) and torch.equal(rank1[:, 2], v[2:])


def test_cli_lora_target_w_pack_trains_and_merges(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``--model.lora.target_modules=[W_pack]`` on a Baichuan2 checkpoint: trains, exports the peft-format adapter at
    the end of ``fit`` (lora_B in Baichuan's row order), and ``lightning_llm merge --ckpt`` / ``--adapter`` write
    merged Baichuan weights equal to base + adapter."""
    from lightning_llm.cli import main
    from lightning_llm.export.merge import main as merge_main
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft

    src = write_baichuan(tmp_path / "src", vocab=264)  # the byte tokenizer's vocabulary
    assert main([
        "fit", "--model=lightning_llm.tasks.CausalLMTask", f"--model.backbone={src}", "--model.lora.r=4",
        "--model.lora.dropout=0.0", "--model.lora.target_modules=[W_pack]", "--data=lightning_llm.data.TextDataModule",
        "--data.tokenizer_dir=byte",  # the checkpoint has no tokenizer files: byte ids on purpose
        "--data.generated_docs=40", "--data.block_size=32", "--data.batch_size=4", f"--data.cache_dir={tmp_path / 'c'}",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}",
    ]) == 0
    assert "adapter not exported" not in caplog.text and (tmp_path / "adapter" / "adapter_config.json").is_file()
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt"))
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    assert state and all(".W_pack.lora_" in k for k in state)

    assert merge_main(["--base", str(src), "--ckpt", str(ckpt), "--output", str(tmp_path / "merged")]) == 0
    ours, _ = load_hf(src)
    ours = apply_peft(ours, PeftConfig(lora=LoraArgs(r=4, dropout=0.0, target_modules=["W_pack"]))).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=False)
    batch = _batch()
    err = _err(_logits(ours, batch, hf=False), _logits(baichuan_reference(tmp_path / "merged"), batch, hf=True),
               batch["attention_mask"])
    print(f"baichuan2 CLI LoRA(W_pack) -> merge --ckpt -> reference: max_abs_err={err:.2e}")
    assert err <= TOL
    assert merge_main(["--base", str(src), "--adapter", str(tmp_path / "adapter"),
                       "--output", str(tmp_path / "m2")]) == 0
    err2 = _err(_logits(ours, batch, hf=False), _logits(baichuan_reference(tmp_path / "m2"), batch, hf=True),
                batch["attention_mask"])
    print(f"baichuan2 CLI LoRA(W_pack) -> fit-end adapter -> merge --adapter -> reference: max_abs_err={err2:.2e}")
    assert err2 <= TOL


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_adapter_export_loads_in_peft_on_the_hf_model(name: str, tmp_path: Path) -> None:
    """peft-format adapter of a LoRA on all seven projections (names as HF writes them) loads with
    ``PeftModel.from_pretrained`` on the transformers model and gives our adapted logits; ``load_adapter`` reads it
    back."""
    import peft

    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter, load_adapter

    src, ref = _source(name, tmp_path)
    ours, _ = load_hf(src)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = PeftConfig(lora=LoraArgs(r=4, alpha=8.0, dropout=0.0, target_modules=targets))
    ours = apply_peft(ours, cfg).eval()
    _randomize_lora(ours, seed=1, scale=0.2)
    export_adapter(ours, cfg, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = peft.PeftModel.from_pretrained(ref, str(tmp_path / "adapter")).eval()
    batch = _batch()
    err = _err(_logits(hf, batch, hf=True), _logits(ours, batch, hf=False), batch["attention_mask"])
    print(f"{name}: exported LoRA adapter in peft on transformers max_abs_err={err:.2e}")
    assert err <= TOL
    back, _ = load_adapter(load_hf(src)[0], tmp_path / "adapter")
    assert _err(_logits(back.eval(), batch, hf=False), _logits(ours, batch, hf=False), batch["attention_mask"]) <= TOL


def test_learned_positions_past_the_table_raise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=8,
                                  activation_function="gelu_pytorch_tanh", bos_token_id=1, eos_token_id=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    ours, c = load_hf(tmp_path)
    assert c.activation == "gelu_tanh" and not ours.training
    ours(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sequence of 9 tokens .* max_position_embeddings=8"):
        ours(torch.zeros(1, 9, dtype=torch.long))


def _edit_config(d: Path, **changes: Any) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unsupported_configs_are_refused_by_name(tmp_path: Path) -> None:
    from lightning_llm.models import build_model
    from lightning_llm.models.hf import config_from_hf
    from lightning_llm.peft import LoraArgs, PeftConfig, apply_peft, export_adapter

    d = write_baichuan(tmp_path / "b")
    with pytest.raises(ValueError, match="13B layout"):
        load_hf(_edit_config(d, max_position_embeddings=None))
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 8}
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        config_from_hf({**llama, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf({**llama, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="hidden_act='relu2'"):
        config_from_hf({**llama, "hidden_act": "relu2"})
    with pytest.raises(ValueError, match="qkv_packed=True .* num_kv_heads == num_heads"):
        build_model("debug-baichuan2", family="decoder", num_kv_heads=2)
    # a sliding window on some layers only is not what MistralForCausalLM computes
    mixed = build_model("debug-mistral", family="decoder", layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2)
    with pytest.raises(ValueError, match="not representable as MistralForCausalLM.*sliding_layers"):
        save_hf(mixed, tmp_path / "x")
    # tensors the class has no place for (a module a user's subclass adds, an untied head saved as the base class)
    # are refused, not dropped
    extra = build_model("debug-mistral", family="decoder")
    extra.value_head = nn.Linear(extra.config.hidden_size, 1)
    with pytest.raises(ValueError, match=r"MistralForCausalLM has no place for 2 .*'value_head.bias', 'value_head"):
        save_hf(extra, tmp_path / "never")
    untied = build_model("debug-mistral", family="decoder", tie_embeddings=False)
    with pytest.raises(ValueError, match=r"MistralModel has no place for 1 .*\['lm_head.weight'\]"):
        save_hf(untied, tmp_path / "never", architecture="MistralModel")
    assert not (tmp_path / "never").exists()
    # an adapter tensor on W_pack other than LoRA's lora_A / lora_B (IA3's row scales) is not converted: refused
    ia3 = PeftConfig(method="ia3", options={"target_modules": ["W_pack"]})
    with pytest.raises(ValueError, match="W_pack but not a LoRA"):
        export_adapter(apply_peft(build_model("debug-baichuan2", family="decoder"), ia3), ia3, tmp_path / "never")
    head = apply_peft(build_model("debug-baichuan2", family="decoder"),
                      PeftConfig(lora=LoraArgs(target_modules=["lm_head"])))
    with pytest.raises(ValueError, match="NormHead"):
        export_adapter(head, PeftConfig(lora=LoraArgs(target_modules=["lm_head"])), tmp_path / "never")


# ---------------------------------------------------------------------------------------------------- the records


def test_a_family_is_its_record_alone() -> None:
    """The tables read the family records (``models/hf/families/``): ERNIE 4.5 and Seed-OSS, added by their files
    alone, are named by no other library file, yet every table has them; records do not inherit what is a family's
    own (sizes, tiny checkpoint, guess, chat template); every named chat template exists."""
    from pathlib import Path

    import lightning_llm
    from lightning_llm.data.chat.template import NAMED_TEMPLATES
    from lightning_llm.models import NAMED_SIZES
    from lightning_llm.models.hf import SUPPORTED_ARCHITECTURES
    from lightning_llm.models.hf.convert.architectures import DEFAULT_ARCHITECTURE, families_markdown
    from lightning_llm.models.hf.convert.registry import FAMILIES
    from lightning_llm.tools.tiny import FAMILIES as TINY

    package = Path(lightning_llm.__file__).parent
    for kind, words in {"ernie4_5": ("ernie", "Ernie4_5"), "seed_oss": ("seed_oss", "seed-oss", "SeedOss")}.items():
        naming = sorted(str(f.relative_to(package)) for f in package.rglob("*.py")
                        if any(w.lower() in f.read_text(encoding="utf-8").lower() for w in words))
        assert naming == [f"models/hf/families/{kind}.py"], naming
        record = FAMILIES[kind]
        assert set(record.classes) <= set(SUPPORTED_ARCHITECTURES) and DEFAULT_ARCHITECTURE[kind] in record.classes
        assert f"(`{kind}`)" in families_markdown() and kind in TINY
        assert [n for (_, n), f in NAMED_SIZES.items() if f.get("extra", {}).get("hf_model_type") == kind] == [
            record.tiny]
    derived = FAMILIES["mixtral"]  # Mistral's record, with experts
    assert not derived.sizes and derived.tiny is None and derived.guess_rank is None and FAMILIES["mistral"].sizes
    templates = {kind: r.chat_template for kind, r in FAMILIES.items() if r.chat_template}
    assert templates["qwen3"] == "chatml" and templates["gemma3"] == "gemma" and "olmoe" not in templates
    assert set(templates.values()) <= set(NAMED_TEMPLATES), set(templates.values()) - set(NAMED_TEMPLATES)
