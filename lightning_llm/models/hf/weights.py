"""The weight mapping: for a config and an HF class, the list of entries (HF key <-> our keys, with split and merge
functions) that loading and saving walk, generated from the config, so missing and unexpected keys are reported by
name. The LLaMA-layout decoders' entries are here; GPT-2's and the encoders' are in :mod:`.families.gpt2` and
:mod:`.families.encoders`, the experts' in :mod:`.entries`."""

from __future__ import annotations

import re

from torch import Tensor

from ..config import ModelConfig
from .architectures import SUPPORTED_ARCHITECTURES, layout_kind
from .entries import Entry, Fused, Stacked, head_entries, lin, moe_mlp_entries
from .families.decoders import DECODER_KINDS, wpack_from_hf, wpack_to_hf
from .families.encoders import ENCODER_HEAD_KEYS, ENCODER_PREFIX, encoder_entries
from .families.gemma import GEMMA_KINDS, GEMMA_NORMS
from .families.glm4 import GLM4_NORMS
from .families.gpt2 import gpt2_entries
from .families.olmo import OLMO_KINDS, OLMO_NORMS
from .families.phi3 import phi3_attention_entries, phi3_mlp_entries
from .families.qwen3_next import hybrid_attention_entries

__all__ = ["BASE_PREFIX", "IGNORED", "HEAD_KEYS", "entries", "save_entries"]

BASE_PREFIX = {**{k: "model." for k in DECODER_KINDS}, "gpt2": "transformer.", **ENCODER_PREFIX}
"""The base model's prefix of each weight layout's keys (``model.layers.0...``)."""

IGNORED = re.compile(
    r"(^|\.)attn\.(masked_)?bias$|(^|\.)position_ids$|(^|\.)token_type_ids$|(^|\.)rotary_emb\.inv_freq$"
)
"""Checkpoint keys that carry no weights we need (buffers that old versions persisted)."""

HEAD_KEYS = {
    **{k: re.compile(r"^(score|lm_head)\.") for k in DECODER_KINDS + ("gpt2",)},
    **ENCODER_HEAD_KEYS,
}
"""Head weights of other tasks: dropped with a warning (e.g. an MLM head when loading a backbone; the LM head of a
``...ForCausalLM`` a reward model starts from)."""


def _mla_entries(hf: str, ours: str, c: ModelConfig) -> list[Entry]:
    """Multi-head Latent Attention's projections and latent norms (``mla.LatentAttention``: transformers' names)."""
    assert c.mla is not None
    bias = c.attention_bias  # on the down-projections from the hidden state (and o_proj: o_bias)
    names = [("q_proj", False)] if c.mla.q_lora_rank is None else [
        ("q_a_proj", bias), ("q_a_layernorm", False), ("q_b_proj", False)]
    names += [("kv_a_proj_with_mqa", bias), ("kv_a_layernorm", False), ("kv_b_proj", False)]
    return [entry for name, b in names for entry in lin(f"{hf}.{name}", f"{ours}.{name}", b)]


def _attention_entries(c: ModelConfig, p: str) -> list[Entry]:
    """One decoder layer's attention (``p``: ``layers.N``, the same prefix on both sides)."""
    if c.mla is not None:
        e = _mla_entries(f"{p}.self_attn", f"{p}.self_attn", c)
    elif c.qkv_packed:  # [q; k; v] rows in the checkpoint, head-interleaved in our W_pack (block.Attention)
        n = c.num_heads
        e = [Entry(f"{p}.self_attn.W_pack.{t}", (f"{p}.self_attn.W_pack.{t}",),
                   split=lambda w, n=n: (wpack_from_hf(w, n),), merge=lambda ws, n=n: wpack_to_hf(ws[0], n))
             for t in (("weight", "bias") if c.attention_bias else ("weight",))]
    else:
        e = [x for name in ("q_proj", "k_proj", "v_proj")
             for x in lin(f"{p}.self_attn.{name}", f"{p}.self_attn.{name}", c.attention_bias)]
    e += lin(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj", bool(c.o_bias))
    if c.qk_norm:
        e += lin(f"{p}.self_attn.q_norm", f"{p}.self_attn.q_norm", False)
        e += lin(f"{p}.self_attn.k_norm", f"{p}.self_attn.k_norm", False)
    if c.attention_sinks:  # gpt-oss: a bare [N] tensor, our AttentionSinks module's weight
        e.append(Entry(f"{p}.self_attn.sinks", (f"{p}.self_attn.sinks.weight",)))
    return e


_LLAMA_NORMS = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"))
BLOCK_NORMS = {"glm4": GLM4_NORMS, **{kind: OLMO_NORMS for kind in OLMO_KINDS},
               **{kind: GEMMA_NORMS for kind in GEMMA_KINDS}}
"""A family's block norms ``(HF name, ours)`` where they are not LLaMA's ``input_layernorm`` / ``post_attention_
layernorm`` (our ``attn_norm`` / ``mlp_norm``)."""


def _decoder_entries(c: ModelConfig, kind: str, head: str) -> list[Entry | Stacked | Fused]:
    e: list[Entry | Stacked | Fused] = list(lin("embed_tokens", "embed_tokens", False))
    for i in range(c.num_layers):
        p = f"layers.{i}"
        if i in c.linear_layers:
            e += hybrid_attention_entries(c, p)
        else:
            e += phi3_attention_entries(c, p) if kind == "phi3" else _attention_entries(c, p)
        if i in c.moe_layers:
            e += moe_mlp_entries(c, kind, i)
        elif kind in ("phi3", "glm4"):  # one fused gate_up_proj
            e += phi3_mlp_entries(c, p)
        else:
            for name in (("gate_proj", "up_proj", "down_proj") if c.gated else ("up_proj", "down_proj")):
                e += lin(f"{p}.mlp.{name}", f"{p}.mlp.{name}", c.mlp_bias)
        for hf_norm, ours in BLOCK_NORMS.get(kind, _LLAMA_NORMS):
            e += lin(f"{p}.{hf_norm}", f"{p}.{ours}", False)
    e += lin("norm", "norm", False)
    return e + head_entries(c, head)


def entries(config: ModelConfig, architecture: str) -> list[Entry | Stacked | Fused]:
    """The mapping of ``architecture``'s keys (without the base prefix, but for ``top`` entries) to ours."""
    a = SUPPORTED_ARCHITECTURES[architecture]
    if layout_kind(architecture) in DECODER_KINDS:  # a multimodal class: its language model's layout
        return _decoder_entries(config, layout_kind(architecture), a.head)
    if a.kind == "gpt2":
        return list(gpt2_entries(config, a.head))
    return list(encoder_entries(config, a))


def save_entries(config: ModelConfig, architecture: str, sd: dict[str, Tensor]) -> list[Entry]:
    """The entries of :func:`entries` with each fused expert tensor written per expert and part (the rows of an
    expert's gate and up projections: half each)."""
    out: list[Entry] = []
    for e in entries(config, architecture):
        if isinstance(e, Fused):
            out.append(e.save_entry())
        elif isinstance(e, Stacked):
            t = sd.get(e.ours)
            if t is None:
                out.append(Entry(e.hf[0][0], (e.ours,)))  # reported missing by the caller
                continue
            out += e.save_entries([t.shape[1] // len(e.hf[0])] * len(e.hf[0]))
        else:
            out.append(e)
    return out
