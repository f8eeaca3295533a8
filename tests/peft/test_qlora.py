"""QLoRA on one device: LoRA on a frozen base whose block linears are torchao NF4 (``--model.quantize=nf4``).

Independent references: torchao's own ``to_nf4`` / ``linear_nf4`` on the checkpoint's weights, a plain LoRA run on a
full-precision model holding the dequantized values, transformers' ``LlamaForCausalLM`` on the merged export, and
peft's ``PeftModel`` on the exported adapter. fp32 compute, dropout 0.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import TextDataModule
from lightning_llm.models import build_model, load_hf, save_hf
from lightning_llm.models.quantize import QuantizationConfig, quantized_bytes, quantized_linears
from lightning_llm.peft import LoraArgs
from lightning_llm.tasks import CausalLMTask, OptimConfig
from lightning_llm.testing import StepRecorder, max_abs_err

torchao = pytest.importorskip("torchao", reason="--model.quantize needs torchao (the [quant] extra)")
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4  # noqa: E402

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=ALL_PROJ)
# The debug decoder's linears hold 32-128 NF4 blocks of 64: 16 scales per double-quantization block divides them all
QCFG = QuantizationConfig(block_size=64, scaler_block_size=16)
STEPS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF (LlamaForCausalLM) export of a random debug decoder (fp32) covering the byte tokenizer."""
    torch.manual_seed(0)
    return save_hf(build_model("debug", family="decoder", vocab_size=264), tmp_path_factory.mktemp("base") / "hf")


@pytest.fixture(scope="module")
def dequantized_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The base with every block linear replaced by torchao's own NF4 round trip of it (``to_nf4`` then
    ``get_original_weight``), written as a plain full-precision checkpoint: the reference model."""
    model, _ = load_hf(base_dir, family="decoder")
    with torch.no_grad():
        for _, lin in quantized_linears(model):
            lin.weight.copy_(to_nf4(lin.weight.detach(), 64, 16).get_original_weight())
    return save_hf(model, tmp_path_factory.mktemp("deq") / "hf")


def _fit(tmp: Path, backbone: Path, *, steps: int = STEPS, ckpt_path: str | None = None,
         every_step: bool = False, **task_kw) -> tuple[list[float], CausalLMTask]:
    pl.seed_everything(0)
    task = CausalLMTask(str(backbone), optim=OptimConfig(lr=2e-2, weight_decay=0.0), lora=LORA, **task_kw)
    dm = TextDataModule(tokenizer_dir="byte", generated_docs=40, block_size=32, batch_size=4, val_fraction=0.1,
                        cache_dir=str(tmp / "cache"))
    rec = StepRecorder(str(tmp / "steps.json"))
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp / "ckpt"), save_last=True, save_top_k=-1 if every_step else 1,
                                        every_n_train_steps=1 if every_step else None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp),
                         callbacks=[rec, ckpt])
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    return rec.losses, task


@pytest.fixture(scope="module")
def qlora_run(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float], CausalLMTask]:
    tmp = tmp_path_factory.mktemp("qlora")
    losses, task = _fit(tmp, base_dir, quantize="nf4", quantization=QCFG, every_step=True)
    return tmp, losses, task


def test_training_equals_lora_on_the_dequantized_full_precision_model(
        base_dir: Path, dequantized_dir: Path, qlora_run: tuple[Path, list[float], CausalLMTask],
        tmp_path: Path) -> None:
    _, quantized, task = qlora_run
    reference, _ = _fit(tmp_path / "ref", dequantized_dir)
    full, _ = _fit(tmp_path / "full", base_dir)
    err, quant_effect = max_abs_err(quantized, reference), max_abs_err(quantized, full)
    print(f"QLoRA vs LoRA on the dequantized weights: max |train_loss diff| over {STEPS} steps = {err:.2e}; "
          f"vs LoRA on the original weights: {quant_effect:.2e}")
    assert len(quantized) == STEPS and err <= 1e-5
    assert quant_effect > 1e-4  # the quantization changed the run: the comparison above could fail
    weights = [lin.weight for _, lin in quantized_linears(task.model)]
    assert len(weights) == 4 * 7 and all(isinstance(w, NF4Tensor) and not w.requires_grad for w in weights)


def test_quantized_layer_forward_equals_torchao_reference(base_dir: Path,
                                                          qlora_run: tuple[Path, list[float], CausalLMTask]) -> None:
    """Each quantized linear (its peft LoRA wrapper's base layer) against torchao's ``linear_nf4`` on ``to_nf4`` of
    the checkpoint's weight: the same packed data and scales, the same outputs."""
    _, _, task = qlora_run
    original, _ = load_hf(base_dir, family="decoder")
    ours = dict(quantized_linears(task.model))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3))
    worst = 0.0
    for name, lin in quantized_linears(original):
        mine = ours[f"{name}.base_layer"]  # every projection carries a LoRA
        ref = to_nf4(lin.weight.detach(), 64, 16)
        for piece in ("quantized_data", "quantized_scalers", "quantization_factor"):
            assert torch.equal(getattr(mine.weight, piece), getattr(ref, piece)), (name, piece)
        inp = x[..., :lin.in_features]
        with torch.no_grad():
            worst = max(worst, (mine(inp) - linear_nf4(inp, ref)).abs().max().item())
    print(f"quantized linears vs torchao linear_nf4: max |diff| = {worst:.1e}")
    assert worst == 0.0


