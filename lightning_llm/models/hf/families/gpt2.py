"""GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``, ``GPT2ForSequenceClassification``): ``config.json`` and weight names <-> a learned-position
:class:`~lightning_llm.models.DecoderLM` with LayerNorms and biases.

Conv1D weights are stored ``[in, out]`` (transposed to ``nn.Linear``'s ``[out, in]``) and ``c_attn`` holds q, k, v
as one ``[H, 3H]`` matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...config import ModelConfig
from ..record.entries import Entry, Fused, Stacked, head_entries, lin
from ..record.family import Family
from ..record.readers import PLAIN_ACT_TO_HF, plain_act

__all__ = ["GPT2", "RECORDS"]


class GPT2(Family):
    model_type = "gpt2"
    label = "GPT-2"
    classes = {"GPT2LMHeadModel": "lm", "GPT2Model": "base", "GPT2ForSequenceClassification": "cls"}
    base_prefix = "transformer."
    guess_rank = 0  # learned positions

    def guess(self, c: ModelConfig) -> bool:
        return c.position != "rope"

    def config_from_hf(self, hf: dict[str, Any], *, arch: str, head: str, extra: dict[str, Any], pad: int,
                       where: str) -> ModelConfig:
        return _config_from_hf(hf, extra=extra, pad=pad)

    def config_to_hf(self, c: ModelConfig, arch: str) -> dict[str, Any]:
        return _config_to_hf(c)

    def entries(self, c: ModelConfig, head: str) -> list[Entry | Stacked | Fused]:
        return list(_entries(c, head))


def _config_from_hf(hf: dict[str, Any], *, extra: dict[str, Any], pad: int) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx", False) or not hf.get("scale_attn_weights", True):
        raise ValueError("GPT-2 configs with scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False "
                         "are not supported")
    if hf.get("add_cross_attention", False):
        raise ValueError("GPT-2 with cross attention is not supported")
    h = int(hf.get("n_embd", 768))
    return ModelConfig(
        family="decoder", vocab_size=int(hf.get("vocab_size", 50257)), hidden_size=h,
        num_layers=int(hf.get("n_layer", 12)), num_heads=int(hf.get("n_head", 12)),
        intermediate_size=int(hf.get("n_inner") or 4 * h),
        max_position_embeddings=int(hf.get("n_positions", 1024)), norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=plain_act(hf.get("activation_function", "gelu_new")),  # type: ignore[arg-type]
        position="learned", attention_bias=True, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pre_norm=True, embedding_norm=False,
        final_norm=True, dropout=float(hf.get("resid_pdrop", 0.1)),
        initializer_range=float(hf.get("initializer_range", 0.02)), pad_token_id=pad, extra=extra,
    )


def _config_to_hf(c: ModelConfig) -> dict[str, Any]:
    return dict(
        vocab_size=c.vocab_size, n_positions=c.max_position_embeddings, n_embd=c.hidden_size, n_layer=c.num_layers,
        n_head=c.num_heads, n_inner=c.intermediate_size, activation_function=PLAIN_ACT_TO_HF.get(c.activation,
                                                                                                  c.activation),
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=c.norm_eps,
        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        tie_word_embeddings=c.tie_embeddings,
    )


def _t(x: Tensor) -> Tensor:
    return x.t().contiguous()


def _conv1d(hf: str, ours: str) -> list[Entry]:
    """GPT-2 Conv1D: weight stored [in, out] -> nn.Linear [out, in]."""
    return [
        Entry(f"{hf}.weight", (f"{ours}.weight",), split=lambda w: (_t(w),), merge=lambda ws: _t(ws[0])),
        Entry(f"{hf}.bias", (f"{ours}.bias",)),
    ]


def _entries(c: ModelConfig, head: str) -> list[Entry]:
    e = lin("wte", "embed_tokens", False) + lin("wpe", "embed_positions", False)
    for i in range(c.num_layers):
        p, q = f"h.{i}", f"layers.{i}"
        a_ = f"{q}.self_attn"
        e.append(Entry(
            f"{p}.attn.c_attn.weight", tuple(f"{a_}.{n}_proj.weight" for n in "qkv"),
            split=lambda w: [x.contiguous() for x in w.t().chunk(3, dim=0)],  # [H, 3H] -> 3 x [H, H]
            merge=lambda ws: torch.cat(list(ws), dim=0).t().contiguous(),
        ))
        e.append(Entry(
            f"{p}.attn.c_attn.bias", tuple(f"{a_}.{n}_proj.bias" for n in "qkv"),
            split=lambda b: [x.clone() for x in b.chunk(3, dim=0)],
            merge=lambda bs: torch.cat(list(bs), dim=0),
        ))
        e += _conv1d(f"{p}.attn.c_proj", f"{a_}.o_proj")
        e += _conv1d(f"{p}.mlp.c_fc", f"{q}.mlp.up_proj")
        e += _conv1d(f"{p}.mlp.c_proj", f"{q}.mlp.down_proj")
        e += lin(f"{p}.ln_1", f"{q}.attn_norm", True)
        e += lin(f"{p}.ln_2", f"{q}.mlp_norm", True)
    e += lin("ln_f", "norm", True)
    return e + head_entries(c, head)


RECORDS = (GPT2(),)
