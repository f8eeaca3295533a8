"""PPO task: prompt data, learning a programmatic reward, LoRA reference without a copy, reward models (our
ClassificationTask checkpoint and an HF directory), configuration errors, and every layout against one device in one
launch of 2 processes (ddp, zero3, deepspeed_zero2, tp, 3d, pp with whole-copy and staged decoding; a reward model, a
separate critic and a LoRA policy placed like the policy; the 4-process layouts: test_rl_replica_layouts.py)."""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.data import ByteTokenizer, PromptDataModule
from lightning_llm.generation import GenerationConfig
from lightning_llm.peft import LoraArgs
from lightning_llm.rl import CharShareReward, PPOConfig, RewardConfig, RewardModel
from lightning_llm.rl.rollouts.policy import adapters_disabled
from lightning_llm.tasks import OptimConfig, PPOTask
from lightning_llm.testing import MetricRows, run_worker, write_json_on_rank0
from lightning_llm.testing.rl import PPO_SPEC, compare_fits, held_bytes, layout_runs, rl_fit

DIGITS = RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", kwargs={"chars": "digits"})
KEYS = ("objective/scores", "objective/kl", "objective/kl_coef", "objective/entropy", "objective/rlhf_reward",
        "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/ratio",
        "val/num_eos_tokens", "policy/skipped_minibatches")




def _task(**kwargs: Any) -> PPOTask:
    defaults: dict[str, Any] = {
        "model_overrides": {"num_layers": 2}, "generation": GenerationConfig(max_new_tokens=12, do_sample=True),
        "ppo": PPOConfig(ppo_epochs=4, num_mini_batches=2, kl_coef=0.01), "reward": DIGITS,
        "optim": OptimConfig(lr=3e-3, warmup_steps=0, scheduler="constant", weight_decay=0.0)}
    return PPOTask("debug", **{**defaults, **kwargs})


def _fit(task: PPOTask, rollouts: int, *, batch_size: int = 16) -> list[dict[str, float]]:
    pl.seed_everything(0)
    rec = MetricRows()
    steps = rollouts * task.ppo.updates_per_rollout
    dm = PromptDataModule(batch_size=batch_size, generated_prompts=256, max_prompt_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[rec], limit_val_batches=0,
                   num_sanity_val_steps=0).fit(task, dm)
    return rec.rows


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


# ------------------------------------------------------------------------------------------------ data
def test_prompt_datamodule_left_pads_and_keeps_prompt_ends(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ["hello world", "hi", "abcdefghij"]) + "\n")
    dm = PromptDataModule(str(path), max_prompt_len=8, batch_size=3)
    dm.setup("fit")
    batch = dm.collate([dm.datasets["fit"][i] for i in range(3)])
    assert batch["input_ids"][1].tolist() == [ByteTokenizer.pad_token_id] * 6 + list(b"hi")
    assert batch["attention_mask"][1].tolist() == [0] * 6 + [1, 1]
    assert batch["input_ids"][0].tolist() == list(b"lo world")  # the end of a long prompt is kept
    assert batch["prompt"] == ["hello world", "hi", "abcdefghij"] and dm.eos_token_id == ByteTokenizer.eos_token_id
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="missing field 'prompt'"):
        PromptDataModule(str(tmp_path / "bad.jsonl")).setup("fit")
    generated = PromptDataModule(generated_prompts=10)
    generated.setup("fit")
    assert len(generated.datasets["fit"]) == 10


