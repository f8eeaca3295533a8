"""PPO and GRPO log-probs from the model's token scores (``--model.fused_loss``, the default): the per-token
log-probs at the sampling temperature and their entropies come from the hidden states and the head in chunks,
never as ``[B, S, V]`` logits. Compared with the logits path (flag off) on the same weights and rollout: old,
reference and new log-probs, values, entropies, the mini-batch loss, its statistics and every parameter gradient
within 1e-5 (fp32), for a full fine-tune (frozen reference copy), LoRA (reference = adapters off) and a separate
critic trunk; the fused path is asserted to never call the head as a module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_llm.generation import GenerationConfig
from lightning_llm.kernels.loss.cross_entropy import fused_linear_cross_entropy
from lightning_llm.kernels.loss.head_loss import head_token_scores
from lightning_llm.peft import LoraArgs
from lightning_llm.rl import GRPOConfig, PPOConfig, RewardConfig
from lightning_llm.rl.rollouts.policy import Rollout, pack_responses
from lightning_llm.tasks import GRPOTask, PPOTask

TOL = 1e-5
T = 0.7  # a sampling temperature != 1: the log-probs are those of logits / T
DIGITS = RewardConfig(fn="lightning_llm.rl.rewards:CharShareReward", kwargs={"chars": "digits"})
LORA = LoraArgs(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])


def test_token_scores_equal_log_softmax_at_a_temperature_in_float64() -> None:
    """Loss (= -log p of the label under softmax(logits / T)), its gradients and the entropy, against float64."""
    torch.manual_seed(0)
    head = nn.Linear(16, 97, bias=True)
    h = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, 97, (3, 11))
    labels[0, :4] = -100
    upstream = torch.randn(3, 11)
    scores = head_token_scores(h, head, labels, temperature=T)
    (scores.loss * upstream).sum().backward()
    got = [scores.loss.detach(), scores.entropy, h.grad, head.weight.grad, head.bias.grad]
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, head.weight, head.bias))
    logp = torch.log_softmax((h64 @ w64.T + b64) / T, -1)
    valid = labels != -100
    loss = torch.where(valid, -logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (loss * upstream.double()).sum().backward()
    want = [loss.detach(), entropy.detach(), h64.grad, w64.grad, b64.grad]
    errs = [float((a.double() - b).abs().max()) for a, b in zip(got, want)]
    print("fused token scores vs float64 (loss, entropy, dh, dW, db):", [f"{e:.1e}" for e in errs])
    assert max(errs) < TOL and scores.entropy.requires_grad is False and scores.hidden is h
    with pytest.raises(ValueError, match="with_entropy=True needs reduction='none'"):
        fused_linear_cross_entropy(h, head.weight, labels, with_entropy=True)


def _rollout(v: int, *, b: int = 4, p: int = 6, n: int = 7) -> Rollout:
    gen = torch.Generator().manual_seed(3)
    prompts, responses = torch.randint(3, v, (b, p), generator=gen), torch.randint(3, v, (b, n), generator=gen)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :2] = 0  # a left-padded prompt
    responses[0, 3] = 2  # EOS: row 0's response ends after 4 tokens
    qr, am, pos, rmask, has_eos = pack_responses(prompts, prompt_mask, responses, [2])
    zeros = torch.zeros(b, n)
    return Rollout(query_responses=qr, attention_mask=am, position_ids=pos, context_length=p, responses=responses,
                   response_mask=rmask, has_eos=has_eos, logprobs=zeros, ref_logprobs=zeros, values=zeros,
                   scores=torch.rand(b, generator=gen))


def _pair(cls: type, **kwargs: Any) -> tuple[Any, Any]:
    """The same task with the fused loss on and off, identical weights."""
    tasks = []
    for fused in (True, False):
        torch.manual_seed(0)
        task = cls("debug", model_overrides={"num_layers": 2}, fused_loss=fused, reward=DIGITS,
                   generation=GenerationConfig(max_new_tokens=7, do_sample=True, temperature=T), **kwargs)
        task.configure_model()
        for prm in task.parameters():  # LoRA's B starts at 0: move it so the adapters change the policy
            if prm.requires_grad and prm.abs().max() == 0:
                prm.data.normal_(0, 0.02)
        tasks.append(task.eval())
    on, off = tasks
    off.load_state_dict(on.state_dict())
    return on, off


def _no_head_calls(task: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count calls of the policy's LM head as a module (the fused path reads its weight instead)."""
    head = task.policy.lm_head
    calls: list[int] = []
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda x: calls.append(1) or forward(x))
    return calls


