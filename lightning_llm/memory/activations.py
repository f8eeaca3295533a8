"""Activation and loss memory of a training step: what autograd keeps per transformer layer (the tensors it saves;
flash/memory-efficient attention: no S x S term), plus embeddings and the LM head's loss, for one sample or a batch
(part of :mod:`lightning_llm.memory`).

An MoE layer's activations per token replace the dense MLP's by what autograd saves for the router and the ``top_k``
assignments of the token (:func:`moe_layer_bytes_per_token`), with the tokens spread evenly over the experts (a rank
of an expert-parallel group then computes as many assignments as its tokens made). A Gated DeltaNet layer's (Qwen3.5,
Qwen3-Next) replace the attention's by what its chunked delta rule saves (:func:`deltanet_bytes`: projections,
convolution, the chunks' [64, 64] matrices and one recurrent state per chunk).
"""

from __future__ import annotations

from typing import Any

from lightning_llm.kernels.loss.cross_entropy import default_chunk_size

__all__ = ["FUSED_CHUNK_FP32_COPIES", "activation_bytes_per_sample", "attention_elements_per_token", "attention_width",
           "deltanet_bytes", "deltanet_flops_per_token", "loss_bytes", "loss_peak_bytes", "moe_layer_bytes_per_token"]

FUSED_CHUNK_FP32_COPIES = 2
"""fp32 ``[chunk, V]`` buffers alive at once in the fused loss's torch path: the chunk's logits (overwritten by their
gradient) and their shifted exponentials (``benchmarks/loss_memory.py``)."""


def _act_bytes(precision: str) -> int:
    return 4 if precision == "32-true" else 2


def activation_bytes_per_sample(config: Any, *, seq_len: int, precision: str, fused_loss: bool = False, cp: int = 1
                                ) -> tuple[int, int]:
    """(per transformer layer, whole model) activation bytes autograd keeps on one rank for one sample of ``seq_len``
    tokens; with ``fused_loss`` no logits are kept (:func:`loss_peak_bytes` counts what the loss needs instead).
    Under context parallelism (``cp > 1``) a rank keeps ``seq_len / cp`` tokens' activations plus, per layer, the
    keys and values of the whole sequence its attention gathered (kv heads: ``2 S K D``)."""
    b = _act_bytes(precision)
    h, i = config.hidden_size, config.intermediate_size
    attention, gathered = attention_elements_per_token(config)
    # Per token and layer: norm input + output (2H), the attention's, MLP norm input + output (2H), MLP: gate/up
    # (+ activation and product for gated MLPs) or up + activation.
    mlp = 4 * i if config.gated else 2 * i
    per_token_layer = b * (4 * h + attention + mlp)
    if getattr(config, "disentangled", None) is not None:  # DeBERTa's eager attention keeps its probabilities [N, S]
        per_token_layer += b * config.num_heads * seq_len
    if config.dropout > 0:
        per_token_layer += 3 * h  # 1-byte dropout masks on attention/residual paths (probabilities not counted)
    local = seq_len // cp
    per_layer = per_token_layer * local + (b * gathered * seq_len if cp > 1 else 0)
    moe_layers = set(getattr(config, "moe_layers", ()))
    linear_layers = set(getattr(config, "linear_layers", ()))
    # An MoE layer: the dense MLP's term replaced by the router's and the experts' (the largest layer is reported).
    moe_extra = local * (moe_layer_bytes_per_token(config, precision=precision) - b * mlp) if moe_layers else 0
    # A Gated DeltaNet layer: the attention's term replaced by the layer's (its chunks padded to 64 tokens).
    linear_extra = deltanet_bytes(config, tokens=local, precision=precision) - b * attention * local \
        if linear_layers else 0
    vocab = config.vocab_size
    # Embedding output, final norm (2H), logits in the compute dtype + their fp32 copy for the loss (none for a
    # decoder's score head: [B, S, num_labels]).
    no_logits = fused_loss or getattr(config, "num_labels", 0) > 0
    head = local * (b * 3 * h + (0 if no_logits else (b + 4) * vocab))
    each = [per_layer + (moe_extra if n in moe_layers else 0) + (linear_extra if n in linear_layers else 0)
            for n in range(config.num_layers)]
    return max(each), sum(each) + head


