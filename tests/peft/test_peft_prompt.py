"""P-tuning and prefix tuning against peft's own PeftModelForCausalLM on a LlamaForCausalLM written by transformers
(MHA and GQA), training, peft-format export reloaded by peft, generation, checkpointing, and refusals."""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.contract import Capabilities
from lightning_llm.data import TextDataModule
from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.models import load_hf
from lightning_llm.peft import (
    PeftConfig,
    PrefixTuningLM,
    PTuningLM,
    apply_peft,
    count_parameters,
    enable_gradient_checkpointing,
    export_adapter,
    load_adapter,
    merge_peft,
)
from lightning_llm.peft.prompt import check_prompt_layout
from lightning_llm.tasks import CausalLMTask, OptimConfig

N = 3  # virtual tokens
CASES = {
    "prefix": ("prefix_tuning", {}),
    "prefix_projection": ("prefix_tuning", {"prefix_projection": True, "encoder_hidden_size": 16}),
    "p_tuning_mlp": ("p_tuning", {"encoder_hidden_size": 16}),
    "p_tuning_lstm": ("p_tuning", {"encoder_reparameterization_type": "LSTM", "encoder_hidden_size": 16}),
}


def _hf_base(directory: Path, kv_heads: int, *, std: float = 0.02) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         initializer_range=std)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module", params=[4, 2], ids=["mha", "gqa"])
def base_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_base(tmp_path_factory.mktemp(f"kv{request.param}") / "hf", request.param)


