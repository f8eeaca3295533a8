"""The vocabulary a run trains with: which tokenizer goes with the backbone, and growing a checkpoint's embeddings
to a larger tokenizer.

* **The backbone's tokenizer is the default.** A Hugging Face backbone directory brings its own tokenizer: without
  ``--data.tokenizer_dir`` the command line gives the datamodule that directory (:func:`default_tokenizer_dir`,
  applied once in ``LLMCLI.before_instantiate_classes``, where the parsed ``--model`` and ``--data`` meet before
  either is built). A backbone directory without tokenizer files and no ``--data.tokenizer_dir`` is refused there,
  naming both parameters. The built-in byte tokenizer stays available as an explicit choice
  (``--data.tokenizer_dir=byte``), and is the default of named sizes (``debug``, ...). A task built outside the
  command line checks the same rule at build time (:func:`check_backbone_tokenizer`): an HF backbone never trains on
  byte ids by accident.
* **Vocabulary extension** (``--model.resize_embeddings=true``, the Chinese-LLaMA-Alpaca recipe): a tokenizer with
  more ids than the checkpoint's embedding grows ``embed_tokens`` and ``lm_head`` (tied or not) to the tokenizer's
  size (:func:`resize_embeddings`). New rows are drawn as transformers' ``resize_token_embeddings(mean_resizing=True)``
  draws them: from a normal with the old rows' mean and ``1e-9`` times their covariance (the mean itself when that is
  not positive definite), here from a generator seeded by the model's ``init_seed``, so every rank of a sharded run
  draws the same rows. With PEFT the new rows must be trained: ``modules_to_save`` has to hold ``embed_tokens`` and
  ``lm_head`` (:func:`check_new_rows_trained`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_llm.data.base import BYTE_TOKENIZER
from lightning_llm.data.tokenizer_files import has_tokenizer
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.models.init import name_seed

log = logging.getLogger(__name__)

__all__ = ["added_rows", "check_backbone_tokenizer", "check_new_rows_trained", "default_tokenizer_dir",
           "mean_resized_rows", "resize_embeddings"]

MEAN_RESIZING_EPS = 1e-9
"""Scale of the old rows' covariance for the new rows (transformers' ``_init_added_embeddings_weights_with_mean``)."""


def _is_hf_dir(backbone: Any) -> bool:
    return isinstance(backbone, str) and Path(backbone).expanduser().is_dir()


# ---------------------------------------------------------------------------------------------------- tokenizer


def default_tokenizer_dir(backbone: Any, tokenizer_dir: str | None) -> str | None:
    """The ``--data.tokenizer_dir`` to use: the given one; else, for an HF backbone directory, the backbone itself
    (it must hold tokenizer files); else ``None`` (the byte tokenizer of named sizes). ``ValueError`` naming both
    parameters for an HF backbone without tokenizer files."""
    if tokenizer_dir is not None or not _is_hf_dir(backbone):
        return tokenizer_dir
    if not has_tokenizer(Path(backbone).expanduser()):
        raise ValueError(f"--model.backbone={backbone} holds no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, vocab.txt): pass --data.tokenizer_dir=DIR with the tokenizer the "
                         "checkpoint was trained with (or --data.tokenizer_dir=byte to train on byte ids on purpose)")
    log.info("--data.tokenizer_dir not given: using the tokenizer of --model.backbone=%s", backbone)
    return str(backbone)


def check_backbone_tokenizer(backbone: Any, datamodule: Any) -> None:
    """Refuse an HF backbone with the byte tokenizer the datamodule fell back to (``tokenizer_dir=None``): only an
    explicit ``tokenizer_dir="byte"`` trains a real checkpoint on byte ids."""
    tok = getattr(datamodule, "tokenizer", None)
    if not (_is_hf_dir(backbone) and isinstance(tok, ByteTokenizer)):
        return
    if getattr(datamodule, "tokenizer_dir", None) == BYTE_TOKENIZER:
        return
    raise ValueError(f"--model.backbone={backbone} is a Hugging Face checkpoint but the datamodule fell back to the "
                     "built-in byte tokenizer (--data.tokenizer_dir not given): pass --data.tokenizer_dir=DIR (the "
                     "backbone directory when it holds its tokenizer; the command line does this by default), or "
                     "--data.tokenizer_dir=byte to train on byte ids on purpose")


# ---------------------------------------------------------------------------------------------------- resizing


def mean_resized_rows(old: Tensor, n: int, *, generator: torch.Generator) -> Tensor:
    """``n`` new rows [n, H] for the matrix ``old`` [V, H]: samples of N(mean, 1e-9 * cov) of its rows (fp32 math),
    or the mean repeated when that covariance is not positive definite, as transformers' mean resizing."""
    w = old.detach().to(torch.float32)
    mean = w.mean(dim=0)  # [H]
    centered = w - mean
    cov = MEAN_RESIZING_EPS * (centered.T @ centered) / w.shape[0]  # [H, H]
    chol, info = torch.linalg.cholesky_ex(cov)
    if int(info) != 0:
        log.info("embedding covariance is not positive definite: new rows are the mean row")
        return mean.expand(n, -1).to(old.dtype).clone()
    z = torch.randn(n, w.shape[1], generator=generator, dtype=torch.float32)  # [n, H]
    return (mean + z @ chol.T).to(old.dtype)


