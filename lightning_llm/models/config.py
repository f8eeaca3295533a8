"""Model configuration shared by the decoder and encoder families (the named sizes: :mod:`.sizes`; the configs of the
optional kinds of layer: :mod:`.layers.configs`).

The config is plain data: no parallel degrees, no device placement. Strategies read it (e.g. to check that
heads divide the tensor-parallel size) but never write parallel state into it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from .layers.configs import DisentangledConfig, LinearAttentionConfig, MLAConfig, MoEConfig

log = logging.getLogger(__name__)

Family = Literal["decoder", "encoder"]


@dataclass
class ModelConfig:
    """Architecture of one transformer. Field names follow the LLaMA/BERT vocabulary."""

    family: Family = "decoder"
    """``decoder`` (causal LM: LLaMA, GPT-2) or ``encoder`` (bidirectional: BERT, RoBERTa, MegatronBERT)."""
    vocab_size: int = 32000
    """Rows of the token embedding (and of the LM head for decoders)."""
    hidden_size: int = 4096
    """Width of the residual stream."""
    num_layers: int = 32
    """Number of transformer blocks."""
    num_heads: int = 32
    """Attention (query) heads; must divide ``hidden_size``."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``num_heads`` (multi-head attention)."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_heads``."""
    intermediate_size: int = 11008
    """Hidden width of the MLP (per branch for gated MLPs)."""
    max_position_embeddings: int = 4096
    """Longest sequence; also the size of the learned position table when ``position='learned'``."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalization layer type."""
    norm_eps: float = 1e-5
    """Epsilon of every norm."""
    norm_offset: float = 0.0
    """RMSNorms scale by ``norm_offset + weight`` (computed in fp32), their weights starting at ``1 - norm_offset``:
    Gemma's and Qwen3-Next's ``(1 + weight)`` norms are ``1.0`` (weights stored around 0); 0 is LLaMA's norm."""
    activation: Literal["swiglu", "geglu", "geglu_tanh", "gelu", "gelu_tanh", "relu"] = "swiglu"
    """``swiglu``/``geglu``/``geglu_tanh`` are gated (gate_proj, up_proj, down_proj; HF ``hidden_act`` silu / gelu /
    gelu_pytorch_tanh); the others are plain (up_proj, down_proj)."""
    position: Literal["rope", "learned", "none"] = "rope"
    """Rotary embeddings applied to q/k, a learned absolute position table added to token embeddings, or ``none``
    (encoders whose attention carries relative positions: DeBERTa-v3, ``disentangled``)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE frequency scaling as in HF ``rope_parameters`` minus ``rope_theta`` (``{"rope_type": "linear" | "llama3"
    | "dynamic" | "yarn", "factor": ..., ...}``); ``None`` means plain RoPE."""
    partial_rotary_factor: float = 1.0
    """Rotary embedding on the first ``int(head_dim * factor)`` dims of each query/key head, the rest unrotated
    (GLM-4.5: 0.5); see :attr:`rotary_dim`."""
    attention_bias: bool = False
    """Biases on the q/k/v projections (and on o_proj unless ``o_bias`` says otherwise)."""
    o_bias: bool | None = None
    """Bias on the attention output projection; ``None`` means ``attention_bias`` (Qwen2: q/k/v biased, o not)."""
    qk_norm: bool = False
    """RMSNorm of queries and keys before rotary (Qwen3 ``q_norm``/``k_norm``: per head; see ``qk_norm_over``)."""
    qk_norm_over: Literal["head", "projection"] = "head"
    """What ``qk_norm`` normalises over: each head's ``head_dim`` (Qwen3) or the whole q / k projection, every head at
    once (OLMoE: ``q_norm`` [N*D], ``k_norm`` [K*D])."""
    attention_sinks: bool = False
    """A learned logit per query head that joins every softmax as one more column and is then dropped (gpt-oss
    ``sinks``): a query may give part of its attention to nothing (``models/layers/sinks.py``)."""
    qkv_packed: bool = False
    """One fused ``W_pack`` projection for q, k, v (Baichuan), stored head-interleaved (see ``block.Attention``);
    needs ``num_kv_heads == num_heads``."""
    norm_head: bool = False
    """LM head weight L2-normalised per vocabulary row in forward (Baichuan2 ``NormHead``)."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral, Qwen2): a query attends to the ``sliding_window`` most recent positions
    (itself included), as HF's ``kv_idx > q_idx - sliding_window``; ``None`` = full causal attention. Encoders
    (ModernBERT's ``local_attention``): a query attends to the keys within ``sliding_window // 2`` columns on either
    side."""
    layer_types: list[str] | None = None
    """Per-layer ``"full_attention"`` / ``"sliding_attention"`` (HF ``layer_types``); ``None`` = every layer slides
    when ``sliding_window`` is set. Ignored without ``sliding_window``."""
    mlp_bias: bool = False
    """Biases on the MLP projections."""
    tie_embeddings: bool = False
    """Share the LM head weight with the token embedding (GPT-2)."""
    pre_norm: bool = True
    """Pre-LN blocks (LLaMA, GPT-2, MegatronBERT) or post-LN blocks (BERT, RoBERTa)."""
    embedding_norm: bool = False
    """Norm on the summed embeddings (BERT/RoBERTa: yes; MegatronBERT and decoders: no)."""
    final_norm: bool = True
    """Norm after the last block (decoders and MegatronBERT: yes; post-LN BERT: no)."""
    type_vocab_size: int = 0
    """Token-type (segment) embeddings for encoders; 0 disables them."""
    position_offset: int = 0
    """Offset added to position ids (RoBERTa starts at ``pad_token_id + 1``)."""
    pooler: bool = False
    """Encoder pooler (dense + tanh on the first token)."""
    num_labels: int = 0
    """Size of the sequence-classification head on the pooled output; 0 = no head. A decoder with ``num_labels > 0``
    is a sequence classifier (a reward model): a ``score`` head [H -> num_labels] in place of the LM head."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    classifier_dropout: float | None = None
    """Dropout before the classification head; ``None`` means ``dropout``."""
    initializer_range: float = 0.02
    """Std of the normal initialisation."""
    pad_token_id: int = 0
    """Padding token id (used for generation, RoBERTa position ids and a decoder classifier's last token)."""
    kernels: Literal["auto", "triton", "torch"] = "auto"
    """Fused Triton kernels (``triton``), plain torch (``torch``), or Triton on CUDA only (``auto``)."""
    attention: Literal["auto", "sdpa", "varlen"] = "auto"
    """Attention of padded, packed and sliding-window rows (``models/layers/attention.py``): ``varlen`` = flash varlen
    (``torch.nn.attention.varlen.varlen_attn``), no ``[S, S]`` mask (on the CPU: its per-sequence reference, slow);
    ``sdpa`` = SDPA with a dense mask; ``auto`` = varlen on CUDA (Ampere+) in fp16/bf16 without attention dropout,
    sdpa elsewhere. Decoding with a KV cache always takes sdpa."""
    moe: MoEConfig | None = None
    """Mixture-of-Experts feed-forward layers (decoders); ``None``: every layer has a dense MLP."""
    mla: MLAConfig | None = None
    """Multi-head Latent Attention in every layer (DeepSeek-V2/V3, Kimi-K2); ``None``: q/k/v projections."""
    rope_interleave: bool = False
    """The rotary dims of each head pair up as ``(x0, x1), (x2, x3), ...`` (GLM-4's layout) instead of LLaMA's halves
    ``(x_i, x_{i+R/2})``."""
    nope_layers: list[int] = field(default_factory=list)
    """Layers whose attention applies no rotary embedding (SmolLM3's NoPE layers: HF ``no_rope_layers[i] == 0``)."""
    sliding_rope: dict[str, Any] | None = None
    """RoPE of the sliding-window layers where it differs from the other layers' (OLMo 3: YaRN on the full layers
    only; ModernBERT's and Gemma 3's local layers: their own base), as HF ``rope_parameters`` (``{"rope_type": ...,
    "rope_theta": ..., ...}``); ``None``: every layer's is ``rope_theta`` / ``rope_scaling``."""
    branch_input_norm: bool = True
    """Pre-LN blocks norm each branch's input (``attn_norm``, ``mlp_norm``); ``False``: they do not (OLMo 2/3)."""
    branch_output_norm: bool = False
    """Pre-LN blocks norm each branch's output before the residual add (``attn_out_norm``, ``mlp_out_norm``: GLM-4's
    ``post_self_attn_layernorm``/``post_mlp_layernorm``, OLMo 2/3's ``post_attention``/``post_feedforward`` norms)."""
    norm_weight_fp32: bool = False
    """RMSNorms multiply by their weight in fp32 and cast afterwards (OLMo 2/3: ``(weight * x).to(dtype)``); ``False``:
    LLaMA's order, cast first (the same in fp32)."""
    linear_attention: LinearAttentionConfig | None = None
    """Gated DeltaNet layers where ``layer_types`` says ``"linear_attention"`` (Qwen3.5, Qwen3-Next)."""
    attention_output_gate: bool = False
    """The attention output times ``sigmoid(gate)``, the gate from a second half of ``q_proj`` (per head ``[q_h,
    gate_h]``: Qwen3.5's and Qwen3-Next's gated attention)."""
    disentangled: DisentangledConfig | None = None
    """DeBERTa-v2/v3's disentangled attention in every layer of an encoder (``models/layers/deberta.py``); ``None``: plain
    attention. A DeBERTa encoder also zeroes the padding rows of its embeddings, as transformers does."""
    norm_bias: bool = True
    """Biases on the LayerNorms (ModernBERT: none)."""
    pooling: Literal["cls", "mean"] = "cls"
    """What an encoder's pooler reads: the first token, or the mean over the real tokens (ModernBERT)."""
    pooler_activation: str = "tanh"
    """The pooler's activation (BERT: ``tanh``; DeBERTa and ModernBERT: ``gelu``; any name of ``block.activation``)."""
    pooler_bias: bool = True
    """Bias on the pooler's dense layer (ModernBERT: ``classifier_bias``)."""
    pooler_norm: bool = False
    """A norm after the pooler's activation (ModernBERT's prediction head)."""
    pooler_dropout: float | None = 0.0
    """Dropout on the pooled token before the pooler's dense layer (DeBERTa's ``pooler_dropout``); ``None``: the
    classifier's dropout (RoBERTa's classification head drops out before both of its layers)."""
    # Gemma 2/3 (models/hf/families/gemma.py); each off by default
    scale_embeddings: bool = False
    """Token embeddings multiplied by ``sqrt(hidden_size)`` rounded to the embedding's dtype, inside the embedding
    (Gemma's ``embed_scale``: ``inputs_embeds`` given to the model are taken as they are)."""
    query_pre_attn_scalar: float | None = None
    """Softmax scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5`` (Gemma 2/3)."""
    attn_logit_softcap: float | None = None
    """Attention scores soft-capped to ``cap * tanh(scores / cap)`` before the mask and the softmax (Gemma 2's
    ``attn_logit_softcapping``): no flash kernel takes it, so every row takes the eager scores [B, N, S, T]
    (``attention=varlen`` is refused; ``auto`` takes sdpa's mask path)."""
    final_logit_softcap: float | None = None
    """Logits soft-capped to ``cap * tanh(logits / cap)`` (Gemma 2's ``final_logit_softcapping``): in forward, in the
    fused loss's chunks and in generation."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form metadata kept through save/load (e.g. the HF architecture name)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from a checkpoint's or the command line's plain data
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)
        if isinstance(self.linear_attention, dict):
            self.linear_attention = LinearAttentionConfig(**self.linear_attention)
        if isinstance(self.disentangled, dict):
            self.disentangled = DisentangledConfig(**self.disentangled)
        if self.mla is not None:
            self._check_mla(self.mla)
        if self.moe is not None:
            if self.family != "decoder":
                raise ValueError("ModelConfig: moe= (Mixture-of-Experts layers) needs family='decoder'")
            if any(not 0 <= i < self.num_layers for i in self.moe.dense_layers):
                raise ValueError(f"ModelConfig: moe.dense_layers={self.moe.dense_layers} must be layer indices in "
                                 f"0..{self.num_layers - 1}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"ModelConfig: hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.o_bias is None:
            self.o_bias = self.attention_bias
        if self.qkv_packed and self.num_kv_heads != self.num_heads:
            raise ValueError(f"ModelConfig: qkv_packed=True (fused W_pack) needs num_kv_heads == num_heads, got "
                             f"num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads}")
        if self.attention_sinks and self.dropout:
            raise ValueError(f"ModelConfig: dropout={self.dropout} with attention_sinks (gpt-oss) is not supported: "
                             "the sink kernels have no attention dropout; set dropout 0")
        if self.attention_output_gate and (self.qkv_packed or self.mla is not None
                                           or (self.qk_norm and self.qk_norm_over != "head")):
            raise ValueError("ModelConfig: attention_output_gate (a gate half in q_proj) takes separate q/k/v "
                             "projections with per-head q/k norms (no qkv_packed, mla or qk_norm_over='projection')")
        if self.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"ModelConfig: qk_norm_over={self.qk_norm_over!r} must be 'head' or 'projection'")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig: sliding_window={self.sliding_window} must be >= 1 (or None)")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention", "linear_attention"})
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig: layer_types must list num_layers={self.num_layers} entries of "
                                 f"full_attention / sliding_attention / linear_attention, got {self.layer_types}")
        if bool(self.linear_layers) != (self.linear_attention is not None):
            raise ValueError("ModelConfig: linear_attention= (Gated DeltaNet layers) and layer_types entries "
                             f"'linear_attention' go together (got linear_attention={self.linear_attention}, "
                             f"layer_types={self.layer_types})")
        self._check_block_layout()
        self._check_gemma()
        rotary = self.rotary_dim
        if self.position == "rope" and (not 0 < self.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2):
            raise ValueError(f"ModelConfig: partial_rotary_factor={self.partial_rotary_factor} of head_dim="
                             f"{self.head_dim} gives {rotary} rotary dims: it must be in (0, 1] and give an even "
                             "number >= 2")

    def _check_block_layout(self) -> None:
        """The per-layer rotary switches and the branch norms: indices in range, norms only in pre-LN blocks."""
        self.nope_layers = sorted(int(i) for i in self.nope_layers)
        bad = [msg for ok, msg in (
            (all(0 <= i < self.num_layers for i in self.nope_layers),
             f"nope_layers={self.nope_layers} must be layer indices in 0..{self.num_layers - 1}"),
            (self.pre_norm or (self.branch_input_norm and not self.branch_output_norm),
             "branch_input_norm=false / branch_output_norm=true need pre_norm=true (post-LN blocks norm the sum)"),
            (self.branch_input_norm or self.branch_output_norm,
             "branch_input_norm=false needs branch_output_norm=true (a block without norms)"),
            (self.sliding_rope is None or self.position == "rope", "sliding_rope needs position='rope'"),
            (self.sliding_rope is None or str(self.sliding_rope.get("rope_type", "default")) in (
                "default", "linear", "llama3", "yarn"), f"sliding_rope={self.sliding_rope}: its rope_type must be "
             "default, linear, llama3 or yarn (frequencies that do not follow the forward's length)"),
            (self.family == "decoder" or self.sliding_rope is None or set(self.sliding_rope) <= {"rope_type", "rope_theta"}
             and self.sliding_rope.get("rope_type", "default") == "default",
             f"sliding_rope={self.sliding_rope}: an encoder's sliding layers take a plain rope of their own base only"),
            (not (self.rope_interleave or self.nope_layers or self.sliding_rope) or self.mla is None,
             "rope_interleave / nope_layers / sliding_rope do not apply to mla= (its own rotary layout)")) if not ok]
        if bad:
            raise ValueError(f"ModelConfig: {'; '.join(bad)}")

    def _check_gemma(self) -> None:
        """Gemma's switches: positive caps and scalar; no varlen attention with soft-capped scores."""
        bad = [f"{name}={value} must be > 0 (or None)" for name, value in (
            ("query_pre_attn_scalar", self.query_pre_attn_scalar), ("attn_logit_softcap", self.attn_logit_softcap),
            ("final_logit_softcap", self.final_logit_softcap))
            if value is not None and not value > 0]
        if self.attn_logit_softcap is not None and self.attention == "varlen":
            bad.append(f"attention=varlen with attn_logit_softcap={self.attn_logit_softcap}: no varlen kernel "
                       "soft-caps the scores (use attention=auto or sdpa: the eager scores)")
        if bad:
            raise ValueError(f"ModelConfig: {'; '.join(bad)}")

    def _check_mla(self, mla: MLAConfig) -> None:
        """MLA sets the q/k head size and has one key/value head per query head (expanded from the latent)."""
        bad = [f"{name}={got} (MLA needs {want})" for name, got, want in (
            ("head_dim", self.head_dim, mla.qk_head_dim), ("num_kv_heads", self.num_kv_heads, self.num_heads),
            ("partial_rotary_factor", self.partial_rotary_factor, 1.0), ("qk_norm", self.qk_norm, False),
            ("qkv_packed", self.qkv_packed, False), ("position", self.position, "rope"),
            ("family", self.family, "decoder")) if got not in (None, want)]
        if bad:
            raise ValueError(f"ModelConfig: mla= (Multi-head Latent Attention) with {'; '.join(bad)}")
        self.head_dim, self.num_kv_heads = mla.qk_head_dim, self.num_heads

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu", "geglu_tanh")

    @property
    def rotary_dim(self) -> int:
        """Rotary dims of each query/key head: MLA's ``qk_rope_head_dim``, else ``int(head_dim *
        partial_rotary_factor)`` (transformers' rounding)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        assert self.head_dim is not None
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose feed-forward is a Mixture-of-Experts block (empty without ``moe``)."""
        if self.moe is None:
            return ()
        dense = set(self.moe.dense_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (``layer_types`` entries ``"linear_attention"``)."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "linear_attention")

    @property
    def linear_key_heads(self) -> int | None:
        """The DeltaNet layers' key heads (``None`` without them): tensor parallelism splits them."""
        return None if self.linear_attention is None else self.linear_attention.num_key_heads

    @property
    def linear_value_heads(self) -> int | None:
        """The DeltaNet layers' value heads (``None`` without them)."""
        return None if self.linear_attention is None else self.linear_attention.num_value_heads

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the layers that use the sliding window (empty without ``sliding_window``)."""
        if self.sliding_window is None:
            return ()
        if self.layer_types is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (``head_dim`` is recomputed unless given; so is ``o_bias`` when
        ``attention_bias`` changes)."""
        if "head_dim" not in changes and ("hidden_size" in changes or "num_heads" in changes):
            changes["head_dim"] = None
        if "num_kv_heads" not in changes and "num_heads" in changes:
            changes["num_kv_heads"] = None
        if "o_bias" not in changes and "attention_bias" in changes:
            changes["o_bias"] = None
        # a partial dict changes those fields of the existing one (a loaded backbone's)
        for name in ("moe", "mla", "linear_attention", "disentangled"):
            if isinstance(changes.get(name), dict) and getattr(self, name) is not None:
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        if self.mla is not None or changes.get("mla") is not None:  # derived from mla: recomputed from the new one
            changes.setdefault("head_dim", None)
            changes.setdefault("num_kv_heads", None)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}")
        return cls(**d)
