"""Tensor-parallel plans of the model families, named by their :class:`~.parallel_spec.ParallelSpec` (``tp_plan``),
and the parallel styles they add to torch's (:class:`HeadSharded`, :class:`SumGradOverRanks`).

The plans follow Megatron's layout (Shoeybi et al. 2019), expressed with DTensor styles:

* attention q/k/v and MLP gate/up are column-parallel (output features sharded), attention o and MLP down are
  row-parallel (input features sharded). The block input is turned into one replicated DTensor per block half
  (``PrepareModuleInput`` on ``self_attn``/``mlp``), so each half does exactly one collective forward (Megatron's
  *g*: all-reduce after the row-parallel linear) and one backward (Megatron's *f*: all-reduce of the input grad).
* the token embedding is vocab-parallel (``RowwiseParallel`` on ``nn.Embedding``: rows sharded, output all-reduced);
  the LM head is column-parallel over the vocabulary and, with ``loss_parallel``, keeps its logits sharded
  ``[B, S, V/tp]`` so the loss never materialises the full vocabulary.
* sequence parallel (Korthikanti et al. 2022): the residual stream between blocks is a DTensor sharded on the
  sequence dim; norms and dropout run on ``[B, S/tp, H]`` shards, each block half all-gathers its input and
  reduce-scatters its output (same bytes as one all-reduce, 1/tp of the activation memory).
* everything else (position/token-type embeddings, encoder pooler and classifier, a decoder classifier's score head,
  norms without SP) is replicated.

Plans are keyed by module path relative to the backbone (``parallelize_module`` syntax, ``*`` per path atom) and
tolerate modules a pipeline split removed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from .config import ModelConfig

__all__ = ["HeadSharded", "SumGradOverRanks", "TPPlan", "decoder_tp_plan", "encoder_tp_plan"]

TPPlan = dict[str, ParallelStyle]
"""Module path (``parallelize_module`` syntax, ``*`` wildcards per path atom) -> parallel style."""


class HeadSharded(ParallelStyle):
    """A module whose parameters are per-head vectors, split with the heads (each ``Shard(0)``): gpt-oss's attention
    sinks [N] (``takes_input=False``: called with nothing, it returns its weight, handed to the core as this rank's
    heads' logits [N/tp]) and OLMoE's q/k norms over the whole projection [N*D], [K*D] (``takes_input=True``: the
    input is this rank's heads of the projection [B, S, N/tp*D], seen as the full tensor sharded on its last dim, so
    the norm's mean of squares is all-reduced over the heads and is the whole projection's). The output is a local
    tensor again."""

    def __init__(self, *, takes_input: bool) -> None:
        super().__init__()
        self.takes_input = takes_input

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for attr, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(attr, nn.Parameter(
                distribute_tensor(p, mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=p.requires_grad))

    @staticmethod
    def _input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            return inputs
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False), *inputs[1:])

    @staticmethod
    def _output(module: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input if self.takes_input else None,
                                 self._output)


class SumGradOverRanks(ParallelStyle):
    """A module's input that each tensor-parallel rank uses for its part of a sum (MLA's rotary key, shared by the
    heads that the ranks split): identity forward; backward sums its gradient over the ranks (Megatron's *f*), as
    DTensor sums a column-parallel linear's input gradient: the input is seen as replicated and its local gradient as
    a partial sum (``to_local(grad_placements=Partial)``), which the replicated input's backward all-reduces."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def pre_hook(_: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
            x = DTensor.from_local(inputs[0], device_mesh, (Replicate(),), run_check=False)
            return (x.to_local(grad_placements=(Partial(),)), *inputs[1:])

        module.register_forward_pre_hook(pre_hook)
        return module


def _attention_plan(prefix: str, config: ModelConfig) -> TPPlan:
    """Column-parallel q/k/v (or the fused ``W_pack``), plus Qwen3's per-head ``q_norm``/``k_norm``.

    ``W_pack`` [3*N*D, H] is stored head-interleaved (rows ``[q_h0, k_h0, v_h0, q_h1, ...]``, see
    ``block.Attention``), so the plain ``Shard(0)`` of ``ColwiseParallel`` gives each rank whole heads' q, k and v:
    out [B, S, N/tp*3*D]. ``q_norm``/``k_norm`` weights [D] are replicated and see their heads' slice of q/k
    [B, S, N/tp, D] as ``Shard(2)`` of the full tensor (``SequenceParallel`` on dim 2: the norm is over D, so the
    local result is exact; the weight gradient comes out ``Partial`` over the heads and is summed by the strategy, as
    for sequence-parallel norms).
    """
    plan: TPPlan = {}
    if config.mla is not None:
        return _latent_attention_plan(prefix, config)
    names = ("W_pack",) if config.qkv_packed else ("q_proj", "k_proj", "v_proj")
    for name in names:
        plan[f"{prefix}.self_attn.{name}"] = ColwiseParallel()
    if config.qk_norm:
        for name in ("q_norm", "k_norm"):
            plan[f"{prefix}.self_attn.{name}"] = HeadSharded(takes_input=True) if config.qk_norm_over == "projection" \
                else SequenceParallel(sequence_dim=2, use_local_output=True)
    if config.attention_sinks:
        plan[f"{prefix}.self_attn.sinks"] = HeadSharded(takes_input=False)
    return plan


def _latent_attention_plan(prefix: str, config: ModelConfig) -> TPPlan:
    """Multi-head Latent Attention (``mla.LatentAttention``): heads split after the up-projections. The queries'
    ``q_proj`` or ``q_b_proj`` [N*Dqk, Rq] and ``kv_b_proj`` [N*(Dn+Dv), Rkv] are column-parallel over whole heads
    (their rows are head-major): out [B, S, N/tp*...]; ``o_proj`` is row-parallel (in ``_block_plan``). The
    down-projections ``q_a_proj``, ``kv_a_proj_with_mqa`` and the latent norms are replicated: every rank computes the
    latents [B, S, Rq | Rkv + Dr] of its tokens whole (a plain tensor input: the block hands the attention its input
    as a local tensor), and each column-parallel up-projection all-reduces the gradient of its latent input (``Rq``,
    ``Rkv`` wide, narrower than H) in backward; so does ``rope_key`` for the rotary key its heads share
    (:class:`SumGradOverRanks`: without it a rank's key gradient holds its own heads' part only)."""
    assert config.mla is not None
    up = "q_proj" if config.mla.q_lora_rank is None else "q_b_proj"
    return {f"{prefix}.self_attn.{up}": ColwiseParallel(), f"{prefix}.self_attn.kv_b_proj": ColwiseParallel(),
            f"{prefix}.self_attn.rope_key": SumGradOverRanks()}


def _deltanet_plan(prefix: str, config: ModelConfig) -> TPPlan:
    """A Gated DeltaNet layer (``deltanet.GatedDeltaNet``), split by key heads with their value heads: the input
    projections column-parallel (their rows are per key head, or per value head: a row shard holds whole heads, out
    [B, S, Hk/tp * ...]), the convolution's channels (per key head too), ``A_log`` and ``dt_bias`` split with the
    heads (:class:`HeadSharded`, called with nothing); the gated norm's weight [Dv] replicated over its heads
    [B, S, Hv/tp, Dv] (``SequenceParallel`` on dim 2, as Qwen3's per-head q/k norms); ``out_proj`` row-parallel (in
    :func:`_block_plan`)."""
    la = config.linear_attention
    assert la is not None
    names = ("in_proj_qkvz", "in_proj_ba") if la.fused_projections else ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                         "in_proj_a")
    plan: TPPlan = {f"{prefix}.self_attn.{name}": ColwiseParallel() for name in names}
    plan.update({f"{prefix}.self_attn.{name}": HeadSharded(takes_input=False) for name in ("conv1d", "A_log",
                                                                                           "dt_bias")})
    plan[f"{prefix}.self_attn.norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _block_plan(prefix: str, config: ModelConfig, *, sequence_parallel: bool, mlp: bool = True,
                linear: bool = False) -> TPPlan:
    """Styles of every ``TransformerBlock`` under ``prefix`` (``layers.*``); same for both families (``mlp=False``:
    without the feed-forward's, which a model with MoE layers plans per layer: :func:`_moe_plan`).

    Shapes (local, per rank): q/k/v out [B, S, N/tp*D] (W_pack [B, S, N/tp*3*D]), o in [B, S, N/tp*D]; gate/up out
    [B, S, I/tp]. ``linear``: the blocks are Gated DeltaNet layers (:func:`_deltanet_plan`, ``out_proj``).
    """
    resid: Placement = Shard(1) if sequence_parallel else Replicate()
    # One conversion per block half: SP all-gathers [B, S/tp, H] -> [B, S, H] here; without SP it is free forward
    # and the single all-reduce of the input grad backward.
    half_input = PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),),
                                    use_local_output=False)
    # Row-parallel output: all-reduce (no SP) or reduce-scatter to sequence shards (SP, kept as DTensor so the
    # residual add and the next norm stay sharded).
    row = RowwiseParallel(output_layouts=resid, use_local_output=not sequence_parallel)
    # MLA's replicated down-projections take the input as a plain tensor (its up-projections make it a DTensor)
    attn_input = half_input if config.mla is None else PrepareModuleInput(
        input_layouts=(resid,), desired_input_layouts=(Replicate(),), use_local_output=True)
    plan: TPPlan = {
        f"{prefix}.self_attn": attn_input,
        **(_deltanet_plan(prefix, config) if linear else _attention_plan(prefix, config)),
        f"{prefix}.self_attn.{'out_proj' if linear else 'o_proj'}": row,
    }
    if mlp:
        plan.update(_mlp_plan(prefix, config, sequence_parallel=sequence_parallel))
    if sequence_parallel:  # every norm of the block runs on sequence shards: on the input, and on each branch's
        # reduce-scattered output before the residual add (branch_output_norm)
        norms = [("attn_norm", "mlp_norm")] if config.branch_input_norm or not config.pre_norm else []
        norms += [("attn_out_norm", "mlp_out_norm")] if config.branch_output_norm else []
        for name in (n for pair in norms for n in pair):
            plan[f"{prefix}.{name}"] = SequenceParallel()
        # The block's residual dropout needs no entry: it receives the reduce-scattered DTensor [B, S/tp, H].
    return plan


