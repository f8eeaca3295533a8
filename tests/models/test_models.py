"""Model construction, shapes, init, meta-device, masking and pipeline-style use (no HF needed)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_llm.models import NAMED_SIZES, DecoderLM, EncoderModel, ModelConfig, build_model, named_config
from lightning_llm.models.init import materialize
from lightning_llm.models.layers.block import Attention, apply_rotary, precompute_rope, rms_norm, rotate_half


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared parameters counted once


def test_named_debug_decoder_shapes() -> None:
    torch.manual_seed(0)
    m = build_model("debug", family="decoder")
    assert isinstance(m, DecoderLM)
    c = m.config
    assert list(m.layers.keys()) == [str(i) for i in range(c.num_layers)]
    assert m.embed_positions is None and m.norm is not None and m.lm_head.bias is None
    blk = m.layers["0"]
    assert blk.mlp.gate_proj is not None
    assert blk.self_attn.q_proj.weight.shape == (c.num_heads * c.head_dim, c.hidden_size)
    assert blk.self_attn.k_proj.weight.shape == (c.num_kv_heads * c.head_dim, c.hidden_size)  # GQA: 2 kv heads
    assert c.num_kv_heads == 2 and c.num_heads == 4
    ids = torch.randint(0, c.vocab_size, (2, 16))
    logits = m(ids)
    assert logits.shape == (2, 16, c.vocab_size)
    assert {n for n, _ in m.named_buffers()} == {"rope_cos", "rope_sin"}
    assert "rope_cos" not in m.state_dict()  # non-persistent


def test_named_debug_encoder_shapes() -> None:
    torch.manual_seed(0)
    m = build_model("debug", family="encoder", num_labels=3)
    assert isinstance(m, EncoderModel)
    c = m.config
    assert m.embed_token_types is not None and m.embed_norm is not None and m.final_norm is None
    assert m.layers["0"].mlp.gate_proj is None
    ids = torch.randint(0, c.vocab_size, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    assert m(ids, attention_mask=mask).shape == (2, 3)
    hidden, pooled = m.encode(ids, attention_mask=mask)
    assert hidden.shape == (2, 10, c.hidden_size) and pooled.shape == (2, c.hidden_size)
    bare = build_model("debug", family="encoder", pooler=False, type_vocab_size=0)
    assert bare.pooler is None and bare.classifier is None and bare.embed_token_types is None
    assert bare(ids).shape == (2, 10, c.hidden_size)


def test_unknown_size_error() -> None:
    with pytest.raises(ValueError, match=r"unknown decoder model size 'huge'.*known sizes: .*debug"):
        build_model("huge", family="decoder")
    with pytest.raises(ValueError, match="known sizes"):
        named_config("llama2-7b", family="encoder")


def test_missing_backbone_path() -> None:
    with pytest.raises(FileNotFoundError, match=r"backbone.*/does/not/exist"):
        build_model("/does/not/exist", family="decoder")


@pytest.mark.parametrize(
    ("family", "name", "lo", "hi"),
    [("decoder", "llama2-7b", 6.70e9, 6.78e9), ("encoder", "erlangshen-1.3b", 1.2e9, 1.4e9)],
)
def test_meta_device_big_models(family: str, name: str, lo: float, hi: float) -> None:
    with torch.device("meta"):
        m = build_model(name, family=family)
    n = _n_params(m)
    print(f"{name}: {n / 1e9:.3f}B parameters")
    assert lo <= n <= hi
    assert all(p.is_meta for p in m.parameters())


def test_meta_init_matches_eager_init() -> None:
    """A model built on the meta device and materialized equals one built on the CPU from the same seed, and
    init_weights() reproduces those values whatever torch's generator state is (init is a function of init_seed
    and the parameter names)."""
    cfg = named_config("debug", family="decoder")
    torch.manual_seed(123)
    eager = DecoderLM(cfg)
    after_eager = torch.random.get_rng_state()
    torch.manual_seed(123)
    with torch.device("meta"):
        lazy = DecoderLM(cfg)
    assert torch.equal(torch.random.get_rng_state(), after_eager)  # both drew exactly the seed
    assert all(p.is_meta for p in lazy.parameters())
    materialize(lazy, "cpu")
    torch.manual_seed(999)
    lazy.init_weights()
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    for (n1, b1), (_, b2) in zip(eager.named_buffers(), lazy.named_buffers()):
        assert torch.equal(b1, b2), n1
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert torch.equal(eager(ids), lazy(ids))


def test_init_statistics() -> None:
    torch.manual_seed(0)
    m = build_model("debug", family="encoder", num_labels=2, initializer_range=0.05)
    w = m.layers["0"].self_attn.q_proj.weight
    assert abs(w.std().item() - 0.05) < 0.01
    assert torch.all(m.layers["0"].self_attn.q_proj.bias == 0)
    assert torch.all(m.layers["0"].attn_norm.weight == 1) and torch.all(m.layers["0"].attn_norm.bias == 0)


def test_tied_weights_share_storage() -> None:
    m = build_model("debug", family="decoder", tie_embeddings=True)
    assert m.lm_head.weight is m.embed_tokens.weight
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    assert _n_params(m) == _n_params(build_model("debug", family="decoder")) - m.embed_tokens.weight.numel()
    with torch.device("meta"):
        lazy = build_model("debug", family="decoder", tie_embeddings=True)
    materialize(lazy, "cpu")
    assert lazy.lm_head.weight is lazy.embed_tokens.weight


def test_gpt2_style_decoder() -> None:
    torch.manual_seed(0)
    cfg = named_config("debug", family="decoder").replace(
        norm="layernorm", activation="gelu_tanh", position="learned", attention_bias=True, mlp_bias=True,
        tie_embeddings=True,
    )
    m = DecoderLM(cfg)
    assert m.rope_cos is None and m.embed_positions is not None and m.layers["0"].mlp.gate_proj is None
    assert m(torch.randint(0, cfg.vocab_size, (2, 5))).shape == (2, 5, cfg.vocab_size)


def test_padding_mask_semantics() -> None:
    torch.manual_seed(0)
    m = build_model("debug", family="decoder").eval()
    ids = torch.randint(0, 256, (2, 8))
    full = m(ids)
    ones = m(ids, attention_mask=torch.ones(2, 8, dtype=torch.long))
    torch.testing.assert_close(full, ones, rtol=0, atol=1e-6)
    # right padding does not change earlier positions (causal)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    out = m(ids, attention_mask=mask)
    torch.testing.assert_close(out[0, :5], full[0, :5], rtol=0, atol=1e-6)
    # left padding: fully masked query rows must not produce NaN; real tokens ignore the pads
    left = torch.ones(2, 8, dtype=torch.long)
    left[1, :3] = 0
    out = m(ids, attention_mask=left)
    assert torch.isfinite(out).all()
    shifted = m(ids[1:, 3:], position_ids=torch.arange(3, 8))
    torch.testing.assert_close(out[1:, 3:], shifted, rtol=0, atol=1e-5)
    # encoder: an all-padding row stays finite
    enc = build_model("debug", family="encoder").eval()
    em = torch.ones(2, 6, dtype=torch.long)
    em[1] = 0
    assert torch.isfinite(enc(torch.randint(0, 100, (2, 6)), attention_mask=em)).all()


def test_heads_derived_from_weights() -> None:
    """A column-sharded q/k/v and row-sharded o (as tensor parallel would) still computes per-head attention."""
    torch.manual_seed(0)
    cfg = named_config("debug", family="decoder")
    attn = Attention(cfg).eval()
    x = torch.randn(2, 6, cfg.hidden_size)
    cos, sin = precompute_rope(cfg.head_dim, 16, cfg.rope_theta)
    pos = torch.arange(6).expand(2, 6)
    rope = (cos[pos], sin[pos])
    full = attn(x, rope=rope, is_causal=True)
    halves = []
    for r in range(2):
        shard = copy.deepcopy(attn)
        nq, nk = attn.q_proj.out_features // 2, attn.k_proj.out_features // 2
        for name, n in (("q_proj", nq), ("k_proj", nk), ("v_proj", nk)):
            lin = getattr(shard, name)
            lin.weight = torch.nn.Parameter(lin.weight[r * n:(r + 1) * n])
        shard.o_proj.weight = torch.nn.Parameter(shard.o_proj.weight[:, r * nq:(r + 1) * nq])
        halves.append(shard(x, rope=rope, is_causal=True))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=0, atol=1e-5)


def test_rotary_helpers() -> None:
    x = torch.arange(8.0)
    assert torch.equal(rotate_half(x), torch.tensor([-4.0, -5, -6, -7, 0, 1, 2, 3]))
    cos, sin = precompute_rope(8, 4, 10000.0)
    q = torch.randn(1, 4, 2, 8)
    k = torch.randn(1, 4, 1, 8)
    q2, k2 = apply_rotary(q, k, cos[None], sin[None])
    torch.testing.assert_close(q2[:, 0], q[:, 0])  # position 0 is the identity
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))  # rotations preserve norms
    y = rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("learned", [False, True])
def test_pipeline_split_chains_to_full_forward(learned: bool) -> None:
    torch.manual_seed(0)
    overrides = dict(position="learned", norm="layernorm", activation="gelu", tie_embeddings=True) if learned else {}
    full = build_model("debug", family="decoder", **overrides).eval()
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    for k in ("2", "3"):
        del first.layers[k]
    first.norm = None
    first.lm_head = None
    for k in ("0", "1"):
        del second.layers[k]
    second.embed_tokens = None
    second.embed_positions = None
    assert list(second.layers.keys()) == ["2", "3"]
    ids = torch.randint(0, 256, (2, 7))
    hidden = first(ids)
    assert hidden.shape == (2, 7, full.config.hidden_size)
    torch.testing.assert_close(second(hidden), full(ids), rtol=0, atol=1e-6)
    first.init_weights()  # init tolerates removed modules and gives each stage the whole model's values
    second.init_weights()
    torch.testing.assert_close(second(first(ids)), full(ids), rtol=0, atol=1e-6)
    # state-dict keys keep their global layer index
    assert any(k.startswith("layers.3.") for k in second.state_dict())


def test_dropout_and_train_mode() -> None:
    torch.manual_seed(0)
    m = build_model("debug", family="encoder", dropout=0.1, num_labels=2).train()
    ids = torch.randint(0, 100, (2, 5))
    out = m(ids)
    out.sum().backward()
    assert m.embed_tokens.weight.grad is not None


def test_config_roundtrip_and_named_sizes() -> None:
    for (family, name), fields in NAMED_SIZES.items():
        cfg = named_config(name, family=family)
        assert cfg.family == family == fields["family"]
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_bf16_forward() -> None:
    m = build_model("debug", family="decoder").to(torch.bfloat16)
    out = m(torch.randint(0, 256, (1, 4)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("rows", ["padded", "packed", "sliding"])
def test_one_additive_mask_is_saved_for_every_layer(rows: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder converts its boolean mask to SDPA's additive form once per forward: every layer saves that one
    [B, 1, S, S] tensor for backward (SDPA converted a boolean mask in each layer and saved each copy: 4 layers, 4
    copies), and outputs and gradients are bit-identical to the per-layer boolean path, with autocast and without."""
    import lightning_llm.models.decoder as decoder

    s = 64
    name = "debug-mistral" if rows == "sliding" else "debug"  # every layer windowed (sliding_window=8)
    model = build_model(name, family="decoder", dropout=0.0)
    ids = torch.randint(0, 200, (2, s))
    kwargs = {"attention_mask": torch.ones(2, s, dtype=torch.long).index_fill_(1, torch.arange(9), 0)}
    if rows == "packed":
        kwargs = {"segment_ids": torch.repeat_interleave(torch.arange(1, 5), s // 4).expand(2, s)}

    def run(autocast: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
        masks: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 4 and t.shape[-2:] == (s, s) and t.shape[1] == 1:
                masks.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(ids, **kwargs)
        grad = torch.autograd.grad(out.float().square().mean(), model.layers["0"].self_attn.q_proj.weight)[0]
        return len(masks), out.detach(), grad

    for autocast in (False, True):
        shared, out, grad = run(autocast)
        with monkeypatch.context() as m:
            m.setattr(decoder, "additive_mask", lambda mask, dtype: mask)  # each layer's SDPA converts it
            per_layer, ref_out, ref_grad = run(autocast)
        print(f"{rows}, autocast={autocast}: masks saved for backward {shared} (per-layer boolean: {per_layer})")
        assert shared == 1 and per_layer == model.config.num_layers
        assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rmsnorm_is_gemmas_one_plus_weight_norm(dtype: torch.dtype) -> None:
    """``norm_offset=1``: the scale is ``1 + weight`` in fp32 (transformers' Gemma3RMSNorm, Qwen3NextRMSNorm), the
    weight starts at 0 (eager and planned init alike), and its gradient is the plain norm's."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from lightning_llm.models.layers.block import RMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g).to(dtype)
    ours, ref = RMSNorm(16, 1e-6, offset=1.0).to(dtype), Gemma3RMSNorm(16, eps=1e-6).to(dtype)
    assert torch.equal(ours.weight, torch.zeros(16, dtype=dtype))
    w = (torch.randn(16, generator=g) * 0.1).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    assert torch.equal(ours(x), ref(x))
    ours = ours.float()
    ours(x.float()).square().sum().backward()
    plain = RMSNorm(16, 1e-6)
    with torch.no_grad():
        plain.weight.copy_(w.float() + 1)
    plain.to(torch.float32)(x.float()).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad.float(), plain.weight.grad, rtol=1e-5, atol=1e-6)
    cfg = named_config("debug", family="decoder").replace(norm_offset=1.0, qk_norm=True)
    with torch.device("meta"):
        lazy = DecoderLM(cfg)
    materialize(lazy, "cpu")
    assert all(torch.equal(p, torch.zeros_like(p)) for n, p in lazy.named_parameters() if "norm" in n)
