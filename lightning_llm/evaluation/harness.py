"""The lm-evaluation-harness model class over our decoder: :class:`HarnessLM`, a ``lm_eval.api.model.TemplateLM``.

It scores requests with the task that holds the model, whatever the layout: ``task.run_model`` for whole-sequence
log-probabilities (under tensor parallelism the vocab-sharded logits are gathered; under a pipeline the last stage's
output reaches every pipeline rank; rolling log-likelihoods, which need no argmax, take the model's fused loss path and
never form ``[B, S, V]`` logits) and :func:`lightning_llm.generation.generate` over ``task.decoding_model()`` for
``generate_until``. Every rank of a job scores every request in the same order and batches (the evaluator is told
``world_size=1``): tensor- and pipeline-parallel ranks must make the same model calls, and so must ZeRO-3 replicas,
whose forward gathers parameters. Requests are batched longest first; log-likelihood rows are right-padded (the
model is causal, so padding after a row changes none of its logits), prompts for generation left-padded.

What it computes follows lm-eval's ``HFLM`` (the reference it is tested against): the same tokenization
(``tokenizer.encode`` with the tokenizer's own special tokens; a string that starts with BOS is not given another),
the same context truncation (``max_length``, left), log-probabilities from the fp32 log-softmax of the logits,
``is_greedy`` as every continuation token being the argmax, rolling windows from ``lm_eval.utils``, generation
stopped at EOS (the tokenizer's and the generation config's) and cut at the first stop string.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from lightning_llm.generation import GenerationConfig, generate, strip_after_eos

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_GEN_KWARGS", "HarnessLM", "check_gen_kwargs"]

SUPPORTED_GEN_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "num_beams", "length_penalty",
                        "repetition_penalty")
"""Generation settings a task may ask for (after lm-eval's ``normalize_gen_kwargs``; ``until`` and the max-token
aliases are read separately): :class:`lightning_llm.generation.GenerationConfig`'s."""

def check_gen_kwargs(gen_kwargs: dict[str, Any] | None, *, where: str) -> None:
    """Refuse generation settings our generation does not implement, naming them (``where``: the task)."""
    kwargs = normalize_gen_kwargs(dict(gen_kwargs or {}))
    kwargs.pop("until", None)
    kwargs.pop("max_gen_toks", None)
    unsupported = sorted(k for k in kwargs if k not in SUPPORTED_GEN_KWARGS)
    if unsupported:
        raise ValueError(f"{where}: generation_kwargs {unsupported} are not supported by lightning_llm's generation "
                         f"(supported: until, max_gen_toks, {', '.join(SUPPORTED_GEN_KWARGS)})")


def _full(out: torch.Tensor) -> torch.Tensor:
    """A model output as a plain tensor (under tensor parallelism: the vocab-sharded logits, or replicated losses)."""
    return out.full_tensor() if isinstance(out, DTensor) else out


def _max_positions(model: Any) -> int:
    """``max_position_embeddings`` of the decoder inside ``model`` (a prompt-learning wrapper holds it as ``base``)."""
    config = getattr(model, "config", None) or getattr(getattr(model, "base", None), "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no model config: pass max_length")
    return int(config.max_position_embeddings)


