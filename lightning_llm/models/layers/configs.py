"""The configs of the optional kinds of layer, fields of :class:`~lightning_llm.models.config.ModelConfig`: a decoder's
Mixture-of-Experts feed-forward (``moe``), Multi-head Latent Attention (``mla``), Gated DeltaNet layers
(``linear_attention``) and an encoder's disentangled attention (``disentangled``). Plain data, as the model config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


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
