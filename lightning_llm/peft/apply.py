"""PEFT methods on our decoder: their configuration (:class:`PeftConfig`), applying them (:func:`apply_peft`), the
adapters' initial values, counting parameters, and activation checkpointing of the blocks.

Injection methods (LoRA, IA3, LoHa, LoKr, ...) use ``peft.inject_adapter_in_model`` on our module tree in place, so
module paths stay ours (``layers.0.self_attn.q_proj.base_layer``, ``...lora_A.default``) and parallel plans keyed by
path still find their modules. Prompt-learning methods (prompt tuning, P-tuning, prefix tuning) wrap the decoder
(:mod:`lightning_llm.peft.prompt`) with peft's own ``PromptEmbedding`` / ``PromptEncoder`` / ``PrefixEncoder``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_llm.models.init import canonical_name, name_seed
from lightning_llm.models.layers.block import TransformerBlock
from lightning_llm.peft.prompt import (
    PROMPT_METHODS,
    PrefixTuningLM,
    build_prompt_model,
    check_prompt_options,
)

log = logging.getLogger(__name__)

__all__ = ["INJECTED_METHODS", "LoraArgs", "PeftConfig", "PeftMethod", "apply_peft", "check_expert_lora",
           "count_parameters",
           "enable_gradient_checkpointing", "init_adapters", "initialises_without_base"]

PeftMethod = Literal["lora", "ia3", "loha", "lokr", "prompt_tuning", "p_tuning", "prefix_tuning"]
INJECTED_METHODS = ("lora", "ia3", "loha", "lokr")


@dataclass
class LoraArgs:
    """LoRA hyper-parameters (``peft.LoraConfig``), e.g. the Chinese-LLaMA-Alpaca-2 recipe: r=64, alpha=128,
    all seven projections targeted, ``modules_to_save=[embed_tokens, lm_head]``."""

    r: int = 8
    """Rank of the update ``B @ A``."""
    alpha: float = 16.0
    """Scale numerator: the update is multiplied by ``alpha / r``."""
    dropout: float = 0.05
    """Dropout on the LoRA branch input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names (suffixes) as in the HF checkpoint: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj (LLaMA, Qwen2, Qwen3, Mistral); Baichuan2 fuses q/k/v into ``W_pack`` (LLaMA-Factory's recipe targets
    ``[W_pack]``: one LoRA on the fused linear, exactly peft's on the HF model)."""
    modules_to_save: list[str] | None = None
    """Modules trained in full and saved with the adapter (e.g. ``[embed_tokens, lm_head]`` for a new vocabulary)."""
    target_parameters: list[str] | None = None
    """Parameters (suffixes) adapted directly, peft's ``target_parameters``: a Mixture-of-Experts model's fused experts
    (``[mlp.experts.gate_up_proj, mlp.experts.down_proj]``, a rank-``r`` update per expert, as peft does on
    transformers' MoE models). One device, ddp, zero1/2, tp and pp; refused under expert parallelism and ZeRO-3."""
    bias: Literal["none", "all", "lora_only"] = "none"
    """Which biases are trained."""
    use_rslora: bool = False
    """Rank-stabilized scaling ``alpha / sqrt(r)``."""


@dataclass
class PeftConfig:
    """Which PEFT method, and its settings. ``lora`` is read for ``method=lora``; ``num_virtual_tokens`` for the
    prompt-learning methods, ``prompt_init`` for ``prompt_tuning``; ``options`` go verbatim to peft's config class
    for ia3 / loha / lokr, ``p_tuning`` (``PromptEncoderConfig``: ``encoder_reparameterization_type`` MLP|LSTM,
    ``encoder_hidden_size``, ``encoder_num_layers``, ``encoder_dropout``) and ``prefix_tuning``
    (``PrefixTuningConfig``: ``prefix_projection``, ``encoder_hidden_size``)."""

    method: PeftMethod = "lora"
    """``lora``, ``ia3``, ``loha``, ``lokr`` (injected into linear layers), ``prompt_tuning`` / ``p_tuning``
    (virtual input tokens) or ``prefix_tuning`` (per-layer key/value prefixes)."""
    lora: LoraArgs = field(default_factory=LoraArgs)
    """LoRA settings (``method=lora``)."""
    num_virtual_tokens: int = 20
    """Prompt tuning, P-tuning, prefix tuning: learned tokens (or key/value prefixes) before every sequence."""
    prompt_init: Literal["random", "vocab"] = "vocab"
    """Prompt tuning: initialize virtual tokens randomly or from randomly sampled vocabulary embeddings."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the peft config class (e.g. ``{target_modules: [...], r: 8}`` for loha,
    ``{prefix_projection: true, encoder_hidden_size: 512}`` for prefix_tuning, ``{encoder_reparameterization_type:
    LSTM}`` for p_tuning; sizes derived from the model, such as ``token_dim``, are refused)."""

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # from YAML / a checkpoint
            self.lora = LoraArgs(**self.lora)
        if self.method not in (*INJECTED_METHODS, *PROMPT_METHODS):
            methods = ", ".join((*INJECTED_METHODS, *PROMPT_METHODS))
            raise ValueError(f"peft.method={self.method!r}: choose one of {methods}")
        if self.method == "lora" and self.lora.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.lora.r}")
        if self.method == "lora" and self.lora.target_parameters and self.lora.dropout:
            raise ValueError(f"lora.target_parameters={self.lora.target_parameters} needs lora.dropout=0 (got "
                             f"{self.lora.dropout}): peft adds such an update to the weight itself, which has no input "
                             "to drop")
        if self.method in PROMPT_METHODS and self.num_virtual_tokens < 1:
            raise ValueError(f"peft.num_virtual_tokens must be >= 1, got {self.num_virtual_tokens}")
        if self.method in ("p_tuning", "prefix_tuning"):
            check_prompt_options(self.method, self.options)
        elif self.method == "prompt_tuning" and self.options:
            raise ValueError(f"peft.options {sorted(self.options)}: prompt tuning takes num_virtual_tokens and "
                             "prompt_init only")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def peft_config(self) -> Any:
        """The ``peft`` config object for injection methods (task type CAUSAL_LM, as the adapter export declares)."""
        import peft

        if self.method == "lora":
            a = self.lora
            return peft.LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout,
                                   target_modules=list(a.target_modules),
                                   modules_to_save=list(a.modules_to_save) if a.modules_to_save else None,
                                   target_parameters=list(a.target_parameters) if a.target_parameters else None,
                                   bias=a.bias, use_rslora=a.use_rslora, task_type="CAUSAL_LM")
        cls = {"ia3": peft.IA3Config, "loha": peft.LoHaConfig, "lokr": peft.LoKrConfig}.get(self.method)
        if cls is None:
            raise ValueError(f"peft.method={self.method} is not an injection method")
        options = dict(self.options)
        options.setdefault("target_modules", ["q_proj", "v_proj"])
        if self.method == "ia3":
            options.setdefault("feedforward_modules", [])
        return cls(task_type="CAUSAL_LM", **options)