# ------------------------------------------------------------------------------------------------ learning
def test_ppo_raises_programmatic_reward_with_bounded_kl() -> None:
    """Reward = share of digits in the response (random-init policy starts near 10/259)."""
    task = _task(ppo=PPOConfig(ppo_epochs=4, num_mini_batches=2, kl_coef=0.01))
    rows = _fit(task, 30)
    first, last = _mean(rows[:5], "objective/scores"), _mean(rows[-5:], "objective/scores")
    kls = [r["objective/kl"] for r in rows]
    print(f"scores first5={first:.3f} last5={last:.3f} gain={last - first:.3f}; kl step0={kls[0]:.2e} "
          f"max={max(kls):.2f} last5={_mean(rows[-5:], 'objective/kl'):.2f}; "
          f"clipfrac={_mean(rows, 'policy/clipfrac_avg'):.3f} ratio={_mean(rows, 'val/ratio'):.4f}")
    assert set(KEYS) <= set(rows[0])
    assert abs(kls[0]) < 1e-5  # reference == initial policy: the first rollout has zero KL
    assert last - first >= 0.4
    # KL to the uniform-ish initial policy over 12 tokens: spreading over the 10 digits costs ~12 x log(259/10)
    # = 39 nats, collapsing onto one token ~12 x log(259) = 67; the penalty keeps it near the former.
    assert max(kls) < 50.0
    assert all(abs(r["objective/kl_coef"] - 0.01) < 1e-7 for r in rows)


