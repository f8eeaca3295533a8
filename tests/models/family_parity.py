"""A decoder family against transformers, as each family's tests check it: a checkpoint written by
``save_pretrained`` in the test (a tiny fp32 model, perturbed so that norms, biases and every rope parameter matter),
batches with right and left padding (``padded_lm_batch``):

* logits on the real tokens of padded rows, eager and lazy loads;
* the loss and every gradient of a training forward (dropout off);
* the export: transformers' own key set, reloaded by transformers with the same logits.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.conftest import loaded_logits_error, padded_lm_batch

VOCAB = 96
SEQ = 12
LLAMA_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
"""A tiny decoder's transformers config keys (EOS 2, as :func:`generation_equal` stops at)."""


def perturbed(model: Any, seed: int = 0, scale: float = 0.1) -> Any:
    """``model`` with every parameter moved by N(0, ``scale``) (norm weights ~1 +- 0.1, biases ~ +-0.1 by default);
    returned in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def write_perturbed(model: Any, out: Path, seed: int = 0, scale: float = 0.1) -> Any:
    """``model`` (transformers') :func:`perturbed`, saved to ``out``; returned in eval mode."""
    perturbed(model, seed, scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out))
    return model


def llama_names(tensors: dict[str, torch.Tensor], norms: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """transformers' tensors of a LLaMA-layout model (parameters or their gradients) under our names (``model.``
    dropped, the block's norms renamed: ``norms``, LLaMA's by default)."""
    norms = LLAMA_NORMS if norms is None else norms
    out = {}
    for n, t in tensors.items():
        n = n.removeprefix("model.")
        module, _, leaf = n.rpartition(".")
        parent, _, last = module.rpartition(".")
        out[f"{parent}.{norms.get(last, last)}.{leaf}" if parent else n] = t
    return out


def logits_error(model: Any, ref: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """``max |logits - ref|`` on the real tokens."""
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        out = out.logits if hasattr(out, "logits") else out
    return float((out - ref)[mask.bool()].abs().max())


def check_against_transformers(hf: Any, tmp_path: Path, *,
                               in_our_layout: Callable[[Any, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
                               | None = None) -> dict[str, float]:
    """Every check of the module docstring for ``hf`` (a transformers ``...ForCausalLM`` written to ``tmp_path /
    "src"`` by :func:`write_perturbed`); ``in_our_layout``: its gradients under our names (default
    :func:`llama_names`). The errors, by name (each asserted below 1e-5 here)."""
    from safetensors import safe_open

    from lightning_llm.models import load_hf, save_hf

    ids, mask, labels = padded_lm_batch(VOCAB, SEQ)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    ours = load_hf(tmp_path / "src")[0]
    err = {"logits": logits_error(ours, ref, ids, mask),
           "lazy": loaded_logits_error(tmp_path / "src", ids, mask, ref, lazy=True)}

    save_hf(ours, tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        type(hf)(hf.config).save_pretrained(str(tmp_path / "own"))  # transformers' own key set
        back = type(hf).from_pretrained(str(tmp_path / "out")).eval()
    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "out", tmp_path / "own")]
    assert keys[0] == keys[1], (sorted(keys[0] - keys[1]), sorted(keys[1] - keys[0]))
    err["export"] = logits_error(back, ref, ids, mask)

    hf.train()
    out = hf(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ours.train()
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    loss = ours(ids, attention_mask=mask, labels=shifted)
    loss.backward()
    err["loss"] = abs(float(loss.detach()) - float(out.loss.detach()))
    grads = {n: p.grad for n, p in hf.named_parameters()}
    theirs = in_our_layout(hf, grads) if in_our_layout is not None else llama_names(grads)
    assert set(theirs) == {n for n, _ in ours.named_parameters()}, set(theirs) ^ {n for n, _ in ours.named_parameters()}
    err["gradients"] = max(float((theirs[n] - p.grad).abs().max()) for n, p in ours.named_parameters())
    hf.eval()
    assert max(err.values()) < 1e-5, err
    return err


def check_and_generate(hf: Any, tmp_path: Path, label: str) -> Any:
    """:func:`check_against_transformers` (LLaMA's names), then greedy generation from three left-padded prompts
    equal to transformers' (:func:`generation_equal`); both printed under ``label``. Our model loaded from
    ``tmp_path / "src"``, in eval mode."""
    from lightning_llm.models import load_hf

    err = check_against_transformers(hf, tmp_path)
    ours = load_hf(tmp_path / "src")[0].eval()
    tokens = generation_equal(hf, ours, [[5, 9, 17, 3, 44, 7], [7, 8], [50, 51, 52]])
    print(f"{label}: {', '.join(f'{k} {v:.1e}' for k, v in err.items())}; greedy generation: {tokens} tokens as "
          "transformers'")
    return ours


def generation_equal(hf: Any, ours: Any, prompts: list[list[int]], *, beams: int = 1, cache: str = "dynamic",
                     new: int = 10) -> int:
    """Our generation from left-padded ``prompts`` equals transformers' token for token (``new`` tokens, greedy or
    beam search, EOS 2); the tokens generated."""
    from lightning_llm.data.base import left_pad
    from lightning_llm.generation import GenerationConfig, generate, strip_after_eos

    ids, mask = left_pad(prompts, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, num_beams=beams, do_sample=False,
                           pad_token_id=0, eos_token_id=2)[:, ids.shape[1]:]
    got = generate(ours, ids, mask, config=GenerationConfig(max_new_tokens=new, num_beams=beams, eos_token_id=2,
                                                             cache_implementation=cache))
    rows = [strip_after_eos(t, [2]) for t in (got, want)]
    assert rows[0] == rows[1] and max(len(r) for r in rows[0]) > 4, (beams, cache, rows)
    return sum(map(len, rows[0]))


def estimated_parameters(cls: Any, directory: Path) -> tuple[int, int]:
    """``(lightning_llm estimate's parameter count, transformers' own)`` of ``cls``'s default config (its published
    shape, written to ``directory``, no weights)."""
    import contextlib
    import io
    import json

    from lightning_llm.cli import main

    config = cls.config_class()
    config.architectures = [cls.__name__]
    config.save_pretrained(str(directory))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", f"--model={directory}", "--seq-len=4096", "--json"]) == 0
    with torch.device("meta"):
        reference = sum(p.numel() for p in cls(config).parameters())
    return json.loads(out.getvalue())["parameters"], reference