def _hf(directory: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaForCausalLM.from_pretrained(str(directory)).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: input_ids [3, 10] and its attention mask."""
    x = torch.randint(0, 264, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[1, :1] = 0
    return x, mask


def _peft_logits(model: torch.nn.Module, method: str, x: torch.Tensor, mask: torch.Tensor, n: int = N) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=mask).logits
    return logits[:, n:] if method == "p_tuning" else logits  # peft returns the virtual tokens' logits too


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_peft_model_and_export_reloads(case: str, base_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel, get_peft_model

    method, options = CASES[case]
    cfg = PeftConfig(method=method, num_virtual_tokens=N, options=options)
    ours = apply_peft(load_hf(base_dir, family="decoder")[0], cfg).eval()
    assert isinstance(ours, PrefixTuningLM if method == "prefix_tuning" else PTuningLM)
    x, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        got = ours(x, attention_mask=mask)
        base = ours.base(x, attention_mask=mask)
    moved = (got - base)[real].abs().max().item()

    # peft's own model on the HF base with our encoder weights (its config is the one we derived, GQA included).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = get_peft_model(_hf(base_dir), ours.peft_config).eval()
    ref.prompt_encoder["default"].load_state_dict(ours.prompt.state_dict())
    err = (_peft_logits(ref, method, x, mask) - got)[real].abs().max().item()

    # Our export, loaded by peft on the HF base.
    export_adapter(ours, cfg, tmp_path / "adapter", base_model_name_or_path=str(base_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = PeftModel.from_pretrained(_hf(base_dir), str(tmp_path / "adapter")).eval()
    err_export = (_peft_logits(reloaded, method, x, mask) - got)[real].abs().max().item()
    print(f"{case} ({base_dir.parent.name}): ours vs peft max |logit diff| = {err:.3e}, vs peft-reloaded export "
          f"{err_export:.3e} (the method moved logits by {moved:.3e})")
    assert moved > 1e-2
    assert err <= 1e-5 and err_export <= 1e-5


@pytest.mark.parametrize("method", ["prefix_tuning", "p_tuning"])
def test_generation_with_kv_cache_equals_recomputation(method: str, base_dir: Path) -> None:
    model = apply_peft(load_hf(base_dir, family="decoder")[0], PeftConfig(method=method, num_virtual_tokens=N)).eval()
    x, mask = _batch()
    gc = dict(max_new_tokens=5, eos_token_id=None)
    a = generate(model, x, mask, config=GenerationConfig(**gc))
    b = generate(model, x, mask, config=GenerationConfig(**gc, use_cache=False))
    assert torch.equal(a, b)
    # the first generated token is the argmax of the full forward at the last (real) position
    with torch.no_grad():
        first = model(x, attention_mask=mask)[:, -1].argmax(-1)
    assert torch.equal(a[:, 0], first)


def test_init_is_seed_deterministic(base_dir: Path) -> None:
    cfg = PeftConfig(method="prefix_tuning", num_virtual_tokens=N, options={"prefix_projection": True})
    base = load_hf(base_dir, family="decoder")[0]
    torch.manual_seed(1)
    a = apply_peft(base, cfg).prompt.state_dict()
    torch.manual_seed(2)
    state = torch.random.get_rng_state()
    b = apply_peft(base, cfg).prompt.state_dict()
    assert torch.equal(state, torch.random.get_rng_state())  # torch's generator is left alone
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_reentrant_checkpointing_gives_same_grads_reentrant_refused(base_dir: Path) -> None:
    cfg = PeftConfig(method="prefix_tuning", num_virtual_tokens=N, options={"prefix_projection": True})
    x, mask = _batch()

    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the backbone's init_seed, which seeds the prefix encoder's init
        model = apply_peft(load_hf(base_dir, family="decoder")[0], cfg)
        if checkpointing:
            assert enable_gradient_checkpointing(model) == 2
        torch.nn.functional.cross_entropy(model(x, attention_mask=mask).flatten(0, 1), x.flatten()).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    ref, got = grads(False), grads(True)
    assert set(ref) == {n for n in ref if n.startswith("prompt.")} and all(g is not None for g in got.values())
    err = max((ref[n] - got[n]).abs().max().item() for n in ref)
    print(f"prefix tuning: max |grad diff| with vs without checkpointing = {err:.3e}")
    assert err <= 1e-6
    with pytest.raises(ValueError, match="reentrant"):
        enable_gradient_checkpointing(apply_peft(load_hf(base_dir, family="decoder")[0], cfg), use_reentrant=True)


class _FixedBatchLoss(pl.Callback):
    """The training loss on the first training batch, at the start and at the end of fit (eval mode)."""

    def __init__(self) -> None:
        self.batch: dict[str, torch.Tensor] | None = None
        self.losses: list[float] = []

    def _loss(self, task: CausalLMTask) -> None:
        if self.batch is None:
            self.batch = next(iter(task.trainer.train_dataloader))
        was = task.training
        task.eval()
        with torch.no_grad():
            self.losses.append(task.compute_loss(self.batch, "val")[0].item())
        task.train(was)

    def on_train_start(self, trainer: pl.Trainer, task: CausalLMTask) -> None:
        self._loss(task)

    def on_train_end(self, trainer: pl.Trainer, task: CausalLMTask) -> None:
        self._loss(task)


@pytest.mark.parametrize("method", ["prefix_tuning", "p_tuning"])
def test_fit_trains_only_the_prompt_and_export_matches_peft(method: str, tmp_path: Path) -> None:
    from peft import PeftModel

    base_dir = _hf_base(tmp_path / "hf", 2, std=0.2)  # a random base whose outputs depend on the context
    cfg = PeftConfig(method=method, num_virtual_tokens=4, options={"encoder_hidden_size": 16} if method == "p_tuning"
                     else {"prefix_projection": True, "encoder_hidden_size": 16})
    before = load_hf(base_dir, family="decoder")[0].state_dict()
    pl.seed_everything(0)
    task = CausalLMTask(str(base_dir), peft=cfg, optim=OptimConfig(lr=3e-2, weight_decay=0.0))
    dm = TextDataModule(generated_docs=40, block_size=32, batch_size=4, val_fraction=0.1,
                        cache_dir=str(tmp_path / "cache"), tokenizer_dir="byte")
    probe = _FixedBatchLoss()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=str(tmp_path),
                         enable_checkpointing=False, callbacks=[probe])
    trainer.fit(task, dm)
    model = task.model.eval()
    start, end = probe.losses
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    print(f"{method}: train loss on the first batch {start:.4f} -> {end:.4f} after 20 steps; trainable "
          f"{count_parameters(model)[0]:,} params")
    assert trainable and all(n.startswith("prompt.") for n in trainable)
    assert end < start - 0.05
    for k, v in model.base.state_dict().items():  # the backbone is frozen
        assert torch.equal(v, before[k]), k
    # The adapter written at the end of fit loads in peft with the same logits.
    adapter = tmp_path / "adapter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = PeftModel.from_pretrained(_hf(base_dir), str(adapter)).eval()
    xm, mask = _batch()
    with torch.no_grad():
        got = model(xm, attention_mask=mask)
    err = (_peft_logits(hf, method, xm, mask, n=4) - got)[mask.bool()].abs().max().item()
    print(f"{method}: trained adapter reloaded by peft, max |logit diff| = {err:.3e}")
    assert err <= 1e-5


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="encoder_hiden_size"):
        PeftConfig(method="p_tuning", options={"encoder_hiden_size": 8})
    with pytest.raises(ValueError, match="token_dim"):
        PeftConfig(method="prefix_tuning", options={"token_dim": 8})  # derived from the model
    with pytest.raises(ValueError, match="MLP or LSTM"):
        PeftConfig(method="p_tuning", options={"encoder_reparameterization_type": "GRU"})
    with pytest.raises(ValueError, match="num_virtual_tokens"):
        PeftConfig(method="prefix_tuning", num_virtual_tokens=0)
    # A model without attention layers (or without an embedding) gets no prefix.
    no_layers = torch.nn.Module()
    no_layers.embed_tokens = torch.nn.Embedding(8, 4)
    no_layers.config = SimpleNamespace(num_layers=1)
    with pytest.raises(ValueError, match="self_attn"):
        apply_peft(no_layers, PeftConfig(method="prefix_tuning"))
    with pytest.raises(ValueError, match="embed_tokens"):
        apply_peft(torch.nn.Linear(2, 2), PeftConfig(method="p_tuning"))
    # Layouts that split the model are refused before the model is built.
    task = CausalLMTask("debug", peft=PeftConfig(method="prefix_tuning"))
    for caps in (Capabilities(batch_shared=True, deferred_init=True), Capabilities(deferred_init=True),
                 Capabilities(batch_shared=True, pipelined=True)):
        task._trainer = SimpleNamespace(strategy=SimpleNamespace(capabilities=caps))  # type: ignore[assignment]
        with pytest.raises(ValueError, match="data-parallel layouts only"):
            task.build_policy()
    check_prompt_layout("prefix_tuning", Capabilities(data_parallel_size=2))  # ddp / zero1/2: the whole model
    # Nothing to merge; a prompt-learning adapter cannot be merged into weights either.
    base_dir = _hf_base(tmp_path / "hf", 2)
    model = apply_peft(load_hf(base_dir, family="decoder")[0], PeftConfig(method="prefix_tuning"))
    with pytest.raises(ValueError, match="no weights to merge"):
        merge_peft(model)
    export_adapter(model, PeftConfig(method="prefix_tuning"), tmp_path / "adapter")
    with pytest.raises(ValueError, match="only LoRA.*PREFIX_TUNING.*no weights to merge"):
        load_adapter(load_hf(base_dir, family="decoder")[0], tmp_path / "adapter")


@pytest.mark.parametrize("method", ["prefix_tuning", "p_tuning"])
def test_checkpoint_rebuilds_the_trained_model(method: str, base_dir: Path) -> None:
    """A PEFT run's checkpoint (trainable weights only) rebuilds the same model (what `lightning_llm export` reads)."""
    from lightning_llm.export.model import rebuild_model

    cfg = PeftConfig(method=method, num_virtual_tokens=N, options={"encoder_hidden_size": 8})
    model = apply_peft(load_hf(base_dir, family="decoder")[0], cfg).eval()
    checkpoint = {"state_dict": {f"model.{n}": p.detach() for n, p in model.named_parameters() if p.requires_grad},
                  "peft": cfg.to_dict(), "hyper_parameters": {"backbone": str(base_dir)}}
    torch.manual_seed(123)  # another init seed: the weights must come from the checkpoint
    rebuilt, rebuilt_cfg = rebuild_model(checkpoint)
    assert type(rebuilt) is type(model) and rebuilt_cfg.method == method
    x, mask = _batch()
    with torch.no_grad():
        assert torch.equal(rebuilt(x, attention_mask=mask), model(x, attention_mask=mask))


@pytest.mark.parametrize("method", ["prefix_tuning", "p_tuning"])
def test_zero3_run_is_refused_before_training(method: str, tmp_path: Path) -> None:
    """A real ZeRO-3 run (one CPU process: the engine still shards and builds lazily) stops before its first step."""
    from lightning_llm.strategies import ZeroStrategy

    task = CausalLMTask("debug", peft=PeftConfig(method=method), model_overrides={"vocab_size": 264})
    dm = TextDataModule(generated_docs=20, block_size=16, batch_size=2, val_fraction=0.1,
                        cache_dir=str(tmp_path / "cache"), tokenizer_dir="byte")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=3), max_steps=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"peft.method={method} runs under data-parallel layouts only"):
        trainer.fit(task, dm)
    assert trainer.global_step == 0
