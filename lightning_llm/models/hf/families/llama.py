"""LLaMA (``LlamaForCausalLM``, ``LlamaModel``, ``LlamaForSequenceClassification``): the LLaMA layout, the base record
of every decoder with LLaMA's module names.

Keys ``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head`` (or ``score``); ``config.json`` keys ``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``, ``hidden_act``, ``rope_parameters``
(or the legacy ``rope_theta`` + ``rope_scaling``: default, linear, llama3, dynamic, yarn), ``tie_word_embeddings``;
LLaMA's own: ``attention_bias`` (q/k/v/o), ``mlp_bias``.

A family with this layout derives from :class:`Llama` and overrides what differs, as transformers' modular files do:
the config class's defaults (:attr:`Llama.max_positions`, :attr:`Llama.norm_eps`, :attr:`Llama.head_dim`,
:attr:`Llama.rope_default`), its own keys (:meth:`Llama.fields_from_hf` / :meth:`Llama.fields_to_hf`), its rope
(:meth:`Llama.rope_from_hf`), a block's norms (:attr:`Llama.norms`), attention or MLP weight names
(:meth:`Llama.attention_entries`, :meth:`Llama.mlp_entries`), Mixture-of-Experts layers (:attr:`Llama.moe_defaults`,
:meth:`Llama.experts_from_hf` / :meth:`Llama.experts_to_hf`; experts stored per expert: :meth:`Llama.moe_entries`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from ...config import ModelConfig
from ...layers.configs import MoEConfig
from ..record.entries import Entry, Fused, Stacked, experts_entries, head_entries, lin
from ..record.family import Family, decoder_classes
from ..record.readers import GATED_ACT_TO_HF, gated_act, rope_from_hf, rope_to_hf

__all__ = ["LLAMA_NORMS", "Llama", "RECORDS"]

LLAMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"))
"""A LLaMA block's norms: (HF name, ours)."""


