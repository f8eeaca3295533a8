"""Which parameters Muon updates, decided by their role in the model (not by shape alone), and the matrices each one
holds.

Muon takes every hidden weight matrix of a registered family's blocks (``ParallelSpec.layers``): the ``weight`` of
each ``nn.Linear`` there (attention and MLP projections, MLA's, Gated DeltaNet's and DeBERTa's, shared experts) and
the routed experts' stacked ``gate_up_proj`` / ``down_proj`` (``[E, rows, cols]``: ``E`` matrices). AdamW takes the
rest: embeddings, the LM / score / value heads and anything else outside the blocks (a task's own modules), norms,
biases, 1-D tensors, the MoE router (a classifier over the experts, like a head) and one-row gates (a shared expert's
``[1, H]`` gate: a vector).

A parameter's :class:`Matrices` says how its tensor splits into the matrices a transformers checkpoint holds, each
orthogonalised on its own: the stacked experts' leading dim, and the parts of a fused tensor (Baichuan's ``W_pack``,
whose rows are stored head-interleaved ``[N, 3, D]``: q, k, v; the experts' ``gate_up_proj`` rows ``[2, I]``: gate,
up). PEFT adapters stay on AdamW unless asked (``adapters=True``: LoRA's ``lora_A``/``lora_B`` are matrices too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn

from lightning_llm.models import family_roots

__all__ = ["Matrices", "MuonSplit", "split_parameters"]


class Matrices(NamedTuple):
    """How a parameter's (global) tensor holds matrices: ``stack`` leading dims index whole matrices (stacked experts:
    1), and each matrix's rows are ``[outer, parts, inner]`` with part ``j`` the rows ``[:, j, :]`` (one of
    ``outer``/``inner`` is -1, the rest of the rows): ``parts=1`` is one matrix. Plain data: it travels in the param
    group (ZeRO-1/2 rebuild the optimizer from its groups, checkpoints keep the groups' hyperparameters)."""

    stack: int = 0
    outer: int = 1
    parts: int = 1
    inner: int = -1

    def part_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(rows, cols)`` of one part of a tensor of ``shape`` (its global shape)."""
        rows, cols = shape[self.stack], shape[self.stack + 1]
        return rows // self.parts, cols

    def count(self, shape: tuple[int, ...]) -> int:
        """The matrices a tensor of ``shape`` holds."""
        return math.prod(shape[: self.stack]) * self.parts

    def check(self, shape: tuple[int, ...], name: str) -> None:
        if len(shape) != self.stack + 2:
            raise ValueError(f"Muon: {name} {tuple(shape)} is not {self.stack} stacked dims and a matrix")
        rows = shape[self.stack]
        block = self.parts * (self.inner if self.inner > 0 else self.outer)
        if rows % block:
            raise ValueError(f"Muon: {name} has {rows} rows, not a multiple of its {self.parts} fused parts")


WHOLE = Matrices()


@dataclass
class MuonSplit:
    """The task's trainable parameters by optimizer: ``muon`` (parameter -> its :class:`Matrices`, in module order),
    ``adamw`` (the rest) and, of those, the PEFT adapters' (``adapters``: names)."""

    muon: dict[nn.Parameter, Matrices]
    adamw: list[nn.Parameter]
    names: dict[int, str]
    adapters: list[str]

    def describe(self, adapters_on_muon: bool, *, stage: bool = False) -> str:
        """The run summary's line: tensors, matrices and parameters per optimizer (``stage``: of this pipeline stage,
        the parameters a rank holds after the split)."""
        n_muon = sum(_numel(p) for p in self.muon)
        mats = sum(m.count(tuple(_shape(p))) for p, m in self.muon.items())
        n_adam = sum(_numel(p) for p in self.adamw)
        line = (f"optimizer{' (pipeline stage of rank 0)' if stage else ''}: Muon on {len(self.muon)} hidden weight tensors ({mats} matrices, {n_muon:,} parameters); "
                f"AdamW on {len(self.adamw)} tensors ({n_adam:,} parameters: embeddings, heads, norms, biases, "
                "routers)")
        if self.adapters:
            where = "Muon (--model.optim.muon_adapters=true)" if adapters_on_muon else "AdamW"
            line += f"; {len(self.adapters)} PEFT adapter tensors on {where}"
        return line


def _shape(p: Tensor) -> Any:
    return getattr(p, "ds_shape", p.shape)  # DeepSpeed's zero.Init leaves 1-D placeholders; ds_shape is the real one


def _numel(p: Tensor) -> int:
    return math.prod(_shape(p))


def _adapter_params(module: nn.Module) -> set[int]:
    """ids of the trainable parameters of peft's adapter layers (LoRA's ``lora_A``/``lora_B`` & co, not the wrapped
    ``base_layer``) and of ``modules_to_save`` copies."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    out: set[int] = set()
    for m in module.modules():
        if isinstance(m, (BaseTunerLayer, ModulesToSaveWrapper)):
            base = getattr(m, "base_layer", None) or getattr(m, "original_module", None)
            skip = {id(p) for p in base.parameters()} if isinstance(base, nn.Module) else set()
            out |= {id(p) for p in m.parameters() if id(p) not in skip}
    return out


def _block_matrices(block: nn.Module, adapters: set[int], adapters_on_muon: bool) -> dict[int, Matrices]:
    """id(parameter) -> its matrices, for the hidden matrices of one transformer block."""
    out: dict[int, Matrices] = {}
    for path, m in block.named_modules():
        stacked = getattr(m, "expert_params", None)
        if stacked is not None:  # routed experts: [E, rows, cols] each
            for name in stacked:
                p = getattr(m, name)
                if p.dim() == 3 and name in ("gate_up_proj", "down_proj"):
                    out[id(p)] = Matrices(stack=1, parts=2) if name == "gate_up_proj" else Matrices(stack=1)
            continue
        if not isinstance(m, nn.Linear) or m.weight.dim() != 2:
            continue
        w = m.weight
        if id(w) in adapters:
            if adapters_on_muon:
                out[id(w)] = WHOLE
            continue
        if m.out_features == 1:  # a scalar gate (a shared expert's): a vector, not a matrix
            continue
        if path.rsplit(".", 1)[-1] == "W_pack":  # Baichuan's fused q, k, v, rows head-interleaved [N, 3, D]
            attention = block.get_submodule(path.rpartition(".")[0]) if "." in path else block
            out[id(w)] = Matrices(outer=-1, parts=3, inner=int(attention.head_dim))
        else:
            out[id(w)] = WHOLE
    return out


def split_parameters(task: nn.Module, *, adapters_on_muon: bool = False) -> MuonSplit:
    """The trainable parameters of ``task`` by optimizer (see the module doc). Raises ``ValueError`` when no hidden
    matrix is found (a model of no registered family): Muon would then train nothing."""
    adapters = _adapter_params(task)
    muon_ids: dict[int, Matrices] = {}
    model = getattr(task, "model", None)
    for prefix, backbone, spec in family_roots(model) if isinstance(model, nn.Module) else []:
        try:
            layers = backbone.get_submodule(spec.layers)
        except AttributeError:
            continue
        for block in layers.children():
            muon_ids.update(_block_matrices(block, adapters, adapters_on_muon))
    names = {id(p): n for n, p in task.named_parameters()}
    muon: dict[nn.Parameter, Matrices] = {}
    adamw: list[nn.Parameter] = []
    for p in task.parameters():
        if not p.requires_grad:
            continue
        layout = muon_ids.get(id(p))
        if layout is None:
            adamw.append(p)
            continue
        layout.check(tuple(_shape(p)), names[id(p)])
        muon[p] = layout
    adapter_names = sorted(n for n, p in task.named_parameters() if id(p) in adapters and p.requires_grad)
    if not muon and not adapter_names:  # (a PEFT run may leave Muon nothing: its adapters on AdamW, said at set-up)
        raise ValueError("--model.optim.name=muon: no trainable hidden weight matrix found (Muon takes the "
                         "projections of a registered family's transformer blocks; this model has none, or they are "
                         "frozen)")
    return MuonSplit(muon=muon, adamw=adamw, names=names, adapters=adapter_names)
