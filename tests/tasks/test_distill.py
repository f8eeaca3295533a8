"""Distillation (``DistillTask``): the chunked divergence against trl's own ``generalized_jsd_loss`` (run here), the
task's loss against each divergence computed with the transformers models of its student and teacher on the same
tokens, a student equal to its teacher at 0, the on-policy rows (prompts, labels, draws), and bad inputs refused in
one line. Every layout against one device: ``test_distill_layouts.py``."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_llm.kernels.loss.divergence import fused_linear_divergence, token_divergence
from lightning_llm.tasks import DistillTask
from tests.conftest import tiny_hf_llama

# (divergence, beta, trl's beta): trl's generalized JSD is the forward KL at beta 0, the reverse KL at beta 1
KINDS = [("reverse_kl", 0.5, 1.0), ("forward_kl", 0.5, 0.0), ("jsd", 0.3, 0.3), ("jsd", 0.5, 0.5)]


def trl_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, *, beta: float,
            temperature: float, reduction: str = "batchmean") -> torch.Tensor:
    """trl 1.16's own loss (GKDTrainer.generalized_jsd_loss), run here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta=beta, temperature=temperature,
                                           reduction=reduction)


@pytest.mark.parametrize(("kind", "beta", "trl_beta"), KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_divergence_equals_trl_in_float64(kind: str, beta: float, trl_beta: float, temperature: float) -> None:
    """The chunks (of 8 tokens, a bias on both heads, the student's logits soft-capped) against trl's loss on whole
    logits, values and the gradients of the student's hidden states, head and bias (autograd through trl)."""
    g = torch.Generator().manual_seed(0)
    n, h, ht, v, cap = 37, 16, 24, 101, 3.0
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=g, requires_grad=True)
    th, tw, tb = (torch.randn(n, ht, dtype=torch.float64, generator=g), torch.randn(v, ht, dtype=torch.float64,
                  generator=g), torch.randn(v, dtype=torch.float64, generator=g))
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:5] = -100
    ours = fused_linear_divergence(hidden, weight, th / temperature, tw, labels, kind=kind, beta=beta, bias=bias,
                                   teacher_bias=tb / temperature, softcap=(cap, cap / temperature), chunk_size=8)
    ours.backward()
    got = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    student = torch.tanh((hidden @ weight.T + bias) / cap) * cap
    ref = trl_jsd(student[None], (th @ tw.T + tb)[None], labels[None], beta=trl_beta, temperature=temperature,
                  reduction="sum")
    ref.backward()
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-12), (float(ours), float(ref))
    # (the bias's gradient is summed over each chunk's rows in fp32 by the shared contraction, whatever the dtype)
    for name, a, b, tol in zip(("hidden", "weight", "bias"), got, (hidden.grad, weight.grad, bias.grad),
                               (1e-12, 1e-12, 1e-6)):
        assert torch.allclose(a, b, rtol=0, atol=tol), (name, float((a - b).abs().max()))
    per_token = fused_linear_divergence(hidden.detach() / temperature, weight.detach(), th / temperature, tw, labels,
                                        kind=kind, beta=beta, reduction="none", chunk_size=5)
    plain = token_divergence(hidden.detach() @ weight.detach().T, th @ tw.T, kind=kind, beta=beta,
                             temperature=temperature)
    assert torch.allclose(per_token, torch.where(labels != -100, plain, 0.0), atol=1e-12)


