"""What each model family declares for parallelism: data next to the models, read by the strategies.

The models themselves hold no parallel code, and ``lightning_llm/strategies/`` names no model module: a strategy
looks the family up with :func:`parallel_spec_of` and applies what its :class:`ParallelSpec` says (as torchtitan's
per-model ``parallelize.py``). A new family registers one spec in :data:`PARALLEL_SPECS` here.

The tensor-parallel plans a spec names are in :mod:`.tp_plans`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from .config import ModelConfig
from .decoder import DecoderLM
from .encoder import EncoderModel
from .layers.masks import segment_positions
from .layers.rope import longrope_original, rope_type
from .tp_plans import TPPlan, decoder_tp_plan, encoder_tp_plan

__all__ = ["ParallelSpec", "PARALLEL_SPECS", "family_roots", "parallel_spec_of", "routing_stats_of"]


@dataclass(frozen=True)
class ParallelSpec:
    """Everything a strategy needs to know about a family, by attribute name and as plan builders."""

    first: tuple[str, ...]
    """Modules run before the first block (embeddings): the first pipeline stage keeps them."""
    last: tuple[str, ...]
    """Modules run after the last block (final norm, pooler, heads): the last pipeline stage keeps them."""
    tp_plan: Callable[..., TPPlan]
    """``(backbone, *, sequence_parallel, loss_parallel) -> plan`` relative to the backbone."""
    tp_divides: tuple[str, ...]
    """Config fields the tensor-parallel degree must divide."""
    tied: Callable[[nn.Module], tuple[tuple[str, str], ...]]
    """``backbone -> ((copy, source), ...)`` parameter names that are one weight (a tied LM head): a pipeline keeps
    ``source`` on the first stage and ``copy`` on the last and sums their gradients."""
    layers: str = "layers"
    """``nn.ModuleDict`` of blocks keyed ``"0".."n-1"``: pipeline split units, FSDP units, recompute units."""
    fsdp_units: tuple[str, ...] = field(default=("layers.*", ""))
    """FSDP2 units relative to the backbone, innermost first (``""`` = the backbone: embeddings, norm, heads)."""
    attention_cores: str | None = None
    """Context parallelism: the attention cores (``attention.DotProductAttention``, path relative to the backbone, ``*``
    per atom) a layout splitting the sequence replaces by its attention across the slices; ``None``: the family
    cannot split its sequence."""
    context_parallel_blocker: Callable[[nn.Module], str | None] = field(default=lambda model: None)
    """``backbone -> why this model cannot split its sequence`` (``None``: it can)."""
    pipeline_blocker: Callable[[nn.Module], str | None] = field(default=lambda model: None)
    """``backbone -> why this model cannot be split into pipeline stages`` (``None``: it can): e.g. a module every
    block reads (DeBERTa's relative-position table), which a stage without it would lack."""
    position_limit: Callable[[nn.Module], int | None] = field(default=lambda model: None)
    """``backbone -> the longest row a context-parallel slice computes as one device does`` (``None``: any). A
    decoder computes RoPE past its table from the positions themselves, on one device and on a slice alike; a learned
    position table ends (one device refuses a longer row too), and ``dynamic`` RoPE picks its frequencies from the
    whole row's longest position, which a slice does not hold."""
    routing: Callable[[nn.Module], Any] = field(default=lambda model: None)
    """``backbone -> its MoE layers' router statistics`` (:class:`~lightning_llm.models.layers.routing.RoutingStats`, ``None``
    without MoE layers): a pipeline opens them for its micro-batches' forwards."""
    expert_modules: str | None = None
    """The routed experts (``moe.GroupedExperts``, path relative to the backbone, ``*`` per atom) an expert-parallel
    layout replaces by its module holding this rank's experts; ``None``: the family has none."""
    segment_positions: Callable[[Tensor], Tensor] | None = None
    """``segment_ids [B, S] -> position_ids [B, S]``: the positions the family gives packed rows without
    ``position_ids`` (a context-parallel slice needs them from the whole row)."""
    # Initialisation is declared by the family model itself, not here: ``model.init_plan`` (parameter name -> its
    # init), ``model.init_seed``, ``model.weights_source`` (a lazily loaded checkpoint) and ``model.init_buffers()``,
    # which :func:`lightning_llm.models.init.materialize` reads to fill shards of a meta-device model.


def _tied_lm_head(model: nn.Module) -> tuple[tuple[str, str], ...]:
    cfg = getattr(model, "config", None)  # (a sequence classifier has no LM head to tie)
    tied = cfg is not None and cfg.tie_embeddings and not cfg.num_labels
    return (("lm_head.weight", "embed_tokens.weight"),) if tied else ()


_TP_DIVIDES = ("num_heads", "num_kv_heads", "hidden_size", "intermediate_size", "vocab_size", "linear_key_heads")


def _decoder_cp_blocker(model: nn.Module) -> str | None:
    """Why a decoder's sequence cannot be split: what the attention across slices does not rebuild."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    if config.sliding_layers:
        return (f"sliding-window attention (sliding_window={config.sliding_window} on layers "
                f"{list(config.sliding_layers)}) is not supported under context parallelism")
    if config.dropout:
        return f"dropout={config.dropout} is not supported under context parallelism (attention dropout)"
    if config.attention_sinks:
        return "attention sinks (gpt-oss) are not supported under context parallelism"
    if config.linear_layers:
        return (f"Gated DeltaNet layers (linear attention on layers {list(config.linear_layers)}: Qwen3.5, Qwen3-Next) "
                "are not supported under context parallelism: their recurrent state would have to pass from rank to "
                "rank over the sequence shards")
    if config.attn_logit_softcap is not None:
        return (f"attention logit soft-capping (attn_logit_softcap={config.attn_logit_softcap}, Gemma 2) is not "
                "supported under context parallelism")
    return None


def _decoder_position_limit(model: nn.Module) -> int | None:
    config: ModelConfig = model.config  # type: ignore[assignment]
    if rope_type(config.rope_scaling) == "longrope":  # the factors follow the whole row's longest position
        return longrope_original(config.rope_scaling)
    whole_row = config.position == "learned" or rope_type(config.rope_scaling) == "dynamic"
    return config.max_position_embeddings if whole_row else None


def _encoder_cp_blocker(model: nn.Module) -> str:
    return "the encoder family (bidirectional attention, a pooler on token 0) cannot split its sequence"


def _encoder_pp_blocker(model: nn.Module) -> str | None:
    if getattr(model, "rel_embeddings", None) is None:
        return None
    return ("DeBERTa's relative-position table (rel_embeddings, rel_norm) is read by every layer, so every pipeline "
            "stage would hold a copy whose gradients no layout sums: pipeline parallelism is not supported for it; "
            "use tp, zero1-3, ddp or deepspeed")

PARALLEL_SPECS: dict[type[nn.Module], ParallelSpec] = {
    DecoderLM: ParallelSpec(first=("embed_tokens", "embed_positions"), last=("norm", "lm_head", "score"),
                            tp_plan=decoder_tp_plan, tp_divides=_TP_DIVIDES, tied=_tied_lm_head,
                            attention_cores="layers.*.self_attn.core", context_parallel_blocker=_decoder_cp_blocker,
                            position_limit=_decoder_position_limit,
                            routing=lambda model: model.routing, expert_modules="layers.*.mlp.experts",
                            segment_positions=segment_positions),
    EncoderModel: ParallelSpec(first=("embed_tokens", "embed_positions", "embed_token_types", "embed_norm"),
                               last=("final_norm", "pooler", "pooler_norm", "classifier"), tp_plan=encoder_tp_plan,
                               tp_divides=_TP_DIVIDES, tied=lambda model: (),
                               context_parallel_blocker=_encoder_cp_blocker, pipeline_blocker=_encoder_pp_blocker),
}
"""Model class -> its spec. A new family adds its entry here (and its module next to this file)."""


def parallel_spec_of(model: nn.Module) -> tuple[str, nn.Module, ParallelSpec] | None:
    """``(path prefix, backbone, spec)`` of the first registered family inside ``model`` (PEFT wrappers put it at
    ``base_model.model.``), or ``None`` for a model of no registered family."""
    for name, mod in model.named_modules():
        for cls, spec in PARALLEL_SPECS.items():
            if isinstance(mod, cls):
                return (f"{name}." if name else ""), mod, spec
    return None


def family_roots(model: nn.Module) -> list[tuple[str, nn.Module, ParallelSpec]]:
    """``(path prefix, backbone, spec)`` of every registered family inside ``model`` that is not inside another one
    (PPO's actor-critic: the policy, then a separate critic trunk), in module order."""
    found: list[tuple[str, nn.Module, ParallelSpec]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(prefix) for prefix, _, _ in found):
            continue
        spec = next((s for cls, s in PARALLEL_SPECS.items() if isinstance(mod, cls)), None)
        if spec is not None:
            found.append(((f"{name}." if name else ""), mod, spec))
            if not name:
                break
    return found


def routing_stats_of(model: nn.Module) -> Any:
    """The router statistics of the registered family inside ``model`` (through PEFT wrappers), or ``None`` for a
    model without MoE layers or of no registered family."""
    found = parallel_spec_of(model)
    return None if found is None else found[2].routing(found[1])
