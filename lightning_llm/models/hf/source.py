"""Reading a local HF checkpoint lazily: the tensors' names and shapes up front, their values element range by
element range when a (possibly sharded) parameter is materialized.

:class:`CheckpointFiles` indexes ``model.safetensors``, sharded ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json``, or ``pytorch_model.bin`` (optionally sharded). Safetensors files are opened per read
and only the requested slice is read (``safe_open(...).get_slice``), so a rank that owns a row block of a weight reads
those rows only; a column block (a row-parallel weight) reads each row's columns, and the file mapping is closed
after every read, so resident memory never holds more than one tensor's pages. ``.bin`` files are memory-mapped
(zip format) or loaded whole (legacy format).

:class:`HFWeightsSource` is what a lazily loaded model carries as ``weights_source`` (:mod:`.init`): our parameter
name -> the checkpoint tensor (plus the conversion of entries that are not one-to-one, e.g. GPT-2's fused ``c_attn``
or Baichuan's ``W_pack`` row order; those are read whole, one tensor at a time, then sliced).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_llm.checkpoint import check_torch_file, first_line, loading
from lightning_llm.files import DataError, read_json

log = logging.getLogger(__name__)

__all__ = ["CheckpointFiles", "HFWeightsSource", "Mapped", "MappedReader", "Mxfp4Mapped", "PermutedMapped",
           "RowsMapped", "StackedMapped", "dequantize_mxfp4"]

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _as_slices(index: Sequence[Tensor]) -> tuple[tuple[slice, ...], tuple[Tensor | None, ...]]:
    """Per dim: the bounding slice of an index, and the positions to pick inside it (None when the index is the
    whole contiguous range, the usual case of a tensor-parallel or FSDP shard)."""
    slices, picks = [], []
    for idx in index:
        if idx.numel() == 0:
            slices.append(slice(0, 0))
            picks.append(None)
            continue
        lo, hi = int(idx.min()), int(idx.max()) + 1
        slices.append(slice(lo, hi))
        contiguous = hi - lo == idx.numel() and bool((idx[1:] > idx[:-1]).all()) if idx.numel() > 1 else True
        picks.append(None if contiguous else (idx - lo).cpu())
    return tuple(slices), tuple(picks)


def _pick(t: Tensor, picks: Sequence[Tensor | None]) -> Tensor:
    for d, p in enumerate(picks):
        if p is not None:
            t = t.index_select(d, p)
    return t


class CheckpointFiles:
    """The tensors of a local HF checkpoint directory by key: shapes and dtypes without reading values."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.format, self.file_of = self._index(directory)
        self.bytes_read = 0
        """Bytes of tensor data read so far (what a sharded load saves is visible here)."""
        self._bin: dict[str, Tensor] = {}  # .bin checkpoints: key -> (memory-mapped) tensor
        self._meta: dict[str, Tensor] = {}
        if self.format == "safetensors":
            for f in sorted(set(self.file_of.values())):
                with _safetensors(f) as handle:
                    for key in handle.keys():
                        if self.file_of.get(key) == f:
                            sl = handle.get_slice(key)
                            self._meta[key] = torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()],
                                                          device="meta")
        else:
            for f in sorted(set(self.file_of.values())) or [directory / "pytorch_model.bin"]:
                self._bin.update(_torch_weights(f))
            self.file_of = {k: self.file_of.get(k, directory / "pytorch_model.bin") for k in self._bin}
            self._meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in self._bin.items()}

    @staticmethod
    def _index(directory: Path) -> tuple[str, dict[str, Path]]:
        st, st_index = directory / "model.safetensors", directory / "model.safetensors.index.json"
        pt, pt_index = directory / "pytorch_model.bin", directory / "pytorch_model.bin.index.json"
        if st.is_file():
            return "safetensors", _keys_of_safetensors(st)
        if st_index.is_file():
            return "safetensors", _sharded(directory, st_index)
        if pt.is_file():
            return "bin", {}
        if pt_index.is_file():
            return "bin", _sharded(directory, pt_index)
        raise FileNotFoundError(
            f"no weights in {directory}: expected one of model.safetensors, model.safetensors.index.json, "
            f"pytorch_model.bin, pytorch_model.bin.index.json")

    def keys(self) -> list[str]:
        return list(self._meta)

    def meta(self, key: str) -> Tensor:
        """A meta tensor with the stored shape and dtype."""
        return self._meta[key]

    def read(self, key: str, index: Sequence[Tensor] | None = None) -> Tensor:
        """The tensor ``key`` (whole, or the elements ``index``: one global index per dim), in its stored dtype."""
        t = self._read(key, index)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _read(self, key: str, index: Sequence[Tensor] | None) -> Tensor:
        if self.format == "bin":
            t = self._bin[key]
            if index is None:
                return t.clone()
            slices, picks = _as_slices(index)
            return _pick(t[slices], picks).clone()
        from safetensors import safe_open

        with safe_open(str(self.file_of[key]), framework="pt") as handle:  # closed after each read: see module doc
            if index is None:
                return handle.get_tensor(key)
            slices, picks = _as_slices(index)
            return _pick(handle.get_slice(key)[slices], picks)


