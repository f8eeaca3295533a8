"""The static KV cache and the compiled decoding step (issue 57): the same tokens as the dynamic cache's eager loop
and as an independent reference (whole-sequence recomputation, no cache), few host reads per generation, no new graph
for other prompt lengths and lengths to generate within a bucket, and the fallbacks (beam search, a prompt past the
largest bucket, prompt learning) each with one logged line.

Compiling on the CPU is slow (tens of seconds per graph), so one module-scoped set of compiled generations (greedy
with EOS at three prompt lengths / lengths to generate of one bucket, and per-row sampling) serves every compiled
check; every other check runs the static cache's steps eagerly (the same code, uncompiled).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from lightning_llm.generation import GenerationConfig, generate
from lightning_llm.generation import static as static_decoding
from lightning_llm.models import DecoderLM, named_config
from lightning_llm.testing import HostReadCounter

EOS = [44, 75, 130, 209]  # tokens the debug model often picks: its rows end at different steps
STATIC = dict(cache_implementation="static")
COMPILED = dict(cache_implementation="static", compile=True)
LENGTHS = [(8, 64), (20, 60), (5, 70)]  # prompt columns, new tokens: S + N in (64, 96], one bucket


def _model(name: str = "debug", **overrides: Any) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(named_config(name, family="decoder", **overrides)).eval()


def _prompts(rows: int, width: int, seed: int, *, padded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts left-padded to ``width`` (row r has ``width - 2r`` tokens when ``padded``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 250, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for r in range(rows):
        pad = min(2 * r, width - 1) if padded else 0
        ids[r, :pad], mask[r, :pad] = 0, 0
    return ids, mask


@torch.no_grad()
def _reference(model: Any, ids: torch.Tensor, mask: torch.Tensor, new: int, eos: list[int]) -> torch.Tensor:
    """Greedy decoding by recomputing the whole sequence every step (no cache), stopped where every row ended."""
    seqs, att, ended, out = ids, mask, torch.zeros(ids.shape[0], dtype=torch.bool), []
    for _ in range(new):
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        token = model(seqs, attention_mask=att, position_ids=pos)[:, -1].argmax(-1)
        token = torch.where(ended, torch.zeros_like(token), token)
        ended = ended | torch.isin(token, torch.tensor(eos, dtype=torch.long))
        out.append(token)
        seqs, att = torch.cat([seqs, token[:, None]], 1), torch.cat([att, torch.ones_like(att[:, :1])], 1)
        if eos and bool(ended.all()):
            break
    return torch.stack(out, 1)


def _generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, seed: int | None = None, **settings: Any
              ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return generate(model, ids, mask, config=GenerationConfig(**settings), generator=generator)


@pytest.fixture(scope="module")
def model() -> DecoderLM:
    return _model()


# ------------------------------------------------------------------------------------------------ static, eagerly
@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=24, eos_token_id=EOS),  # greedy: rows end at different steps
    dict(max_new_tokens=24, eos_token_id=None, repetition_penalty=1.3),
    dict(max_new_tokens=24, do_sample=True, top_k=40, top_p=0.9, temperature=0.7, eos_token_id=EOS),
], ids=["greedy_eos", "repetition", "sampled_generator"])
def test_static_cache_gives_the_dynamic_tokens(model: DecoderLM, settings: dict[str, Any]) -> None:
    for padded in (True, False):
        ids, mask = _prompts(4, 11, seed=1, padded=padded)
        dynamic = _generate(model, ids, mask, seed=3, **settings)
        static = _generate(model, ids, mask, seed=3, **settings, **STATIC)
        assert torch.equal(static, dynamic), (settings, padded)
        if not settings.get("do_sample") and settings.get("repetition_penalty", 1.0) == 1.0:
            assert torch.equal(dynamic, _reference(model, ids, mask, settings["max_new_tokens"], EOS))
        if settings.get("eos_token_id") and padded and not settings.get("do_sample"):  # rows end at different steps
            ended = torch.isin(static, torch.tensor(EOS))
            assert ended.any(-1).all() and not ended[:, 0].all() and static.shape[1] < settings["max_new_tokens"]
    ids, mask = _prompts(4, 11, seed=1)
    with pytest.raises(ValueError, match="LEFT-padded"):  # right padding is refused by both, as before
        _generate(model, ids.flip(1), mask.flip(1), **settings, **STATIC)


def test_sliding_window_learned_positions_and_per_row_draws() -> None:
    """The static cache's mask of a step (a device-side column) with a sliding window, learned positions (GPT-2)
    and the per-row uniforms of GRPO's rollouts."""
    ids, mask = _prompts(3, 13, seed=2)
    uniforms = torch.rand(3, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for model in (_model("debug-mistral", num_layers=2), _model("debug", position="learned", norm="layernorm",
                                                                 num_layers=2)):
        for settings in (dict(max_new_tokens=16, eos_token_id=None),
                         dict(max_new_tokens=16, do_sample=True, eos_token_id=EOS)):
            dynamic = generate(model, ids, mask, config=GenerationConfig(**settings), uniforms=uniforms)
            static = generate(model, ids, mask, config=GenerationConfig(**settings, **STATIC), uniforms=uniforms)
            assert torch.equal(static, dynamic), (model.config.sliding_window, settings)


def test_lora_and_qlora_models_decode_the_same_with_the_static_cache() -> None:
    from lightning_llm.peft import PeftConfig, apply_peft

    ids, mask = _prompts(3, 9, seed=4)
    lora = apply_peft(_model(num_layers=2), PeftConfig(method="lora"))
    with torch.no_grad():  # adapters that change the output (lora_B starts at zero)
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    models = {"lora": lora.eval()}
    if _torchao():
        from lightning_llm.models.quantize import QuantizationConfig, quantize_

        qlora = _model(num_layers=2)
        quantize_(qlora, "nf4", QuantizationConfig(block_size=64, scaler_block_size=16))
        models["qlora"] = apply_peft(qlora, PeftConfig(method="lora")).eval()
    for name, m in models.items():
        dynamic = _generate(m, ids, mask, max_new_tokens=12, eos_token_id=EOS)
        assert torch.equal(_generate(m, ids, mask, max_new_tokens=12, eos_token_id=EOS, **STATIC), dynamic), name


def _torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def _fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("lightning_llm.generation")]


