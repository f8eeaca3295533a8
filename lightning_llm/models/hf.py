"""Conversion between local Hugging Face checkpoints and :class:`DecoderLM` / :class:`EncoderModel`.

Reads ``config.json`` plus ``model.safetensors`` / sharded safetensors (``model.safetensors.index.json``) /
``pytorch_model.bin`` (optionally sharded) from a LOCAL directory; never downloads. Writes ``config.json`` +
``model.safetensors`` that ``transformers.AutoModel*.from_pretrained`` loads.

Supported architectures (``kind`` = weight layout):

* llama:        LlamaForCausalLM, LlamaModel
* qwen2, qwen3, mistral: Qwen2/Qwen3/MistralForCausalLM and their ...Model (LLaMA's names; see ``hf_decoders``)
* baichuan:     BaichuanForCausalLM (Baichuan2-7B: fused ``W_pack``, ``NormHead``; trust_remote_code, so transformers
                itself cannot load what ``save_hf`` writes without Baichuan's modeling files beside it)
* gpt2:         GPT2LMHeadModel, GPT2Model (Conv1D weights are [in, out]; ``c_attn`` is fused q,k,v)
* bert:         BertModel, BertForSequenceClassification (+ BertForMaskedLM/BertForPreTraining as load sources)
* megatron-bert: MegatronBertModel, MegatronBertForSequenceClassification (+ ...ForMaskedLM/ForPreTraining sources)
* roberta:      RobertaModel, RobertaForSequenceClassification (+ RobertaForMaskedLM source)

The mapping is an explicit list of entries (HF key <-> our keys, with split/merge functions), generated from the
config, so missing and unexpected keys are reported by name.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.files import atomic_path, read_json

from .config import ModelConfig
from .decoder import DecoderLM
from .encoder import EncoderModel
from .hf_config import (
    _DEFAULT_ARCH,
    SUPPORTED_ARCHITECTURES,
    _architecture_name,
    config_from_hf,
    config_to_hf,
)
from .hf_decoders import DECODER_KINDS, wpack_from_hf, wpack_to_hf
from .hf_deepseek import MTP_KINDS
from .hf_entries import Entry, Fused, Stacked, lin, moe_mlp_entries
from .hf_source import CheckpointFiles, HFWeightsSource, Mapped, StackedMapped
from .init import materialize

log = logging.getLogger(__name__)

__all__ = ["load_hf", "save_hf", "config_from_hf", "config_to_hf", "SUPPORTED_ARCHITECTURES"]

_BASE_PREFIX = {**{k: "model." for k in DECODER_KINDS}, "gpt2": "transformer.", "bert": "bert.", "megatron-bert": "bert.",
                "roberta": "roberta."}

# Checkpoint keys that carry no weights we need (buffers that old versions persisted).
_IGNORED = re.compile(
    r"(^|\.)attn\.(masked_)?bias$|(^|\.)position_ids$|(^|\.)token_type_ids$|(^|\.)rotary_emb\.inv_freq$"
)
# Head weights of other tasks: dropped with a warning (e.g. an MLM head when loading a backbone).
_HEAD_KEYS = {
    **{k: re.compile(r"^score\.") for k in DECODER_KINDS},
    "gpt2": re.compile(r"^score\."),
    "bert": re.compile(r"^(cls|classifier|pooler)\."),
    "megatron-bert": re.compile(r"^(cls|classifier|pooler)\."),
    "roberta": re.compile(r"^(lm_head|classifier|pooler)\."),
}



# ====================================================================================================================
# Weight mapping
# ====================================================================================================================


_Entry = Entry  # the mapping's entries (hf_entries.py); MoE experts are Stacked entries
_lin = lin


def _t(x: Tensor) -> Tensor:
    return x.t().contiguous()


def _conv1d(hf: str, ours: str) -> list[_Entry]:
    """GPT-2 Conv1D: weight stored [in, out] -> nn.Linear [out, in]."""
    return [
        _Entry(f"{hf}.weight", (f"{ours}.weight",), split=lambda w: (_t(w),), merge=lambda ws: _t(ws[0])),
        _Entry(f"{hf}.bias", (f"{ours}.bias",)),
    ]


def _mla_entries(hf: str, ours: str, c: ModelConfig) -> list[_Entry]:
    """Multi-head Latent Attention's projections and latent norms (``mla.LatentAttention``: transformers' names)."""
    assert c.mla is not None
    bias = c.attention_bias  # on the down-projections from the hidden state (and o_proj: o_bias)
    names = [("q_proj", False)] if c.mla.q_lora_rank is None else [
        ("q_a_proj", bias), ("q_a_layernorm", False), ("q_b_proj", False)]
    names += [("kv_a_proj_with_mqa", bias), ("kv_a_layernorm", False), ("kv_b_proj", False)]
    return [entry for name, b in names for entry in _lin(f"{hf}.{name}", f"{ours}.{name}", b)]


def _entries(config: ModelConfig, architecture: str) -> list[_Entry | Stacked | Fused]:
    a = SUPPORTED_ARCHITECTURES[architecture]
    c = config
    e: list[_Entry | Stacked | Fused] = []
    ab, mb = c.attention_bias, c.mlp_bias
    if a.kind in DECODER_KINDS:
        e += _lin("embed_tokens", "embed_tokens", False)
        n = c.num_heads
        for i in range(c.num_layers):
            p, q = f"layers.{i}", f"layers.{i}"
            if c.mla is not None:
                e += _mla_entries(f"{p}.self_attn", f"{q}.self_attn", c)
            elif c.qkv_packed:  # [q; k; v] rows in the checkpoint, head-interleaved in our W_pack (layers.Attention)
                for t in ("weight", "bias") if ab else ("weight",):
                    e.append(_Entry(f"{p}.self_attn.W_pack.{t}", (f"{q}.self_attn.W_pack.{t}",),
                                    split=lambda w, n=n: (wpack_from_hf(w, n),),
                                    merge=lambda ws, n=n: wpack_to_hf(ws[0], n)))
            else:
                for name in ("q_proj", "k_proj", "v_proj"):
                    e += _lin(f"{p}.self_attn.{name}", f"{q}.self_attn.{name}", ab)
            e += _lin(f"{p}.self_attn.o_proj", f"{q}.self_attn.o_proj", bool(c.o_bias))
            if c.qk_norm:
                e += _lin(f"{p}.self_attn.q_norm", f"{q}.self_attn.q_norm", False)
                e += _lin(f"{p}.self_attn.k_norm", f"{q}.self_attn.k_norm", False)
            if c.attention_sinks:  # gpt-oss: a bare [N] tensor, our AttentionSinks module's weight
                e.append(_Entry(f"{p}.self_attn.sinks", (f"{q}.self_attn.sinks.weight",)))
            if i in c.moe_layers:
                e += moe_mlp_entries(c, a.kind, i)
            else:
                for name in (("gate_proj", "up_proj", "down_proj") if c.gated else ("up_proj", "down_proj")):
                    e += _lin(f"{p}.mlp.{name}", f"{q}.mlp.{name}", mb)
            e += _lin(f"{p}.input_layernorm", f"{q}.attn_norm", False)
            e += _lin(f"{p}.post_attention_layernorm", f"{q}.mlp_norm", False)
        e += _lin("norm", "norm", False)
        if a.head != "base":  # Baichuan's NormHead stores the raw weight too (normalised in forward)
            e += _lin("lm_head", "lm_head", False, group="lm_head", top=True)
        return e
    if a.kind == "gpt2":
        e += _lin("wte", "embed_tokens", False)
        e += _lin("wpe", "embed_positions", False)
        for i in range(c.num_layers):
            p, q = f"h.{i}", f"layers.{i}"
            a_ = f"{q}.self_attn"
            e.append(_Entry(
                f"{p}.attn.c_attn.weight", tuple(f"{a_}.{n}_proj.weight" for n in "qkv"),
                split=lambda w: [x.contiguous() for x in w.t().chunk(3, dim=0)],  # [H, 3H] -> 3 x [H, H]
                merge=lambda ws: torch.cat(list(ws), dim=0).t().contiguous(),
            ))
            e.append(_Entry(
                f"{p}.attn.c_attn.bias", tuple(f"{a_}.{n}_proj.bias" for n in "qkv"),
                split=lambda b: [x.clone() for x in b.chunk(3, dim=0)],
                merge=lambda bs: torch.cat(list(bs), dim=0),
            ))
            e += _conv1d(f"{p}.attn.c_proj", f"{a_}.o_proj")
            e += _conv1d(f"{p}.mlp.c_fc", f"{q}.mlp.up_proj")
            e += _conv1d(f"{p}.mlp.c_proj", f"{q}.mlp.down_proj")
            e += _lin(f"{p}.ln_1", f"{q}.attn_norm", True)
            e += _lin(f"{p}.ln_2", f"{q}.mlp_norm", True)
        e += _lin("ln_f", "norm", True)
        if a.head != "base":
            e += _lin("lm_head", "lm_head", False, group="lm_head", top=True)
        return e

    # encoders
    megatron = a.kind == "megatron-bert"
    e += _lin("embeddings.word_embeddings", "embed_tokens", False)
    e += _lin("embeddings.position_embeddings", "embed_positions", False)
    if c.type_vocab_size > 0:
        e += _lin("embeddings.token_type_embeddings", "embed_token_types", False)
    if c.embedding_norm:
        e += _lin("embeddings.LayerNorm", "embed_norm", True)
    for i in range(c.num_layers):
        p, q = f"encoder.layer.{i}", f"layers.{i}"
        for hn, n in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            e += _lin(f"{p}.attention.self.{hn}", f"{q}.self_attn.{n}", ab)
        e += _lin(f"{p}.attention.output.dense", f"{q}.self_attn.o_proj", ab)
        e += _lin(f"{p}.intermediate.dense", f"{q}.mlp.up_proj", mb)
        e += _lin(f"{p}.output.dense", f"{q}.mlp.down_proj", mb)
        if megatron:
            e += _lin(f"{p}.attention.ln", f"{q}.attn_norm", True)
            e += _lin(f"{p}.ln", f"{q}.mlp_norm", True)
        else:
            e += _lin(f"{p}.attention.output.LayerNorm", f"{q}.attn_norm", True)
            e += _lin(f"{p}.output.LayerNorm", f"{q}.mlp_norm", True)
    if megatron and c.final_norm:
        e += _lin("encoder.ln", "final_norm", True)
    if c.pooler:
        if a.kind == "roberta" and a.head == "cls":
            e += _lin("classifier.dense", "pooler", True, group="pooler", top=True)
        else:
            e += _lin("pooler.dense", "pooler", True, group="pooler")
    if c.num_labels > 0 and a.head in ("cls", "base", "mlm"):
        name = "classifier.out_proj" if a.kind == "roberta" else "classifier"
        e += _lin(name, "classifier", True, group="classifier", top=True)
    return e


# ====================================================================================================================
# Reading checkpoints
# ====================================================================================================================


def _normalized_keys(keys: list[str], kind: str) -> dict[str, str]:
    """Checkpoint key -> key without the base-model prefix (``model.``, ``transformer.``, ``bert.``, ``roberta.``)
    and old gamma/beta names, as ``{normalized: stored}``."""
    prefix = _BASE_PREFIX[kind]
    out: dict[str, str] = {}
    for k in keys:
        k2 = k[len(prefix):] if k.startswith(prefix) else k
        k2 = re.sub(r"(LayerNorm|\bln(_\w+)?)\.gamma$", r"\1.weight", k2)
        k2 = re.sub(r"(LayerNorm|\bln(_\w+)?)\.beta$", r"\1.bias", k2)
        out[k2] = k
    return out


def _map_to_ours(
    files: CheckpointFiles, config: ModelConfig, architecture: str, where: str
) -> tuple[dict[str, Mapped], dict[str, tuple[int, ...]]]:
    """Where each of our parameters is stored, and its shape after conversion (from the stored shapes, nothing
    read). Raises on missing or unexpected keys; parameters left out are initialised fresh (heads)."""
    kind = SUPPORTED_ARCHITECTURES[architecture].kind
    stored = _normalized_keys(files.keys(), kind)
    mapping: dict[str, Mapped] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    used: set[str] = set()
    missing: list[str] = []
    fresh: list[str] = []
    for e in _entries(config, architecture):
        if isinstance(e, Stacked):
            _map_stacked(e, files, stored, mapping, shapes, used, missing)
            continue
        if isinstance(e, Fused):
            found = e.locate(files, stored)
            if found is None:
                missing.append(e.hf)
            else:
                mapping[e.ours], shapes[e.ours], keys = found  # type: ignore[assignment]
                used.update(keys)
            continue
        if e.group == "lm_head" and config.tie_embeddings:
            used.add(e.hf)  # tied: a stored copy (if any) is redundant
            continue
        if e.hf not in stored:
            if e.group in ("lm_head", "pooler", "classifier"):
                fresh.extend(e.ours)  # HF also initialises these freshly (with a warning)
            else:
                missing.append(e.hf)
            continue
        used.add(e.hf)
        meta = files.meta(stored[e.hf])
        parts = e.split(meta) if e.split is not None else (meta,)  # on meta tensors: shapes only
        for i, (name, part) in enumerate(zip(e.ours, parts)):
            mapping[name] = Mapped(stored[e.hf], i, e.split)
            shapes[name] = tuple(part.shape)
    rest = [k for k in stored if k not in used and not _IGNORED.search(k)]
    heads = [k for k in rest if _HEAD_KEYS[kind].match(k)]
    mtp = [k for k in rest if kind in MTP_KINDS and (m := re.match(r"layers\.(\d+)\.", k)) is not None
           and int(m.group(1)) >= config.num_layers]
    if mtp:  # as transformers: DeepSeek-V3's and GLM-4.5's multi-token-prediction layers are not built
        log.warning("%s: ignoring %d keys of the multi-token-prediction layers (num_nextn_predict_layers), which "
                    "transformers does not build either", where, len(mtp))
    unexpected = [k for k in rest if k not in heads and k not in mtp]
    if missing or unexpected:
        parts_ = []
        if missing:
            parts_.append(f"missing keys ({len(missing)}): {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            parts_.append(f"unexpected keys ({len(unexpected)}): {unexpected[:20]}"
                          f"{' ...' if len(unexpected) > 20 else ''}")
        raise ValueError(f"{where}: checkpoint does not match a {architecture} with this config: " + "; ".join(parts_))
    if heads:
        log.warning("%s: ignoring head weights not used by this model: %s", where, sorted(heads))
    if fresh:
        log.warning("%s: newly initialised (not in checkpoint): %s", where, fresh)
    return mapping, shapes


def _map_stacked(e: Stacked, files: CheckpointFiles, stored: dict[str, str], mapping: dict[str, Mapped],
                 shapes: dict[str, tuple[int, ...]], used: set[str], missing: list[str]) -> None:
    """Where a fused expert tensor is stored: one HF key per expert and part, each read on its own."""
    absent = [k for k in e.keys() if k not in stored]
    used.update(k for k in e.keys() if k in stored)
    if absent:
        missing.extend(absent)
        return
    parts = [[tuple(files.meta(stored[k]).shape) for k in keys] for keys in e.hf]
    rows = tuple(s[0] for s in parts[0])
    if any(tuple(s[0] for s in p) != rows or {s[1:] for s in p} != {parts[0][0][1:]} for p in parts):
        raise ValueError(f"{e.ours}: the experts' stored tensors differ in shape: {parts}")
    mapping[e.ours] = StackedMapped(tuple(tuple(stored[k] for k in keys) for keys in e.hf), rows)
    shapes[e.ours] = (len(e.hf), sum(rows), *parts[0][0][1:])


def _resolve_dtype(dtype: torch.dtype | str | None, hf: dict[str, Any]) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    d = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return d


def _checked_mapping(model: nn.Module, mapping: dict[str, Mapped], shapes: dict[str, tuple[int, ...]],
                     where: str) -> dict[str, Mapped]:
    """Compare the stored shapes with the model's; a classifier of another ``num_labels`` is initialised fresh."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bad: list[str] = []
    out = dict(mapping)
    for k, shape in shapes.items():
        want = expected.get(k)
        if want is None:
            bad.append(f"{k}: in the checkpoint mapping but not in the model")
        elif shape != want:
            if k.startswith("classifier."):
                log.warning("%s: %s has shape %s, model needs %s (num_labels changed): re-initialising",
                            where, k, shape, want)
                del out[k]
            else:
                bad.append(f"{k}: checkpoint {shape} vs model {want}")
    if bad:
        raise ValueError(f"{where}: shape mismatch: " + "; ".join(bad))
    if getattr(model.config, "tie_embeddings", False) and "embed_tokens.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]  # a pipeline's last stage holds the tied head alone
    return out