class HarnessLM(TemplateLM):
    """lm-eval's model interface (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``, chat templates)
    over an :class:`~lightning_llm.tasks.base.LLMTask` whose model is a decoder, at any layout."""

    def __init__(self, task: Any, *, tokenizer: Any, max_length: int | None = None,
                 eos_token_ids: list[int] | None = None,
                 batch_size: int = 8, max_gen_toks: int = 256, seed: int = 1234, show_progress: bool = True,
                 cache_implementation: str = "dynamic", compile: bool = False) -> None:
        """
        Args:
            task: The LightningModule holding the model (set up by its Trainer: ``run_model``/``decoding_model``).
            tokenizer: A Hugging Face tokenizer (or the byte tokenizer) the model was trained with.
            max_length: Longest input in tokens (default: the model's ``max_position_embeddings``): longer contexts
                are cut from the left, rolling log-likelihoods use windows of this length.
            eos_token_ids: Tokens generation stops at besides the tokenizer's EOS (a generation config's, a chat
                template's end of turn).
            batch_size: Rows per model call.
            max_gen_toks: Default most new tokens of ``generate_until`` when a task names none.
            seed: Seed of the uniform draws of sampled generation (the same on every rank, so every rank picks the
                same tokens).
            show_progress: Show progress bars (global rank 0).
            cache_implementation: ``generate_until``'s KV cache (``GenerationConfig.cache_implementation``).
            compile: Compile ``generate_until``'s decoding step (``GenerationConfig.compile``).
        """
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
        self.task = task
        self.tokenizer = tokenizer
        self.max_length = int(max_length or _max_positions(task.model))
        self.batch_size = int(batch_size)
        self._max_gen_toks = int(max_gen_toks)
        self.show_progress = show_progress
        eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
        self.eos_ids = list(dict.fromkeys([*eos, *map(int, eos_token_ids or [])]))
        self._seed, self._draws = int(seed), 0
        self._decoding = dict(cache_implementation=cache_implementation, compile=compile)  # GenerationConfig's
        # Pipelines build one schedule per input shape: lengths rounded up to a multiple of this bound their number.
        self._pad_multiple = 32 if task.capabilities.pipelined else 1

    # ------------------------------------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def device(self) -> torch.device:
        return self.task.device

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tok_decode([self.prefix_token_id], False)):
            special = {"add_special_tokens": False}  # the text already starts with BOS: do not add another
        ids = list(self.tokenizer.encode(string, **special))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict[str, Any]:
        counts = getattr(self.task, "parameter_counts", None)  # (total, trainable), counted when the model was built
        return {"model_num_parameters": counts[0]} if counts else {}

    # ------------------------------------------------------------------------------------------ model calls
    @contextmanager
    def _scoring(self) -> Iterator[None]:
        """No gradients, the model in eval mode (dropout off) and the Trainer's precision (autocast), as in its
        validation steps; the training mode is restored afterwards (a callback scores during ``fit``)."""
        model = self.task.model
        was_training = model.training
        trainer = self.task._trainer
        precision = trainer.precision_plugin.forward_context() if trainer is not None else nullcontext()
        model.eval()
        try:
            with torch.no_grad(), precision:
                yield
        finally:
            model.train(was_training)

    def _scores(self, ids: torch.Tensor, targets: torch.Tensor, *, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities of ``targets`` [B, S] (-100: not scored, 0 there) given right-padded ``ids``
        [B, S] (no mask needed: the model is causal), and whether each target is the argmax (``greedy``).

        With ``greedy`` (or a model that does not compute its own loss): fp32 log-softmax of the logits (under tensor
        parallelism the vocab-sharded logits are gathered; under a pipeline the last stage's reach every rank).
        Without: the model's fused loss path (``labels=``, per-token losses), which never forms ``[B, S, V]`` logits
        and under a pipeline sends only ``[B, S]`` from the last stage."""
        ids, targets = ids.to(self.device), targets.to(self.device)
        if not greedy and getattr(self.task.model, "computes_loss", False):
            losses = _full(self.task.run_model(ids, labels=targets, reduction="none")).float()
            return -losses, torch.zeros_like(targets, dtype=torch.bool)
        logp = torch.log_softmax(_full(self.task.run_model(ids)).float(), dim=-1)  # [B, S, V]
        scored = targets.clamp(min=0)
        picked = logp.gather(-1, scored[..., None]).squeeze(-1).masked_fill(targets < 0, 0.0)
        return picked, logp.argmax(-1) == scored

    def _progress(self, total: int, desc: str, disable: bool) -> tqdm:
        return tqdm(total=total, desc=desc, disable=disable or not self.show_progress)

    # ------------------------------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              greedy: bool = True, **kwargs: Any) -> list[tuple[float, bool]]:
        """``(sum of the continuation's log-probs, whether every continuation token is the argmax)`` per
        ``(key, context ids, continuation ids)``, in request order (``greedy=False``: the flag is not computed)."""
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(f"a log-likelihood request with {len(context)} context and {len(continuation)} "
                                 f"continuation tokens: both must be non-empty, the continuation at most "
                                 f"max_length={self.max_length} tokens")
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = self._progress(len(requests), "Running loglikelihood requests", disable_tqdm)
        with self._scoring():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                # Context + continuation, cut from the left to max_length + 1 tokens; the last token is only scored.
                rows = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):] for i in chunk]
                width = -(-max(len(r) - 1 for r in rows) // self._pad_multiple) * self._pad_multiple
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                targets = torch.full((len(rows), width), -100, dtype=torch.long)
                for r, (row, i) in enumerate(zip(rows, chunk)):
                    n, m = len(row) - 1, len(requests[i][2])
                    ids[r, :n] = torch.tensor(row[:-1])
                    targets[r, n - m:n] = torch.tensor(row[-m:])  # the positions predicting the continuation
                logp, argmax = self._scores(ids, targets, greedy=greedy)
                scored = targets.to(argmax.device) >= 0
                for r, i in enumerate(chunk):
                    answer = (float(logp[r].double().sum()), bool(argmax[r][scored[r]].all()))
                    results[i] = answer
                    if requests[i][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.show_progress)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-probability, in disjoint windows of ``max_length`` tokens each conditioned on as much
        of the text before it as fits (``lm_eval.utils.get_rolling_token_windows``), the first on the prefix token."""
        owners: list[int] = []
        windows: list[tuple[Any, list[int], list[int]]] = []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                owners.append(i)
                windows.append((None, context, continuation))
        totals = [0.0] * len(requests)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm, greedy=False)
        for i, (ll, _) in zip(owners, scores):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ------------------------------------------------------------------------------------------ generation
    def _generation_config(self, kwargs: dict[str, Any], max_new_tokens: int) -> GenerationConfig:
        check_gen_kwargs(kwargs, where="generate_until")
        do_sample = bool(kwargs.get("do_sample", False))
        settings = {k: v for k, v in kwargs.items() if k in SUPPORTED_GEN_KWARGS and k != "do_sample"}
        if not do_sample:  # greedy (or beam search): the sampling settings do not apply
            settings = {k: v for k, v in settings.items() if k not in ("temperature", "top_k", "top_p")}
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, eos_token_id=self.eos_ids,
                                pad_token_id=self.eot_token_id if pad is None else int(pad), **settings,
                                **self._decoding)

    def _prompts(self, contexts: list[str], max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask [B, S], each context cut from the left to ``max_context`` tokens."""
        rows = [self.tok_encode(c, left_truncate_len=max_context) for c in contexts]
        width = -(-max(map(len, rows)) // self._pad_multiple) * self._pad_multiple
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):] = torch.tensor(row)
            mask[r, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context with its task's settings (greedy unless ``do_sample``), up to
        ``max_gen_toks`` new tokens or EOS, cut at the first of the ``until`` strings."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        results: list[str | None] = [None] * len(requests)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        bar = self._progress(len(requests), "Running generate_until requests", disable_tqdm)
        with self._scoring():
            for members in groups.values():
                kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
                max_new = int(kwargs.pop("max_gen_toks"))
                if max_new >= self.max_length:
                    raise ValueError(f"generate_until: max_gen_toks={max_new} leaves no room for a prompt in "
                                     f"max_length={self.max_length} tokens")
                cfg = self._generation_config(kwargs, max_new)
                members = sorted(members, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
                for start in range(0, len(members), self.batch_size):
                    chunk = members[start:start + self.batch_size]
                    texts = self._generate([requests[i].args[0] for i in chunk], cfg, self.max_length - max_new)
                    for i, text in zip(chunk, texts):
                        results[i] = postprocess_generated_text(text, until, None)
                        self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
                    bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

    def _generate(self, contexts: list[str], cfg: GenerationConfig, max_context: int) -> list[str]:
        ids, mask = self._prompts(contexts, max_context)
        uniforms = None
        if cfg.do_sample:  # the same draws on every rank (tensor/pipeline ranks must pick the same tokens)
            g = torch.Generator().manual_seed(self._seed + self._draws)
            self._draws += 1
            uniforms = torch.rand(len(contexts), cfg.max_new_tokens, generator=g, dtype=torch.float64)
            uniforms = uniforms.to(self.device)
        tokens = generate(self.task.decoding_model(), ids, mask, config=cfg, uniforms=uniforms)
        return [self.tok_decode(row) for row in strip_after_eos(tokens, cfg.eos_ids)]
