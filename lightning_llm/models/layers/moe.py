"""Mixture-of-Experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4.5): no parallel code.

Module tree of one MoE layer's ``mlp`` (the names transformers 5 holds in memory, so a checkpoint maps one to one)::

    gate                  Router: weight [E, H] (logits in fp32); bias [E] with router_bias (gpt-oss);
                          e_score_correction_bias [E] (buffer) with score_bias
    experts               GroupedExperts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I];
                          gate_up_proj_bias [E, 2I], down_proj_bias [E, H] with expert_bias (gpt-oss)
    shared_expert         MLP of shared_intermediate_size (optional; Qwen2-MoE, DeepSeek's and GLM's shared_experts)
    shared_expert_gate    Linear [1, H]: the shared expert's output times sigmoid of it (optional; Qwen2-MoE)

A token's output is ``sum_k w_k * expert_{e_k}(x)`` over its ``top_k`` experts (dropless: no capacity, no token is
dropped) plus the shared expert. The routed computation sorts the ``N * top_k`` assignments by expert and runs each
projection as one grouped GEMM over every expert's rows (:func:`expert_ffn`: ``torch._grouped_mm``, or the loop over
experts kept as the reference and fallback). ``experts`` is a declared hook (``ParallelSpec.expert_modules``): an
expert-parallel layout replaces it by a module with the same parameters and call, ``(tokens sorted by expert, tokens
per expert) -> outputs``, that sends the tokens to the ranks holding their experts and back.

Router statistics (:class:`~.routing.RoutingStats`) are recorded while a training step has them open: the load per
expert and layer, and the load-balancing loss's gradient, injected at the router logits when backward reaches them.

Shape legend: B batch, S sequence, H hidden, N = B*S tokens, E experts, k top_k, M = N*k assignments, I expert width.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import ModelConfig
from .configs import MoEConfig
from .block import MLP, activation
from .routing import RoutingStats

log = logging.getLogger(__name__)

__all__ = ["GroupedExperts", "MoEBlock", "Router", "RoutingInput", "expert_ffn", "grouped_mm_supported",
           "moe_parameters", "route_scores"]


@dataclass(frozen=True)
class RoutingInput:
    """What the decoder hands its MoE layers per forward: which tokens are real (the load-balancing statistics
    exclude padding) and the statistics to record into (``None``: not recording)."""

    keep: Tensor | None = None
    """[N] bool, True = a real token (flattened [B, S]); None: every token is."""
    stats: RoutingStats | None = None


# ---------------------------------------------------------------------------------------------------- routing


def route_scores(logits: Tensor, cfg: MoEConfig, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(expert ids [N, k], weights [N, k] fp32)`` from router logits [N, E] (fp32).

    softmax: top-k of the softmax probabilities, renormalised with ``norm_topk_prob`` (Mixtral: always; DeepSeek-V2:
    never). softmax_topk (gpt-oss): the top-k logits, their softmax the weights. sigmoid (DeepSeek-V3, GLM-4.5): the
    correction ``bias`` is added to the scores to choose the experts only. Group-limited choice keeps the
    ``topk_groups`` best groups: ranked by the sum of their two best (biased) scores, the other groups' experts
    excluded (``group_score=top2_sum``: DeepSeek-V3), or by their best score, the other groups' scores zeroed
    (``max``: DeepSeek-V2's ``group_limited_greedy``). The weights are the unbiased scores, renormalised with
    ``norm_topk_prob`` and times ``routed_scaling_factor``."""
    k = cfg.top_k
    if cfg.scoring == "softmax_topk":
        top, ids = logits.topk(k, dim=-1)  # [N, k]: transformers' GptOssTopKRouter
        weights = torch.softmax(top, dim=-1)
        return ids, weights * cfg.routed_scaling_factor if cfg.routed_scaling_factor != 1.0 else weights
    scores = torch.softmax(logits, dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.num_groups > 1:
        n, e = choice.shape
        grouped = choice.view(n, cfg.num_groups, e // cfg.num_groups)
        if cfg.group_score == "max":
            group_scores = grouped.max(dim=-1).values  # [N, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices, True)
        fill = 0.0 if cfg.group_score == "max" else float("-inf")
        choice = choice.masked_fill(~keep.repeat_interleave(e // cfg.num_groups, dim=1), fill)
        if cfg.group_score == "max":
            scores = choice  # (unbiased) transformers' weights are the zeroed scores
    if bias is None and cfg.num_groups == 1:
        weights, ids = scores.topk(k, dim=-1)  # [N, k]: the order transformers' routers return
    else:
        ids = choice.topk(k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return ids, weights


class Router(nn.Module):
    """``gate``: logits ``x @ weight.T`` [N, E] computed in fp32 (autocast off: the choice of experts must not depend
    on the compute dtype's rounding), and the choice of experts (:func:`route_scores`)."""

    param_inits = ("weight",)
    """Initialised normal(initializer_range), as transformers inits its routers (read by the init plan)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        if cfg.router_bias:
            self.param_inits = ("weight", "bias")  # transformers inits gpt-oss's router bias normal(std) too
        self.e_score_correction_bias: Tensor | None
        if cfg.score_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        # The correction bias stays fp32 whatever dtype the model is cast to (transformers keeps it so:
        # _keep_in_fp32_modules_strict): the aux-free update's steps (1e-3) would vanish in a 16-bit bias.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def logits(self, x: Tensor) -> Tensor:  # [N, H] -> [N, E] fp32
        device = x.device.type
        autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        bias = self.e_score_correction_bias
        return route_scores(logits, self.cfg, None if bias is None else bias.float())

    def extra_repr(self) -> str:
        c = self.cfg
        return f"experts={c.num_experts}, top_k={c.top_k}, scoring={c.scoring}, norm_topk_prob={c.norm_topk_prob}"


# ---------------------------------------------------------------------------------------------------- experts


def grouped_mm_supported(x: Tensor) -> bool:
    """Whether torch has a grouped-GEMM kernel for ``x``'s device and dtype: the CPU (fp32 eagerly, bf16; exact), and
    bf16 on CUDA devices of compute capability 8.0 and newer."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        # torch.compile traces with the meta kernel, which takes bf16 only: an fp32 graph takes the loop
        return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not torch.compiler.is_compiling())
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def _compute_dtype(x: Tensor) -> torch.dtype:
    device = x.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _glu(act: str, gate: Tensor, up: Tensor, clamp: tuple[float, float] | None) -> Tensor:
    """The gated activation: ``act(gate) * up``, or gpt-oss's clamped SwiGLU with ``clamp = (alpha, limit)``:
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)`` (transformers'
    ``GptOssExperts._apply_gate``, in its order of operations)."""
    if clamp is None:
        return activation(act, gate) * up
    alpha, limit = clamp
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def describe_ffn(ffn: dict[str, Any]) -> str:
    clamp = ffn["clamp"]
    act = ffn["act"] if clamp is None else f"clamped swiglu (alpha={clamp[0]}, limit={clamp[1]})"
    return f"act={act}, impl={ffn['impl']}"


def _per_row(bias: Tensor, counts: Tensor, rows: int) -> Tensor:
    """Each row's expert's bias [M, C] from ``bias`` [E, C] and the rows per expert ``counts`` [E]."""
    expert = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=rows)
    return bias.index_select(0, expert)


def expert_ffn(tokens: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor, *, act: str, impl: str,
               gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None,
               clamp: tuple[float, float] | None = None) -> Tensor:
    """The experts' gated MLPs on ``tokens`` [M, H] sorted by expert, ``counts`` [E] rows per expert (summing to M):
    ``down_e(glu(gate_e(x), up_e(x)))`` with ``gate_up`` [E, 2I, H] (gate rows first) and ``down`` [E, H, I], plus
    the biases ``gate_up_bias`` [E, 2I] and ``down_bias`` [E, H] where given; ``glu``: ``act(gate) * up``, or with
    ``clamp = (alpha, limit)`` gpt-oss's clamped SwiGLU (:func:`_glu`).

    ``impl``: ``grouped`` (two ``torch._grouped_mm`` calls over every expert's rows), ``loop`` (one pair of GEMMs per
    expert: the reference) or ``auto``. Under autocast both run in its dtype (grouped GEMMs have no autocast rule).
    Returns [M, H] in the compute dtype."""
    dtype = _compute_dtype(tokens)
    tokens = tokens.to(dtype)
    gate_up, down = gate_up.to(dtype), down.to(dtype)
    gate_up_bias = None if gate_up_bias is None else gate_up_bias.to(dtype)
    down_bias = None if down_bias is None else down_bias.to(dtype)
    if tokens.is_meta:  # FLOP counting: the counter has matmul formulas, and torch's meta grouped GEMM takes bf16 only
        impl = "loop"
    elif impl == "auto":
        impl = "grouped" if grouped_mm_supported(tokens) else "loop"
    if impl == "grouped":
        offs = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
        h = torch._grouped_mm(tokens, gate_up.transpose(-2, -1), offs=offs)  # [M, 2I]
        if gate_up_bias is not None:
            h = h + _per_row(gate_up_bias, counts, tokens.shape[0])
        gate, up = h.chunk(2, dim=-1)
        out = torch._grouped_mm(_glu(act, gate, up, clamp).contiguous(), down.transpose(-2, -1), offs=offs)
        return out if down_bias is None else out + _per_row(down_bias, counts, tokens.shape[0])
    if tokens.is_meta:  # shapes only (FLOP counting): the loop needs the rows per expert as numbers
        per, rest = divmod(tokens.shape[0], counts.shape[0])
        sizes = [per + (e < rest) for e in range(counts.shape[0])]
    else:
        sizes = counts.tolist()
    outs = []
    e = counts.shape[0]
    # unbind, not gate_up[e]: indexing one expert makes its backward fill a whole [E, 2I, H] gradient per expert
    biases_in = gate_up_bias.unbind(0) if gate_up_bias is not None else (None,) * e
    biases_out = down_bias.unbind(0) if down_bias is not None else (None,) * e
    for part, w_in, w_out, b_in, b_out in zip(tokens.split(sizes), gate_up.unbind(0), down.unbind(0), biases_in,
                                              biases_out):
        gate, up = F.linear(part, w_in, b_in).chunk(2, dim=-1)  # [m_e, I] each
        outs.append(F.linear(_glu(act, gate, up, clamp), w_out, b_out))
    return torch.cat(outs) if outs else tokens.new_zeros(0, down.shape[1])


class GroupedExperts(nn.Module):
    """``experts``: the routed experts' weights fused per projection, ``forward(tokens sorted by expert [M, H], rows
    per expert [E]) -> [M, H]`` (:func:`expert_ffn`). Every parameter is stacked over the experts (dim 0):
    :attr:`expert_params` names them, and :attr:`ffn` holds the rest of the call (what expert parallelism copies)."""

    param_inits = ("gate_up_proj", "down_proj")
    """Parameters initialised normal(initializer_range), as transformers inits its experts (read by the init plan)."""
    zero_inits = ("gate_up_proj_bias", "down_proj_bias")
    """Parameters that start at zero (gpt-oss's expert biases, as transformers inits them)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig, *, act: str) -> None:
        super().__init__()
        clamp = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        self.ffn: dict[str, Any] = dict(act=act, impl=cfg.experts_impl, clamp=clamp)
        e, i = cfg.num_experts, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size))

    @property
    def expert_params(self) -> tuple[str, ...]:
        """The parameters, each ``[E, ...]``: what an expert-parallel rank holds ``E / ep`` of."""
        return tuple(n for n, _ in self.named_parameters(recurse=False))

    def forward(self, tokens: Tensor, counts: Tensor) -> Tensor:
        return expert_ffn(tokens, counts, self.gate_up_proj, self.down_proj, gate_up_bias=self.gate_up_proj_bias,
                          down_bias=self.down_proj_bias, **self.ffn)

    def extra_repr(self) -> str:
        e, i2, h = self.gate_up_proj.shape
        return f"experts={e}, hidden={h}, intermediate={i2 // 2}, {describe_ffn(self.ffn)}, " \
               f"bias={self.gate_up_proj_bias is not None}"


# ---------------------------------------------------------------------------------------------------- the block


def balanced_counts(m: int, e: int, device: torch.device) -> Tensor:
    """Rows per expert when ``m`` assignments are spread evenly over ``e`` experts (what a meta-device forward, which
    has no values to route by, assumes: the FLOPs of the active parameters)."""
    per, rest = divmod(m, e)
    return torch.tensor([per + (i < rest) for i in range(e)], device=device)


class _TokensByExpert(torch.autograd.Function):
    """``x[order // k]``: each of the ``N * k`` assignments' token [M, H], sorted by expert. Backward sums each token's
    ``k`` rows after putting them back in token order (a gather by the inverse permutation, then a sum over ``k``),
    instead of ``index_select``'s scatter-add of ``M`` rows into ``N`` (atomics: 4x slower on an H200 in the
    Qwen3-30B-A3B profile, and not deterministic)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, order: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (order,) = ctx.saved_tensors
        inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        by_token = grad.index_select(0, inverse)  # [M, H] in assignment order: token t's rows at t*k .. t*k + k-1
        return by_token.view(-1, ctx.k, grad.shape[-1]).sum(1), None, None


def dispatch_to_experts(experts: nn.Module, x: Tensor, ids: Tensor, weights: Tensor, num_experts: int) -> Tensor:
    """``sum_k weights[:, k] * expert_{ids[:, k]}(x)`` [N, H]: the ``N * k`` assignments sorted by expert (stable, so
    each expert sees its tokens in order), computed by ``experts(tokens, counts)``, put back in token order (a
    permutation: deterministic, unlike a scatter-add on CUDA) and weighted and summed per token in fp32 (as Mixtral's
    experts weigh their bf16 outputs by fp32 scores); backward keeps the experts' outputs in the compute dtype only."""
    n, k = ids.shape
    flat = ids.reshape(-1)  # [M]
    if x.is_meta:
        order = torch.arange(n * k, device=x.device)
        counts = balanced_counts(n * k, num_experts, x.device)
    else:
        order = torch.argsort(flat, stable=True)
        # (not bincount: on CUDA it reads the largest id back to size its output, a host sync per layer)
        counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    out = experts(_TokensByExpert.apply(x, order, k), counts)  # [M, H] sorted by expert
    by_token = torch.empty_like(out).index_copy_(0, order, out).view(n, k, -1)  # [N, k, H] (in place: no extra copy)
    return (by_token * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # fp32 weights: the product and the sum in fp32


class MoEBlock(nn.Module):
    """A Mixture-of-Experts feed-forward (see the module docstring): ``forward(x [B, S, H], routing=) -> [B, S, H]``."""

    takes_routing = True
    """The block takes ``routing=`` (a :class:`RoutingInput`) from the decoder (dense MLPs do not)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        cfg = config.moe
        assert cfg is not None
        self.cfg, self.layer = cfg, layer
        h = config.hidden_size
        self.gate = Router(h, cfg)
        self.experts = GroupedExperts(h, cfg, act=config.activation)
        self.shared_expert: MLP | None = (
            MLP(config, intermediate_size=cfg.shared_intermediate_size) if cfg.shared_intermediate_size else None)
        self.shared_expert_gate: nn.Linear | None = (
            nn.Linear(h, 1, bias=False) if cfg.shared_intermediate_size and cfg.shared_gate else None)

    def forward(self, x: Tensor, *, routing: RoutingInput | None = None) -> Tensor:  # [B, S, H] -> [B, S, H]
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        logits = self.gate.logits(flat)  # [N, E] fp32
        stats = routing.stats if routing is not None and self.training else None
        keep = routing.keep if routing is not None else None
        if stats is not None:  # the load-balancing loss's gradient joins here in backward
            logits = stats.attach(self.layer, logits, keep)
        ids, weights = self.gate.route(logits)
        if stats is not None:
            stats.record(self.layer, logits, ids, keep)
        out = dispatch_to_experts(self.experts, flat, ids, weights, self.cfg.num_experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


def moe_parameters(config: ModelConfig) -> tuple[int, int]:
    """``(routed expert parameters of the whole model, those a token uses)``: ``E`` and ``top_k`` experts of
    ``3 x I x H`` each (plus ``2I + H`` biases with ``expert_bias``) per MoE layer (the rest of the model every token
    uses)."""
    moe = config.moe
    if moe is None:
        return 0, 0
    per_expert = 3 * moe.intermediate_size * config.hidden_size
    if moe.expert_bias:
        per_expert += 2 * moe.intermediate_size + config.hidden_size
    layers = len(config.moe_layers)
    return layers * moe.num_experts * per_expert, layers * moe.top_k * per_expert