def load_hf(
    path: str | os.PathLike[str],
    *,
    family: str | None = None,
    dtype: torch.dtype | str | None = None,
    lazy: bool = False,
    **config_overrides: Any,
) -> tuple[nn.Module, ModelConfig]:
    """Load a local HF checkpoint directory as (DecoderLM | EncoderModel, ModelConfig), in eval mode (as
    transformers' ``from_pretrained``; Lightning switches to train mode in ``fit``).

    ``dtype``: None -> torch's default dtype (float32 unless a precision context set another), ``"auto"`` -> the
    checkpoint's dtype, or a torch dtype / its name. ``config_overrides`` are applied to the converted config (e.g.
    ``num_labels=3`` to add a fresh classifier, ``dropout=0.0``); overrides that change tensor shapes (other than
    ``num_labels``) fail with the mismatching keys. Parameters the checkpoint lacks (a fresh head) get the family's
    init (:mod:`.init`).

    ``lazy=True``: the model stays on the meta device with ``weights_source`` set, names and shapes already checked;
    :func:`~lightning_llm.models.init.materialize` (which a sharding strategy calls after splitting and sharding)
    then reads only the elements each rank holds.
    """
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"load_hf: checkpoint directory {str(d)!r} does not exist")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"load_hf: {str(cfg_file)!r} not found")
    hf = read_json(cfg_file)
    arch = _architecture_name(hf, where=str(cfg_file))
    config = config_from_hf(hf, where=str(cfg_file))
    if config_overrides.get("num_labels", 0) > 0 and "pooler" not in config_overrides:
        config_overrides = {**config_overrides, "pooler": True}  # HF classification heads sit on the pooler
    if config_overrides:
        config = config.replace(**config_overrides)
    if family is not None and config.family != family:
        raise ValueError(f"load_hf: {str(d)!r} holds a {config.family} ({arch}), but family={family!r} was requested")
    target = _resolve_dtype(dtype, hf)
    files = CheckpointFiles(d)
    mapping, shapes = _map_to_ours(files, config, arch, where=str(d))
    cls = DecoderLM if config.family == "decoder" else EncoderModel
    with torch.device("meta"):
        model = cls(config).to(target)
    model.weights_source = HFWeightsSource(files, _checked_mapping(model, mapping, shapes, str(d)), where=str(d))
    if not lazy:
        materialize(model, "cpu")
        model.weights_source = None
    model.eval()  # as transformers' from_pretrained: dropout off until a trainer switches to train mode
    log.info("%s %s from %s (%s, %d layers, dtype %s)", "indexed" if lazy else "loaded", arch, d, config.family,
             config.num_layers, target)
    return model, config


