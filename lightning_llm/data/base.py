"""Shared datamodule plumbing: tokenizer loading, data-parallel-aware sampling, loaders."""

from __future__ import annotations

import importlib.util

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, SequentialSampler

from lightning_llm.checkpoint import first_line
from lightning_llm.data.tokenizers import ByteTokenizer
from lightning_llm.files import DataError, read_json, read_text

log = logging.getLogger(__name__)

BYTE_TOKENIZER = "byte"
"""``--data.tokenizer_dir=byte`` (``--tokenizer byte``): the built-in byte tokenizer (ids 0-258), chosen explicitly
(named sizes, debug)."""


def load_tokenizer(tokenizer_dir: str | None, *, param: str = "--data.tokenizer_dir") -> Any:
    """Load a tokenizer from a local directory (never from a hub), or the built-in byte tokenizer for ``"byte"``
    (:data:`BYTE_TOKENIZER`, taken wherever a tokenizer directory is), with an error naming ``param``."""
    from transformers import AutoTokenizer, BertTokenizer

    if not tokenizer_dir:
        raise ValueError(f"{param} is required (a local directory with vocab.txt or tokenizer.json, or byte)")
    if tokenizer_dir == BYTE_TOKENIZER:
        return ByteTokenizer()
    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{param}={tokenizer_dir}: directory not found (or byte: the built-in byte tokenizer)")
    files = {p.name for p in path.iterdir()}
    spm = sorted(files & {"spm.model", "spiece.model", "sentencepiece.bpe.model", "tokenizer.model"})
    if spm and "tokenizer.json" not in files and importlib.util.find_spec("sentencepiece") is None:
        raise ValueError(f"{param}={tokenizer_dir}: its tokenizer is a sentencepiece model ({spm[0]}) without "
                         "tokenizer.json, which transformers reads only with the sentencepiece package: pip install "
                         "sentencepiece (or save the tokenizer with tokenizer.json)")
    try:
        check_tokenizer_files(path)
        if "tokenizer_config.json" in files or "tokenizer.json" in files:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if "vocab.txt" in files:  # a bare WordPiece vocabulary (Chinese BERT/RoBERTa/Erlangshen)
            return BertTokenizer.from_pretrained(str(path), local_files_only=True)
    except DataError as e:
        raise DataError(f"{param}={tokenizer_dir}: cannot load tokenizer: {e}") from None
    except Exception as e:  # noqa: BLE001 - re-raised with the parameter named
        raise ValueError(f"{param}={tokenizer_dir}: cannot load tokenizer: {first_line(e)}") from e
    raise FileNotFoundError(
        f"{param}={tokenizer_dir}: no tokenizer.json, tokenizer_config.json or vocab.txt in that directory"
    )


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "config.json")
"""JSON files ``AutoTokenizer`` may read (``config.json``: for the model type when ``tokenizer_config.json`` names
no tokenizer class)."""


def check_tokenizer_files(path: Path) -> None:
    """Read a tokenizer directory's JSON files and ``vocab.txt`` before transformers does: :class:`DataError` naming
    the file and line that cannot be read or parsed (transformers' own errors name neither)."""
    for name in TOKENIZER_JSON_FILES:
        if (path / name).is_file():
            read_json(path / name)
    if (path / "vocab.txt").is_file():
        read_text(path / "vocab.txt")


def tokenizer_or_bytes(tokenizer_dir: str | None, *, param: str = "--data.tokenizer_dir") -> Any:
    """:func:`load_tokenizer`, or the built-in byte tokenizer for ``"byte"`` / ``None``. On the command line ``None``
    means the backbone's own tokenizer (:func:`lightning_llm.vocab.default_tokenizer_dir` fills it in); a task on an
    HF backbone refuses an implicit byte tokenizer (:func:`lightning_llm.vocab.check_backbone_tokenizer`)."""
    return ByteTokenizer() if tokenizer_dir is None else load_tokenizer(tokenizer_dir, param=param)


def eos_and_pad_ids(tokenizer: Any, tokenizer_dir: str | None) -> tuple[int, int]:
    """``(eos, pad)`` ids of a tokenizer that ends responses: EOS, or [SEP] for BERT-style vocabularies; pad falls
    back to EOS. ``ValueError`` naming ``--data.tokenizer_dir`` when it has neither EOS nor SEP."""
    eos = tokenizer.eos_token_id
    if eos is None:  # BERT-style vocabularies: [SEP] ends a response
        eos = getattr(tokenizer, "sep_token_id", None)
    if eos is None:
        raise ValueError(f"--data.tokenizer_dir={tokenizer_dir}: the tokenizer has no EOS (or SEP) token")
    pad = tokenizer.pad_token_id
    return int(eos), int(pad) if pad is not None else int(eos)


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Rows an embedding needs for this tokenizer (largest id + 1; vocab files can hold duplicate lines)."""
    return max(tokenizer.get_vocab().values()) + 1


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, S], attention_mask [B, S]) padded on the left."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, s in enumerate(sequences):
        if len(s):
            ids[i, longest - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, longest - len(s):] = 1
    return ids, mask


class EncodedDataset(Dataset):
    """Pre-tokenized examples held in memory: a list of dicts (padding happens per batch in the collate)."""

    def __init__(self, examples: list[dict[str, Any]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.examples[i]


_CHUNK = 1 << 16  # indices turned into Python ints at a time


class ResumableDistributedSampler(DistributedSampler):
    """A seeded DistributedSampler that can skip the first samples of one epoch (a mid-epoch resume).

    ``len()`` stays the full epoch length so Lightning's batch counters, restored from the checkpoint, line up
    with the shorter iteration that follows. The indices are torch's DistributedSampler's, kept in one int32 tensor
    (4 bytes a sample) instead of its Python lists (~70 bytes a sample: 200 MB per rank for 3 M blocks of a 1 GiB
    pretraining corpus).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_epoch: int | None = None
        self.skip_samples = 0

    def epoch_indices(self) -> torch.Tensor:
        """This rank's indices of the current epoch: ``DistributedSampler.__iter__``'s order, as a tensor."""
        n = len(self.dataset)
        dtype = torch.int32 if self.total_size < 2**31 else torch.int64
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g, dtype=dtype)  # the same values as the int64 default
        else:
            indices = torch.arange(n, dtype=dtype)
        padding = self.total_size - n
        if padding > 0:  # not drop_last: repeat the first indices to make the total divisible by the replicas
            indices = torch.cat([indices, indices.repeat(math.ceil(padding / n))[:padding]])
        return indices[:self.total_size][self.rank::self.num_replicas]

    def __iter__(self):  # noqa: ANN204 - Iterator[int]
        indices = self.epoch_indices()
        if self.skip_epoch == self.epoch and self.skip_samples:
            indices = indices[self.skip_samples:]
            self.skip_epoch, self.skip_samples = None, 0  # only once
        return (i for start in range(0, len(indices), _CHUNK) for i in indices[start:start + _CHUNK].tolist())