def test_checkpoint_holds_adapters_and_settings_and_resumes(
        base_dir: Path, qlora_run: tuple[Path, list[float], CausalLMTask], tmp_path: Path) -> None:
    tmp, straight, task = qlora_run
    ckpt = torch.load(tmp / "ckpt" / "epoch=0-step=3.ckpt", map_location="cpu", weights_only=True)
    trainable = {n for n, p in task.named_parameters() if p.requires_grad}
    assert set(ckpt["state_dict"]) == trainable and all("lora_" in k for k in trainable)
    # compute_dtype=auto is stored as the dtype the quantized weights had (fp32 here), so merge re-quantizes alike
    assert QCFG.compute_dtype == "auto"
    assert ckpt["quantization"] == {"quantize": "nf4", **QCFG.to_dict(), "compute_dtype": "float32"}
    resumed, _ = _fit(tmp_path / "resume", base_dir, ckpt_path=str(tmp / "ckpt" / "epoch=0-step=3.ckpt"),
                      quantize="nf4", quantization=QCFG)
    print(f"resumed at step 3: losses {resumed} vs straight {straight[3:]}")
    assert max_abs_err(resumed, straight[3:]) <= 1e-6
    with pytest.raises(ValueError, match="trained with quantization"):
        _fit(tmp_path / "other", base_dir, ckpt_path=str(tmp / "ckpt" / "epoch=0-step=3.ckpt"))