def _keys_of_safetensors(path: Path) -> dict[str, Path]:
    with _safetensors(path) as handle:
        return {k: path for k in handle.keys()}


def _safetensors(path: Path) -> Any:
    """``safe_open(path)``; a file whose header cannot be read (cut, not safetensors) raises :class:`DataError`
    naming it (safetensors' own error does not). Opening checks that the file covers every tensor it indexes."""
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike mean the file is unreadable
        raise DataError(f"{path}: not a readable safetensors file ({first_line(e)})") from None


def _torch_weights(path: Path) -> dict[str, Tensor]:
    """A ``pytorch_model.bin`` state dict (memory-mapped when possible); a cut or corrupt file raises one error
    naming it."""
    name = str(path)
    check_torch_file(path, name=name)
    with loading(name):
        try:
            return torch.load(name, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) format cannot be memory-mapped
            return torch.load(name, map_location="cpu", weights_only=True)


def _sharded(directory: Path, index: Path) -> dict[str, Path]:
    weight_map: dict[str, str] = read_json(index)["weight_map"]
    out: dict[str, Path] = {}
    for key, shard in weight_map.items():
        sp = directory / shard
        if not sp.is_file():
            raise FileNotFoundError(f"{index} names shard {shard!r}, but {sp} does not exist")
        out[key] = sp
    return out


@dataclass(frozen=True)
class Mapped:
    """One of our parameters in the checkpoint: stored under ``key``; ``split`` (for entries that are not
    one-to-one) turns the stored tensor into the parts ``e.ours``, of which this parameter is ``part``."""

    key: str
    part: int = 0
    split: Callable[[Tensor], Sequence[Tensor]] | None = None


class MappedReader(Protocol):
    """One of our parameters stored other than as one tensor to slice: it reads the elements ``index`` (one global
    index per dim of our parameter) itself, reading only the stored elements they need."""

    def read(self, files: CheckpointFiles, index: Sequence[Tensor]) -> Tensor: ...


@dataclass(frozen=True)
class StackedMapped:
    """One of our fused expert tensors [E, R, C] in the checkpoint: expert ``e`` is the row concatenation of the
    stored tensors ``keys[e]`` (of ``rows`` rows each). A read of some experts' elements reads only theirs."""

    keys: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]

    def read(self, files: CheckpointFiles, index: Sequence[Tensor]) -> Tensor:
        experts, rows, cols = (i.cpu() for i in index)
        out = torch.empty(len(experts), len(rows), len(cols), dtype=files.meta(self.keys[0][0]).dtype)
        for n, e in enumerate(experts.tolist()):
            start = 0
            for key, r in zip(self.keys[e], self.rows):
                mine = (rows >= start) & (rows < start + r)  # the index's rows in this part
                if bool(mine.any()):
                    out[n, mine] = files.read(key, (rows[mine] - start, cols))
                start += r
        return out