def deltanet_bytes(config: Any, *, tokens: int, precision: str) -> int:
    """Bytes autograd keeps for ``tokens`` tokens of one Gated DeltaNet layer on the torch path
    (``kernels/delta_rule.py``; measured on the layer in ``tests/models/test_deltanet.py``, within 8%: how many
    copies the chunks' batched matmuls make of their keys depends on the shapes), with ``Cc`` convolution channels,
    ``Hv`` value heads, ``Dk``/``Dv`` head widths and chunks of ``C`` = 64: in the compute dtype the convolution's
    input and output (``2 Cc``), the gates (``3 Hv``), the gated norm's tensors and ``out_proj``'s input
    (``5 Hv Dv``); in fp32 (the delta rule runs in fp32) the L2-normed q/k (``2 Hv Dk + 3 Hv``) and, per token
    padded to whole chunks, the chunks' keys, queries, values and outputs (``8 Hv Dk + 4 Hv Dv + 3 Hv``) and [C, C]
    matrices (``5 Hv C``), and one state [Hv, Dk, Dv] per chunk. fla's kernels (CUDA) keep less."""
    la = config.linear_attention
    hk, hv, dk, dv, c = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, 64
    conv = hk * 2 * dk + hv * dv
    padded = -(-tokens // c) * c
    compute = tokens * (2 * conv + 3 * hv + 5 * hv * dv)
    fp32 = tokens * (2 * hv * dk + 3 * hv) + padded * (8 * hv * dk + 4 * hv * dv + 3 * hv + 5 * hv * c) \
        + padded // c * hv * dk * dv
    return _act_bytes(precision) * compute + 4 * fp32


def deltanet_flops_per_token(config: Any) -> int:
    """A training step's FLOPs per token of one Gated DeltaNet layer's delta rule (3x the forward's chunked form,
    chunks of ``C`` = 64, per value head): the [C, C] products of keys with keys and with queries (``4 C Dk``), their
    product with the values (``2 C Dv``), the two triangular solves (``C (Dk + Dv)``) and the state's reads and update
    (``6 Dk Dv``); the projections are counted with the parameters."""
    la = config.linear_attention
    dk, dv, c = la.key_head_dim, la.value_head_dim, 64
    return 3 * la.num_value_heads * (4 * c * dk + 2 * c * dv + c * (dk + dv) + 6 * dk * dv)


def attention_elements_per_token(config: Any) -> tuple[int, int]:
    """``(elements autograd keeps per token in one attention layer, elements per token of the keys and values a
    context-parallel rank gathers)``.

    q/k/v projections: q/k/v (``q + 2kv``), rotated q/k (``q + kv``), the attention output (``q``); gathered ``2kv``.
    Multi-head Latent Attention (measured on the layer in ``tests/models/test_mla.py``): the query path's down-projection,
    norm statistics, normed latent and the up-projection's input (``3 Rq + 1``), the key/value latent with the rotary
    key, its norm statistics, normed latent and input copy (``3 Rkv + Dr + 1``), the keys, queries, values padded to
    the keys' width and the padded output (``4 N Dqk``), the log-sum-exp (``N``) and o_proj's input (``N Dv``);
    gathered: keys and padded values ``2 N Dqk``."""
    mla = getattr(config, "mla", None)
    if mla is None:
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        gate = 3 * q if getattr(config, "attention_output_gate", False) else 0  # the gate, its sigmoid, the product
        return 3 * q + 3 * kv + gate, 2 * kv
    n, qk = config.num_heads, mla.qk_head_dim
    query = 3 * mla.q_lora_rank + 1 if mla.q_lora_rank is not None else 0
    latent = 3 * mla.kv_lora_rank + mla.qk_rope_head_dim + 1
    return query + latent + 4 * n * qk + n + n * mla.v_head_dim, 2 * n * qk


def attention_width(config: Any) -> int:
    """``A`` of the attention FLOPs ``12 L A S`` per token (``tools/estimate.train_flops_per_token``): the query/key
    width of the scores and the value width of their product with the values, averaged (``N D``; MLA:
    ``N (Dqk + Dv) / 2``)."""
    mla = getattr(config, "mla", None)
    if mla is None:
        return config.num_heads * config.head_dim
    return config.num_heads * (mla.qk_head_dim + mla.v_head_dim) // 2


def moe_layer_bytes_per_token(config: Any, *, precision: str) -> int:
    """Bytes autograd saves per token in one MoE layer's feed-forward (``config.moe``; measured on the block in
    ``tests/cli/test_estimate.py``), with the ``top_k`` assignments of a token:

    * router: its probabilities ``[E]`` fp32 and, with the load-balancing loss on, its logits ``[E]`` fp32 (the
      aux gradient's input); the fp32 copy of its input ``[H]`` when the block runs in a 16-bit dtype; their sum;
    * per assignment: three ``[H]`` in the compute dtype (the token's copy sorted by expert, the expert's output,
      that output in token order, which the fp32 weighting keeps), the expert's gate/up output ``[2I]``, activation
      ``[I]`` and product ``[I]`` (compute dtype), and its id, weight and sorting order (24 bytes: the order is
      saved once, both for the gather of the tokens and for putting the outputs back);
    * a shared expert: a dense gated MLP of its width, and its sigmoid gate's ``[H + 1]``; under autocast each of
      its linears reading the fp32 input saves its own cast ``[H]``."""
    moe = config.moe
    b = _act_bytes(precision)  # the compute dtype
    block = 2 if precision in ("bf16-true", "16-true") else 4  # the residual stream's dtype (fp32 under AMP)
    h, e, k, i = config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size
    router = 4 * e * (2 if moe.aux_loss_coef > 0 else 1) + (4 * h if block != 4 else 0) + 4
    assignment = 3 * b * h + 4 * i * b + 24
    shared = 0
    if moe.shared_intermediate_size:
        linears = 3 if moe.shared_gate else 2  # gate, up (and the sigmoid gate) read the block input
        shared = b * 4 * moe.shared_intermediate_size + (b * (h + 1) if moe.shared_gate else 0) + \
            (linears * b * h if block != b else 0)
    return router + k * assignment + shared


def loss_peak_bytes(*, tokens: int, vocab: int, hidden: int, precision: str, fused: bool, tp: int = 1) -> int:
    """Peak transient memory of the LM-head loss and its backward for ``tokens`` tokens, above the hidden states, the
    head's weight and its gradient buffer (as ``benchmarks/loss_memory.py`` measures it).

    Full logits: the peak is in the backward of the log-softmax, where its fp32 output (saved), the NLL gradient and
    the log-softmax gradient ``[N, V/tp]`` coexist (bf16 logits add their own copy and the gradient cast back); the
    weight's and hidden states' gradients come after those are freed. Fused: ``dW [V, H]`` fp32 and ``dhidden
    [N, H]`` are allocated in the forward and live until the backward, beside one token chunk's logits (which
    become its gradient in place) and their shifted exponentials (:func:`~lightning_llm.kernels.loss.cross_entropy.
    default_chunk_size` tokens)."""
    b = _act_bytes(precision)
    v = -(-vocab // tp)
    if fused:
        chunk = default_chunk_size(tokens, v, hidden)
        return 4 * v * hidden + b * tokens * hidden + FUSED_CHUNK_FP32_COPIES * 4 * chunk * v
    return (3 * 4 + (2 * b if b != 4 else 0)) * tokens * v


def loss_bytes(config: Any, *, tokens: int, precision: str, fused: bool, tp: int) -> int:
    """:func:`loss_peak_bytes` of ``config``'s LM head for ``tokens`` tokens (0 for an encoder's classifier)."""
    if getattr(config, "family", "decoder") != "decoder" or getattr(config, "num_labels", 0) > 0:
        return 0  # classification heads (a decoder's score head too): [B, S or 1, num_labels] scores
    return loss_peak_bytes(tokens=tokens, vocab=config.vocab_size, hidden=config.hidden_size, precision=precision,
                           fused=fused, tp=tp)