def check_batch_sizes(batch_size: int, eval_batch_size: int | None) -> None:
    """``ValueError`` naming the parameter for a batch size below 1 (``eval_batch_size=None`` means ``batch_size``;
    0 used to fall back to it silently, -1 reached the DataLoader, whose error names neither parameter)."""
    if batch_size < 1:
        raise ValueError(f"--data.batch_size must be >= 1, got {batch_size}")
    if eval_batch_size is not None and eval_batch_size < 1:
        raise ValueError(f"--data.eval_batch_size must be >= 1 (or null for --data.batch_size), got {eval_batch_size}")


# Lightning warns on every mid-epoch resume that the training DataLoader "is not resumable" because the loader
# itself has no state_dict. Ours is: the datamodule's state_dict records the consumed batches and the next loader's
# sampler skips exactly those (see make_loader; tests/checkpoints/test_reliability.py checks the losses match an uninterrupted
# run). The filter is installed only once such a skip is set up, and matches only that message.
_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is"


def _silence_not_resumable_warning() -> None:
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE_WARNING, category=PossibleUserWarning)


class LLMDataModule(pl.LightningDataModule):
    """Base for our datamodules: batch sizes, workers, and a training sampler keyed by data-parallel rank.

    The training loader always uses a seeded :class:`DistributedSampler` built from the strategy's
    ``distributed_sampler_kwargs`` (1 replica on one device). So one device with batch 8 and two
    data-parallel ranks with batch 4 see the same samples in every global batch, and pipeline/tensor
    parallel ranks of one data-parallel group see identical batches (our strategies report the ``dp``
    mesh coordinates there, not the global rank).
    """

    def __init__(self, *, batch_size: int = 32, eval_batch_size: int | None = None, num_workers: int = 0,
                 seed: int = 42) -> None:
        super().__init__()
        check_batch_sizes(batch_size, eval_batch_size)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self._resume: dict[str, int] | None = None

    def _replicas(self) -> tuple[int, int]:
        trainer = self.trainer  # None outside a Trainer
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    # Mid-epoch resume: the checkpoint records how many training batches of which epoch were consumed; on
    # load the next training loader skips exactly those (same seed + epoch => same permutation).
    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        if trainer is None or trainer.state.fn != "fit":
            return {}
        loop = trainer.fit_loop.epoch_loop
        batches = int(loop.batch_progress.current.processed)
        # "samples" counts the global batch (x data-parallel replicas) so a resume at another dp degree with the
        # same global batch skips exactly the consumed samples.
        return {"epoch": trainer.current_epoch, "batches": batches,
                "samples": batches * self.batch_size * self._replicas()[0]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "epoch" in state_dict:
            self._resume = {"epoch": int(state_dict["epoch"]), "batches": int(state_dict["batches"]),
                            "samples": int(state_dict.get("samples", -1))}

    def make_loader(self, dataset: Dataset, *, train: bool, collate_fn: Callable | None = None,
                    shard_eval: bool = False) -> DataLoader:
        """The training loader (seeded, data-parallel-rank-keyed, resumable) or an evaluation loader. ``shard_eval``
        (validation/test of large datasets, never predict): shard it here as Lightning would (a padded
        DistributedSampler without shuffling), with the tensor-backed sampler instead of Lightning's Python lists."""
        if train:
            num_replicas, rank = self._replicas()
            sampler = ResumableDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                                                  seed=self.seed)
            batch_size = self.batch_size
            if self._resume is not None:
                sampler.skip_epoch = self._resume["epoch"]
                sampler.skip_samples = self._resume["batches"] * batch_size
                if self._resume["samples"] >= 0:  # global samples -> this replica's share of them
                    sampler.skip_samples = self._resume["samples"] // num_replicas
                self._resume = None
                _silence_not_resumable_warning()
        elif shard_eval and self._replicas()[0] > 1:
            num_replicas, rank = self._replicas()
            sampler = ResumableDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
            batch_size = self.eval_batch_size
        else:
            # Lightning shards evaluation loaders itself (padded for val/test, unrepeated for predict).
            sampler, batch_size = SequentialSampler(dataset), self.eval_batch_size
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=self.num_workers,
                          collate_fn=collate_fn, persistent_workers=self.num_workers > 0)