def _mlp_plan(prefix: str, config: ModelConfig, *, sequence_parallel: bool) -> TPPlan:
    """A dense feed-forward: one conversion of its input (as the attention's), column-parallel gate/up [B, S, I/tp],
    row-parallel down (all-reduce, or reduce-scatter to sequence shards with SP)."""
    resid: Placement = Shard(1) if sequence_parallel else Replicate()
    plan: TPPlan = {
        f"{prefix}.mlp": PrepareModuleInput(input_layouts=(resid,), desired_input_layouts=(Replicate(),),
                                            use_local_output=False),
        f"{prefix}.mlp.up_proj": ColwiseParallel(),
        f"{prefix}.mlp.down_proj": RowwiseParallel(output_layouts=resid, use_local_output=not sequence_parallel),
    }
    if config.gated:
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
    return plan


def _moe_plan(prefix: str, config: ModelConfig, *, sequence_parallel: bool) -> TPPlan:
    """An MoE layer's feed-forward under tensor parallelism: the router and the routed experts are whole on every
    tensor-parallel rank (Megatron found expert parallelism over whole experts faster than splitting them; expert
    parallelism spreads them), computed on the block input gathered to a plain tensor [B, S, H]; a shared expert is
    split as a dense MLP (column-parallel gate/up, row-parallel down, all-reduced to a plain tensor [B, S, H]). With
    sequence parallelism the input is all-gathered and the output handed back as this rank's sequence shard (a local
    slice: every rank computed the whole)."""
    moe = config.moe
    assert moe is not None
    plan: TPPlan = {}
    if sequence_parallel:
        plan[f"{prefix}.mlp"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False)
    if moe.shared_intermediate_size:
        shared = f"{prefix}.mlp.shared_expert"
        plan.update({f"{shared}.gate_proj": ColwiseParallel(), f"{shared}.up_proj": ColwiseParallel(),
                     f"{shared}.down_proj": RowwiseParallel(output_layouts=Replicate(), use_local_output=True)})
    return plan


