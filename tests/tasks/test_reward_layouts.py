"""RewardTask under every layout against one device, in one launch of 2 processes: ddp, tp, pp, zero1, zero2, zero3,
cp (each row cut in two slices: the scored token on one rank), 3d (tp2 with sequence parallelism: the score head's
input gathered), and LoRA (ddp) and QLoRA (zero3, NF4 base) against their one-device runs, computed before the
launch. Compared: every parameter's first-step gradient (per tensor: the harness's check,
``testing.run_layouts_and_reference``); per step ``train_loss`` and ``rewards/margins``; after the last step:
``val_loss``, ``val_accuracy``, ``val_margin``.

In the same launch, PPO scored by a decoder reward model (an HF ``LlamaForSequenceClassification`` directory) that
also starts its value model, under tp and zero3: the reward model and the critic placed like the policy (a rank holds
part of the reward model's bytes), the first update's gradients (policy and critic), the scores and losses one
device's."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_llm.testing import (
    LoggedLoss,
    gathered,
    gradient_summary,
    max_abs_err,
    run_layouts_and_reference,
    run_worker,
    write_json_on_rank0,
    two_rank_layout,
)

STEPS = 4
TOL = 1e-5
LAYOUTS = ["ddp", "tp", "pp", "zero1", "zero2", "zero3", "cp", "3d", "ddp/lora", "zero3/qlora"]
PPO_LAYOUTS = ["ppo/tp", "ppo/zero3"]
PPO_KEYS = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg")
PEFT = {"": {}, "lora": {"lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj",
                                                                                         "gate_proj"]}}}
PEFT["qlora"] = {**PEFT["lora"], "quantize": "nf4"}
VAL_KEYS = ("val_loss", "val_accuracy", "val_margin", "val_rewards/chosen")


class Logged(LoggedLoss):
    """Also rewards/margins per step, and the validation metrics at the end."""

    def __init__(self, grads: str, reference: str) -> None:
        super().__init__(grads=grads, reference=reference)
        self.margins: list[float] = []
        self.val: dict[str, float] = {}

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, *args)
        self.margins.append(float(trainer.callback_metrics.get("rewards/margins", float("nan"))))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.val = {k: float(trainer.callback_metrics[k]) for k in VAL_KEYS}


def _fit(layout: str, devices: int, out: Path, *, peft: str = "", run: str = "") -> dict[str, Any]:
    """``STEPS`` steps; the first step's gradients recorded as ``run`` (one device: as ``reward[/peft]``)."""
    import lightning.pytorch as pl

    from lightning_llm.data import PreferenceDataModule
    from lightning_llm.models.quantize import QuantizationConfig
    from lightning_llm.tasks import RewardTask
    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = two_rank_layout(layout) if devices > 1 else ("auto", 8)
    # QLoRA: double-quantization blocks of 16 scales, so zero3 x2 splits every quantized weight of the debug model
    quant = {"quantization": QuantizationConfig(scaler_block_size=16)} if peft == "qlora" else {}
    pl.seed_everything(5)
    task = RewardTask("debug", model_overrides={"num_layers": 2}, center_rewards_coefficient=0.01,
                      optim=OptimConfig(lr=1e-3, scheduler="constant", weight_decay=0.0), **PEFT[peft], **quant)
    dm = PreferenceDataModule(generated_pairs=64, generated_val_pairs=8, cutoff_len=32, max_prompt_len=16,
                              batch_size=batch, eval_batch_size=4, pad_to_multiple_of=4)
    reference = "reward" + (f"/{peft}" if peft else "")
    rec = Logged(grads=run or reference, reference=reference)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=STEPS, num_sanity_val_steps=0, callbacks=[rec], default_root_dir=str(out))
    trainer.fit(task, dm)
    return {"losses": rec.losses, "margins": rec.margins, "val": rec.val}


def _reward_model(out: Path) -> Path:
    """A random `debug`-shaped LlamaForSequenceClassification (num_labels=1, the byte tokenizer's pad id) with the
    byte tokenizer's files, its score head scaled so that responses score apart."""
    import torch

    from lightning_llm.data.tokenizer_files import write_tokenizer
    from lightning_llm.data.tokenizers import ByteTokenizer
    from lightning_llm.models import build_model, save_hf

    torch.manual_seed(0)
    rm = build_model("debug", family="decoder", num_layers=2, vocab_size=264, num_labels=1, pad_token_id=256)
    with torch.no_grad():
        rm.score.weight.mul_(50.0)
    save_hf(rm, out)
    write_tokenizer(ByteTokenizer(), out)
    return out


class PPOLogged(LoggedLoss):
    """PPO's statistics per optimizer step, and the bytes this rank holds of the reward model."""

    def __init__(self, grads: str) -> None:
        super().__init__(grads=grads, reference="ppo")
        self.rows: list[list[float]] = []
        self.scoring_bytes = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_llm.strategies.zero.native import model_state_bytes

        self.scoring_bytes = sum(model_state_bytes(m, [])["params"] for m in pl_module.scoring_models().values())

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.rows.append([float(trainer.callback_metrics[k]) for k in PPO_KEYS])