# ====================================================================================================================
# Saving
# ====================================================================================================================


def _save_entries(config: ModelConfig, architecture: str, sd: dict[str, Tensor]) -> list[_Entry]:
    """The entries of :func:`_entries` with each fused expert tensor written per expert and part (the rows of an
    expert's gate and up projections: half each)."""
    out: list[_Entry] = []
    for e in _entries(config, architecture):
        if isinstance(e, Fused):
            out.append(e.save_entry())
        elif isinstance(e, Stacked):
            t = sd.get(e.ours)
            if t is None:
                out.append(_Entry(e.hf[0][0], (e.ours,)))  # reported missing below
                continue
            out += e.save_entries([t.shape[1] // len(e.hf[0])] * len(e.hf[0]))
        else:
            out.append(e)
    return out


def default_architecture(config: ModelConfig) -> str:
    """HF architecture a model is saved as by default (from ``extra['hf_model_type']`` or the config's shape)."""
    kind = (config.extra or {}).get("hf_model_type")
    if kind not in _DEFAULT_ARCH:
        if config.family == "decoder":
            kind = _decoder_kind(config)
        elif config.pre_norm:
            kind = "megatron-bert"
        else:
            kind = "roberta" if config.position_offset > 0 else "bert"
    if config.family == "decoder" or kind in DECODER_KINDS + ("gpt2",):
        return _DEFAULT_ARCH[kind]
    names = {
        ("bert", False): "BertModel", ("bert", True): "BertForSequenceClassification",
        ("megatron-bert", False): "MegatronBertModel", ("megatron-bert", True): "MegatronBertForSequenceClassification",
        ("roberta", False): "RobertaModel", ("roberta", True): "RobertaForSequenceClassification",
    }
    return names[(kind, config.num_labels > 0)]


def _decoder_kind(config: ModelConfig) -> str:
    """The HF family a decoder of no recorded origin is saved as: the one whose switches it uses."""
    if config.position != "rope":
        return "gpt2"
    if config.mla is not None:
        return "deepseek_v3"
    if config.qkv_packed or config.norm_head:
        return "baichuan"
    if config.attention_sinks:
        return "gpt_oss"
    if config.qk_norm and config.qk_norm_over == "projection":
        return "olmoe"
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias and not config.o_bias:
        return "qwen2"
    if config.sliding_layers:
        return "mistral"
    return "llama"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    with atomic_path(path) as tmp:
        write(tmp)


_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def _size_bytes(size: int | str) -> int:
    """``5GB`` (decimal, as transformers), ``5GiB``, or a byte count."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: expected a byte count or a size such as 500MB / 5GB / 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2) or "B"])


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Keys grouped in file order, each group at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, n in sizes.items():
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    return groups


@torch.no_grad()
def save_hf(model: nn.Module, path: str | os.PathLike[str], *, architecture: str | None = None,
            max_shard_size: int | str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``transformers`` (the model must be whole).

    ``max_shard_size`` (e.g. ``"5GB"``): split the weights into ``model-0000i-of-0000n.safetensors`` files of at most
    that size plus ``model.safetensors.index.json``, as ``save_pretrained`` does; each file is converted and written
    on its own, so saving holds one file's tensors besides the model."""
    from safetensors.torch import save_file

    config: ModelConfig = model.config  # type: ignore[assignment]
    arch = architecture or default_architecture(config)
    a = SUPPORTED_ARCHITECTURES.get(arch)
    if a is None or a.head == "mlm":
        raise ValueError(f"save_hf: cannot save as {arch!r}")
    if (a.kind in DECODER_KINDS + ("gpt2",)) != (config.family == "decoder"):
        raise ValueError(f"save_hf: a {config.family} model cannot be saved as {arch}")
    sd = model.state_dict()
    dtypes = {t.dtype for t in sd.values() if t.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    hf_cfg = config_to_hf(config, arch, dtype=dtype)
    prefix = _BASE_PREFIX[a.kind] if a.head != "base" else ""
    plan: dict[str, tuple[_Entry, list[Tensor]]] = {}  # HF key -> (entry, our tensors)
    missing: list[str] = []
    for e in _save_entries(config, arch, sd):
        if e.group == "lm_head" and config.tie_embeddings:
            continue  # HF re-ties from tie_word_embeddings
        if e.group == "classifier" and a.head != "cls":
            continue
        absent = [n for n in e.ours if n not in sd]
        if absent:
            missing.extend(absent)
            continue
        plan[e.hf if e.top else prefix + e.hf] = (e, [sd[n] for n in e.ours])
    if missing:
        raise ValueError(f"save_hf: model lacks {missing[:20]} (a pipeline stage or sharded model? save the whole model)")

    def converted(keys: list[str]) -> dict[str, Tensor]:
        out = {}
        for key in keys:
            e, ts = plan[key]
            t = e.merge(ts) if e.merge is not None else ts[0]
            out[key] = t.detach().to("cpu").contiguous().clone()
        return out

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    sizes = {k: sum(t.numel() * t.element_size() for t in ts) for k, (_, ts) in plan.items()}
    groups = _shards(sizes, _size_bytes(max_shard_size)) if max_shard_size is not None else [list(plan)]
    meta = {"format": "pt"}
    if len(groups) == 1:
        _atomic_write(d / "model.safetensors", lambda p: save_file(converted(groups[0]), p, metadata=meta))
        stale = [d / "model.safetensors.index.json", *d.glob("model-*-of-*.safetensors")]
    else:
        names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for name, keys in zip(names, groups):
            _atomic_write(d / name, lambda p, keys=keys: save_file(converted(keys), p, metadata=meta))
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {k: name for name, keys in zip(names, groups) for k in keys}}
        _atomic_write(d / "model.safetensors.index.json",
                      lambda p: Path(p).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n"))
        stale = [d / "model.safetensors", *(f for f in d.glob("model-*-of-*.safetensors") if f.name not in names)]
    for f in stale:  # a previous save in the other layout would shadow or contradict this one
        f.unlink(missing_ok=True)
    _atomic_write(d / "config.json", lambda p: Path(p).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n"))
    log.info("saved %s (%d tensors in %d file(s)) to %s", arch, len(plan), len(groups), d)
    return d