def _split_sequence(layer: str) -> TPPlan:
    """The first block of a stage receives the replicated hidden state; shard it on the sequence (a local slice)."""
    return {f"layers.{layer}": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=False)}


def _embedding_plan(*, sequence_parallel: bool, first_layer: str | None) -> TPPlan:
    # Vocab-parallel embedding: rows [V/tp, H] per rank, out-of-shard ids give zeros, one all-reduce sums them.
    # The full [B, S, H] embedding is kept (positions / token types / embedding norm are added replicated, as in
    # Megatron); with SP the first block splits it into sequence shards (a local slice, no communication).
    plan: TPPlan = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
    if sequence_parallel and first_layer is not None:
        plan.update(_split_sequence(first_layer))
    return plan


def _layer_keys(model: nn.Module) -> list[str]:
    layers = getattr(model, "layers", None)
    return list(layers.keys()) if isinstance(layers, nn.ModuleDict) else []


def decoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """Plan for :class:`~.decoder.DecoderLM` (tolerates modules removed by a pipeline split)."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    keys = _layer_keys(model)
    plan: TPPlan = {}
    if getattr(model, "embed_tokens", None) is not None:
        plan.update(_embedding_plan(sequence_parallel=sequence_parallel, first_layer=keys[0] if keys else None))
    elif sequence_parallel and keys:
        plan.update(_split_sequence(keys[0]))  # a later pipeline stage: split the hidden state like stage 0 does
    if keys and config.linear_layers:  # hybrid: each block's kind of attention and feed-forward
        moe, linear = set(config.moe_layers), set(config.linear_layers)
        for key in keys:
            plan.update(_block_plan(f"layers.{key}", config, sequence_parallel=sequence_parallel, mlp=False,
                                    linear=int(key) in linear))
            layer_plan = _moe_plan if int(key) in moe else _mlp_plan
            plan.update(layer_plan(f"layers.{key}", config, sequence_parallel=sequence_parallel))
    elif keys and config.moe is None:
        plan.update(_block_plan("layers.*", config, sequence_parallel=sequence_parallel))
    elif keys:  # the feed-forward per layer: dense MLPs and MoE blocks split differently
        plan.update(_block_plan("layers.*", config, sequence_parallel=sequence_parallel, mlp=False))
        moe = set(config.moe_layers)
        for key in keys:
            layer_plan = _moe_plan if int(key) in moe else _mlp_plan
            plan.update(layer_plan(f"layers.{key}", config, sequence_parallel=sequence_parallel))
    if sequence_parallel and getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        # [B, S, H] -> logits [B, S, V/tp]; SP all-gathers the sequence shards first.
        plan["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    elif getattr(model, "score", None) is not None:
        # A sequence classifier's head [H -> L] (L too small to split) stays replicated: with SP its input is gathered
        # to a plain [B, S, H] (without SP the norm's output already is one).
        if sequence_parallel:
            plan["score"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True)
    elif sequence_parallel and keys:
        # Last stage of a pipeline split without the head: hand the next stage a full replicated hidden state.
        plan[f"layers.{keys[-1]}"] = PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def encoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = True) -> TPPlan:
    """Plan for :class:`~.encoder.EncoderModel`; pooler and classifier (tiny) stay replicated.

    ``loss_parallel`` is accepted for symmetry and ignored: the classification logits are not vocab-sized.
    """
    config: ModelConfig = model.config  # type: ignore[assignment]
    keys = _layer_keys(model)
    plan: TPPlan = {}
    whole = _whole_sequence_layers(model, keys) if sequence_parallel else []
    keys = [k for k in keys if k not in whole]  # the layers sequence parallelism splits
    sequence_parallel = sequence_parallel and bool(keys)
    for key in whole:
        plan.update(_block_plan(f"layers.{key}", config, sequence_parallel=False))
    if getattr(model, "embed_tokens", None) is not None:
        first = keys[0] if keys and not whole else None
        plan.update(_embedding_plan(sequence_parallel=sequence_parallel, first_layer=first))
    if whole and sequence_parallel:
        plan.update(_split_sequence(keys[0]))  # the hidden state after the whole-sequence layers: split here
    plan.update(_relative_position_plan("layers.*", config))
    if keys:
        for key in keys:
            plan.update(_block_plan(f"layers.{key}", config, sequence_parallel=sequence_parallel))
        if sequence_parallel:
            # The pooler reads token 0 of the full sequence: gather the shards once after the last block, so the
            # final norm / pooler / classifier run replicated on plain tensors. With a single layer the first layer's
            # PrepareModuleInput and this output hook share the module, hence the combined style.
            gather: dict[str, Any] = dict(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                          use_local_output=True)
            last = f"layers.{keys[-1]}"
            if len(keys) == 1 and (whole or getattr(model, "embed_tokens", None) is not None):
                plan[last] = PrepareModuleInputOutput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                      use_local_input=False, **gather)
            else:
                plan[last] = PrepareModuleOutput(**gather)
    return plan


def _whole_sequence_layers(model: nn.Module, keys: list[str]) -> list[str]:
    """The first layers that must see the whole sequence under sequence parallelism: DeBERTa-v2's first block with its
    convolution over the sequence (``layers.0.conv``), which then runs as without sequence parallelism."""
    layers = getattr(model, "layers", None)
    return [k for k in keys[:1] if getattr(layers[k], "conv", None) is not None] if layers is not None else []


def _relative_position_plan(prefix: str, config: ModelConfig) -> TPPlan:
    """DeBERTa's own relative-position projections (without ``share_att_key``): column-parallel over whole heads like
    ``k_proj``/``q_proj`` ([P, H] -> [P, N/tp*D]: each rank scores its heads' relative terms). Their input, the
    relative table every layer reads, is a replicated plain tensor whose gradient each projection all-reduces in
    backward (with ``share_att_key`` the content ``k_proj``/``q_proj`` take it the same way)."""
    dis = config.disentangled
    if dis is None or not dis.relative_attention or dis.share_att_key:
        return {}
    names = [n for n, t in (("pos_key_proj", "c2p"), ("pos_query_proj", "p2c")) if t in dis.pos_att_type]
    return {f"{prefix}.self_attn.{n}": ColwiseParallel() for n in names}
