"""The base of every task on a decoder backbone (causal LM, SFT, PPO, DPO, GRPO): the backbone arguments are
declared here once, with the policy build (backbone -> PEFT -> activation checkpointing), PEFT-aware checkpoints
and the adapter export at the end of ``fit``.

Subclasses add their own arguments and forward the rest with ``**kwargs``; LightningCLI resolves those through
``super().__init__`` (``--model.backbone``, ``--model.lora``, ... keep their names for every decoder task).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.utilities import rank_zero_info
import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_llm.contract import builds_lazily, replica_mean
from lightning_llm.export.meta import _tokenizer_source, chat_template_source
from lightning_llm.models import backbone_config
from lightning_llm.models.layers.moe import moe_parameters
from lightning_llm.models.quantize import (
    QuantizationConfig,
    QuantizeMode,
    checkpoint_entry,
    describe,
    is_quantized,
    load_quantized,
    quantized_linears,
    require_torchao,
    shard_problem,
)
from lightning_llm.peft import (
    INJECTED_METHODS,
    LoraArgs,
    PeftConfig,
    apply_peft,
    check_expert_lora,
    count_parameters,
    enable_gradient_checkpointing,
    export_adapter,
    initialises_without_base,
    peft_state_dict,
)
from lightning_llm.peft.prompt import check_prompt_layout
from lightning_llm.rl.rollouts.reference import ReferencePolicy
from lightning_llm.tasks.base import LLMTask, OptimConfig
from lightning_llm.vocab import added_rows, check_new_rows_trained

log = logging.getLogger(__name__)

__all__ = ["DecoderTask", "REFERENCE_COPY", "fused_loss_blocker"]

REFERENCE_COPY = "reference.frozen"
"""Where a task's frozen reference copy lives (``task.reference.frozen``), as :meth:`DecoderTask.frozen_models`
names it."""

_LOSS_HOOKS = ("model_inputs", "loss_from_output", "compute_loss")


def fused_loss_blocker(task: DecoderTask) -> str | None:
    """Why ``task`` computes its loss from full logits, or ``None`` when the model's fused loss is used."""
    if not task.fused_loss:
        return "--model.fused_loss=false"
    own = [n for n in _LOSS_HOOKS if not getattr(getattr(type(task), n), "__module__", "").startswith("lightning_llm.")]
    if own:
        return f"{type(task).__name__} overrides {', '.join(own)}"
    if not getattr(task.model, "computes_loss", False):
        return f"{type(task.model).__name__} does not compute its own loss"
    return None