def test_fallbacks_log_one_line_and_keep_the_tokens(model: DecoderLM, caplog: pytest.LogCaptureFixture) -> None:
    static_decoding._logged.clear()
    caplog.set_level(logging.WARNING, logger="lightning_llm.generation")
    ids, mask = _prompts(2, 9, seed=6)
    beam = dict(max_new_tokens=8, num_beams=3, eos_token_id=EOS)
    for _ in range(2):  # one line, however many generations
        assert torch.equal(_generate(model, ids, mask, **beam, **COMPILED), _generate(model, ids, mask, **beam))
    assert len(lines := _fallback_lines(caplog)) == 1 and "beam search" in lines[0]
    caplog.clear()
    long_ids, long_mask = _prompts(2, 250, seed=6)  # 250 + 10 columns: past max_position_embeddings=256
    settings = dict(max_new_tokens=10, eos_token_id=None)
    for _ in range(2):
        assert torch.equal(_generate(model, long_ids, long_mask, **settings, **COMPILED),
                           _generate(model, long_ids, long_mask, **settings))
    assert len(lines := _fallback_lines(caplog)) == 1 and "largest bucket" in lines[0]
    assert static_decoding.capacity_bucket(246) == 256 and static_decoding.capacity_bucket(257) == 384
    caplog.clear()
    from lightning_llm.peft import PeftConfig, apply_peft

    prompted = apply_peft(_model(), PeftConfig(method="prompt_tuning", num_virtual_tokens=3)).eval()
    assert torch.equal(_generate(prompted, ids, mask, **settings, **STATIC), _generate(prompted, ids, mask, **settings))
    assert len(lines := _fallback_lines(caplog)) == 1 and "PromptTuningLM takes no static KV cache" in lines[0]
    with pytest.raises(ValueError, match="cache_implementation=static as well"):
        GenerationConfig(compile=True)