@dataclass(frozen=True)
class RowsMapped:
    """Our parameter = the rows ``start ..`` of the stored tensor ``key`` (a block of a fused projection, e.g. Phi-3's
    ``qkv_proj``): a read of some of its rows reads only those."""

    key: str
    start: int

    def read(self, files: CheckpointFiles, index: Sequence[Tensor]) -> Tensor:
        rows, *rest = (i.cpu() for i in index)
        return files.read(self.key, (rows + self.start, *rest))


def interleaved_rows(rows: Tensor, total: int) -> Tensor:
    """Positions in a dim that alternates gate and up entries (``g0, u0, g1, ...``, ``total`` of them) of our rows
    ``rows`` of the gate half then the up half."""
    half = total // 2
    return torch.where(rows < half, 2 * rows, 2 * (rows - half) + 1)


@dataclass(frozen=True)
class PermutedMapped:
    """Our tensor = the stored tensor ``key`` with dims permuted (our dim ``d`` is its dim ``dims[d]``) and, with
    ``interleaved``, our dim 1 in gate-then-up order where the stored dim alternates them
    (:class:`~.record.entries.Fused`). A read of some experts reads only theirs."""

    key: str
    dims: tuple[int, ...]
    interleaved: bool = False

    def read(self, files: CheckpointFiles, index: Sequence[Tensor]) -> Tensor:
        stored: list[Tensor] = [torch.empty(0)] * len(self.dims)
        shape = files.meta(self.key).shape
        for d, i in enumerate(index):
            i = i.cpu()
            stored[self.dims[d]] = interleaved_rows(i, shape[self.dims[d]]) if self.interleaved and d == 1 else i
        return files.read(self.key, stored).permute(*self.dims)


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 (E2M1) code, by code."""


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 (OCP microscaling, as gpt-oss is published) -> float32: ``blocks`` [..., G, 16] uint8 hold 32 FP4 codes
    per block, two per byte (the low nibble first), ``scales`` [..., G] uint8 one power of two per block (its exponent
    + 127): [..., G * 32], every value exact (an FP4 value times a power of two)."""
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return values.flatten(-2)


@dataclass(frozen=True)
class Mxfp4Mapped:
    """Our tensor [E, R, C] stored as MXFP4 ``blocks`` [E, R, C/32, 16] and ``scales`` [E, R, C/32] (our dim 1 in
    gate-then-up order with ``interleaved``): a read dequantizes only the experts and rows it needs."""

    blocks: str
    scales: str
    interleaved: bool = False

    def read(self, files: CheckpointFiles, index: Sequence[Tensor]) -> Tensor:
        experts, rows, cols = (i.cpu() for i in index)
        g, b = files.meta(self.blocks).shape[2:]
        if self.interleaved:
            rows = interleaved_rows(rows, files.meta(self.blocks).shape[1])
        blocks = files.read(self.blocks, (experts, rows, torch.arange(g), torch.arange(b)))
        scales = files.read(self.scales, (experts, rows, torch.arange(g)))
        return dequantize_mxfp4(blocks, scales).index_select(2, cols)


class HFWeightsSource:
    """:class:`~lightning_llm.models.init.WeightsSource` of a local HF checkpoint (see the module docstring)."""

    def __init__(self, files: CheckpointFiles, mapping: dict[str, Mapped | MappedReader], *, where: str) -> None:
        self.files, self.mapping, self.where = files, mapping, where

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read so far (what a sharded load saves is visible here)."""
        return self.files.bytes_read

    def has(self, name: str) -> bool:
        return name in self.mapping

    def read(self, name: str, index: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        m = self.mapping[name]
        if not isinstance(m, Mapped):  # a reader of its own (experts: some of them, another layout)
            t = m.read(self.files, index)
        elif m.split is None:
            t = self.files.read(m.key, index)
        else:  # not one-to-one: convert the whole stored tensor, then take our part's elements
            whole = self.files.read(m.key)
            slices, picks = _as_slices(index)
            t = _pick(m.split(whole)[m.part][slices], picks)
        return t.to(dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> HFWeightsSource:
        return self  # a frozen copy of a lazily loaded model reads the same files (nothing mutable but a counter)