@pytest.mark.parametrize(("kind", "beta", "trl_beta"), KINDS)
def test_chunked_divergence_on_bf16_hidden_states_and_fp32_heads(kind: str, beta: float, trl_beta: float) -> None:
    """Mixed precision as a model runs it: bf16 hidden states, fp32 heads (masters; cast once to bf16 for the
    chunks' matmuls, the softmaxes in fp32): against trl's loss (float64) on the bf16 logits, values and gradients
    (the head's gradient comes back in fp32, summed over the chunks in fp32)."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 29, 16, 67
    hidden = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    th, tw = torch.randn(n, h, generator=g).bfloat16(), torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:4] = -100
    ours = fused_linear_divergence(hidden, weight, th, tw, labels, kind=kind, beta=beta, chunk_size=8)
    ours.backward()
    assert ours.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().bfloat16().double().requires_grad_()
    student = (h64 @ w64.T).bfloat16().double()  # the chunks' logits: a bf16 matmul's output, rounded once
    teacher = (th.double() @ tw.bfloat16().double().T).bfloat16().double()
    ref = trl_jsd(student[None], teacher[None], labels[None], beta=trl_beta, temperature=1.0, reduction="sum")
    ref.backward()
    assert abs(float(ours) - float(ref)) <= 1e-5 * max(1.0, abs(float(ref))), (float(ours), float(ref))
    for name, a, b in (("hidden", hidden.grad, h64.grad), ("weight", weight.grad, w64.grad)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err <= 1e-2, (name, err)  # bf16 operands of the gradient's matmuls


# ------------------------------------------------------------------------------------------------ the task's loss
def _tiny_qwen2(out: Path, tokenizer_from: Path, *, hidden: int = 48, std: float = 0.3) -> Path:
    """A tiny random ``Qwen2ForCausalLM`` (2 layers, wider than the student, biased q/k/v) on the student's tokenizer
    and vocabulary, written by ``save_pretrained``; ``std`` large enough that its distributions are far from uniform."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if "token" in f.name:
            shutil.copy(f, out / f.name)
    config = Qwen2Config(vocab_size=304, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=std, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Qwen2ForCausalLM(config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("distill")
    student = tiny_hf_llama(root / "student")
    return student, _tiny_qwen2(root / "teacher", student)


def _rows() -> dict[str, torch.Tensor]:
    """Three right-padded rows of 20 tokens: a prompt, then a response whose tokens are labelled (pre-shifted)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 304, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = torch.full_like(ids, -100)
    for row, (start, end) in enumerate([(6, 19), (3, 14), (10, 19)]):
        labels[row, start:end] = ids[row, start + 1:end + 1]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _task(student: Path | str, teacher: Path | str, **kwargs: Any) -> DistillTask:
    task = DistillTask(str(student), teacher=str(teacher), **kwargs)
    task.configure_model()
    return task


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("kind", "beta", "trl_beta"), KINDS)
def test_task_loss_equals_the_divergence_of_the_transformers_models(dirs: tuple[Path, Path], kind: str, beta: float,
                                                                     trl_beta: float, fused: bool) -> None:
    """train_loss (the token mean over the responses) and the student's gradients against trl's loss on the logits
    of transformers' own LlamaForCausalLM (student) and Qwen2ForCausalLM (teacher) on the same rows, chunked
    (fused) and on whole logits."""
    from transformers import AutoModelForCausalLM

    student_dir, teacher_dir = dirs
    task = _task(student_dir, teacher_dir, divergence=kind, beta=beta, temperature=0.8, fused_loss=fused)
    rows = _rows()
    loss, _ = task.compute_loss(task.prepared(rows, on_policy=False), "train")
    loss.backward()
    hf_student = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32)
    hf_teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        teacher_logits = hf_teacher(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    student_logits = hf_student(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    ref = trl_jsd(student_logits, teacher_logits, rows["labels"], beta=trl_beta, temperature=0.8)
    ref.backward()
    print(f"{kind} beta={beta} fused={fused}: loss {loss.item():.6f}, transformers + trl {ref.item():.6f}")
    assert float(ref) > 1e-3  # far from 0: the teacher is not the student
    assert abs(float(loss) - float(ref)) <= 1e-5 * max(1.0, float(ref))
    for ours, theirs in (("lm_head.weight", "lm_head.weight"), ("embed_tokens.weight", "model.embed_tokens.weight"),
                         ("layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight")):
        a = task.model.get_parameter(ours).grad
        b = hf_student.get_parameter(theirs).grad
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4), (ours, float((a - b).abs().max()))
    assert all(p.grad is None for p in task.teacher_model.parameters())  # never trained


@pytest.mark.parametrize(("kind", "beta"), [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.5)])
def test_a_student_equal_to_its_teacher_gives_zero(dirs: tuple[Path, Path], kind: str, beta: float) -> None:
    student_dir, _ = dirs
    task = _task(student_dir, student_dir, divergence=kind, beta=beta, temperature=0.7)
    loss, _ = task.compute_loss(task.prepared(_rows(), on_policy=False), "train")
    loss.backward()
    assert abs(float(loss)) <= 1e-7, float(loss)
    assert max(float(p.grad.abs().max()) for p in task.model.parameters() if p.grad is not None) <= 1e-6


def test_validation_loss_is_the_per_token_mean_without_gradient(dirs: tuple[Path, Path]) -> None:
    """Without gradient (validation) the student's forward returns per-token divergences [B, S] (what a pipeline
    concatenates over micro-batches); their mean over the responses is the training loss."""
    task = _task(*dirs)
    batch = task.prepared(_rows(), on_policy=False)
    train, _ = task.compute_loss(batch, "train")
    args, kwargs = task.model_inputs(batch, "val")
    with torch.no_grad():
        per_token = task.model(*args, **kwargs)
        val, _ = task.compute_loss(batch, "val")
    assert per_token.shape == batch["labels"].shape
    assert float(per_token[batch["labels"] == -100].abs().max()) == 0.0
    assert abs(float(val) - float(train)) <= 1e-6


# ------------------------------------------------------------------------------------------------ on-policy rows
def test_prompts_are_the_conversations_before_their_last_reply() -> None:
    """The prompt cut from a training row (before its last learned reply) is the generation prompt the datamodule
    renders on its own for that conversation (ChatML, two turns: the first reply is context)."""
    from lightning_llm.data import InstructionDataModule
    from lightning_llm.tasks.distill import last_reply_prompts

    dm = InstructionDataModule(tokenizer_dir="byte", template="chatml", generated_conversations=64, cutoff_len=256,
                               batch_size=4, eval_batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    prompt, mask = last_reply_prompts(batch["input_ids"], batch["labels"], batch["attention_mask"], pad_id=0)
    for row in range(prompt.shape[0]):
        ours = prompt[row][mask[row].bool()].tolist()
        theirs = batch["gen_input_ids"][row][batch["gen_attention_mask"][row].bool()].tolist()
        assert ours == theirs, (dm.tokenizer.decode(ours), dm.tokenizer.decode(theirs))
    assert bool((mask[:, -1] == 1).all())  # left-padded


def test_sampled_rows_label_the_response_and_do_not_depend_on_the_batch(dirs: tuple[Path, Path]) -> None:
    """A sampled row labels exactly its response tokens up to its first EOS, at the columns that predict them, and
    draws from (seed, step, its prompt): the same prompt in another batch (another padding width) samples the same
    response, as it must at another layout."""
    from lightning_llm.generation import GenerationConfig

    task = _task(*dirs, generation=GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=[2]), seed=3)
    rows = _rows()
    whole = task.sample_rows(rows)
    alone = task.sample_rows({k: v[1:2, :15] for k, v in rows.items()})  # row 1 alone, its padding cut
    p_whole, p_alone = 20, 15  # prompt widths: the rows' widths
    assert torch.equal(whole["input_ids"][1, p_whole:], alone["input_ids"][0, p_alone:])
    for out, p in ((whole, p_whole), (alone, p_alone)):
        resp = out["input_ids"][:, p:]
        labelled = out["labels"][:, p - 1:-1]
        real = out["attention_mask"][:, p:].bool()
        assert torch.equal(labelled[real], resp[real]) and bool((labelled[~real] == -100).all())
        assert bool((out["labels"][:, :p - 1] == -100).all())
        # real response tokens end at the first EOS (included)
        for r in range(resp.shape[0]):
            n = int(real[r].sum())
            eos = (resp[r] == 2).nonzero()
            assert n == (int(eos[0]) + 1 if len(eos) else resp.shape[1])
    other_seed = _task(*dirs, generation=task.generation, seed=4).sample_rows(rows)
    assert not torch.equal(other_seed["input_ids"], whole["input_ids"])


def test_on_policy_draws_depend_on_seed_step_and_batch_only(dirs: tuple[Path, Path]) -> None:
    task = _task(*dirs, lmbda=0.3, seed=7)
    draws = [task.on_policy(i) for i in range(400)]
    assert draws == [task.on_policy(i) for i in range(400)]
    assert 0.22 < sum(draws) / len(draws) < 0.38
    assert all(_task(*dirs, lmbda=1.0).on_policy(i) for i in range(5))
    assert not any(_task(*dirs, lmbda=0.0).on_policy(i) for i in range(5))


# ------------------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs_are_refused_in_one_line(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    student_dir, teacher_dir = dirs
    other_vocab = tmp_path / "wide"
    shutil.copytree(teacher_dir, other_vocab)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config.from_pretrained(str(teacher_dir))
    cfg.vocab_size = 320
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Qwen2ForCausalLM(cfg).save_pretrained(str(other_vocab))
    with pytest.raises(ValueError, match=r"vocabulary of 320 rows and the student .* 304"):
        _task(student_dir, other_vocab)
    unknown = tmp_path / "unknown"
    shutil.copytree(teacher_dir, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family",
                                                     "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ValueError) as err:
        DistillTask(str(student_dir), teacher=str(unknown))
    assert "\n" not in str(err.value) and "NoSuchForCausalLM" in str(err.value) and str(unknown) in str(err.value)
    with pytest.raises(ValueError, match="--model.teacher=.*nowhere: not a local Hugging Face directory"):
        DistillTask("debug", teacher=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="--model.divergence='kl'"):
        DistillTask("debug", teacher="debug", divergence="kl")  # type: ignore[arg-type]
    for name, value in (("lmbda", 1.5), ("beta", -0.1), ("temperature", 0.0)):
        with pytest.raises(ValueError, match=f"--model.{name}={value}"):
            DistillTask("debug", teacher="debug", **{name: value})
    from lightning_llm.peft import PeftConfig

    with pytest.raises(ValueError, match="prompt_tuning: distillation"):
        DistillTask("debug", teacher="debug", peft=PeftConfig(method="prompt_tuning"))


def test_a_checkpoint_teacher_is_rebuilt_with_its_trained_weights(tmp_path: Path) -> None:
    """``--model.teacher`` may be a checkpoint of this package: the teacher holds the run's trained weights, frozen."""
    from lightning_llm.export.checkpoint import read_checkpoint
    from lightning_llm.testing import checkpointed_fit

    checkpointed_fit(tmp_path / "run", strategy="auto", devices=1, steps=2, batch=4)
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    saved = {k.removeprefix("model."): v for k, v in read_checkpoint(ckpt)["state_dict"].items()}
    task = _task("debug", ckpt, model_overrides={"vocab_size": saved["embed_tokens.weight"].shape[0]})
    teacher = task.teacher_model.state_dict()
    assert all(torch.equal(teacher[k], v) for k, v in saved.items())
    assert not any(p.requires_grad for p in task.teacher_model.parameters()) and not task.teacher_model.training


def test_an_moe_students_router_statistics_are_its_training_forwards() -> None:
    """The on-policy generation runs inside the training step, after the step's router statistics opened: its
    forwards (in eval mode) record nothing, so the load-balancing loss is that of the training forward."""
    from lightning_llm.generation import GenerationConfig
    from lightning_llm.tasks.callbacks.moe import routing_stats

    task = _task("debug-moe", "debug-moe", generation=GenerationConfig(max_new_tokens=4, do_sample=False))
    stats = routing_stats(task)
    rows = {k: torch.where(v >= 0, v % 256, v) if k != "attention_mask" else v for k, v in _rows().items()}
    batch = task.prepared(rows, on_policy=False)
    stats.begin(forwards=1)
    task.compute_loss(batch, "train")
    expected = stats.aux_loss()
    stats.begin(forwards=1)
    sampled = task.sample_rows(rows)  # several decoding forwards, none recorded
    assert sampled["input_ids"].shape[1] > 20 and stats.recording
    task.compute_loss(batch, "train")
    assert torch.equal(stats.aux_loss(), expected)