@pytest.mark.parametrize("settings", [dict(), STATIC], ids=["dynamic", "static"])
def test_host_reads_per_generation(model: DecoderLM, settings: dict[str, Any]) -> None:
    """A 64-token generation reads the host at most 64 / 8 + 4 times (was 65 without EOS ids, 129 with them: a
    position read and an end check per token)."""
    ids, mask = _prompts(3, 9, seed=7)
    for eos in (None, [300]):  # EOS ids that never come: all 64 tokens
        with HostReadCounter().counting() as reads:
            out = _generate(model, ids, mask, max_new_tokens=64, eos_token_id=eos, **settings)
        print(f"{settings or 'dynamic'}, eos {eos}: {len(reads)} host reads {reads}")
        assert out.shape == (3, 64) and len(reads) <= 64 // 8 + 4


# ------------------------------------------------------------------------------------------------ compiled
@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, Any]:
    """Compiled generations (CPU: plain ``torch.compile``; a one-layer decoder, which compiles fastest): greedy with
    EOS at three (prompt, new tokens) of one bucket, each against the eager dynamic loop, the graphs counted after
    each; then per-row sampled decoding."""
    from torch._dynamo.utils import counters

    model = _model(num_layers=1)
    torch._dynamo.reset()
    counters.clear()
    runs: dict[str, Any] = {"graphs": [], "equal": [], "reads": None}
    for i, (width, new) in enumerate(LENGTHS):
        ids, mask = _prompts(4, width, seed=10 + i)
        # the first: EOS ids that never come (all 64 tokens), as many as EOS (the same shapes: the same graph)
        settings = dict(max_new_tokens=new, eos_token_id=EOS if i else [300 + j for j in range(len(EOS))])
        compiled = _generate(model, ids, mask, **settings, **COMPILED)
        runs["equal"].append(torch.equal(compiled, _generate(model, ids, mask, **settings)))
        runs["graphs"].append(counters["stats"]["unique_graphs"])
        if i == 0:
            with HostReadCounter().counting() as reads:
                _generate(model, ids, mask, **settings, **COMPILED)
            runs["reads"] = list(reads)
    ids, mask = _prompts(4, 8, seed=20)
    uniforms = torch.rand(4, 40, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    sampled = GenerationConfig(max_new_tokens=40, do_sample=True, top_k=50, eos_token_id=EOS)
    runs["sampled_equal"] = torch.equal(
        generate(model, ids, mask, config=GenerationConfig(**{**sampled.__dict__, **COMPILED}), uniforms=uniforms),
        generate(model, ids, mask, config=sampled, uniforms=uniforms))
    return runs


@pytest.mark.multiprocess  # inductor's C++ compiler runs as processes
def test_compiled_steps_give_the_eager_tokens(compiled_runs: dict[str, Any]) -> None:
    assert compiled_runs["equal"] == [True] * len(LENGTHS) and compiled_runs["sampled_equal"]


@pytest.mark.multiprocess  # inductor's C++ compiler runs as processes
def test_no_new_graph_within_a_bucket(compiled_runs: dict[str, Any]) -> None:
    """One graph for the greedy step of (B=4, capacity 96), traced at the first generation; the second and third
    prompt lengths and lengths to generate reuse it."""
    graphs = compiled_runs["graphs"]
    print(f"unique graphs after each length set: {graphs}")
    assert graphs[0] == 1 and graphs[1] == graphs[0] and graphs[2] == graphs[0]
    assert not static_decoding._partial  # the step traced as one graph (fullgraph=True), not in pieces


@pytest.mark.multiprocess  # inductor's C++ compiler runs as processes
def test_compiled_generation_reads_the_host_rarely(compiled_runs: dict[str, Any]) -> None:
    reads = compiled_runs["reads"]
    print(f"compiled, 64 tokens with EOS ids: {len(reads)} host reads {reads}")
    assert len(reads) <= 64 // 8 + 4