# Hyper-parameters saved in checkpoints hold these dataclasses; let `torch.load(weights_only=True)` (what Lightning
# uses to resume) accept them.
torch.serialization.add_safe_globals([LoraArgs, PeftConfig])


# ---------------------------------------------------------------------------------------------------- apply / count


def apply_peft(model: nn.Module, cfg: PeftConfig) -> nn.Module:
    """Freeze ``model`` and add the trainable PEFT parameters; returns the model to train (same object for
    injection methods, a :class:`PromptLearningLM` wrapper for prompt tuning, P-tuning and prefix tuning)."""
    if cfg.method in PROMPT_METHODS:
        return build_prompt_model(model, cfg.method, cfg.num_virtual_tokens, options=cfg.options,
                                  prompt_init=cfg.prompt_init)
    from peft import inject_adapter_in_model

    peft_cfg = cfg.peft_config()
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in (getattr(peft_cfg, "target_modules", None) or []) if t not in names]
    if missing:
        raise ValueError(f"{cfg.method}.target_modules: {missing} not found in the model (its linear layers are "
                         f"q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
    params = [n for n, _ in model.named_parameters()]
    absent = [t for t in (getattr(peft_cfg, "target_parameters", None) or [])
              if not any(n == t or n.endswith(f".{t}") for n in params)]
    if absent:
        raise ValueError(f"{cfg.method}.target_parameters: {absent} not found in the model (a Mixture-of-Experts "
                         "model's fused experts are mlp.experts.gate_up_proj and mlp.experts.down_proj)")
    check_expert_lora(getattr(model, "config", None), cfg)
    with torch.random.fork_rng(devices=[]):  # the adapters' values come from init_adapters, not torch's generator
        model = inject_adapter_in_model(peft_cfg, model)
    init_adapters(model, peft_cfg)
    return model


def check_expert_lora(config: Any, cfg: PeftConfig | None) -> None:
    """LoRA on the fused experts (``lora.target_parameters``) is peft's update of transformers' in-memory expert
    tensors, so its adapter loads on transformers' model. gpt-oss's experts are held here as ``[E, 2I, H]`` with the
    gate rows first (transformers: ``[E, H, 2I]``, gate and up columns alternating, with biases): such an adapter
    would not be transformers', so it is refused."""
    moe = getattr(config, "moe", None)
    targets = cfg.lora.target_parameters if cfg is not None and cfg.method == "lora" else None
    if targets and moe is not None and (moe.expert_bias or moe.swiglu_limit is not None):
        raise ValueError(f"--model.lora.target_parameters={targets}: LoRA on gpt-oss's fused experts is not "
                         "supported (they are held in another layout than transformers' [E, H, 2I] with alternating "
                         "gate/up columns, so the adapter would not load in peft); adapt the attention projections "
                         "(target_modules) instead")


def initialises_without_base(cfg: PeftConfig | None) -> bool:
    """Whether the method's trainable weights start without reading the base weights (so the base may be built on
    the meta device): the injected adapters do; prompt tuning samples vocabulary embeddings (P-tuning and prefix
    tuning do not read the base, but their wrappers are refused under sharded layouts: see ``DecoderTask``)."""
    return cfg is None or cfg.method in INJECTED_METHODS


def _adapter_reset(layer: nn.Module, adapter: str, peft_cfg: Any) -> None:
    """peft's own initialisation of one adapter of one layer (what ``update_layer`` runs when it is created)."""
    from peft.tuners.ia3 import IA3Layer
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    from peft.tuners.lora import LoraLayer

    if isinstance(layer, LoraLayer):
        layer.reset_lora_parameters(adapter, peft_cfg.init_lora_weights)
    elif isinstance(layer, IA3Layer):
        layer.reset_ia3_parameters(adapter)
    elif isinstance(layer, (LoHaLayer, LoKrLayer)):
        if peft_cfg.init_weights:
            layer.reset_adapter_parameters(adapter)
        else:
            layer.reset_adapter_parameters_random(adapter)
    else:
        raise ValueError(f"no initialisation known for the adapter layer {type(layer).__name__}")


@torch.no_grad()
def init_adapters(model: nn.Module, peft_cfg: Any) -> None:
    """(Re)initialise every adapter with peft's own init, drawn from a generator seeded by the backbone's
    ``init_seed`` and the layer's name: the same values on one device, on a meta-device base (adapters peft moved
    to the meta device are allocated on the CPU first) and on every rank, whatever torch's generator state."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    seed = next((int(m.init_seed) for m in model.modules() if hasattr(m, "init_seed")), 0)
    for name, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        for adapter in layer.active_adapters:
            for attr in layer.adapter_layer_names:
                container = getattr(layer, attr, None)
                if container is None or adapter not in container:
                    continue
                item = container[adapter]
                if isinstance(item, nn.Module) and any(p.is_meta for p in item.parameters()):
                    item.to_empty(device="cpu")
                elif isinstance(item, nn.Parameter) and item.is_meta:
                    container[adapter] = nn.Parameter(torch.empty_like(item, device="cpu"),
                                                      requires_grad=item.requires_grad)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(name_seed(seed, f"{canonical_name(name)}:{adapter}") % 2**63)
                _adapter_reset(layer, adapter, peft_cfg)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; shared (tied) tensors are counted once."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def enable_gradient_checkpointing(model: nn.Module, *, use_reentrant: bool = False) -> int:
    """Recompute every transformer block's activations in backward; returns the number of blocks wrapped.

    The blocks' ``forward`` is wrapped per instance, so module paths and state-dict keys do not change. With the
    reentrant implementation a block whose *inputs* do not require grad produces outputs that do not either, and
    the adapter weights inside get no gradient when the embedding is frozen (the LoRA case); a forward hook makes
    the embedding output require grad, as HF's ``enable_input_require_grads`` does.
    """
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        if getattr(block, "_llm_checkpointed", False):
            continue
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Tensor:
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            if use_reentrant:  # the reentrant variant takes no kwargs: bind them
                return checkpoint(functools.partial(_inner, **kwargs), *args, use_reentrant=True)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
        block._llm_checkpointed = True  # type: ignore[attr-defined]
    if use_reentrant and isinstance(model, PrefixTuningLM):
        # The prefix keys/values reach each block through the cache, not as checkpoint inputs: reentrant
        # checkpointing would not carry their gradient back to the prefix encoder.
        raise ValueError("peft.method=prefix_tuning with reentrant activation checkpointing "
                         "(--model.checkpoint_reentrant=true) is not supported: use the non-reentrant variant")
    embed = next((m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "embed_tokens"), None)
    if use_reentrant and embed is not None and not getattr(embed, "_llm_input_grad_hook", False):
        embed.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True) if not out.requires_grad else out)
        embed._llm_input_grad_hook = True  # type: ignore[attr-defined]
    return len(blocks)