def _errs(on: dict[str, torch.Tensor], off: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((on[k].double() - off[k].double()).abs().max()) for k in on}


def _update(task: Any, r: Rollout) -> dict[str, torch.Tensor]:
    """One mini-batch loss on ``r`` and every gradient it produces."""
    task.zero_grad(set_to_none=True)
    loss, stats = task.minibatch_loss(r)
    loss.backward()
    grads = {f"grad {n}": p.grad for n, p in task.named_parameters() if p.grad is not None}
    assert grads
    return {"loss": loss.detach(), **{k: torch.as_tensor(v) for k, v in stats.items()}, **grads}


@pytest.mark.parametrize("variant", ["full", "lora", "critic"])
def test_ppo_scores_equal_logits(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {"ppo": PPOConfig(kl_coef=0.05)}
    if variant == "lora":
        kwargs["lora"] = LORA
    if variant == "critic":
        kwargs["critic_backbone"] = "debug"
    on, off = _pair(PPOTask, **kwargs)
    calls = _no_head_calls(on, monkeypatch)
    assert on.uses_fused_loss() and not off.uses_fused_loss()
    out: list[dict[str, torch.Tensor]] = []
    for task in (on, off):
        r = _rollout(on.policy.config.vocab_size)
        with torch.no_grad():
            logprobs, values, entropy = task._forward(r, T)
            r.logprobs, r.values = logprobs * r.response_mask, values * r.response_mask
            r.ref_logprobs = task.reference_logprobs(r, T) * r.response_mask
        task.compute_advantages(r)
        out.append({"old": r.logprobs, "ref": r.ref_logprobs, "values": r.values, "advantages": r.advantages,
                    "token_entropy": entropy * r.response_mask, **_update(task, r)})
    errs = _errs(*out)
    print(f"PPO {variant}: fused vs logits max err {max(errs.values()):.1e} over {len(errs)} tensors; "
          f"old {errs['old']:.1e} ref {errs['ref']:.1e} loss {errs['loss']:.1e} entropy {errs['token_entropy']:.1e}")
    assert set(out[0]) == set(out[1]), set(out[0]) ^ set(out[1])
    assert max(errs.values()) < TOL
    assert calls == [] and abs(float(out[0]["ratio"]) - 1) < 1e-6  # old == new policy before any update
    if variant == "lora":  # the reference is the base: adapters off changes the log-probs
        assert float((out[0]["old"] - out[0]["ref"]).abs().max()) > 1e-3


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_grpo_scores_equal_logits(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs: dict[str, Any] = {"grpo": GRPOConfig(num_generations=2, beta=0.1)}
    if variant == "lora":
        kwargs["lora"] = LORA
    on, off = _pair(GRPOTask, **kwargs)
    calls = _no_head_calls(on, monkeypatch)
    out: list[dict[str, torch.Tensor]] = []
    for task in (on, off):
        r = _rollout(on.policy.config.vocab_size)
        with torch.no_grad():
            logprobs, entropy = task._logprobs(r, T)
            r.logprobs = logprobs * r.response_mask
            r.ref_logprobs = task.reference_logprobs(r, T) * r.response_mask
        task.compute_advantages(r)
        out.append({"old": r.logprobs, "ref": r.ref_logprobs, "token_entropy": entropy * r.response_mask,
                    **_update(task, r)})
    errs = _errs(*out)
    print(f"GRPO {variant}: fused vs logits max err {max(errs.values()):.1e} over {len(errs)} tensors")
    assert max(errs.values()) < TOL and calls == []
    assert float(out[0]["token_entropy"].max()) > 1.0  # a real entropy (near log V at random init), not zeros


def test_rollout_labels_put_each_response_token_where_its_logits_are() -> None:
    r = _rollout(50, b=2, p=3, n=4)
    labels = r.labels()
    assert labels.shape == r.query_responses.shape
    for i in range(2):
        for t in range(4):
            want = int(r.responses[i, t]) if r.response_mask[i, t] else -100
            assert int(labels[i, 3 - 1 + t]) == want
    assert (labels[:, :2] == -100).all() and (labels[:, -1] == -100).all()
    logits = torch.randn(2, 7, 50)
    lp = -F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 7)[:, 2:-1]
    want = torch.log_softmax(logits[:, 2:-1], -1).gather(-1, r.responses.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp * r.response_mask, want * r.response_mask, atol=1e-6)
