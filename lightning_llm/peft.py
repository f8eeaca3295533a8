"""PEFT integration shared by the decoder tasks: configure, apply, count, save/export adapters, merge.

Injection methods (LoRA, IA3, LoHa, LoKr, ...) use ``peft.inject_adapter_in_model`` on our module tree in place, so
module paths stay ours (``layers.0.self_attn.q_proj.base_layer``, ``...lora_A.default``) and parallel plans keyed by
path still find their modules. Prompt-learning methods (prompt tuning, P-tuning, prefix tuning) wrap the decoder
(:mod:`lightning_llm.peft_prompt`) with peft's own ``PromptEmbedding`` / ``PromptEncoder`` / ``PrefixEncoder``.

Adapter export writes ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's own layout with HF Llama
module names (ours ``layers.N...`` / ``embed_tokens`` / ``norm`` -> ``model.layers.N...`` / ``model.embed_tokens`` /
``model.norm``; ``lm_head`` unchanged), so ``peft.PeftModel.from_pretrained`` loads it on the ``save_hf`` export of
the base model.

``lightning_llm merge`` (:mod:`lightning_llm.merge`) folds an adapter (exported directory or a Lightning checkpoint of a
PEFT run) into the base weights and writes a full HF checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_llm.data.io import read_json
from lightning_llm.peft_prompt import (
    PROMPT_METHODS,
    PrefixTuningLM,
    PromptLearningLM,
    PromptTuningLM,
    PTuningLM,
    build_prompt_model,
    check_prompt_options,
    prompt_table,
)

log = logging.getLogger(__name__)

__all__ = [
    "LoraArgs", "PTuningLM", "PeftConfig", "PrefixTuningLM", "PromptLearningLM", "PromptTuningLM", "apply_peft",
    "count_parameters", "enable_gradient_checkpointing",
    "export_adapter", "hf_module_name", "load_adapter", "merge_main", "merge_peft", "peft_state_dict",
]

PeftMethod = Literal["lora", "ia3", "loha", "lokr", "prompt_tuning", "p_tuning", "prefix_tuning"]
_INJECTED = ("lora", "ia3", "loha", "lokr")


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
        if self.method not in (*_INJECTED, *PROMPT_METHODS):
            raise ValueError(f"peft.method={self.method!r}: choose one of {', '.join((*_INJECTED, *PROMPT_METHODS))}")
        if self.method == "lora" and self.lora.r < 1:
            raise ValueError(f"lora.r must be >= 1, got {self.lora.r}")
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
    with torch.random.fork_rng(devices=[]):  # the adapters' values come from init_adapters, not torch's generator
        model = inject_adapter_in_model(peft_cfg, model)
    init_adapters(model, peft_cfg)
    return model


def initialises_without_base(cfg: PeftConfig | None) -> bool:
    """Whether the method's trainable weights start without reading the base weights (so the base may be built on
    the meta device): the injected adapters do; prompt tuning samples vocabulary embeddings (P-tuning and prefix
    tuning do not read the base, but their wrappers are refused under sharded layouts: see ``DecoderTask``)."""
    return cfg is None or cfg.method in _INJECTED


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

    from lightning_llm.models.init import canonical_name, name_seed

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
    from lightning_llm.models.layers import TransformerBlock

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


# ---------------------------------------------------------------------------------------------------- save / export


def peft_state_dict(model: nn.Module, cfg: PeftConfig) -> dict[str, Tensor]:
    """The adapter weights in peft's saved layout with OUR module names (adapter name stripped)."""
    if cfg.method == "prompt_tuning":
        assert isinstance(model, PromptTuningLM)
        return {"prompt_embeddings": model.prompt.embedding.weight.detach().clone()}
    if cfg.method in PROMPT_METHODS:  # peft saves the encoder's output (what inference_mode loads), not its weights
        assert isinstance(model, (PTuningLM, PrefixTuningLM)), type(model).__name__
        return {"prompt_embeddings": prompt_table(model)}
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}


def hf_module_name(name: str) -> str:
    """Our decoder parameter/module name -> the HF name (``layers.0.mlp.up_proj`` -> ``model.layers.0.mlp.up_proj``).

    One mapping for every LLaMA-layout family (llama, qwen2, qwen3, mistral, baichuan): projection names are the HF
    ones (``q_proj``, Qwen3's ``q_norm``, Baichuan's ``W_pack``); only the base-model prefix differs."""
    if name.startswith(("layers.", "embed_tokens", "norm.")) or name == "norm":
        return "model." + name
    return name