def _grow(module: nn.Module, new_rows: Tensor, *, attr: str) -> None:
    """Append ``new_rows`` to ``module.weight`` (a new Parameter, same dtype/requires_grad) and update ``attr``."""
    old = module.weight
    module.weight = nn.Parameter(torch.cat([old.detach(), new_rows.to(old.device)]), requires_grad=old.requires_grad)
    setattr(module, attr, module.weight.shape[0])


def _generator(model: nn.Module, what: str) -> torch.Generator:
    seed = int(getattr(model, "init_seed", 0))
    return torch.Generator().manual_seed(name_seed(seed, f"resize:{what}") % 2**63)


@torch.no_grad()
def resize_embeddings(model: nn.Module, vocab_size: int) -> int:
    """Grow the decoder ``model``'s ``embed_tokens`` and ``lm_head`` (tied: one draw, re-tied; untied: each from its
    own rows; a bias from its mean) to ``vocab_size`` rows and set ``config.vocab_size``; returns the rows added.
    The model must be built whole (not on the meta device): the new rows are functions of all old rows."""
    config = model.config
    embed, head = model.embed_tokens, model.lm_head
    have = int(embed.weight.shape[0])
    n = vocab_size - have
    if n <= 0:
        return 0
    if embed.weight.is_meta:
        raise ValueError("resize_embeddings: the model is on the meta device; build it whole to resize")
    _grow(embed, mean_resized_rows(embed.weight, n, generator=_generator(model, "embed_tokens")),
          attr="num_embeddings")
    if head is None:  # a sequence classifier (a reward model's score head): the embedding alone
        model.config = config.replace(vocab_size=vocab_size)
    elif config.tie_embeddings:
        model.config = config.replace(vocab_size=vocab_size)
        model.tie_weights()
        head.out_features = vocab_size
    else:
        _grow(head, mean_resized_rows(head.weight, n, generator=_generator(model, "lm_head")), attr="out_features")
        if head.bias is not None:
            b = head.bias.detach()
            head.bias = nn.Parameter(torch.cat([b, b.float().mean().expand(n).to(b.dtype)]),
                                     requires_grad=head.bias.requires_grad)
        model.config = config.replace(vocab_size=vocab_size)
    model.vocab_resized_from = have  # type: ignore[attr-defined] - read by check_new_rows_trained's caller
    log.info("embeddings resized from %d to %d rows (mean resizing; tie_embeddings=%s)", have, vocab_size,
             config.tie_embeddings)
    return n


def added_rows(model: nn.Module) -> int:
    """Rows :func:`resize_embeddings` added to ``model`` (0 if it was not resized)."""
    old = getattr(model, "vocab_resized_from", None)
    return 0 if old is None else int(model.config.vocab_size) - int(old)


def check_new_rows_trained(peft_cfg: Any) -> None:
    """With PEFT the base is frozen: rows added by resizing would stay at their initial draw. Require
    ``modules_to_save`` to hold ``embed_tokens`` and ``lm_head`` (what the Chinese-LLaMA-Alpaca recipe trains)."""
    if peft_cfg is None:
        return
    saved = set((peft_cfg.lora.modules_to_save or []) if peft_cfg.method == "lora"
                else (peft_cfg.options.get("modules_to_save") or []))
    lacking = sorted({"embed_tokens", "lm_head"} - saved)
    if lacking:
        raise ValueError(f"--model.resize_embeddings=true with --model.peft/--model.lora: the new vocabulary rows must "
                         f"be trained, but modules_to_save lacks {lacking}: set --model.lora.modules_to_save="
                         "[embed_tokens,lm_head]")


# ---------------------------------------------------------------------------------------------------- merge / export


def trained_vocab_size(tensors: dict[str, Tensor]) -> int | None:
    """Rows of the embedding / LM head an adapter or PEFT checkpoint trained in full (``modules_to_save``), or None."""
    rows = [int(v.shape[0]) for k, v in tensors.items() if v.dim() == 2 and "lora_" not in k
            and any(a in ("embed_tokens", "lm_head") for a in k.split("."))]
    return max(rows) if rows else None


def grow_base(model: nn.Module, vocab_size: int | None, peft_cfg: Any, *, where: str) -> None:
    """Resize the frozen base ``model`` of a merge/export to the vocabulary its adapter was trained with (the run
    resized it): the adapter's ``modules_to_save`` replace ``embed_tokens`` and ``lm_head`` whole, so the base's new
    rows are never used; an adapter without both is refused (its new rows would be unknown)."""
    have = int(model.config.vocab_size)
    if vocab_size is None or vocab_size <= have:
        return
    try:
        check_new_rows_trained(peft_cfg)
    except ValueError:
        raise ValueError(f"{where}: its vocabulary ({vocab_size} rows) is larger than the base's ({have}) but its "
                         "modules_to_save do not hold both embed_tokens and lm_head: the added rows are "
                         "unknown") from None
    resize_embeddings(model, vocab_size)
