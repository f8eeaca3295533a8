"""RewardTask and decoder reward models: the loss against trl's formula in float64, scores against transformers'
sequence classifiers (written by transformers here) on left- and right-padded rows, the backbones a reward model
starts from, bad input (one line naming the file and line), export -> transformers with the same scores and predict
of (prompt, response) records, and PPO/GRPO scored by a decoder reward model (an export, a RewardTask checkpoint) with
the value model started from it. The layouts: tests/tasks/test_reward_layouts.py."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_llm.cli import main
from lightning_llm.data import DataError, PreferenceDataModule
from lightning_llm.models import build_model
from lightning_llm.models.scores import sequence_scores
from lightning_llm.rl import RewardConfig, RewardModel
from lightning_llm.tasks import OptimConfig, RewardTask
from lightning_llm.tasks.preference.reward import build_reward_source, reward_loss

TOL = 1e-5
BYTE_PAD, BYTE_EOS = 256, 258


def _quiet(fn: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ the loss
def _logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_loss_matches_trls_formula_in_float64() -> None:
    """trl's RewardTrainer: -logsigmoid(r_c - r_r - margin) averaged over pairs + coef * mean((r_c + r_r)^2); the
    accuracy counts ties as wrong."""
    g = torch.Generator().manual_seed(0)
    rc, rr, margin = (torch.randn(12, generator=g, dtype=torch.float64) for _ in range(3))
    rr[:3] = rc[:3]  # ties
    for coef in (None, 0.01):
        loss, stats = reward_loss(rc, rr, margin, center_rewards_coefficient=coef)
        pairs = list(zip(rc.tolist(), rr.tolist(), margin.tolist()))
        ref = sum(-_logsigmoid(c - r - m) for c, r, m in pairs) / 12
        ref += (coef or 0.0) * sum((c + r) ** 2 for c, r, _ in pairs) / 12
        print(f"center_rewards_coefficient={coef}: |ours - trl's formula| = {abs(float(loss) - ref):.1e}")
        assert abs(float(loss) - ref) <= 1e-12
    assert float(stats["rewards/accuracies"]) == sum(c > r for c, r, _ in pairs) / 12 and sum(c > r for c, r, _ in
                                                                                               pairs) <= 9
    assert float(stats["rewards/margins"]) == pytest.approx(float((rc - rr).mean()), abs=1e-12)


def test_task_scores_each_rows_last_token_and_pairs_rows(tmp_path: Path) -> None:
    """loss_from_output on random per-position scores (float64) vs the loss assembled by hand: each row's reward at
    its last token that is not padding, rows paired (chosen, rejected), the records' margins."""
    path = tmp_path / "pairs.jsonl"
    records = [{"prompt": "Continue: ab", "chosen": "12", "rejected": "xyzzy", "margin": 1.5},
               {"prompt": "Say", "chosen": "3456789", "rejected": "q"},
               {"prompt": "Go on", "chosen": "0", "rejected": "abc", "margin": -2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = PreferenceDataModule(str(path), cutoff_len=24, max_prompt_len=12)
    dm.setup("fit")
    batch = dm.collate([dm.split_dataset("fit")[i] for i in range(3)])
    assert batch["margin"].tolist() == [1.5, 1.5, 0.0, 0.0, -2.0, -2.0]
    task = RewardTask("debug", center_rewards_coefficient=0.1)
    task.pad_token_id = BYTE_PAD
    scores = torch.randn(*batch["input_ids"].shape, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss, out = task.loss_from_output(scores, batch, "train")
    r = []
    for row, ids in enumerate(batch["input_ids"].tolist()):
        last = max(t for t, i in enumerate(ids) if i != BYTE_PAD)
        assert ids[last] == BYTE_EOS  # prompt + response + EOS
        r.append(float(scores[row, last, 0]))
    margins = [1.5, 0.0, -2.0]
    ref = sum(-_logsigmoid(r[2 * i] - r[2 * i + 1] - margins[i]) for i in range(3)) / 3
    ref += 0.1 * sum((r[2 * i] + r[2 * i + 1]) ** 2 for i in range(3)) / 3
    assert abs(float(loss) - ref) <= 1e-6 and out["chosen_rewards"].tolist() == pytest.approx(r[0::2], abs=1e-6)


# ------------------------------------------------------------------------------------------------ transformers parity
def _hf_classifier(out: Path, family: str, *, num_labels: int = 1, causal: bool = False) -> Path:
    """A tiny random ``<family>ForSequenceClassification`` (or ``ForCausalLM``) written by transformers, pad id 0."""
    import transformers

    torch.manual_seed(0)
    if family == "GPT2":
        config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         num_labels=num_labels, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    else:
        extra = {"head_dim": 16} if family == "Qwen3" else {"head_dim": 8} if family in CLASSIFIER_EXTRA else {}
        extra.update(CLASSIFIER_EXTRA.get(family, {}))
        config = getattr(transformers, f"{family}Config")(
            vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_labels=num_labels, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **extra)
    model = getattr(transformers, f"{family}For{'CausalLM' if causal else 'SequenceClassification'}")(config)
    _quiet(model.save_pretrained, str(out))
    return out


def _padded(rows: list[list[int]], side: str, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    for i, r in enumerate(rows):
        if side == "right":
            ids[i, : len(r)] = torch.tensor(r)
        else:
            ids[i, width - len(r):] = torch.tensor(r)
    return ids, (ids != pad).long()


CLASSIFIER_EXTRA: dict[str, dict[str, Any]] = {
    "Phi3": {}, "Glm4": {}, "Olmo2": {}, "Olmo3": {}, "SmolLM3": {}, "Gemma2": {},
    "Qwen3Next": {"layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
}
"""The families whose ``...ForSequenceClassification`` the HF table reads beyond Llama/Qwen3/GPT-2 (config extras)."""
ROWS = [[5, 17, 250, 2], [9, 3, 77, 120, 44, 6, 2], [31, 32], [40, 41, 42, 0]]  # the last ends with the pad id


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "GPT2", *CLASSIFIER_EXTRA])
def test_scores_match_transformers_sequence_classifiers_on_padded_rows(tmp_path: Path, family: str) -> None:
    """Ours (loaded from the directory transformers wrote) vs transformers in fp32, on right- and left-padded rows
    (a row ending in the pad id is scored before it, by transformers' rule); RoPE families score both paddings
    alike. GPT-2's learned positions differ for left padding in transformers too (positions count from the row's
    start): right padding only."""
    from transformers import AutoModelForSequenceClassification

    path = _hf_classifier(tmp_path / family, family)
    hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(path)).eval()
    ours = build_model(str(path), family="decoder").eval()
    assert ours.lm_head is None and ours.score.weight.shape == (1, 32)
    sides = ("right",) if family == "GPT2" else ("right", "left")
    got = {}
    with torch.no_grad():
        for side in sides:
            ids, mask = _padded(ROWS, side)
            ref = hf(ids, attention_mask=mask).logits
            got[side] = sequence_scores(ours(ids, attention_mask=mask), ids, 0)
            err = float((got[side] - ref).abs().max())
            print(f"{family} {side}-padded: max |ours - transformers| = {err:.1e}")
            assert err <= TOL
    if family != "GPT2":
        assert float((got["left"] - got["right"]).abs().max()) <= TOL


def test_backbones_a_reward_model_starts_from(tmp_path: Path) -> None:
    """A ...ForCausalLM: its trunk, the score head fresh (its lm_head ignored); a ...ForSequenceClassification with
    one label: its score head too; with two labels: refused naming the count. A policy task refuses a classifier."""
    from lightning_llm.tasks import SFTTask

    causal = _hf_classifier(tmp_path / "causal", "Qwen3", causal=True)
    task = RewardTask(str(causal))
    task.configure_model()
    hf = _quiet(__import__("transformers").AutoModelForCausalLM.from_pretrained, str(causal))
    assert torch.equal(task.model.layers["1"].mlp.down_proj.weight, hf.model.layers[1].mlp.down_proj.weight)
    assert task.model.lm_head is None and task.model.score.weight.std() > 0 and task.pad_token_id == 0
    one = _hf_classifier(tmp_path / "one", "Qwen3")
    task = RewardTask(str(one))
    task.configure_model()
    hf = _quiet(__import__("transformers").AutoModelForSequenceClassification.from_pretrained, str(one))
    assert torch.equal(task.model.score.weight, hf.score.weight)
    two = _hf_classifier(tmp_path / "two", "Qwen3", num_labels=2)
    with pytest.raises(ValueError, match="a sequence classifier with num_labels=2; a reward model has one score"):
        RewardTask(str(two))
    with pytest.raises(ValueError, match=r"is a sequence classifier \(...ForSequenceClassification, num_labels=1\)"):
        SFTTask(str(one))


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_records_are_refused_naming_file_and_line(tmp_path: Path) -> None:
    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    path = tmp_path / "pairs.jsonl"
    for bad, message in [({"prompt": "a", "chosen": "b"}, "missing field 'rejected'"),
                         ({**good, "margin": "big"}, "field 'margin' must be a finite number, got 'big'"),
                         ({**good, "margin": True}, "field 'margin' must be a finite number, got True"),
                         ({**good, "margin": None}, "field 'margin' must be a finite number, got None")]:
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataError, match=rf"^{path}:2: {message}"):
            PreferenceDataModule(str(path)).setup("fit")
    path.write_text(json.dumps({**good, "margin": float("nan")}).replace("NaN", "NaN") + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: field 'margin' must be a finite number, got nan"):
        PreferenceDataModule(str(path)).setup("fit")
    path.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: field 'response' must be a string"):
        PreferenceDataModule(predict_path=str(path)).setup("predict")


# ------------------------------------------------------------------------------------------------ fit, export, predict
def _fit(out: Path, backbone: str = "debug", tokenizer_dir: str | None = None, **task_kwargs: Any
         ) -> tuple[RewardTask, Path]:
    pl.seed_everything(0)
    task = RewardTask(backbone, model_overrides={"num_layers": 2} if backbone == "debug" else {},
                      optim=OptimConfig(lr=3e-3, scheduler="constant", weight_decay=0.0), **task_kwargs)
    dm = PreferenceDataModule(generated_pairs=32, generated_val_pairs=0, cutoff_len=32, max_prompt_len=16,
                              batch_size=4, tokenizer_dir=tokenizer_dir)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=str(out))
    _quiet(trainer.fit, task, dm)
    trainer.save_checkpoint(out / "reward.ckpt")
    return task.eval(), out / "reward.ckpt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A full fine-tune of the `debug` decoder (byte tokenizer), and LoRA on a LlamaForCausalLM written by
    transformers (its BPE tokenizer; the score head starts fresh and trains in full), each exported."""
    from tests.conftest import tiny_hf_llama

    out = tmp_path_factory.mktemp("reward")
    base = str(tiny_hf_llama(out / "llama-hf"))
    runs = {}
    for name, kwargs in (("full", {}), ("lora", {"backbone": base, "tokenizer_dir": base,
                                                 "lora": {"r": 4, "alpha": 8, "dropout": 0.0}})):
        task, ckpt = _fit(out / name, **kwargs)
        assert main(["export", str(ckpt), "--to", str(out / name / "hf")]) == 0
        runs[name] = {"task": task, "ckpt": ckpt, "hf": out / name / "hf"}
    return runs


def _texts() -> tuple[list[str], list[str]]:
    return ["Continue: ab", "x", "Say something long and winding"], ["12a 3", "zz!", "0"]


@pytest.mark.parametrize("run", ["full", "lora"])
def test_export_loads_in_transformers_with_the_same_scores(trained: dict[str, Any], run: str) -> None:
    """LlamaForSequenceClassification, num_labels=1, the run's pad id, the tokenizer: no missing or unexpected keys,
    and transformers' scores of right- and left-padded rows equal the trained task's."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task, directory = trained[run]["task"], trained[run]["hf"]
    hf, info = _quiet(AutoModelForSequenceClassification.from_pretrained, str(directory), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(str(directory))
    assert hf.config.architectures == ["LlamaForSequenceClassification"] and hf.config.num_labels == 1
    assert hf.config.pad_token_id == tok.pad_token_id == task.pad_token_id == (BYTE_PAD if run == "full" else 0)
    assert not (directory / "generation_config.json").exists()
    rows = [tok(p + r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for p, r in zip(*_texts())]
    errs = []
    with torch.no_grad():
        for side in ("right", "left"):
            ids, mask = _padded(rows, side, pad=tok.pad_token_id)
            ref = hf.eval()(ids, attention_mask=mask).logits[:, 0]
            errs.append(float((task.rewards(task.model(ids, attention_mask=mask), {"input_ids": ids}) - ref).abs().max()))
    print(f"{run} export: max |task - transformers| right/left padded = {errs[0]:.1e} / {errs[1]:.1e}")
    assert max(errs) <= TOL
    if run == "lora":  # the score head trained in full beside the adapters (peft's modules_to_save)
        score = task.model.score
        assert not torch.equal(score.modules_to_save["default"].weight, score.original_module.weight)


def test_predict_scores_each_record_as_the_export_does(trained: dict[str, Any], tmp_path: Path) -> None:
    """predict with the checkpoint: one score per (prompt, response) record, in file order, equal to transformers'
    on the export (prompt + response + EOS)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    records = [{"prompt": p, "response": r, "id": i} for i, (p, r) in enumerate(zip(*_texts()))]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    task = RewardTask("debug", model_overrides={"num_layers": 2}, predict_output=str(tmp_path / "scores.jsonl"))
    dm = PreferenceDataModule(predict_path=str(tmp_path / "samples.jsonl"), eval_batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    _quiet(trainer.predict, task, dm, ckpt_path=str(trained["full"]["ckpt"]))
    scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in s.items() if k != "score"} for s in scored] == records
    hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(trained["full"]["hf"])).eval()
    tok = AutoTokenizer.from_pretrained(str(trained["full"]["hf"]))
    with torch.no_grad():
        ref = [float(hf(torch.tensor([tok(r["prompt"] + r["response"], add_special_tokens=False)["input_ids"]
                                      + [BYTE_EOS]])).logits) for r in records]
    err = max(abs(s["score"] - x) for s, x in zip(scored, ref))
    print(f"predict: {len(scored)} scores, max |predict - transformers on the export| = {err:.1e}")
    assert err <= TOL


# ------------------------------------------------------------------------------------------------ PPO / GRPO
def test_decoder_reward_models_score_prompt_response_eos(trained: dict[str, Any], tmp_path: Path) -> None:
    """An exported reward model and the RewardTask checkpoint itself score (prompt, response) as transformers scores
    prompt + response + EOS; a two-output decoder classifier is refused without --model.reward.label."""
    from transformers import AutoModelForSequenceClassification

    prompts, responses = _texts()
    hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(trained["full"]["hf"])).eval()
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([list((p + r).encode()) + [BYTE_EOS]])).logits[:, 0]
                         for p, r in zip(prompts, responses)])
    for source in ("hf", "ckpt"):
        rm = build_reward_source(RewardConfig(model=str(trained["full"][source]), batch_size=2))
        err = float((rm(prompts, responses) - ref).abs().max())
        print(f"reward model from the {source}: max |scores - transformers| = {err:.1e}")
        assert isinstance(rm, RewardModel) and err <= TOL
    with pytest.raises(ValueError, match="max_prompt_length=300 must be >= 1 and below --model.reward.max_length"):
        RewardModel(RewardConfig(model=str(trained["full"]["hf"]), max_prompt_length=300))
    two = _hf_classifier(tmp_path / "two", "Llama", num_labels=2)
    from lightning_llm.data.tokenizer_files import write_tokenizer
    from lightning_llm.data.tokenizers import ByteTokenizer

    write_tokenizer(ByteTokenizer(), two)
    with pytest.raises(ValueError, match="has 2 outputs \\(num_labels=2\\): pick the one that is the reward with "
                                         "--model.reward.label"):
        RewardModel(RewardConfig(model=str(two)))
    rm = RewardModel(RewardConfig(model=str(two), label=1, score="logit"))
    hf2 = _quiet(AutoModelForSequenceClassification.from_pretrained, str(two)).eval()
    with torch.no_grad():
        ref2 = hf2(torch.tensor([list(b"ab12") + [BYTE_EOS]])).logits[:, 1]
    assert float((rm(["ab"], ["12"]) - ref2).abs().max()) <= TOL


def test_ppo_scored_by_a_reward_checkpoint_with_the_value_model_from_its_export(trained: dict[str, Any]) -> None:
    """PPO with --model.reward.model = the RewardTask checkpoint and --model.critic_backbone = its export: every
    rollout's scores are transformers' on prompt + response + EOS, and the value model is the reward model (its
    score head the value head: the first rollout's values are its per-position scores)."""
    from transformers import AutoModelForSequenceClassification

    from lightning_llm.data import PromptDataModule
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.rl import PPOConfig
    from lightning_llm.tasks import PPOTask

    task = PPOTask("debug", model_overrides={"num_layers": 2}, critic_backbone=str(trained["full"]["hf"]),
                   generation=GenerationConfig(max_new_tokens=6, do_sample=True),
                   ppo=PPOConfig(ppo_epochs=1, num_mini_batches=1), reward=RewardConfig(model=str(trained["full"]["ckpt"])),
                   optim=OptimConfig(lr=1e-3, scheduler="constant", weight_decay=0.0))
    seen: list[tuple[list[str], list[str], torch.Tensor]] = []
    score = task.score

    def recorded(samples: Any) -> None:  # what every reward source scored: each row's prompt and response
        score(samples)
        seen.append((samples.prompts, samples.texts, samples.scores.clone()))

    task.score = recorded  # type: ignore[method-assign]
    hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(trained["full"]["hf"])).eval()
    fresh = PPOTask("debug", critic_backbone=str(trained["full"]["hf"]),
                    reward=RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward"))
    fresh.configure_model()
    ids = torch.tensor([list(b"Continue: ab12")])
    kwargs = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(ids.shape[1])[None]}
    with torch.no_grad():
        _, values = fresh.model.eval()(ids, **kwargs)
        ref = hf.score(hf.model(ids, attention_mask=kwargs["attention_mask"]).last_hidden_state)[..., 0]
    print(f"value model = reward model: max |values - transformers' per-position scores| = "
          f"{float((values - ref).abs().max()):.1e}")
    assert fresh.model.value_head is None and float((values - ref).abs().max()) <= TOL
    with pytest.raises(ValueError, match="is a training checkpoint, not an HF directory: export a reward model first"):
        PPOTask("debug", critic_backbone=str(trained["full"]["ckpt"]), reward=RewardConfig(model="m"))
    pl.seed_everything(0)
    dm = PromptDataModule(batch_size=4, generated_prompts=8, max_prompt_len=16, tokenizer_dir="byte")
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    _quiet(trainer.fit, task, dm)
    assert task.model.value_head is None and task.model.critic.score is not None
    err = 0.0
    with torch.no_grad():
        for prompts, responses, scores in seen:
            for p, r, s in zip(prompts, responses, scores.tolist()):
                err = max(err, abs(s - float(hf(torch.tensor([list((p + r).encode()) + [BYTE_EOS]])).logits)))
    print(f"PPO: {sum(len(s[0]) for s in seen)} responses scored, max |score - transformers| = {err:.1e}")
    assert len(seen) == 2 and err <= TOL


def test_grpo_scores_the_prompt_conversation_with_the_reward_models_template(trained: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    """GRPO on chat prompts (ChatML, with a system message): a decoder reward model (the RewardTask checkpoint: its
    byte tokenizer gains ChatML's tokens) with a chat template scores each response as the assistant turn after the
    conversation the policy answered, as transformers renders it (``apply_chat_template``, on the export's
    tokenizer) up to and including the end-of-turn token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lightning_llm.data import PromptDataModule
    from lightning_llm.data.chat.template import NAMED_TEMPLATES
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.rl import GRPOConfig
    from lightning_llm.tasks import GRPOTask

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "system", "content": "Answer in digits."},
                                                     {"role": "user", "content": f"Count to {i}"}]}) + "\n"
                            for i in range(4)))
    task = GRPOTask("debug", model_overrides={"num_layers": 1}, generation=GenerationConfig(max_new_tokens=5, do_sample=True),
                    grpo=GRPOConfig(num_generations=2), reward=RewardConfig(model=str(trained["full"]["ckpt"]),
                                                                            template="chatml"))
    seen: list[tuple[list[str], Any, torch.Tensor]] = []
    score = task.score

    def recorded(samples: Any) -> None:  # each response beside the conversation its prompt (of G responses) holds
        score(samples)
        per = len(samples.texts) // len(samples.conversations)
        seen.append((samples.texts, [c for c in samples.conversations for _ in range(per)], samples.scores.clone()))

    task.score = recorded  # type: ignore[method-assign]
    pl.seed_everything(0)
    dm = PromptDataModule(str(path), tokenizer_dir="byte", template="chatml", batch_size=2, max_prompt_len=48)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0)
    _quiet(trainer.fit, task, dm)
    hf = _quiet(AutoModelForSequenceClassification.from_pretrained, str(trained["full"]["hf"])).eval()
    tok = AutoTokenizer.from_pretrained(str(trained["full"]["hf"]))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.split_special_tokens = False  # the template's tokens read as the tokens they are
    end = tok.convert_tokens_to_ids("<|im_end|>")
    (responses, conversations, scores), = seen
    err = 0.0
    with torch.no_grad():
        for response, conv, s in zip(responses, conversations, scores.tolist()):
            assert conv.messages[0] == {"role": "system", "content": "Answer in digits."}
            messages = [*conv.messages, {"role": "assistant", "content": response}]
            ids = tok.apply_chat_template(messages, chat_template=NAMED_TEMPLATES["chatml"][0], tokenize=True,
                                          return_dict=False)
            ids = ids[: len(ids) - ids[::-1].index(end)]  # through the reply's end-of-turn token
            err = max(err, abs(s - float(hf(torch.tensor([ids])).logits)))
    print(f"GRPO, ChatML: {len(responses)} responses scored as rendered conversations, max |score - transformers| "
          f"= {err:.1e}")
    assert len(responses) == 4 and err <= TOL