def _our_module_name(hf_name: str) -> str:
    """Inverse of :func:`hf_module_name`."""
    return hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


def _wpack_rows(config: Any, state: dict[str, Tensor], *, to_hf: bool, where: str) -> dict[str, Tensor]:
    """Adapter tensors (our names) with Baichuan's ``W_pack`` rows converted between our head-interleaved order and
    the checkpoint's ``[q; k; v]`` (a LoRA's ``lora_B``: ``models.hf_decoders.adapter_tensor_to_hf``); any other
    tensor on ``W_pack`` (another method's, a ``modules_to_save`` copy) is refused rather than written unpermuted."""
    from lightning_llm.models.hf_decoders import adapter_tensor_from_hf, adapter_tensor_to_hf

    odd = [k for k in state if "W_pack" in k.split(".") and not {"lora_A", "lora_B"} & set(k.split("."))]
    if odd and getattr(config, "qkv_packed", False):
        raise ValueError(f"{where}: {odd[0]} is on Baichuan's fused W_pack but not a LoRA lora_A/lora_B tensor: only "
                         "LoRA on W_pack is converted to Baichuan's row order; merge with `lightning_llm merge --ckpt`")
    convert = adapter_tensor_to_hf if to_hf else adapter_tensor_from_hf
    return {k: convert(config, k, v) for k, v in state.items()}