def _ppo(layout: str, devices: int, out: Path, rm: Path) -> dict[str, Any]:
    """2 rollouts of 8 greedy responses (2 x 4 prompts under zero3; one mini-batch, so the replicas' rows make one
    device's), scored by ``rm``, which is also the critic."""
    import lightning.pytorch as pl

    from lightning_llm.data import PromptDataModule
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.rl import PPOConfig, RewardConfig
    from lightning_llm.tasks import PPOTask
    from lightning_llm.tasks.base import OptimConfig

    strategy, batch = (layout, 8 if layout == "tp" else 4) if devices > 1 else ("auto", 8)
    pl.seed_everything(5)
    task = PPOTask("debug", model_overrides={"num_layers": 2}, critic_backbone=str(rm),
                   generation=GenerationConfig(max_new_tokens=6), reward=RewardConfig(model=str(rm)),
                   ppo=PPOConfig(ppo_epochs=2, num_mini_batches=1), optim=OptimConfig(lr=1e-3, scheduler="constant"))
    dm = PromptDataModule(generated_prompts=16, max_prompt_len=16, batch_size=batch, tokenizer_dir="byte")
    rec = PPOLogged(grads=f"ppo/{layout}" if devices > 1 else "ppo")
    pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
               num_sanity_val_steps=0, callbacks=[rec], default_root_dir=str(out)).fit(task, dm)
    return {"rows": rec.rows, "scoring_bytes": rec.scoring_bytes}


def _worker(mode: str, out: Path) -> None:
    if mode == "reference":
        refs = {peft: _fit("1", 1, out / f"ref-{peft}", peft=peft) for peft in ("", "lora", "qlora")}
        refs["ppo"] = _ppo("1", 1, out / "ref-ppo", out / "rm")
        (out / "reference.json").write_text(json.dumps(refs))
        return
    results = {}
    for layout in LAYOUTS:
        name, _, peft = layout.partition("/")
        results[layout] = gathered(_fit(name, 2, out / layout.replace("/", "-"), peft=peft, run=layout))
    for layout in PPO_LAYOUTS:
        results[layout] = gathered(_ppo(layout.partition("/")[2], 2, out / layout.replace("/", "-"), out / "rm"))
    write_json_on_rank0(out / "layouts.json", results)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reward_layouts")
    _reward_model(out / "rm")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out))


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_device(runs: Path, layout: str) -> None:
    refs = json.loads((runs / "reference.json").read_text())
    ref = refs[layout.partition("/")[2]]
    assert ref["margins"][-1] > ref["margins"][0] + 0.02  # it learns: the reward margin grows
    for row in json.loads((runs / "layouts.json").read_text())[layout]:
        # fp32 rounding, relative to the values' size (the rewards grow past 1)
        scale = max(1.0, *map(abs, ref["margins"]), *(abs(v) for v in ref["val"].values()))
        err = max(max_abs_err(row["losses"], ref["losses"]), max_abs_err(row["margins"], ref["margins"])) / scale
        val = max(abs(row["val"][k] - ref["val"][k]) for k in VAL_KEYS) / scale
        print(f"{layout}: max |train_loss, rewards/margins - one device| / {scale:.2f} over {STEPS} steps = {err:.2e}; validation "
              f"{val:.2e} (val_accuracy {row['val']['val_accuracy']:.3f}); {gradient_summary(runs, layout)}")
        assert len(row["losses"]) == STEPS and err <= TOL and val <= TOL, (row, ref)



@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", PPO_LAYOUTS)
def test_ppo_with_a_decoder_reward_model_matches_one_device(runs: Path, layout: str) -> None:
    ref = json.loads((runs / "reference.json").read_text())["ppo"]
    assert len({round(r[0], 5) for r in ref["rows"]}) > 1  # the scores differ from rollout to rollout
    for row in json.loads((runs / "layouts.json").read_text())[layout]:
        # relative to the statistics' size (the value loss of a fresh policy is tens)
        err = max(abs(a - b) / max(1.0, abs(b)) for x, y in zip(row["rows"], ref["rows"], strict=True)
                  for a, b in zip(x, y))
        ratio = row["scoring_bytes"] / ref["scoring_bytes"]
        print(f"{layout}: max relative |{', '.join(PPO_KEYS)} - one device| over {len(row['rows'])} rollouts = "
              f"{err:.2e}; {gradient_summary(runs, layout)}; "
              f"reward model bytes on this rank {row['scoring_bytes']:,} ({ratio:.3f}x of one device's)")
        assert err <= TOL and ratio <= 0.7


if __name__ == "__main__":
    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