class DecoderTask(LLMTask):
    """A task whose trained model is a decoder policy, optionally with PEFT.

    With ``lora`` (or ``peft``) the backbone is frozen and only the adapter (plus ``modules_to_save``) trains;
    checkpoints then hold only those weights (and the optimizer/loop state resume needs), and the adapter is
    exported in peft's format to ``adapter_dir`` at the end of ``fit``.
    """

    scores_sequences: bool = False
    """Whether the task's decoder is a sequence classifier (a ``score`` head: the reward model of ``RewardTask``);
    the others need an LM head and refuse a ``...ForSequenceClassification`` backbone."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        dropout: float | None = None,
        model_overrides: dict[str, Any] | None = None,
        lora: LoraArgs | None = None,
        peft: PeftConfig | None = None,
        quantize: QuantizeMode | None = None,
        quantization: QuantizationConfig | None = None,
        gradient_checkpointing: bool = False,
        checkpoint_reentrant: bool = False,
        adapter_dir: str | None = None,
        resize_embeddings: bool = False,
        optim: OptimConfig | None = None,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        fused_loss: bool = True,
        router_aux_loss_coef: float | None = None,
        compile: bool = False,  # noqa: A002 - the CLI flag is --model.compile
    ) -> None:
        """
        Args:
            backbone: A named decoder size (``debug``, ``small``, ``gpt2``, ``llama2-7b``) or a local HF directory.
            dropout: Override the backbone's dropout.
            model_overrides: Extra ModelConfig fields for a named size (e.g. ``{num_layers: 2}``).
            lora: LoRA settings (shorthand for ``peft: {method: lora, lora: ...}``).
            peft: Any supported PEFT method (``lora``, ``ia3``, ``loha``, ``lokr``, ``prompt_tuning``, ``p_tuning``,
                ``prefix_tuning``; the last two under data-parallel layouts only).
            quantize: Hold the frozen base's block linears quantized (QLoRA): ``nf4`` (4-bit NormalFloat with
                double quantization) or ``int8`` (weight-only, per row), by torchao (``pip install
                'lightning_llm[quant]'``); quantized at load block by block. Needs an injected PEFT method (lora,
                ia3, loha, lokr); one device, ddp, zero1/2, zero3 (nf4 only) and pp; tp and DeepSpeed are refused.
                Checkpoints hold the adapters and these settings; export and merge fold the adapters into the
                dequantized weights.
            quantization: The quantization's details (block sizes, compute dtype) for ``quantize``.
            gradient_checkpointing: Recompute block activations in backward.
            checkpoint_reentrant: Use torch's reentrant checkpointing (then embedding outputs are made to
                require grad so frozen-embedding adapters still get gradients).
            adapter_dir: Where to export the adapter after ``fit`` (default ``<log_dir>/adapter`` when PEFT is on).
            resize_embeddings: Grow the HF backbone's ``embed_tokens`` / ``lm_head`` to the tokenizer's vocabulary
                when the tokenizer has more ids (an extended vocabulary, as Chinese-LLaMA-Alpaca): new rows drawn
                from the old rows' mean and covariance as transformers' ``resize_token_embeddings(mean_resizing=
                True)``. With LoRA set ``lora.modules_to_save=[embed_tokens,lm_head]`` so the new rows train; merge
                and export write the new ``vocab_size``.
            optim: Optimizer and LR schedule.
            nonfinite_loss: On a NaN/inf training loss or gradients: ``stop`` the run (naming the step) or
                ``skip`` the step.
            fused_loss: Compute the token cross-entropy from the hidden states and the LM head in chunks (the
                Triton fused linear cross-entropy on CUDA, chunked torch elsewhere), never materialising the
                ``[B, S, V]`` logits; same loss and gradients. Used when the task's loss hooks are the library's
                own (causal LM, SFT and DPO losses, PPO and GRPO log-probs), under every layout (tensor parallel:
                on the vocabulary shards; pipeline: on the last stage); ``false`` always computes full logits.
            router_aux_loss_coef: Mixture-of-Experts backbones: the coefficient of transformers' load-balancing
                loss (``E x sum_i f_i P_i`` over the global batch's real tokens, pooled over the MoE layers), added to
                the training loss and logged as ``train_aux_loss``. Default: the backbone's ``router_aux_loss_coef``
                (on in training whatever its ``output_router_logits`` says); ``0`` turns it off.
            compile: Compile each transformer block with ``torch.compile`` (regional, as torchtitan; parameter names
                and checkpoints unchanged; refused under tensor parallelism): see ``LLMTask``.
        """
        super().__init__(optim=optim, nonfinite_loss=nonfinite_loss, compile=compile)
        if lora is not None and peft is not None:
            raise ValueError("--model.lora and --model.peft are exclusive: use peft.method=lora with peft.lora")
        self.peft_config: PeftConfig | None = PeftConfig(method="lora", lora=lora) if lora is not None else peft
        # the backbone's own options and what the PEFT method asks of it, refused before any data is prepared
        changes = {} if dropout is None else {"dropout": dropout}
        config = backbone_config(backbone, family="decoder", **changes)
        check_expert_lora(config, self.peft_config)
        if config is not None and config.num_labels > 0 and not self.scores_sequences:
            raise ValueError(f"--model.backbone={backbone} is a sequence classifier (...ForSequenceClassification, "
                             f"num_labels={config.num_labels}) without an LM head: {type(self).__name__} trains a "
                             "language model (a reward model is --model.reward.model, or RewardTask's backbone)")
        self.quantize: QuantizeMode | None = quantize
        self.quantization = quantization or QuantizationConfig()
        if quantize is not None:
            _check_quantize(quantize, self.peft_config)
        self.backbone = backbone
        self.dropout = dropout
        self.model_overrides = dict(model_overrides or {})
        self.gradient_checkpointing = gradient_checkpointing
        self.checkpoint_reentrant = checkpoint_reentrant
        self.adapter_dir = adapter_dir
        self.resize_embeddings = resize_embeddings
        self.fused_loss = fused_loss
        if router_aux_loss_coef is not None and router_aux_loss_coef < 0:
            raise ValueError(f"--model.router_aux_loss_coef={router_aux_loss_coef}: must be >= 0 (0 turns it off)")
        self.router_aux_loss_coef = router_aux_loss_coef
        self._loss_path_logged = False
        self.reference: ReferencePolicy | None = None
        """The frozen reference policy of the tasks that have one (RL, DPO), built with the policy."""
        # Checkpoints of a PEFT run hold only the trainable weights; the frozen base is rebuilt from `backbone`.
        self.strict_loading = self.peft_config is None

    # ------------------------------------------------------------------------------------------ model
    def build_decoder(self, backbone: str | None = None) -> nn.Module:
        """A decoder from ``backbone`` (default: the task's) with the task's dropout and overrides, no PEFT.
        Built lazily (meta device / indexed checkpoint) when the strategy materializes shards and the PEFT method
        initialises without reading the base weights (prompt tuning samples vocabulary embeddings)."""
        lazy = self.capabilities.deferred_init and builds_lazily(self) and initialises_without_base(self.peft_config)
        lazy = lazy or self.quantize is not None  # quantized block by block at load, never whole in full precision
        model = self.build_backbone(backbone or self.backbone, family="decoder", lazy=lazy, dropout=self.dropout,
                                    resize=self.resize_embeddings, **self.model_overrides)
        if self.router_aux_loss_coef is not None:
            set_aux_loss_coef(model, self.router_aux_loss_coef, backbone=backbone or self.backbone)
        if self.quantize is not None:
            model = load_quantized(model, self.quantize, self.quantization)
            caps = self.capabilities
            zero3 = self._trainer is not None and _zero3(self.trainer.strategy)
            problem = shard_problem(model, caps.data_parallel_size) if zero3 else None
            if problem:  # zero3: FSDP2 splits each weight's quantized pieces by rows
                raise ValueError(f"--model.quantize={self.quantize} under zero3 x{caps.data_parallel_size}: {problem}")
            rank_zero_info(f"frozen base: block linears quantized to {describe(self.quantize, self.quantization)}")
            experts, _ = moe_parameters(model.config)
            if experts:
                rank_zero_info(f"frozen base: the {experts:,} routed-expert weights ({100 * experts / max(sum(p.numel() for p in model.parameters()), 1):.0f}% of the model) stay in full "
                               "precision (torchao quantizes linear layers' weights; the fused experts are [E, ...] "
                               "parameters)")
        return model

    def build_policy(self) -> nn.Module:
        """The trained decoder: the backbone with the PEFT method applied (no activation checkpointing yet: a
        reference copy must be taken before :meth:`checkpointed` patches the blocks)."""
        if self.peft_config is not None:
            check_prompt_layout(self.peft_config.method, self.capabilities)  # before anything is built
            check_expert_adapter_layout(self.peft_config, self.trainer.strategy if self._trainer else None)
        if self.quantize is not None:
            check_quantize_layout(self.quantize, self.trainer.strategy if self._trainer else None, self.capabilities)
        model = self.build_decoder()
        moe = getattr(model.config, "moe", None)
        if self.peft_config is not None and moe is not None and moe.bias_update_rate > 0:
            raise ValueError(f"moe.bias_update_rate={moe.bias_update_rate} with --model.{self.peft_config.method}: the "
                             "aux-free update moves the routers' correction biases, which a PEFT run's checkpoints and "
                             "adapters do not hold (only its trainable weights); set it to 0, or fine-tune in full")
        if self.quantize is not None:
            _check_trained_copies(model, self.peft_config)
        if added_rows(model):
            check_new_rows_trained(self.peft_config)
        return apply_peft(model, self.peft_config) if self.peft_config is not None else model

    @override
    def configure_model(self) -> None:
        super().configure_model()
        if self.quantize is not None:
            # DDP broadcasts every parameter from rank 0 at set-up through flattened buckets, which re-quantizes
            # torchao's tensors from their dequantized values (train_loss moved by 1.6e-5 at step 0): every rank built
            # the same frozen weights already, so DDP leaves them alone.
            self._ddp_params_and_buffers_to_ignore = [n for n, p in self.named_parameters() if is_quantized(p)]

    def checkpointed(self, model: nn.Module) -> nn.Module:
        """``model`` with activation checkpointing when ``--model.gradient_checkpointing`` asks for it."""
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(model, use_reentrant=self.checkpoint_reentrant)
        return model

    @override
    def build_model(self) -> nn.Module:
        model = self.checkpointed(self.build_policy())
        trainable, total = count_parameters(model)
        rank_zero_info(f"trainable params: {trainable:,} || all params: {total:,} || "
                       f"trainable%: {100 * trainable / max(total, 1):.4f}")
        return model

    def uses_fused_loss(self) -> bool:
        """Whether a step asks the model for its loss (``labels=``) instead of logits: ``--model.fused_loss``, the
        library's own ``model_inputs``/``loss_from_output``/``compute_loss`` (an override sees logits, as it
        expects) and a model that declares ``computes_loss`` (under a pipeline, its last stage computes it)."""
        reason = fused_loss_blocker(self)
        if not self._loss_path_logged:
            self._loss_path_logged = True
            rank_zero_info("loss: " + ("fused LM-head cross-entropy (no [B, S, V] logits)" if reason is None
                                       else f"cross-entropy on full logits ({reason})"))
        return reason is None

    def log_pair_means(self, means: dict[str, Tensor], pairs: float) -> None:
        """Log a step's statistics of its ``pairs`` preference pairs (trl's names), each the mean over the
        data-parallel replicas weighted by their pairs (one collective for all); ``rewards/accuracies`` also on the
        progress bar."""
        caps = self.capabilities
        values, _ = replica_mean(caps.data_parallel_group, torch.stack(list(means.values())), pairs,
                                 dp=caps.data_parallel_size)
        for name, value in zip(means, values):
            self.log(name, value, on_step=True, on_epoch=False, batch_size=int(pairs))
            if name == "rewards/accuracies":
                self.progress_bar.show(self, "accuracy", value)

    @property
    def policy(self) -> nn.Module:
        """The trained decoder (what the adapter export writes): the model itself unless a subclass wraps it."""
        assert self.model is not None, "configure_model() must run first"
        return self.model

    @override
    def frozen_models(self) -> dict[str, nn.Module]:
        """The reference's frozen copy, where the task holds one (a full fine-tune's RL or DPO reference)."""
        frozen = self.reference.frozen if self.reference is not None else None
        return {REFERENCE_COPY: frozen} if frozen is not None else {}

    @override
    def decoding_frozen_models(self) -> tuple[str, ...]:
        """The reference's frozen copy, where the task holds one: an RL rollout computes its reference log-probs
        inside the rollout's decoding session (DPO and KTO never decode)."""
        return tuple(self.frozen_models().keys() & {REFERENCE_COPY})

    def run_reference(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The reference policy's output for the policy call ``call(*args, **kwargs)`` (no gradient): its frozen copy
        placed like the policy (:meth:`run_frozen`), or the policy with its adapters off, run by ``call``."""
        if self.reference is None:
            raise RuntimeError(f"{type(self).__name__} has no reference policy (configure_model() builds it)")
        return self.reference.run(self.policy, call, *args,
                                  call_frozen=functools.partial(self.run_frozen, REFERENCE_COPY), **kwargs)

    # ------------------------------------------------------------------------------------------ PEFT checkpoints
    def _trainable_keys(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.peft_config is None:
            return
        keep = self._trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["peft"] = self.peft_config.to_dict()
        if self.quantize is not None:  # what export/merge re-quantize the base with (never the weights themselves)
            checkpoint["quantization"] = checkpoint_entry(self.quantize, self.quantization, self.policy)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.peft_config is None or self.model is None:
            return
        saved = checkpoint.get("quantization")
        ours = checkpoint_entry(self.quantize, self.quantization, self.policy) if self.quantize is not None else None
        if saved != ours:  # the adapters were trained against other base weights
            raise ValueError(f"--ckpt_path: the checkpoint was trained with quantization {saved or 'none'}, this run "
                             f"has --model.quantize={self.quantize} {ours or ''}: resume with the same settings")
        missing = sorted(self._trainable_keys() - set(checkpoint["state_dict"]))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} trainable weights (e.g. {missing[:3]}): it was not "
                             f"saved by a run with the same --model.lora/--model.peft settings")

    @override
    def on_fit_end(self) -> None:
        if self.peft_config is None or self.model is None:
            return
        # trainer.log_dir is a collective (broadcast): evaluate it on every rank, then write on rank 0 only.
        directory = self.adapter_dir or (Path(self.trainer.log_dir or self.trainer.default_root_dir) / "adapter")
        if self.capabilities.pipelined:  # each rank holds its stages' adapters only
            if self.trainer.global_rank == 0:
                log.warning("adapter not exported at the end of fit under pipeline parallelism: export it from the "
                            "checkpoint with `lightning_llm export CKPT --to DIR --adapter-only`")
            return
        state = _full_tensors(peft_state_dict(self.policy, self.peft_config))  # a collective under tp / ZeRO-3
        if self.trainer.global_rank != 0:
            return
        try:
            backbone = self.backbone if Path(self.backbone).is_dir() else None
            tokenizer = _tokenizer_source(self.trainer.datamodule)
            export_adapter(self.policy, self.peft_config, directory, base_model_name_or_path=backbone,
                           tokenizer=self.trainer.datamodule.tokenizer if tokenizer == "byte" else tokenizer,
                           chat_template=chat_template_source(self.trainer.datamodule), state=state,
                           quantization=checkpoint_entry(self.quantize, self.quantization, self.policy) if self.quantize else None)
        except ValueError as e:  # e.g. a GPT-2 layout: no HF-named adapter; the checkpoint still has the weights
            log.warning("adapter not exported: %s", e)


def set_aux_loss_coef(model: nn.Module, coef: float, *, backbone: str) -> None:
    """``--model.router_aux_loss_coef`` on the built decoder (its config, so checkpoints and exports carry it)."""
    moe = getattr(getattr(model, "config", None), "moe", None)
    if moe is None:
        raise ValueError(f"--model.router_aux_loss_coef={coef}: the backbone {backbone!r} has no Mixture-of-Experts "
                         "layers (it has no router to balance)")
    moe.aux_loss_coef = coef
    model.routing.aux_loss_coef = coef  # type: ignore[union-attr]


def _check_quantize(mode: str, peft: PeftConfig | None) -> None:
    """A quantized base needs an adapter that trains beside frozen linears, and torchao."""
    if peft is None or peft.method not in INJECTED_METHODS:
        got = "no --model.lora/--model.peft" if peft is None else f"peft.method={peft.method}"
        raise ValueError(f"--model.quantize={mode} quantizes the frozen base of a PEFT run: it needs an injected "
                         f"method ({', '.join(INJECTED_METHODS)}), got {got}")
    require_torchao(mode)


def _check_trained_copies(model: nn.Module, peft: PeftConfig | None) -> None:
    """``modules_to_save`` trains a full copy of a module: refused for the quantized linears (the copy would be a
    quantized tensor that cannot take a gradient step)."""
    # peft's own config of whichever method: LoRA's modules_to_save and those in peft.options (ia3, loha, lokr) alike
    saved = set(getattr(peft.peft_config(), "modules_to_save", None) or []) if peft is not None else set()
    quantized = {path.rsplit(".", 1)[-1] for path, _ in quantized_linears(model)}
    if saved & quantized:
        raise ValueError(f"modules_to_save={sorted(saved)}: {sorted(saved & quantized)} are quantized by "
                         "--model.quantize and cannot be trained in full; adapt them with the adapter (target_modules)")


def check_expert_adapter_layout(peft: PeftConfig, strategy: Any) -> None:
    """LoRA on fused experts (peft's ``target_parameters``) adds its update to the whole ``[E, ...]`` tensor in each
    forward: refused where no rank holds it whole (expert parallelism, ZeRO-3)."""
    if peft.method != "lora" or not peft.lora.target_parameters or strategy is None:
        return
    ep = int(getattr(getattr(strategy, "dims", None), "ep", 1) or 1)
    stage3 = _zero3(strategy) or getattr(strategy, "stage", 0) == 3
    if ep > 1 or stage3:
        where = f"expert parallelism (expert_parallel_size={ep})" if ep > 1 else "ZeRO-3"
        raise ValueError(f"--model.lora.target_parameters={peft.lora.target_parameters} (LoRA on the fused experts) is "
                         f"not supported under {where}: peft's update needs each whole [experts, ...] tensor; use one "
                         "device, ddp, zero1/2, tp or pp, or LoRA on the attention and dense projections only "
                         "(target_modules)")


def _zero3(strategy: Any) -> bool:
    """Whether the native engine shards parameters with FSDP2 (ZeRO-3)."""
    return getattr(strategy, "zero_stage", 0) == 3


def check_quantize_layout(mode: str, strategy: Any, caps: Any) -> None:
    """Refuse, before anything is built, the layouts that cannot hold torchao's quantized weights."""
    tp = int(getattr(getattr(strategy, "dims", None), "tp", 1) or 1)
    if caps.context_parallel_size > 1:  # not shown exact yet: refused rather than trusted
        raise ValueError(f"--model.quantize={mode} is not supported under context parallelism "
                         f"(context_parallel_size={caps.context_parallel_size}); use one device, ddp, zero1/2/3 or pp")
    if tp > 1 or (caps.batch_shared and not caps.pipelined):
        raise ValueError(f"--model.quantize={mode} is not supported under tensor parallelism: a tensor-parallel plan "
                         "makes DTensors of the linears' weights, and torchao's quantized tensors cannot be split that "
                         "way; use one device, ddp, zero1/2/3 or pp")
    if strategy is not None and getattr(type(strategy), "deepspeed_engine", None) is not None:
        raise ValueError(f"--model.quantize={mode} is not supported under DeepSpeed (its ZeRO flattens parameters "
                         "into fp buffers, losing torchao's quantized tensors): use zero1/2/3 (native) or ddp")
    if _zero3(strategy) and caps.data_parallel_size > 1 and mode == "int8":
        raise ValueError("--model.quantize=int8 is not supported under zero3: torchao's Int8Tensor has no FSDP2 "
                         "all-gather hooks (NF4Tensor has); use ddp/zero1/zero2 or --model.quantize=nf4")


def _full_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every DTensor (a tensor-parallel or ZeRO-3 shard) gathered to its full value, on every rank."""
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