def test_merged_export_reloads_in_transformers_with_the_runs_logits(
        base_dir: Path, qlora_run: tuple[Path, list[float], CausalLMTask], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    tmp, _, task = qlora_run
    out = tmp_path / "merged"
    assert main(["export", str(tmp / "ckpt" / "last.ckpt"), "--to", str(out)]) == 0
    hf = LlamaForCausalLM.from_pretrained(str(out)).eval()
    x = torch.randint(0, 259, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        run = task.model.eval()(x)
        merged = hf(input_ids=x).logits
        # What the dequantization alone moves: the same adapter on the original (unquantized) weights.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_original = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(base_dir)),
                                                    str(tmp / "adapter")).eval()(input_ids=x).logits
    err, dequant_err = (merged - run).abs().max().item(), (on_original - run).abs().max().item()
    print(f"merged export (transformers) vs the QLoRA run: max |logit diff| = {err:.2e}; the NF4 dequantization's "
          f"own effect (adapter on the unquantized base vs the run): {dequant_err:.2e}")
    assert err <= 1e-5 < dequant_err
    # merge --adapter and --ckpt fold the adapter into the same dequantized weights
    assert json.loads((tmp / "adapter" / "quantization.json").read_text())["quantize"] == "nf4"
    for src in (["--adapter", str(tmp / "adapter")], ["--ckpt", str(tmp / "ckpt" / "last.ckpt")]):
        dest = tmp_path / src[0].strip("-")
        assert main(["merge", "--base", str(base_dir), *src, "--output", str(dest)]) == 0
        other = LlamaForCausalLM.from_pretrained(str(dest)).eval()
        with torch.no_grad():
            assert (other(input_ids=x).logits - run).abs().max().item() <= 1e-5, src[0]


def test_frozen_base_bytes_against_bf16() -> None:
    """The ``small`` decoder's block linears as NF4 (block 64, double quantization per 256 scales where it divides):
    bytes held against the same weights in bf16."""
    from lightning_llm.models.quantize import quantize_

    model = build_model("small", family="decoder")
    base_bf16 = sum(p.numel() * 2 for p in model.parameters())
    quantize_(model, "nf4", QuantizationConfig())
    nbytes, numel = quantized_bytes(model)
    plain = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, NF4Tensor))
    ratio = nbytes / (2 * numel)
    whole = (nbytes + plain // 2) / base_bf16  # the rest (embeddings, head, norms) in bf16 too
    print(f"small: block linears {numel:,} weights: NF4 {nbytes:,} B vs bf16 {2 * numel:,} B = {ratio:.3f}x; "
          f"whole frozen base with embeddings/head/norms in bf16: {whole:.3f}x")
    assert 0.25 < ratio < 0.27  # 4 bits + an int8 scale per 64 weights + an fp32 factor per scale block


@pytest.mark.multiprocess  # torchao is imported in this process: a fresh one sees the fake
def test_missing_torchao_is_one_line_naming_the_flag(base_dir: Path, tmp_path: Path) -> None:
    """torchao missing (a torchao that fails to import shadows the installed one): one line naming the flag and the
    extra that installs it."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "fake" / "torchao"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('torchao is not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    args = [sys.executable, "-m", "lightning_llm", "fit", "--model=CausalLMTask", f"--model.backbone={base_dir}",
            "--model.lora.r=4", "--model.quantize=nf4", "--data=TextDataModule", "--data.tokenizer_dir=byte",
            "--trainer.max_steps=1", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, check=False)
    err = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "error:" in ln]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(err) == 1 and "--model.quantize=nf4 needs torchao" in err[0] and "[quant]" in err[0], err


def test_refusals_name_the_flag() -> None:
    """No PEFT method, a prompt-learning method, double_quant=false, a quantized module to save."""
    with pytest.raises(ValueError, match="needs an injected method"):
        CausalLMTask("debug", quantize="nf4")
    with pytest.raises(ValueError, match="got peft.method=prompt_tuning"):
        from lightning_llm.peft import PeftConfig

        CausalLMTask("debug", quantize="nf4", peft=PeftConfig(method="prompt_tuning"))
    with pytest.raises(ValueError, match="double_quant=false"):
        QuantizationConfig(double_quant=False)
    task = CausalLMTask("debug", quantize="nf4", quantization=QCFG,
                        lora=LoraArgs(target_modules=["v_proj"], modules_to_save=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match=r"\['q_proj'\] are quantized by --model.quantize"):
        task.build_policy()


def test_int8_trains_like_lora_on_its_dequantized_weights_and_exports(base_dir: Path, tmp_path: Path) -> None:
    """``--model.quantize=int8`` (torchao's weight-only ``Int8Tensor``, one scale per row): 6 steps equal plain LoRA
    on torchao's own dequantization of the same weights; each layer equals ``F.linear`` on torchao's int8 tensor
    built independently; the merged export reloads in transformers with the run's logits."""
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from transformers import LlamaForCausalLM

    model, _ = load_hf(base_dir, family="decoder")
    refs = {name: Int8Tensor.from_hp(lin.weight.detach(), granularity=PerRow()) for name, lin in
            quantized_linears(model)}
    with torch.no_grad():
        for name, lin in quantized_linears(model):
            lin.weight.copy_(refs[name].dequantize())
    reference_dir = save_hf(model, tmp_path / "deq_int8")
    quantized, task = _fit(tmp_path / "int8", base_dir, quantize="int8")
    reference, _ = _fit(tmp_path / "ref", reference_dir)
    err = max_abs_err(quantized, reference)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3))
    ours = dict(quantized_linears(task.model))
    with torch.no_grad():
        layer_err = max((ours[f"{n}.base_layer"](x[..., :ref.shape[1]])
                         - torch.nn.functional.linear(x[..., :ref.shape[1]], ref)).abs().max().item()
                        for n, ref in refs.items())
    print(f"int8: QLoRA vs LoRA on the dequantized weights: max |train_loss diff| = {err:.2e}; layers vs torchao: "
          f"{layer_err:.1e}")
    assert err <= 1e-5 and layer_err == 0.0
    assert all(isinstance(lin.weight, Int8Tensor) for lin in ours.values())
    assert main(["export", str(tmp_path / "int8" / "ckpt" / "last.ckpt"), "--to", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logit_err = (LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()(input_ids=ids).logits
                     - task.model.eval()(ids)).abs().max().item()
    print(f"int8 merged export (transformers) vs the run: max |logit diff| = {logit_err:.2e}")
    assert logit_err <= 1e-5


def test_hf_checkpoint_is_quantized_block_by_block(base_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading an HF checkpoint quantized: at every point at most one block's linears exist in full precision (the
    others are still on the meta device or already NF4), and the result equals quantizing the whole loaded model."""
    from lightning_llm.models import quantize as q
    from lightning_llm.models.init import is_meta

    lazy, _ = load_hf(base_dir, family="decoder", lazy=True)
    plain_at_once: list[int] = []
    real_quantize = q.quantize_

    def counting(part: torch.nn.Module, mode: str, cfg: QuantizationConfig) -> int:
        plain_at_once.append(sum(1 for _, lin in quantized_linears(lazy)
                                 if not is_meta(lin.weight) and not isinstance(lin.weight, NF4Tensor)))
        return real_quantize(part, mode, cfg)

    monkeypatch.setattr(q, "quantize_", counting)
    q.load_quantized(lazy, "nf4", QCFG)
    whole, _ = load_hf(base_dir, family="decoder")
    real_quantize(whole, "nf4", QCFG)
    print(f"full-precision block linears held at each part: {plain_at_once}")
    assert max(plain_at_once) == 7 and len(plain_at_once) >= 4  # one block's seven projections
    for (name, a), (_, b) in zip(quantized_linears(lazy), quantized_linears(whole), strict=True):
        assert torch.equal(a.weight.quantized_data, b.weight.quantized_data), name
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lazy.eval()(ids), whole.eval()(ids))


def test_estimate_counts_quantized_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """``lightning_llm estimate --quantize nf4``: the parameters' bytes are the quantized block linears as stored
    (measured on the built model) plus the rest in fp32; the quantized weights get no gradients or Adam states."""
    from lightning_llm.models.quantize import quantize_

    assert main(["estimate", "--model", "small", "--strategy", "ddp", "--devices", "1", "--precision", "32-true",
                 "--seq-len", "64", "--quantize", "nf4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bytes"]
    model = build_model("small", family="decoder")
    quantize_(model, "nf4", QuantizationConfig())
    qbytes, qnumel = quantized_bytes(model)
    plain = sum(p.numel() for p in model.parameters() if not isinstance(p, NF4Tensor))
    print(f"estimate: parameters {got['params']:,} B; measured {qbytes + 4 * plain:,} B (NF4 {qbytes:,} B)")
    assert abs(got["params"] - (qbytes + 4 * plain)) <= 0.01 * qbytes  # small's MLP uses 172-scale blocks, not 256
    assert got["grads"] == 4 * plain and got["optim"] == 8 * plain


def test_bfloat16_compute_dtype_quantizes_the_bf16_weights() -> None:
    """``compute_dtype=bfloat16``: the NF4 tensor is torchao's ``to_nf4`` of the bf16 weight (bf16 scales), and the
    layer's output in bf16 equals ``linear_nf4`` on it."""
    from lightning_llm.models.quantize import quantize_

    torch.manual_seed(0)
    model = build_model("debug", family="decoder")
    original = {n: lin.weight.detach().clone() for n, lin in quantized_linears(model)}
    quantize_(model, "nf4", QuantizationConfig(scaler_block_size=16, compute_dtype="bfloat16"))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    name, lin = quantized_linears(model)[0]
    ref = to_nf4(original[name].bfloat16(), 64, 16)
    assert lin.weight.dtype == torch.bfloat16 and torch.equal(lin.weight.quantized_data, ref.quantized_data)
    assert torch.equal(lin(x), linear_nf4(x, ref))