def _check_llama_layout(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    if config is None or config.family != "decoder" or config.position != "rope" or config.norm != "rmsnorm":
        raise ValueError("adapter export supports LLaMA-layout decoders (rope + rmsnorm: llama, qwen2, qwen3, mistral, "
                         "baichuan); GPT-2 modules differ in HF (fused c_attn), so merge with `lightning_llm merge` "
                         "instead")
    if config.norm_head and any(n.rsplit(".", 1)[-1] == "lm_head" and hasattr(m, "lora_B")
                                for n, m in model.named_modules()):
        # Baichuan2's NormHead is no nn.Linear in its HF code: peft cannot attach this adapter there.
        raise ValueError("adapter export of a LoRA on Baichuan2's lm_head (a NormHead) is not supported: peft cannot "
                         "target NormHead on the HF model; drop lm_head from lora.target_modules")


def export_adapter(model: nn.Module, cfg: PeftConfig, directory: str | Path, *,
                   base_model_name_or_path: str | None = None, tokenizer: str | Path | None = None,
                   state: dict[str, Tensor] | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (``modules_to_save`` weights included) loadable by
    ``PeftModel.from_pretrained`` on the HF export of the base model, plus the files of ``tokenizer`` (a directory)
    if given. ``state``: :func:`peft_state_dict` of ``model`` already gathered to full tensors (sharded layouts).
    ``directory`` appears only once complete (``export_files.staged_directory``); an existing adapter or model
    directory there is replaced. A LoRA on Baichuan's ``W_pack`` is written in the checkpoint's row order."""
    from safetensors.torch import save_file

    from lightning_llm.export_files import staged_directory, write_tokenizer

    base = model.base if isinstance(model, PromptLearningLM) else model
    _check_llama_layout(base)
    state = peft_state_dict(model, cfg) if state is None else state
    if cfg.method == "prompt_tuning":
        from peft import PromptTuningConfig

        c = base.config
        peft_cfg = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=cfg.num_virtual_tokens,
                                      token_dim=c.hidden_size, num_transformer_submodules=1,
                                      num_attention_heads=c.num_heads, num_layers=c.num_layers)
        tensors = state
    elif cfg.method in PROMPT_METHODS:
        import copy

        assert isinstance(model, (PTuningLM, PrefixTuningLM))
        peft_cfg = copy.deepcopy(model.peft_config)
        tensors = state
    else:
        peft_cfg = cfg.peft_config()
        # Baichuan's W_pack: lora_B rows back to the checkpoint's [q; k; v] order (ours are head-interleaved)
        state = _wpack_rows(base.config, state, to_hf=True, where="adapter export")
        tensors = {"base_model.model." + hf_module_name(k): v for k, v in state.items()}
    peft_cfg.base_model_name_or_path = base_model_name_or_path
    with staged_directory(directory, flag="adapter directory") as tmp:
        peft_cfg.save_pretrained(str(tmp))
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        if tokenizer is not None:  # a run with its own (e.g. extended) tokenizer: merge and PeftModel users need it
            write_tokenizer(Path(tokenizer), tmp)
    log.info("adapter (%d tensors) written to %s", len(tensors), directory)
    return Path(directory)


def load_adapter(model: nn.Module, directory: str | Path) -> tuple[nn.Module, PeftConfig]:
    """Inject an exported LoRA adapter (:func:`export_adapter` or any peft LoRA adapter of a Llama model) into our
    decoder and load its weights (the base grown first to an extended vocabulary its ``modules_to_save`` hold).
    Returns the model and the equivalent :class:`PeftConfig`."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from lightning_llm.vocab import grow_base, trained_vocab_size

    directory = Path(directory)
    raw = read_json(directory / "adapter_config.json")
    if raw.get("peft_type") != "LORA":
        kind = raw.get("peft_type")
        why = (" (a prompt-learning adapter holds no weights to merge: load it with peft.PeftModel.from_pretrained "
               "on the HF base)") if kind in ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING") else ""
        raise ValueError(f"--adapter={directory}: only LoRA adapters can be loaded/merged, got {kind}{why}")
    targets = raw["target_modules"]
    cfg = PeftConfig(method="lora", lora=LoraArgs(
        r=raw["r"], alpha=raw["lora_alpha"], dropout=raw.get("lora_dropout", 0.0),
        target_modules=sorted(targets) if isinstance(targets, list) else [targets],
        modules_to_save=raw.get("modules_to_save"), bias=raw.get("bias", "none"),
        use_rslora=raw.get("use_rslora", False)))
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    grow_base(model, trained_vocab_size(tensors), cfg, where=f"--adapter={directory}")
    model = apply_peft(model, cfg)
    prefix = "base_model.model."
    ours = _wpack_rows(model.config, {_our_module_name(k.removeprefix(prefix)): v for k, v in tensors.items()},
                       to_hf=False, where=f"--adapter={directory}")
    result = set_peft_model_state_dict(model, ours, adapter_name="default")
    unexpected = getattr(result, "unexpected_keys", [])
    # Adapter weights the file lacks would stay at their initialisation (a LoRA at zero, a module_to_save at the
    # base's values): a different model than the one trained.
    missing = [k for k in getattr(result, "missing_keys", []) if ".default." in k or k.endswith(".default")]
    if unexpected or missing:
        raise ValueError(f"--adapter={directory}: does not match the model: unexpected weights {unexpected[:5]}, "
                         f"missing {missing[:5]}")
    return model, cfg


def merge_peft(model: nn.Module) -> nn.Module:
    """Fold injected adapters into the base weights and remove the PEFT wrappers (in place); returns the plain model.
    Modules trained in full (``modules_to_save``) replace the originals.

    A tied embedding / LM head (``tie_embeddings``) stays tied only if both uses still hold the same values: with
    ``modules_to_save`` each use trained its own copy, and a LoRA on ``lm_head`` changes the head only, so the merged
    model is untied (``config.tie_embeddings=False``) and keeps both tensors rather than re-tying to one of them.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    if isinstance(model, PromptLearningLM):
        raise ValueError(f"{model.method} has no weights to merge: export the adapter with --adapter-only and keep it "
                         "beside the base model")
    # A base weight shared by several modules (the tied embedding under a LoRA'd lm_head) is copied before the merge
    # writes into it: merging in place would change the embedding too.
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    replacements: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, (BaseTunerLayer, ModulesToSaveWrapper)):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            if isinstance(module, ModulesToSaveWrapper):
                new = module.modules_to_save["default"]
            else:
                base = module.get_base_layer()
                for pname, p in list(base.named_parameters(recurse=False)):
                    if uses.get(id(p), 0) > 1:
                        setattr(base, pname, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))
                module.merge(safe_merge=True)
                new = base
            replacements.append((parent, name.rsplit(".", 1)[-1], new))
    for parent, attr, new in replacements:
        setattr(parent, attr, new)
    for p in model.parameters():
        p.requires_grad_(True)
    config = getattr(model, "config", None)
    embed, head = getattr(model, "embed_tokens", None), getattr(model, "lm_head", None)
    if getattr(config, "tie_embeddings", False) and embed is not None and head is not None:
        if embed.weight is head.weight or torch.equal(embed.weight, head.weight):
            model.tie_weights()  # type: ignore[operator]
        else:
            log.warning("embed_tokens and lm_head of the tied model were trained apart (modules_to_save / a LoRA on "
                        "lm_head): the merged model is untied (tie_word_embeddings=false) and keeps both")
            model.config = config.replace(tie_embeddings=False)
    return model


def merge_main(argv: list[str]) -> int:
    """``lightning_llm merge``: :func:`lightning_llm.merge.main` (kept here for existing imports)."""
    from lightning_llm.merge import main

    return main(argv)