class Llama(Family):
    """The LLaMA layout (and LLaMA itself)."""

    model_type = "llama"
    label = "Llama 1-3"
    chat_template = "llama3"
    classes = decoder_classes("Llama")
    guess_rank = 100  # a rope decoder of no recorded family that no other family claims

    max_positions: ClassVar[int] = 2048
    """``max_position_embeddings`` when absent (the config class's default; likewise below)."""
    norm_eps: ClassVar[float] = 1e-6
    """``rms_norm_eps`` when absent."""
    head_dim: ClassVar[int | None] = None
    """``head_dim`` when absent or null (None: ``hidden_size / num_attention_heads``)."""
    rope_default: ClassVar[dict[str, Any] | None] = None
    """Rope parameters when the config has none (``{"rope_theta": ...}``: the config class's ``default_theta``)."""
    partial_rotary: ClassVar[bool] = False
    """It reads ``partial_rotary_factor`` (else a value other than 1 is refused)."""
    write_partial_rotary: ClassVar[bool] = False
    """Its ``rope_parameters`` always carry ``partial_rotary_factor`` (its absence means a default other than 1)."""
    norms: ClassVar[tuple[tuple[str, str], ...]] = LLAMA_NORMS
    """A block's norms: (HF name, ours)."""
    moe_defaults: ClassVar[tuple[int, int, int | None, bool] | None] = None
    """An MoE family's (experts, top-k, expert width, ``norm_topk_prob``) when absent; None: dense."""
    shared_expert: ClassVar[str] = "shared_expert"
    """The HF module of an MoE layer's shared expert."""

    def guess(self, c: ModelConfig) -> bool:
        return c.position == "rope"

    # ------------------------------------------------------------------------------------------------ config

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        head_dim = hf.get("head_dim")
        head_dim = self.head_dim if head_dim is None else head_dim
        fields: dict[str, Any] = dict(
            family="decoder", vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
            num_layers=layers, num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=None if head_dim is None else int(head_dim), intermediate_size=self.intermediate_size(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", self.max_positions)), norm="rmsnorm",
            norm_eps=float(hf.get("rms_norm_eps", self.norm_eps)),
            activation=gated_act(hf.get("hidden_act", "silu")), position="rope",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pre_norm=True, embedding_norm=False,
            final_norm=True, dropout=float(hf.get("attention_dropout", 0.0)),
            initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
        )
        fields.update(self.rope_from_hf(hf, where))
        moe = self.moe_from_hf(hf, layers)
        if moe is not None:
            fields["moe"] = moe
        fields.update(self.fields_from_hf(hf, layers, where))
        return ModelConfig(**fields)

    def intermediate_size(self, hf: dict[str, Any]) -> int:
        """The dense MLPs' width."""
        return int(hf["intermediate_size"])

    def rope_from_hf(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The rope fields (``rope_theta``, ``rope_scaling``; a family with rope per layer type ``sliding_rope``)."""
        theta, scaling = rope_from_hf(hf, default=self.rope_default, partial=self.partial_rotary)
        return dict(rope_theta=theta, rope_scaling=scaling)

    def fields_from_hf(self, hf: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
        """The family's own fields (overriding the LLaMA-layout ones)."""
        return dict(attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)))

    def moe_from_hf(self, hf: dict[str, Any], num_layers: int) -> MoEConfig | None:
        """The :class:`MoEConfig` of an MoE family (:attr:`moe_defaults` for absent keys; the load-balancing
        coefficient is ``router_aux_loss_coef`` whatever ``output_router_logits`` says: the loss is on in training
        unless turned off)."""
        if self.moe_defaults is None:
            return None
        experts, top_k, _, _ = self.moe_defaults
        n = int(hf.get("num_experts", hf.get("num_local_experts", experts)) or 0)
        if n < 1:
            raise ValueError(f"{self.model_type} config with num_experts={n}: a model without experts is not "
                             f"supported as {self.model_type}")
        if float(hf.get("router_jitter_noise", 0.0) or 0.0) > 0:
            raise ValueError(f"router_jitter_noise={hf['router_jitter_noise']} (random multiplicative noise on the "
                             "router input in training) is not supported; set it to 0.0")
        return MoEConfig(num_experts=n, top_k=int(hf.get("num_experts_per_tok", top_k)),
                         aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                         **self.experts_from_hf(hf, num_layers))

    def experts_from_hf(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """An MoE family's :class:`MoEConfig` fields beyond the experts, top-k and loss coefficient."""
        raise NotImplementedError(self.model_type)

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        hf = self.base_to_hf(c)
        hf.update(num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_parameters=self.rope_to_hf(c),
                  attention_dropout=c.dropout)
        hf.update(self.moe_to_hf(c))
        hf.update(self.fields_to_hf(c))
        return hf

    def base_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The keys every LLaMA-layout ``config.json`` has."""
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                    hidden_act=GATED_ACT_TO_HF.get(c.activation, c.activation),
                    max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps,
                    tie_word_embeddings=c.tie_embeddings)

    def rope_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """``rope_parameters``."""
        rope = rope_to_hf(c)
        if self.write_partial_rotary or c.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = c.partial_rotary_factor
        return rope

    def fields_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """The family's own keys (inverse of :meth:`fields_from_hf`)."""
        return dict(attention_bias=c.attention_bias, mlp_bias=c.mlp_bias)

    def moe_to_hf(self, c: ModelConfig) -> dict[str, Any]:
        """An MoE family's keys (inverse of :meth:`moe_from_hf`)."""
        if self.moe_defaults is None:
            return {}
        m = c.moe
        if m is None:
            raise ValueError(f"{self.model_type} needs Mixture-of-Experts layers (ModelConfig.moe is None)")
        return dict(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False,
                    **self.experts_to_hf(m))

    def experts_to_hf(self, m: MoEConfig) -> dict[str, Any]:
        """Inverse of :meth:`experts_from_hf`."""
        raise NotImplementedError(self.model_type)

    # ------------------------------------------------------------------------------------------------ weights

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        e: list[Entry | Stacked | Fused] = list(lin("embed_tokens", "embed_tokens", False))
        for i in range(c.num_layers):
            p = f"layers.{i}"
            e += self.attention_entries(c, p, i)
            e += self.moe_entries(c, i) if i in c.moe_layers else self.mlp_entries(c, p)
            for hf_norm, ours in self.norms:
                e += lin(f"{p}.{hf_norm}", f"{p}.{ours}", False)
        e += lin("norm", "norm", False)
        return e + head_entries(c, head)

    def attention_entries(self, c: ModelConfig, p: str, layer: int) -> list[Entry]:
        """Layer ``layer``'s attention (``p``: ``layers.N``, the same prefix on both sides)."""
        e = [x for name in ("q_proj", "k_proj", "v_proj")
             for x in lin(f"{p}.self_attn.{name}", f"{p}.self_attn.{name}", c.attention_bias)]
        e += lin(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", bool(c.o_bias))
        if c.qk_norm:
            e += lin(f"{p}.self_attn.q_norm", f"{p}.self_attn.q_norm", False)
            e += lin(f"{p}.self_attn.k_norm", f"{p}.self_attn.k_norm", False)
        if c.attention_sinks:  # gpt-oss: a bare [N] tensor, our AttentionSinks module's weight
            e.append(Entry(f"{p}.self_attn.sinks", (f"{p}.self_attn.sinks.weight",)))
        return e

    def mlp_entries(self, c: ModelConfig, p: str) -> list[Entry]:
        """A dense layer's MLP."""
        names = ("gate_proj", "up_proj", "down_proj") if c.gated else ("up_proj", "down_proj")
        return [x for name in names for x in lin(f"{p}.mlp.{name}", f"{p}.mlp.{name}", c.mlp_bias)]

    def moe_entries(self, c: ModelConfig, layer: int) -> list[Entry | Stacked | Fused]:
        """An MoE layer's feed-forward: experts stored per expert (``mlp.experts.N.gate_proj`` ...), the shared
        expert under :attr:`shared_expert`."""
        p = f"layers.{layer}.mlp"
        return experts_entries(c, p, p, shared=self.shared_expert)


RECORDS = (Llama(),)