def test_lora_policy_uses_adapter_disabled_reference_without_a_copy(tmp_path: Path) -> None:
    lora = LoraArgs(r=8, alpha=16, dropout=0.0,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    overrides = {"num_layers": 2, "vocab_size": 264}
    full = _task(model_overrides=overrides)
    task = _task(model_overrides=overrides, lora=lora, adapter_dir=str(tmp_path / "adapter"), optim=OptimConfig(lr=1e-2, scheduler="constant", weight_decay=0))
    full.configure_model()
    task.configure_model()
    base = copy.deepcopy(full.model.policy)  # same seedless init is not needed: we compare against task's own base
    base.load_state_dict({k.replace(".base_layer", ""): v for k, v in task.model.policy.state_dict().items()
                          if "lora_" not in k})
    rep_full, rep_lora = full.parameter_report(), task.parameter_report()
    print(f"parameters: full fine-tune {rep_full}; LoRA {rep_lora}")
    assert task.reference.shares_policy and rep_lora["reference"] == 0
    assert rep_full["reference"] == rep_full["policy"] and rep_full["total"] == 2 * rep_full["policy"] + 65
    lora_params = sum(p.numel() for n, p in task.model.policy.named_parameters() if "lora_" in n)
    assert rep_lora["total"] == rep_full["policy"] + lora_params + 65  # base + adapters + value head, no copy
    rows = _fit(task, 20)
    print(f"LoRA scores first3={_mean(rows[:3], 'objective/scores'):.3f} "
          f"last3={_mean(rows[-3:], 'objective/scores'):.3f} kl last={rows[-1]['objective/kl']:.3f}")
    assert abs(rows[0]["objective/kl"]) < 1e-5 and rows[-1]["objective/kl"] > 1e-3  # the adapter moved the policy
    assert _mean(rows[-3:], "objective/scores") - _mean(rows[:3], "objective/scores") >= 0.15
    ids = torch.randint(0, 256, (2, 10))
    policy = task.model.policy.eval()
    with adapters_disabled(policy) as n:
        off = policy(ids)
    assert n > 0 and torch.allclose(off, base.eval()(ids), atol=1e-6)
    assert not torch.allclose(policy(ids), off, atol=1e-4)  # adapters are back on
    assert all(p.requires_grad == ("lora_" in name) for name, p in policy.named_parameters())
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()  # the policy's adapter, exported in peft format


# ------------------------------------------------------------------------------------------------ reward models
def test_hf_sequence_classification_directory_as_reward_model(tmp_path: Path) -> None:
    from transformers import BertForSequenceClassification, BertTokenizer

    from lightning_llm.models import build_model, save_hf
    from lightning_llm.rl.examples.synthetic import write_reward_pairs

    write_reward_pairs(tmp_path / "pairs", n_train=4, n_val=2)
    vocab = (tmp_path / "pairs" / "tokenizer" / "vocab.txt").read_text().splitlines()
    torch.manual_seed(0)
    enc = build_model("debug", family="encoder", vocab_size=len(vocab), num_labels=2)
    save_hf(enc, tmp_path / "rm")
    (tmp_path / "rm" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    with pytest.raises(ValueError, match=r"has 2 outputs \(num_labels=2\): pick the one that is the reward with "
                                         "--model.reward.label"):
        RewardModel(RewardConfig(model=str(tmp_path / "rm")))
    rm = RewardModel(RewardConfig(model=str(tmp_path / "rm"), label=1, score="log_odds"))
    prompts, responses = ["Continue: ab\n", "x"], ["12a 3", "zz!"]
    ours = rm(prompts, responses)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = BertForSequenceClassification.from_pretrained(str(tmp_path / "rm")).eval()
    tok = BertTokenizer.from_pretrained(str(tmp_path / "rm"))
    with torch.no_grad():
        logits = hf(**tok(prompts, responses, padding=True, return_tensors="pt")).logits
    err = float((ours - (logits[:, 1] - logits[:, 0])).abs().max())
    print(f"HF reward model: ours={ours.tolist()} max err vs transformers {err:.2e}")
    assert err < 1e-5


def test_reward_model_trained_by_classification_task_drives_ppo(tmp_path: Path) -> None:
    from lightning_llm.data import SentencePairDataModule
    from lightning_llm.rl.examples.synthetic import write_reward_pairs
    from lightning_llm.tasks import ClassificationTask

    data = write_reward_pairs(tmp_path / "pairs", n_train=1200, n_val=200)
    pl.seed_everything(0)
    clf = ClassificationTask("debug", optim=OptimConfig(lr=2e-3, warmup_steps=20))
    dm = SentencePairDataModule(str(data), str(data / "tokenizer"), max_length=64, batch_size=32)
    ckpt = tmp_path / "rm.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(clf, dm)
    trainer.save_checkpoint(ckpt)
    reward = RewardConfig(model=str(ckpt), tokenizer_dir=str(data / "tokenizer"), max_length=64, label=1)
    rm = RewardModel(reward)
    dev = [json.loads(x) for x in (data / "dev.json").read_text().splitlines()]
    scores = rm([r["sentence1"] for r in dev], [r["sentence2"] for r in dev])
    acc = float(((scores > 0).long() == torch.tensor([int(r["label"]) for r in dev])).float().mean())
    task = _task(reward=reward, model_overrides={"num_layers": 2, "vocab_size": 264})
    task.configure_model()
    dm_p = PromptDataModule(generated_prompts=32)
    dm_p.setup("fit")
    batch = dm_p.collate([dm_p.datasets["fit"][i] for i in range(32)])
    share0 = _sample_digit_share(task, batch)
    rows = _fit(task, 20)
    first, last = _mean(rows[:3], "objective/scores"), _mean(rows[-3:], "objective/scores")
    share = _sample_digit_share(task, batch)  # the property the reward model was trained to prefer
    print(f"reward model dev acc={acc:.3f}; PPO reward-model score first3={first:.2f} last3={last:.2f}; "
          f"digit share of samples before/after PPO={share0:.2f}/{share:.2f}; kl last={rows[-1]['objective/kl']:.2f}")
    assert acc >= 0.85
    assert last - first >= 3.0 and share - share0 >= 0.2


def _sample_digit_share(task: PPOTask, batch: dict[str, Any]) -> float:
    from lightning_llm.generation import generate, strip_after_eos

    cfg = GenerationConfig(max_new_tokens=12, do_sample=True, eos_token_id=ByteTokenizer.eos_token_id,
                           pad_token_id=ByteTokenizer.pad_token_id)
    policy = task.model.policy.eval()
    out = generate(policy, batch["input_ids"], batch["attention_mask"], config=cfg,
                   generator=torch.Generator().manual_seed(123))
    texts = [ByteTokenizer().decode(ids) for ids in strip_after_eos(out, cfg.eos_ids)]
    return sum(CharShareReward()([], texts)) / len(texts)


# ------------------------------------------------------------------------------------------------ errors
def test_configuration_errors_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="exactly one of reward.fn"):
        PPOTask("debug")
    with pytest.raises(ValueError, match="exactly one of reward.fn"):
        PPOTask("debug", reward=RewardConfig(fn="x:y", model="m"))
    with pytest.raises(ValueError, match="ppo.clip_range"):
        PPOConfig(clip_range=0.0)
    with pytest.raises(ValueError, match="kl_target"):
        PPOConfig(adaptive_kl=True)
    with pytest.raises(ValueError, match="cannot import"):
        _task(reward=RewardConfig(fn="lightning_llm.rl.rewards:Nope")).configure_model()
    with pytest.raises(FileNotFoundError, match="reward.model"):
        _task(reward=RewardConfig(model="/no/such/rm")).configure_model()
    with pytest.raises(ValueError, match="num_mini_batches"):
        _fit(_task(ppo=PPOConfig(num_mini_batches=4)), 1, batch_size=2)


def test_command_line_switches_a_config_reward_function_for_a_model_and_lists_sources(tmp_path: Path) -> None:
    """``--model.reward.fn=null`` switches a config's reward function off for a reward model (jsonargparse once made
    the string "None" of it), and ``--model.rewards`` takes several sources with names and weights."""
    from lightning_llm.cli import LLMCLI

    config = Path(__file__).resolve().parents[2] / "configs" / "ppo.yaml"
    base = ["--config", str(config), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = LLMCLI(args=[*base, "--model.reward.fn=null", "--model.reward.model=/some/rm"], run=False)
    assert cli.model.reward_config.fn is None and cli.model.reward_config.model == "/some/rm"
    cli = LLMCLI(args=[*base, "--model.reward.fn=null", "--model.rewards=[{fn: lightning_llm.rl.rewards:FormatReward, "
                       "weight: 0.5, name: fmt}, {fn: lightning_llm.rl.rewards:CharShareReward}]"], run=False)
    assert [(c.source_name, c.weight) for _, c in cli.model.reward_configs] == [("fmt", 0.5), ("CharShareReward", 1.0)]


# ------------------------------------------------------------------------------------------------ layouts
RUNS = {  # spec -> layouts ("/unfused": --model.fused_loss=false)
    "base": ["ddp", "zero3", "zero3/unfused", "deepspeed_zero2", "tp", "tp/unfused", "3d", "pp", "pp_stages"],
    "rm": ["zero3", "tp", "pp"], "critic": ["zero3", "tp"], "lora": ["pp"],
}
SHARDED = ("zero3", "tp", "3d", "pp", "pp_stages")
"""Layouts that split or shard the frozen reference (a rank holds at most 0.55x of its bytes)."""


def _specs(out: Path) -> dict[str, dict[str, Any]]:
    """``base``: testing.rl.PPO_SPEC (the PairedDigits reward on the prompts' columns, rollouts.jsonl); ``rm``: scored
    by an encoder reward model (an HF directory written here); ``critic``: a separate critic trunk; ``lora``: a LoRA
    policy, whose reference is the policy with its adapters off."""
    rm = {"model": str(out / "rm"), "score": "log_odds", "label": 1}
    return {"base": PPO_SPEC, "rm": {**PPO_SPEC, "rewards": [], "reward": rm},
            "critic": {**PPO_SPEC, "critic_backbone": "debug"},
            "lora": {**PPO_SPEC, "lora": {"r": 4, "alpha": 8, "dropout": 0.0}}}


def _layout_fit(spec: str, layout: str, out: Path) -> dict[str, Any]:
    name, _, variant = layout.partition("/")
    settings = {**_specs(out)[spec], **({"fused_loss": False} if variant == "unfused" else {})}
    return rl_fit("ppo", settings, out / f"{spec}-{layout.replace('/', '-')}", prompts=out / "prompts.jsonl",
                  layout=name)


def _reward_model(out: Path) -> None:
    """A `debug` encoder classifier saved as an HF directory with its BERT vocabulary (random weights: its scores are
    what is compared)."""
    from lightning_llm.models import build_model, save_hf
    from lightning_llm.rl.examples.synthetic import write_reward_pairs

    write_reward_pairs(out / "pairs", n_train=4, n_val=2)
    vocab = (out / "pairs" / "tokenizer" / "vocab.txt").read_text().splitlines()
    vocab += [f"[unused{i}]" for i in range(-len(vocab) % 8)]  # as BERT's: a vocabulary tp can split
    torch.manual_seed(0)
    rm = build_model("debug", family="encoder", vocab_size=len(vocab), num_labels=2)
    with torch.no_grad():
        rm.classifier.weight.mul_(50.0)  # scores that differ from response to response (and from one rollout's mean)
    save_hf(rm, out / "rm")
    (out / "rm" / "vocab.txt").write_text("\n".join(vocab) + "\n")


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        for spec in RUNS:
            _layout_fit(spec, "1", out)
        return
    for spec, layouts in RUNS.items():
        for layout in layouts:
            _layout_fit(spec, layout, out)
    write_json_on_rank0(out / "refused.json", _layout_fit("critic", "pp", out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout of every spec in one launch of 2 processes; the one-device runs computed before it."""
    out = tmp_path_factory.mktemp("ppo_layouts")
    _reward_model(out)
    return layout_runs(__file__, out, lambda: _worker("reference", out))


def _compared(runs: Path, spec: str, layout: str) -> tuple[dict[str, float], list[dict[str, float]], Path]:
    other = runs / f"{spec}-{layout.replace('/', '-')}"
    errs = compare_fits(runs / f"{spec}-1", other)
    rows = json.loads((other / "rows.json").read_text())
    print(f"{spec} under {layout}: max |stat - one device| (relative past 1) {errs['stats']:.1e}, params "
          f"{errs['params']:.1e}, rollouts.jsonl {errs['rollouts']:.1e}; kl_coef per rollout "
          f"{[round(r['objective/kl_coef'], 5) for r in rows]}")
    assert errs["stats"] < 1e-5 and errs["params"] < 1e-4 and errs["rollouts"] < 1e-5
    assert len(rows) == 4 and rows[-1]["episode"] == 32  # 4 rollouts x 8 global prompts
    return errs, rows, other


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", RUNS["base"])
def test_layout_matches_one_device(runs: Path, layout: str) -> None:
    """Greedy rollouts (deterministic), global whitening, adaptive KL fed the global KL, losses normalized by the
    global token count: 2 ranks reproduce one device x 8 prompts, parameters and rollouts.jsonl included, the
    reward's columns paired with their prompts (testing.rl.PairedDigits refuses any other pairing); with the fused
    token scores and without them (zero3, tp). ZeRO-3 once clipped before averaging the value head's gradients (a
    task's own plain parameters, outside FSDP2's units): the KL was 0.4 off after two rollouts. DeepSpeed clips only
    inside engine.step(): max_grad_norm reaches its config. Tensor parallel (and 3d: with sequence parallelism): the
    two ranks share one replica's 8 prompts and generate the same tokens. Pipeline parallel: the actor-critic is split
    with its value head on the last stage, rollouts decode with whole copies of it (or, as ``pp_stages``, through the
    stages) and each optimizer step runs micro-batch by micro-batch. The frozen reference is placed like the
    policy; under ZeRO-3 a rollout gathers the parameters once."""
    _, rows, other = _compared(runs, "base", layout)
    one = json.loads((runs / "base-1" / "rows.json").read_text())
    assert one[-1]["objective/kl_coef"] != 0.05  # the adaptive controller moved, identically on both ranks
    frozen, whole = held_bytes(other, "frozen"), held_bytes(runs / "base-1", "frozen")[0]
    assert whole > 0 and (max(frozen) <= 0.55 * whole if layout.partition("/")[0] in SHARDED else
                          max(frozen) == whole), (frozen, whole)
    if layout.startswith("zero3"):
        gathers = json.loads((other / "rollouts.json").read_text())["gathers"]
        assert all(count == 0 for rank in gathers for count in rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", RUNS["rm"])
def test_reward_model_is_placed_like_the_policy(runs: Path, layout: str) -> None:
    """A reward model (an encoder classifier scoring the decoded texts) is sharded like the policy where its inputs
    allow: its family's tensor-parallel plan under tp x2 (0.66x of its bytes per rank), ZeRO-3 shards under zero3 x2
    (0.50x), whole on each rank of pp x2 (it is not split into the policy's stages); the scores, KL and parameters
    equal one device's."""
    _, rows, other = _compared(runs, "rm", layout)
    ratio = max(held_bytes(other, "scoring")) / held_bytes(runs / "rm-1", "scoring")[0]
    print(f"reward model bytes per rank: {ratio:.3f}x of one device's")
    assert len({round(r["objective/scores"], 6) for r in rows}) > 1
    # tp: the encoder's plan keeps position/token-type embeddings, norms, pooler and classifier whole - 31% of this
    # tiny `debug` encoder (0.657x per rank), 1.0% of bert-base (0.505x)
    assert ratio <= {"zero3": 0.55, "tp": 0.7, "pp": 1.0}[layout] and (ratio == 1.0) == (layout == "pp")


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", RUNS["critic"])
def test_separate_critic_is_sharded_like_the_policy(runs: Path, layout: str) -> None:
    """A separate critic trunk (trained, inside the actor-critic) gets its family's tensor-parallel plan and ZeRO-3
    units like the policy (a rank holds at most 0.55x of its bytes; it was replicated); values, losses and parameters
    equal one device's."""
    _, rows, other = _compared(runs, "critic", layout)
    parts = json.loads((other / "rollouts.json").read_text())["parts_bytes"]
    whole = json.loads((runs / "critic-1" / "rollouts.json").read_text())["parts_bytes"][0]["critic"]
    held = max(p["critic"] for p in parts)
    print(f"critic bytes per rank {held} vs {whole} ({held / whole:.3f}x)")
    assert any("critic" in k for k in torch.load(other / "steps.json.pt")) and rows[-1]["loss/value_avg"] > 0
    assert held / whole <= 0.55


@pytest.mark.multiprocess
def test_lora_policy_under_pipeline_matches_one_device(runs: Path) -> None:
    """A LoRA policy under pp x2: the reference is the policy with its adapters off, run through the pipeline (the
    actor-critic asked for the policy's output alone); rollouts, KL and parameters equal one device's LoRA run."""
    _, rows, _ = _compared(runs, "lora", "pp")
    assert rows[-1]["objective/kl"] > 0.01  # the reference (adapters off) really differs from the trained policy


@pytest.mark.multiprocess
def test_separate_critic_is_refused_under_pipeline(runs: Path) -> None:
    refused = json.loads((runs / "refused.json").read_text())["refused"]
    assert refused.startswith("--model.critic_backbone=debug: a separate critic trunk is not split into pipeline "
                              "stages")
    assert not (runs / "critic-pp" / "rows.json").exists()


def test_deepspeed_takes_the_clip_norm_from_the_task_and_refuses_a_conflicting_config() -> None:
    from lightning_llm.strategies.zero.deepspeed import DeepSpeedZeroStrategy

    task = _task(ppo=PPOConfig(max_grad_norm=0.7))
    task.automatic_optimization = False
    strategy = DeepSpeedZeroStrategy(stage=2)
    strategy._lightning_module = task
    assert strategy._with_manual_clipping({"gradient_clipping": 0.0})["gradient_clipping"] == 0.7
    with pytest.raises(ValueError, match="gradient_clipping=0.5 differs from PPOTask's max_grad_norm=0.7"):
        strategy._with_manual_clipping({"gradient_clipping": 0.5})
    task.ppo = PPOConfig(max_grad_norm=None)
    assert "gradient_clipping" not in strategy._with_manual_clipping({})


def test_clip_gradients_under_deepspeed_refuses_a_norm_the_engine_would_not_apply() -> None:
    """A user's manual-optimization task calling clip_gradients(x) under DeepSpeed trained unclipped, silently."""
    from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

    from lightning_llm.strategies.zero.deepspeed import CheckedClipPrecision, DeepSpeedZeroStrategy

    strategy = DeepSpeedZeroStrategy(stage=2)
    strategy.precision_plugin = DeepSpeedPrecision("32-true")  # what Lightning's connector hands the strategy
    plugin = strategy.precision_plugin
    assert isinstance(plugin, CheckedClipPrecision) and plugin.precision == "32-true"
    plugin.clip_gradients(None, 0.0)  # no clipping asked: nothing to check
    with pytest.raises(ValueError, match=r"clip_gradients\(1.0\) under DeepSpeed: .* gradient_clipping=0.0"):
        plugin.clip_gradients(None, 1.0)
    strategy.config["gradient_clipping"] = 1.0  # what the engine applies (max_grad_norm or gradient_clip_val)
    plugin.clip_gradients(None, 1.0)


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
