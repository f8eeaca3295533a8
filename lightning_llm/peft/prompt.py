"""Prompt-learning PEFT methods: a frozen decoder plus learned virtual tokens (peft's prompt tuning, P-tuning) or
learned per-layer key/value prefixes (peft's prefix tuning).

Each wrapper keeps the decoder in ``.base`` and its trainable module in ``.prompt`` (peft's own ``PromptEmbedding``,
``PromptEncoder`` or ``PrefixEncoder``), and has the :class:`~lightning_llm.models.DecoderLM` call protocol, so
tasks and generation use it unchanged; outputs line up with ``input_ids`` (no virtual positions).

What each does is exactly what ``peft.PeftModelForCausalLM`` does on a ``LlamaForCausalLM``:

* **prompt tuning / P-tuning**: ``n`` embeddings are prepended to the input embeddings; virtual tokens take
  positions ``0..n-1``, real tokens are shifted by ``n``; the attention mask gets ``n`` ones in front.
* **prefix tuning**: a table ``[n, num_layers * 2 * K * D]`` (K key/value heads: GQA sizes it to the kv heads) is
  viewed as per-layer keys and values ``[B, K, n, D]`` that sit in the KV cache before the first token, as HF's
  cache does (no rotary applied to them). Real tokens then take positions ``n..n+S-1`` (the cache's length, as HF
  counts them) and the mask gets ``n`` ones in front. The prefix is a :class:`~lightning_llm.models.layers.block.KVCache`
  filled in advance, so the decoder needs no PEFT-specific code.

Initial values are peft's (torch's default init of its modules) drawn from a generator seeded by the backbone's
``init_seed``: the same adapter whatever torch's generator state.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.models.init import name_seed
from lightning_llm.models.layers.block import KVCache

log = logging.getLogger(__name__)

__all__ = ["PROMPT_METHODS", "PTuningLM", "PrefixTuningLM", "PromptLearningLM", "PromptTuningLM",
           "build_prompt_model", "peft_prompt_config", "prompt_table"]

PROMPT_METHODS = ("prompt_tuning", "p_tuning", "prefix_tuning")
# PromptLearningConfig fields the wrapper derives from the model (or that do not apply to a causal LM): not options.
_DERIVED = ("task_type", "peft_type", "num_virtual_tokens", "token_dim", "num_layers", "num_attention_heads",
            "num_transformer_submodules", "inference_mode", "base_model_name_or_path", "revision")


def _peft_config_class(method: str) -> Any:
    import peft

    return {"prompt_tuning": peft.PromptTuningConfig, "p_tuning": peft.PromptEncoderConfig,
            "prefix_tuning": peft.PrefixTuningConfig}[method]


def check_prompt_options(method: str, options: dict[str, Any]) -> None:
    """Refuse ``peft.options`` the peft config class of ``method`` does not have, or that are derived here."""
    import dataclasses

    cls = _peft_config_class(method)
    fields = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(k for k in options if k not in fields or k in _DERIVED)
    if bad:
        allowed = sorted(fields - set(_DERIVED) - {"auto_mapping", "peft_version", "modules_to_save"})
        raise ValueError(f"peft.options {bad} do not apply to peft.method={method} (its options: {allowed}; "
                         f"num_virtual_tokens is peft.num_virtual_tokens, the sizes come from the model)")
    if method == "p_tuning":
        kind = str(options.get("encoder_reparameterization_type", "MLP"))
        if kind not in ("MLP", "LSTM"):
            raise ValueError(f"peft.options.encoder_reparameterization_type={kind!r}: choose MLP or LSTM")


def peft_prompt_config(method: str, num_virtual_tokens: int, options: dict[str, Any], model_config: Any,
                       *, prompt_init: str = "vocab") -> Any:
    """peft's config of ``method`` sized for our decoder, as ``peft.utils.other._prepare_prompt_learning_config``
    sizes it for the HF model: ``token_dim`` = hidden size, ``num_layers``, heads; for prefix tuning ``token_dim``
    = K * D and ``num_attention_heads`` = K (the key/value heads); ``encoder_hidden_size`` defaults to
    ``token_dim``."""
    c = model_config
    kw: dict[str, Any] = dict(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens,
                              token_dim=c.hidden_size, num_layers=c.num_layers, num_attention_heads=c.num_heads,
                              num_transformer_submodules=1)
    if method == "prefix_tuning":
        if getattr(c, "mla", None) is not None:
            raise ValueError("peft.method=prefix_tuning is not supported for Multi-head Latent Attention models "
                             "(DeepSeek-V2/V3): their cache holds compressed latents, not per-head keys and values for "
                             "a prefix; use lora, prompt_tuning or p_tuning")
        kw.update(token_dim=c.num_kv_heads * c.head_dim, num_attention_heads=c.num_kv_heads)
    if method == "prompt_tuning":
        kw["prompt_tuning_init"] = "SAMPLE_VOCAB" if prompt_init == "vocab" else "RANDOM"
    kw.update(options)
    cfg = _peft_config_class(method)(**kw)
    if getattr(cfg, "encoder_hidden_size", 0) is None:
        cfg.encoder_hidden_size = cfg.token_dim
    return cfg


class PromptLearningLM(nn.Module):
    """A frozen decoder ``.base`` with a trainable prompt module ``.prompt`` (see the module docstring)."""

    method: str = ""

    def __init__(self, base: nn.Module, num_virtual_tokens: int) -> None:
        super().__init__()
        self.base = base
        self.num_virtual_tokens = num_virtual_tokens
        for p in base.parameters():
            p.requires_grad_(False)

    @property
    def config(self) -> Any:
        return self.base.config

    def _refuse_packing(self, segment_ids: Tensor | None) -> None:
        """Packed rows are refused: peft prepends one prompt per row and numbers the real tokens after it, so every
        packed example would need its own virtual tokens (or prefix) and positions; one per row is not that."""
        if segment_ids is not None:
            raise ValueError(f"peft.method={self.method} cannot train on packed rows (segment_ids): the virtual "
                             "tokens are prepended once per row, not per example; use --data.packing=false")

    @staticmethod
    def _inputs(x: Tensor, past_real: int, attention_mask: Tensor | None,
                position_ids: Tensor | None) -> tuple[Tensor, Tensor]:
        """Padding mask over real tokens [B, past_real + S] and their positions [B, S] (defaults filled in)."""
        b, s = x.shape[0], x.shape[1]
        if attention_mask is None:
            attention_mask = torch.ones(b, past_real + s, dtype=torch.long, device=x.device)
        if position_ids is None:
            position_ids = torch.arange(past_real, past_real + s, device=x.device).unsqueeze(0).expand(b, s)
        elif position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(b, s)
        return attention_mask, position_ids


class _VirtualTokensLM(PromptLearningLM):
    """Virtual token embeddings [n, H] (from :meth:`virtual_embeddings`) prepended to the input embeddings."""

    def virtual_embeddings(self) -> Tensor:  # [n, H]
        raise NotImplementedError

    def forward(
        self,
        input_ids: Tensor | None = None,  # [B, S]
        *,
        attention_mask: Tensor | None = None,  # [B, T] real tokens only (T = past real + S)
        position_ids: Tensor | None = None,  # [B, S] positions of real tokens (without the virtual offset)
        inputs_embeds: Tensor | None = None,
        kv_cache: KVCache | None = None,
        segment_ids: Tensor | None = None,  # packed rows: refused
        logits_to_keep: int = 0,  # > 0: the last positions' logits only (decoding)
    ) -> Tensor:  # logits [B, S, V]
        self._refuse_packing(segment_ids)
        n = self.num_virtual_tokens
        x = self.base.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, S, H]
        b = x.shape[0]
        first = kv_cache is None or kv_cache.seq_len == 0
        attention_mask, position_ids = self._inputs(x, 0 if first else kv_cache.seq_len - n, attention_mask,
                                                    position_ids)
        mask = torch.cat([attention_mask.new_ones(b, n), attention_mask], dim=1)  # [B, n + T]
        pos = position_ids + n
        if first:
            virtual = self.virtual_embeddings().to(x.dtype).unsqueeze(0).expand(b, n, -1)  # [B, n, H]
            x = torch.cat([virtual, x], dim=1)
            pos = torch.cat([torch.arange(n, device=x.device).unsqueeze(0).expand(b, n), pos], dim=1)
        logits = self.base(inputs_embeds=x, attention_mask=mask, position_ids=pos, kv_cache=kv_cache,
                           logits_to_keep=logits_to_keep)
        return logits[:, n:] if first and not logits_to_keep else logits


class PromptTuningLM(_VirtualTokensLM):
    """Prompt tuning: ``n`` learned input embeddings (peft ``PromptEmbedding``, initialised from sampled vocabulary
    embeddings or at random)."""

    method = "prompt_tuning"

    def __init__(self, base: nn.Module, num_virtual_tokens: int, *, init: str = "vocab") -> None:
        super().__init__(base, num_virtual_tokens)
        from peft.tuners.prompt_tuning import PromptEmbedding

        cfg = peft_prompt_config("prompt_tuning", num_virtual_tokens, {}, base.config, prompt_init=init)
        self.prompt = PromptEmbedding(cfg, base.embed_tokens)  # .embedding: nn.Embedding [n, H]
        self.register_buffer("prompt_ids", torch.arange(num_virtual_tokens), persistent=False)

    def virtual_embeddings(self) -> Tensor:
        return self.prompt(self.prompt_ids)


class PTuningLM(_VirtualTokensLM):
    """P-tuning (peft ``PromptEncoder``): ``n`` embeddings re-parameterised by an MLP (or a bidirectional LSTM and an
    MLP), prepended to the inputs."""

    method = "p_tuning"

    def __init__(self, base: nn.Module, num_virtual_tokens: int, *, options: dict[str, Any] | None = None) -> None:
        super().__init__(base, num_virtual_tokens)
        from peft.tuners.p_tuning import PromptEncoder

        self.peft_config = peft_prompt_config("p_tuning", num_virtual_tokens, dict(options or {}), base.config)
        with _seeded(base, "prompt"):
            self.prompt = PromptEncoder(self.peft_config)
        self.register_buffer("prompt_ids", torch.arange(num_virtual_tokens), persistent=False)

    def virtual_embeddings(self) -> Tensor:
        return self.prompt(self.prompt_ids[None])[0]  # as peft: one row through the encoder (the LSTM runs over n)


class PrefixTuningLM(PromptLearningLM):
    """Prefix tuning (peft ``PrefixEncoder``): per-layer key/value prefixes ``[B, K, n, D]`` pre-filled into the
    KV cache of every attention layer (optionally from an MLP ``prefix_projection``)."""

    method = "prefix_tuning"

    def __init__(self, base: nn.Module, num_virtual_tokens: int, *, options: dict[str, Any] | None = None) -> None:
        super().__init__(base, num_virtual_tokens)
        from peft.tuners.prefix_tuning import PrefixEncoder

        linear = getattr(getattr(base, "config", None), "linear_layers", ())
        if linear:
            raise ValueError(f"peft.method=prefix_tuning: layers {list(linear)} are Gated DeltaNet layers (Qwen3.5, "
                             "Qwen3-Next), which keep a recurrent state, not keys and values a prefix could fill; use "
                             "prompt_tuning, p_tuning or lora")
        attn = self._attention_modules()
        if not attn or any(a is None for a in attn):
            raise ValueError("peft.method=prefix_tuning needs a decoder whose layers all have self_attn (got "
                             f"{type(base).__name__})")
        if len(attn) != base.config.num_layers:
            raise ValueError(f"peft.method=prefix_tuning: the decoder holds {len(attn)} of its "
                             f"{base.config.num_layers} layers (a pipeline stage): prefixes need the whole model")
        self.peft_config = peft_prompt_config("prefix_tuning", num_virtual_tokens, dict(options or {}), base.config)
        with _seeded(base, "prompt"):
            self.prompt = PrefixEncoder(self.peft_config)
        self.register_buffer("prompt_ids", torch.arange(num_virtual_tokens), persistent=False)

    def _attention_modules(self) -> list[Any]:
        """The attention module of every layer, in order (looked up per call: the cache is keyed by identity)."""
        layers = getattr(self.base, "layers", None)
        if not isinstance(layers, nn.ModuleDict):
            return []
        return [getattr(layers[k], "self_attn", None) for k in sorted(layers, key=int)]

    def table(self) -> Tensor:  # [n, num_layers * 2 * K * D]
        return self.prompt(self.prompt_ids[None])[0]

    def _fill(self, cache: KVCache, batch: int, dtype: torch.dtype) -> None:
        """Put every layer's prefix keys/values [B, K, n, D] into ``cache`` (peft's view of the table: columns
        ordered (layer, key|value, head, dim))."""
        c, n = self.config, self.num_virtual_tokens
        kv = self.table().to(dtype).view(n, c.num_layers * 2, c.num_kv_heads, c.head_dim)
        kv = kv.permute(1, 2, 0, 3).unsqueeze(1).expand(-1, batch, -1, -1, -1)  # [2L, B, K, n, D]
        for i, attn in enumerate(self._attention_modules()):
            cache.update(attn, kv[2 * i], kv[2 * i + 1])
        cache.seq_len = n

    def forward(
        self,
        input_ids: Tensor | None = None,  # [B, S]
        *,
        attention_mask: Tensor | None = None,  # [B, T] real tokens only (T = past real + S)
        position_ids: Tensor | None = None,  # [B, S] positions of real tokens (peft adds n, as here)
        inputs_embeds: Tensor | None = None,
        kv_cache: KVCache | None = None,
        segment_ids: Tensor | None = None,  # packed rows: refused
        logits_to_keep: int = 0,  # > 0: the last positions' logits only (decoding)
    ) -> Tensor:  # logits [B, S, V]
        self._refuse_packing(segment_ids)
        n = self.num_virtual_tokens
        x = input_ids if inputs_embeds is None else inputs_embeds
        assert x is not None, "PrefixTuningLM.forward needs input_ids or inputs_embeds"
        b = x.shape[0]
        if kv_cache is None:
            cache: KVCache = _PrefixCache()  # a whole-sequence forward: nothing is kept beyond this call
        else:
            cache = kv_cache
        if cache.seq_len == 0:
            dtype = self.base.embed_tokens.weight.dtype if inputs_embeds is None else inputs_embeds.dtype
            self._fill(cache, b, dtype)
        attention_mask, position_ids = self._inputs(x, cache.seq_len - n, attention_mask, position_ids)
        mask = torch.cat([attention_mask.new_ones(b, n), attention_mask], dim=1)  # [B, n + T]
        return self.base(input_ids, inputs_embeds=inputs_embeds, attention_mask=mask, position_ids=position_ids + n,
                         kv_cache=cache, logits_to_keep=logits_to_keep)


class _PrefixCache(KVCache):
    """A cache holding only the prefix for one whole-sequence forward: ``update`` returns prefix + new keys/values
    without storing them, so a block recomputed by activation checkpointing sees the same prefix again."""

    def update(self, owner: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        past = self._kv.get(id(owner))
        if past is None:  # the prefix itself (filled first)
            self._kv[id(owner)] = (k, v)
            return k, v
        return torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)


class _seeded:
    """Run a peft module's default init from a generator seeded by the backbone's ``init_seed`` and ``name``."""

    def __init__(self, base: nn.Module, name: str) -> None:
        seed = int(getattr(base, "init_seed", 0))
        self._seed = name_seed(seed, name) % 2**63
        self._fork = torch.random.fork_rng(devices=[])
        # Built on the CPU, from the CPU generator (the same values wherever the model runs; the strategy moves it
        # with the model), never on the meta device, where nothing would give the adapter its values.
        self._device = torch.device("cpu")

    def __enter__(self) -> None:
        self._fork.__enter__()
        torch.manual_seed(self._seed)
        self._device.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._device.__exit__(*exc)
        self._fork.__exit__(*exc)


def build_prompt_model(model: nn.Module, method: str, num_virtual_tokens: int, *, options: dict[str, Any],
                       prompt_init: str) -> PromptLearningLM:
    """The prompt-learning wrapper of ``method`` around the (frozen) decoder ``model``."""
    if getattr(model, "embed_tokens", None) is None:
        raise ValueError(f"peft.method={method} needs a decoder with embed_tokens (a whole model, not a later "
                         "pipeline stage)")
    if method == "prompt_tuning":
        return PromptTuningLM(model, num_virtual_tokens, init=prompt_init)
    if method == "p_tuning":
        return PTuningLM(model, num_virtual_tokens, options=options)
    if method == "prefix_tuning":
        return PrefixTuningLM(model, num_virtual_tokens, options=options)
    raise ValueError(f"peft.method={method} is not a prompt-learning method")


@torch.no_grad()
def prompt_table(model: PromptLearningLM) -> Tensor:
    """What peft saves as ``prompt_embeddings``: the virtual token embeddings [n, H] (prompt tuning, P-tuning: the
    encoder's output) or the prefix table [n, num_layers * 2 * K * D], computed in eval mode (no encoder dropout)."""
    was = model.prompt.training
    model.prompt.eval()
    try:
        out = model.table() if isinstance(model, PrefixTuningLM) else model.virtual_embeddings()  # type: ignore
    finally:
        model.prompt.train(was)
    return out.detach().clone()


def check_prompt_layout(method: str, capabilities: Any) -> None:
    """Refuse P-tuning and prefix tuning before training under layouts that split the model (tensor / pipeline
    parallel, ZeRO-3): their wrapper sits outside the backbone the parallel plans shard, and that combination is
    not verified against one device. Data-parallel layouts (ddp, zero1/2) hold the whole model and are fine."""
    if method not in ("p_tuning", "prefix_tuning"):
        return
    if capabilities.deferred_init or capabilities.batch_shared or capabilities.pipelined:
        raise ValueError(f"peft.method={method} runs under data-parallel layouts only (ddp, zero1, zero2): this "
                         "strategy splits the model (tensor/pipeline parallel or ZeRO-3), which is not supported "
                         "for it")
