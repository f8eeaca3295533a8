"""Model configuration shared by the decoder and encoder families, plus the named sizes.

The config is plain data: no parallel degrees, no device placement. Strategies read it (e.g. to check that
heads divide the tensor-parallel size) but never write parallel state into it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

Family = Literal["decoder", "encoder"]


@dataclass
class MoEConfig:
    """Mixture-of-Experts feed-forward layers of a decoder (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5).

    Each MoE layer routes every token to ``top_k`` of ``num_experts`` gated MLPs (dropless: every token is computed,
    as transformers does) and adds their outputs weighted by the router; optionally a shared expert sees every token.
    """

    num_experts: int = 8
    """Routed experts per MoE layer (HF ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``)."""
    top_k: int = 2
    """Experts each token is sent to (HF ``num_experts_per_tok``)."""
    intermediate_size: int = 256
    """Hidden width of each routed expert (HF ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    scoring: Literal["softmax", "sigmoid", "softmax_topk"] = "softmax"
    """Router scores: ``softmax`` over the experts (Mixtral, Qwen, OLMoE), per-expert ``sigmoid`` (DeepSeek-V3), or
    ``softmax_topk``: the top-k logits chosen first, their softmax the weights (gpt-oss; ``norm_topk_prob`` does not
    apply: the weights sum to 1)."""
    norm_topk_prob: bool = True
    """Renormalise the chosen experts' scores to sum to 1 (Mixtral always; Qwen2/3-MoE when the config says)."""
    router_bias: bool = False
    """A learned bias on the router logits (gpt-oss ``router.bias``): it chooses and weights the experts."""
    expert_bias: bool = False
    """Biases on the experts' projections (gpt-oss ``gate_up_proj_bias`` [E, 2I], ``down_proj_bias`` [E, H])."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the experts: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)`` (HF ``swiglu_limit``); ``None``: the model's gated ``activation``."""
    swiglu_alpha: float = 1.702
    """The sigmoid's gain in the clamped SwiGLU (HF ``swiglu_alpha``; used with ``swiglu_limit``)."""
    num_groups: int = 1
    """Group-limited routing: experts form this many groups (DeepSeek ``n_group``)."""
    topk_groups: int = 1
    """Groups a token may choose from (DeepSeek ``topk_group``), ranked as ``group_score`` says."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """How group-limited routing ranks a group: the sum of its two best (biased) scores, the other groups' experts
    excluded (DeepSeek-V3, GLM-4.5), or its best score, the other groups' scores zeroed (DeepSeek-V2's
    ``group_limited_greedy``)."""
    routed_scaling_factor: float = 1.0
    """Factor on the routed experts' weights after renormalisation (DeepSeek-V3)."""
    score_bias: bool = False
    """A per-expert correction bias (``gate.e_score_correction_bias``, a buffer) added to the scores to choose experts
    only, never to weight them: the aux-free balancing of DeepSeek-V3, moved by ``bias_update_rate``."""
    bias_update_rate: float = 0.0
    """Aux-free balancing: after every optimizer step ``bias += rate * sign(mean(load) - load)`` per layer, the loads
    counted over the global batch and the accumulation window (0: the bias stays as loaded)."""
    aux_loss_coef: float = 0.001
    """Coefficient of transformers' load-balancing loss (``router_aux_loss_coef``; ``num_experts x sum_i f_i P_i``
    pooled over the layers and the global batch, padding excluded), added to the training loss; 0 turns it off."""
    shared_intermediate_size: int = 0
    """Hidden width of a shared expert that every token passes through (Qwen2-MoE ``shared_expert``, DeepSeek's
    ``shared_experts``); 0: none."""
    shared_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE)."""
    dense_layers: list[int] = field(default_factory=list)
    """Layers that keep a dense MLP of ``ModelConfig.intermediate_size`` (HF ``mlp_only_layers``, those outside
    ``decoder_sparse_step``, the first ``first_k_dense_replace``)."""
    experts_impl: Literal["auto", "grouped", "loop"] = "auto"
    """The experts' GEMMs: one grouped GEMM per projection over every expert's tokens (``torch._grouped_mm``), a loop
    over the experts, or ``auto`` (grouped where torch has the kernel for the device and dtype: the CPU, bf16 on SM80+
    GPUs)."""

    def __post_init__(self) -> None:
        self.dense_layers = sorted(int(i) for i in self.dense_layers)
        checks = [(self.num_experts >= 1, "num_experts must be >= 1"),
                  (1 <= self.top_k <= self.num_experts, "top_k must be in 1..num_experts"),
                  (self.intermediate_size >= 1, "intermediate_size must be >= 1"),
                  (self.num_groups >= 1 and self.num_experts % self.num_groups == 0,
                   "num_groups must divide num_experts"),
                  (1 <= self.topk_groups <= self.num_groups, "topk_groups must be in 1..num_groups"),
                  (self.num_groups == 1 or self.group_score == "max" or self.num_experts // self.num_groups >= 2,
                   "group-limited routing ranks groups by their two best scores: >= 2 experts per group"),
                  (self.group_score in ("top2_sum", "max"), "group_score must be top2_sum or max"),
                  (self.bias_update_rate == 0 or self.score_bias, "bias_update_rate needs score_bias=true"),
                  (self.aux_loss_coef >= 0 and self.bias_update_rate >= 0, "coefficients must be >= 0"),
                  (self.experts_impl in ("auto", "grouped", "loop"), "experts_impl must be auto, grouped or loop"),
                  (self.scoring in ("softmax", "sigmoid", "softmax_topk"),
                   "scoring must be softmax, sigmoid or softmax_topk"),
                  (self.swiglu_limit is None or self.swiglu_limit > 0, "swiglu_limit must be > 0 (or None)"),
                  (self.scoring != "softmax_topk" or (self.num_groups == 1 and not self.score_bias),
                   "scoring=softmax_topk takes no group-limited routing and no score_bias")]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError(f"MoEConfig: {'; '.join(bad)} (got {self})")


@dataclass
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2; ``models/layers/mla.py``): keys and values of every head
    expanded from one compressed latent per token, queries through an optional low-rank path, and the rotary part of
    each query/key head (one rotary key shared by the heads) decoupled from the rest. With it, ``ModelConfig.head_dim``
    is the query/key head size ``qk_nope_head_dim + qk_rope_head_dim`` and ``num_kv_heads`` is ``num_heads``."""

    kv_lora_rank: int = 512
    """Width of the compressed key/value latent (``kv_a_proj_with_mqa`` -> RMSNorm -> ``kv_b_proj``)."""
    q_lora_rank: int | None = 1536
    """Width of the query's low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``); ``None``: one ``q_proj``."""
    qk_nope_head_dim: int = 128
    """Per-head query/key dims without rotary embedding."""
    qk_rope_head_dim: int = 64
    """Per-head query/key dims with rotary embedding (the key's are shared by every head)."""
    v_head_dim: int = 128
    """Per-head value width (the attention output per head)."""
    rope_interleave: bool = True
    """The rotary dims pair up as ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout; DeepSeek-V2 always) instead of
    LLaMA's halves ``(x_i, x_{i+D/2})``."""
    latent_norm_eps: float = 1e-6
    """Epsilon of the two latent RMSNorms (transformers builds them with their default 1e-6, not ``rms_norm_eps``)."""

    def __post_init__(self) -> None:
        checks = [(self.kv_lora_rank >= 1, "kv_lora_rank must be >= 1"),
                  (self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank must be >= 1 or None"),
                  (self.qk_nope_head_dim >= 0 and self.v_head_dim >= 1, "head dims must be positive"),
                  (self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even")]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError(f"MLAConfig: {'; '.join(bad)} (got {self})")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class LinearAttentionConfig:
    """Gated DeltaNet layers (linear attention with a recurrent state: Qwen3.5, Qwen3-Next; ``models/layers/deltanet.py``),
    on the layers ``ModelConfig.layer_types`` names ``"linear_attention"``. Each key head serves
    ``num_value_heads / num_key_heads`` value heads."""

    num_key_heads: int = 16
    """Query/key heads (HF ``linear_num_key_heads``)."""
    num_value_heads: int = 32
    """Value heads (HF ``linear_num_value_heads``); a multiple of ``num_key_heads``."""
    key_head_dim: int = 128
    """Per-head query/key width (HF ``linear_key_head_dim``)."""
    value_head_dim: int = 128
    """Per-head value width (HF ``linear_value_head_dim``)."""
    conv_kernel_size: int = 4
    """Width of the depthwise causal convolution over q, k, v (HF ``linear_conv_kernel_dim``)."""
    fused_projections: bool = True
    """Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``; ``False``: Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``."""
    kernels: Literal["auto", "fla", "torch"] = "auto"
    """The delta rule and the convolution: flash-linear-attention's kernels (``fla``, the optional ``fla-core``
    package: CUDA, bf16/fp16), the chunked torch form (``torch``), or fla where it runs (``auto``)."""

    def __post_init__(self) -> None:
        checks = [(min(self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim) >= 1,
                   "head counts and widths must be >= 1"),
                  (self.num_value_heads % self.num_key_heads == 0, "num_key_heads must divide num_value_heads"),
                  (self.conv_kernel_size >= 1, "conv_kernel_size must be >= 1"),
                  (self.kernels in ("auto", "fla", "torch"), "kernels must be auto, fla or torch")]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError(f"LinearAttentionConfig: {'; '.join(bad)} (got {self})")


@dataclass
class DisentangledConfig:
    """DeBERTa-v2/v3's disentangled attention (``models/layers/deberta.py``): besides content-to-content scores, each query
    scores the relative position of each key (``c2p``) and each key the relative position of the query (``p2c``),
    through one table of relative-position embeddings shared by every layer (``rel_embeddings`` [2 * span, H], layer-
    normed with ``rel_norm``). The softmax scale is ``1/sqrt(head_dim * (1 + len(pos_att_type)))``."""

    relative_attention: bool = True
    """Add the relative-position scores (HF ``relative_attention``); False: content scores only (the scale still counts
    ``pos_att_type``, as transformers does)."""
    pos_att_type: list[str] = field(default_factory=lambda: ["p2c", "c2p"])
    """Which relative scores: ``c2p`` (content to position), ``p2c`` (position to content), both or none."""
    position_buckets: int = 256
    """Relative distances beyond ``position_buckets // 2`` share log-spaced buckets (HF ``position_buckets``); <= 0:
    no buckets, distances clamped to ``max_relative_positions``."""
    max_relative_positions: int = -1
    """The longest relative distance the buckets reach (< 1: ``max_position_embeddings``)."""
    share_att_key: bool = True
    """The relative embeddings pass through the content ``k_proj``/``q_proj`` (DeBERTa-v3); False: their own
    ``pos_key_proj``/``pos_query_proj``."""
    rel_norm: bool = True
    """LayerNorm the relative embeddings (HF ``norm_rel_ebd="layer_norm"``)."""
    conv_kernel_size: int = 0
    """DeBERTa-v2's convolution beside the first layer (``ConvLayer``: ``norm(layer_0(x) + act(conv(x)))`` on the
    real tokens; HF ``conv_kernel_size``); 0: none."""
    conv_groups: int = 1
    """Groups of that convolution (HF ``conv_groups``)."""
    conv_activation: str = "tanh"
    """Its activation (HF ``conv_act``)."""

    def __post_init__(self) -> None:
        self.pos_att_type = [str(t).strip().lower() for t in self.pos_att_type]
        if not set(self.pos_att_type) <= {"c2p", "p2c"} or len(set(self.pos_att_type)) != len(self.pos_att_type):
            raise ValueError(f"DisentangledConfig: pos_att_type={self.pos_att_type} must list c2p and/or p2c once")
        if self.conv_kernel_size < 0 or (self.conv_kernel_size and self.conv_kernel_size % 2 == 0):
            raise ValueError(f"DisentangledConfig: conv_kernel_size={self.conv_kernel_size} must be 0 or odd (the "
                             "convolution keeps the sequence length)")

    def span(self, max_position_embeddings: int) -> int:
        """Half the rows of the relative-embedding table: the buckets, else the longest distance."""
        if self.position_buckets > 0:
            return self.position_buckets
        return self.max_relative_positions if self.max_relative_positions >= 1 else max_position_embeddings

    def max_distance(self, max_position_embeddings: int) -> int:
        """``max_relative_positions``, defaulted to ``max_position_embeddings`` as transformers does."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else max_position_embeddings


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


_LLAMA = dict(family="decoder", norm="rmsnorm", activation="swiglu", position="rope", pre_norm=True)
_GPT2 = dict(
    family="decoder", norm="layernorm", norm_eps=1e-5, activation="gelu_tanh", position="learned",
    attention_bias=True, mlp_bias=True, tie_embeddings=True, pre_norm=True,
)
_BERT = dict(
    family="encoder", norm="layernorm", norm_eps=1e-12, activation="gelu", position="learned",
    attention_bias=True, mlp_bias=True, pre_norm=False, embedding_norm=True, final_norm=False,
    type_vocab_size=2, pooler=True, dropout=0.1,
)
_MEGATRON_BERT = dict(_BERT, pre_norm=True, embedding_norm=False, final_norm=True)
_DEBERTA_V3 = dict(_BERT, norm_eps=1e-7, position="none", type_vocab_size=0, pooler_activation="gelu",
                   disentangled=dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256,
                                     share_att_key=True, rel_norm=True), extra={"hf_model_type": "deberta-v2"})
_MODERNBERT = dict(family="encoder", norm="layernorm", norm_eps=1e-5, norm_bias=False, activation="geglu",
                   position="rope", rope_theta=160000.0, sliding_window=128,
                   sliding_rope={"rope_type": "default", "rope_theta": 10000.0},
                   pre_norm=True, embedding_norm=True, final_norm=True, pooler=True, pooler_activation="gelu",
                   pooler_bias=False, pooler_norm=True, extra={"hf_model_type": "modernbert"})

# Named sizes: (family, name) -> fields. `debug` exists for both families and is what tests use.
NAMED_SIZES: dict[tuple[str, str], dict[str, Any]] = {
    ("decoder", "debug"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=256,
    ),
    # Debug sizes of the other decoder families (tests; their HF architecture is the default save target).
    ("decoder", "debug-qwen2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, attention_bias=True, o_bias=False,
        tie_embeddings=True, extra={"hf_model_type": "qwen2"},
    ),
    ("decoder", "debug-qwen3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        extra={"hf_model_type": "qwen3"},
    ),
    ("decoder", "debug-mistral"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, sliding_window=8, extra={"hf_model_type": "mistral"},
    ),
    ("decoder", "debug-baichuan2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, qkv_packed=True, norm_head=True,
        extra={"hf_model_type": "baichuan"},
    ),
    # Qwen3-MoE-shaped (q/k norms, no biases, MoE on every layer, renormalised top-k) at test and CPU sizes, and the
    # shape of Qwen3-30B-A3B (estimates, GPU benchmarks with fewer layers through model_overrides).
    ("decoder", "debug-moe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    # gpt-oss- and OLMoE-shaped at test size: sinks, alternating sliding (window 8) and full layers, YaRN, biased
    # router with a softmax over the chosen top-k, biased experts with the clamped SwiGLU; q/k norms over the whole
    # projection and softmax top-k without renormalisation.
    ("decoder", "debug-gpt-oss"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 64},
        attention_bias=True, attention_sinks=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="softmax_topk", norm_topk_prob=False,
                 router_bias=True, expert_bias=True, swiglu_limit=7.0, aux_loss_coef=0.001),
        extra={"hf_model_type": "gpt_oss"},
    ),
    ("decoder", "debug-olmoe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=32, max_position_embeddings=256, norm_eps=1e-5, qk_norm=True, qk_norm_over="projection",
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=False, aux_loss_coef=0.01),
        extra={"hf_model_type": "olmoe"},
    ),
    # Phi-3-, GLM-4-, OLMo-3- and SmolLM3-shaped at test size: Phi-4-mini's partial rotary with LongRoPE whose short
    # range (16) the 32-token blocks pass; GLM-4's rotary pairs, q/k/v biases and norms on both sides of each branch;
    # OLMo 3's output norms, q/k norms over the projection, sliding layers (window 8) with plain RoPE beside YaRN on
    # the full one; SmolLM3's layer without rotary embedding and tied head.
    ("decoder", "debug-phi3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.75,
        rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 16,
                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [2.0 + 0.5 * i for i in range(6)]},
        extra={"hf_model_type": "phi3"},
    ),
    ("decoder", "debug-glm4"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5,
        rope_interleave=True, attention_bias=True, o_bias=False, branch_output_norm=True,
        extra={"hf_model_type": "glm4"},
    ),
    ("decoder", "debug-olmo3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-5, rope_theta=500000.0, qk_norm=True, qk_norm_over="projection",
        branch_input_norm=False, branch_output_norm=True, norm_weight_fp32=True, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        sliding_rope={"rope_type": "default", "rope_theta": 500000.0}, extra={"hf_model_type": "olmo3"},
    ),
    ("decoder", "debug-smollm3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6, rope_theta=2000000.0, nope_layers=[3], tie_embeddings=True,
        extra={"hf_model_type": "smollm3"},
    ),
    # Qwen3.5- and Qwen3-Next-shaped hybrids at test size: three Gated DeltaNet layers, then one gated attention layer
    # (q/k norms, partial rotary 0.25, (1 + weight) norms); Qwen3.5's split projections and dense MLPs, Qwen3-Next's
    # fused projections and MoE with a sigmoid-gated shared expert.
    ("decoder", "debug-qwen3.5"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        norm_offset=1.0, attention_output_gate=True, partial_rotary_factor=0.25,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                              conv_kernel_size=4, fused_projections=False),
        extra={"hf_model_type": "qwen3_5_text"},
    ),
    ("decoder", "debug-qwen3-next"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        norm_offset=1.0, attention_output_gate=True, partial_rotary_factor=0.25,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                              conv_kernel_size=4, fused_projections=True),
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, shared_intermediate_size=32,
                 shared_gate=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_next"},
    ),
    ("decoder", "small-moe"): dict(
        _LLAMA, vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
        intermediate_size=688, max_position_embeddings=1024, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=16, top_k=4, intermediate_size=128, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    ("decoder", "qwen3-30b-a3b"): dict(
        _LLAMA, vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        intermediate_size=6144, max_position_embeddings=40960, norm_eps=1e-6, rope_theta=1e6, qk_norm=True,
        moe=dict(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True, aux_loss_coef=0.001),
        extra={"hf_model_type": "qwen3_moe"},
    ),
    # DeepSeek-V3-shaped (MLA with a query low-rank path, sigmoid router with groups and a correction bias, a shared
    # expert, the first layer dense) and GLM-4.5-shaped (partial rotary, q/k norms, q/k/v biases, the same router) at
    # test sizes; the shape of DeepSeek-V3 itself (estimates: 671B parameters, 37B active).
    ("decoder", "debug-deepseek-v3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, intermediate_size=128,
        max_position_embeddings=256, norm_eps=1e-6,
        mla=dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid", num_groups=2, topk_groups=1,
                 norm_topk_prob=True, routed_scaling_factor=2.5, score_bias=True, shared_intermediate_size=32,
                 dense_layers=[0], aux_loss_coef=0.0),
        extra={"hf_model_type": "deepseek_v3"},
    ),
    ("decoder", "debug-glm4-moe"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-5, partial_rotary_factor=0.5, qk_norm=True,
        attention_bias=True, o_bias=False,
        moe=dict(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid", num_groups=2, topk_groups=1,
                 norm_topk_prob=True, routed_scaling_factor=1.0, score_bias=True, shared_intermediate_size=32,
                 dense_layers=[0], aux_loss_coef=0.0),
        extra={"hf_model_type": "glm4_moe"},
    ),
    ("decoder", "deepseek-v3"): dict(
        _LLAMA, vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, intermediate_size=18432,
        max_position_embeddings=163840, norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        mla=dict(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=dict(num_experts=256, top_k=8, intermediate_size=2048, scoring="sigmoid", num_groups=8, topk_groups=4,
                 norm_topk_prob=True, routed_scaling_factor=2.5, score_bias=True, shared_intermediate_size=2048,
                 dense_layers=[0, 1, 2], aux_loss_coef=0.0),
        extra={"hf_model_type": "deepseek_v3"},
    ),
    # Gemma 2- and Gemma 3-shaped at test size: (1 + weight) norms, four per layer, the embedding scaled, GeGLU, a
    # softmax scale of its own, sliding and full layers, tied head; Gemma 2's soft-capped scores and logits (caps
    # small enough to bite at this size), Gemma 3's q/k norms, local rope base and linearly scaled global rope.
    ("decoder", "debug-gemma2"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, norm_offset=1.0, activation="geglu_tanh",
        tie_embeddings=True, scale_embeddings=True, branch_output_norm=True, query_pre_attn_scalar=24.0,
        attn_logit_softcap=5.0, final_logit_softcap=10.0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, extra={"hf_model_type": "gemma2"},
    ),
    ("decoder", "debug-gemma3"): dict(
        _LLAMA, vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, max_position_embeddings=256, norm_eps=1e-6, norm_offset=1.0, activation="geglu_tanh",
        tie_embeddings=True, scale_embeddings=True, branch_output_norm=True, query_pre_attn_scalar=16.0,
        qk_norm=True, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 2.0},
        sliding_rope={"rope_type": "default", "rope_theta": 1e4}, sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], extra={"hf_model_type": "gemma3_text"},
    ),
    ("decoder", "small"): dict(
        _LLAMA, vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4,
        intermediate_size=688, max_position_embeddings=1024,
    ),
    ("decoder", "gpt2"): dict(
        _GPT2, vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=1024,
    ),
    ("decoder", "llama-1b"): dict(
        _LLAMA, vocab_size=32000, hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4,
        intermediate_size=5632, max_position_embeddings=2048,
    ),
    ("decoder", "llama2-7b"): dict(
        _LLAMA, vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
        intermediate_size=11008, max_position_embeddings=4096,
    ),
    ("encoder", "debug"): dict(
        _BERT, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position_embeddings=512, dropout=0.0,
    ),
    # DeBERTa-v3- and ModernBERT-shaped encoders at test size (relative positions with log buckets; global and
    # sliding layers with their own rope theta, the GLU feed-forward and the prediction head)
    ("encoder", "debug-deberta-v3"): dict(
        _DEBERTA_V3, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
        max_position_embeddings=512, dropout=0.0,
    ),
    ("encoder", "debug-modernbert"): dict(
        _MODERNBERT, vocab_size=21128, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96,
        max_position_embeddings=8192, layer_types=["full_attention", "sliding_attention"],
    ),
    ("encoder", "bert-base"): dict(
        _BERT, vocab_size=21128, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
        max_position_embeddings=512,
    ),
    ("encoder", "erlangshen-1.3b"): dict(
        _MEGATRON_BERT, vocab_size=21248, hidden_size=2048, num_layers=24, num_heads=32,
        intermediate_size=8192, max_position_embeddings=512,
    ),
}


def named_config(name: str, *, family: Family, **overrides: Any) -> ModelConfig:
    """Config of a named size (``debug``, ``bert-base``, ...) for ``family``, with field overrides."""
    key = (family, name)
    if key not in NAMED_SIZES:
        known = sorted(n for f, n in NAMED_SIZES if f == family)
        raise ValueError(f"unknown {family} model size {name!r}; known sizes: {', '.join(known)}")
    return ModelConfig(**copy.deepcopy({**NAMED_SIZES[key], **overrides}))  # no config shares the table's dicts
