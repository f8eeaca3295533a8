"""First-step gradients of a layout against one device's: recorded in full, compared per parameter.

A loss curve alone cannot tell a layout's gradient from a wrong one: AdamW's first update is the gradient's sign, so a
gradient counted twice, or never reduced, on a replicated parameter trains almost like one device for a few steps.
The layout harness (:func:`~lightning_llm.testing.run_layouts_and_reference`) therefore compares every parameter's
gradient of the first optimizer step as well:

* :class:`GradientRecorder` reads them where the optimizer does (``on_before_optimizer_step``: after the data-parallel
  reduction and a pipeline's rescaling, before clipping), gathers every full tensor from its shards (DTensor: tp, ep,
  FSDP2; pipeline stages; a ZeRO-2 gradient its owner keeps; DeepSpeed's partitions through
  ``deepspeed.utils.safe_get_full_grad``) and rank 0 writes them with the run's name. Data-parallel replicas holding
  the same parameter must hold the same gradient: the largest disagreement is written beside (``replicas``).
* :func:`compare_gradient_records` pairs each layout run's record with its one-device reference and measures, per
  tensor, ``max |g - g_ref| / max |g_ref|`` (:data:`GRAD_RTOL`): a failure names the run, the parameter and the numbers.

The records go to the folder named by :data:`GRADIENTS_ENV` (set by the harness; no folder: nothing is recorded).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_llm.files import atomic_open

__all__ = ["GRADIENTS_ENV", "GRAD_RTOL", "GradientRecorder", "assert_gradients_close", "compare_gradient_records",
           "full_gradients", "gradient_errors", "recorder_cli_args", "relative_errors"]

GRADIENTS_ENV = "LIGHTNING_LLM_GRADIENTS"
"""The folder gradient records go to (the harness sets it: ``OUT/gradients/reference`` for the one-device run,
``OUT/gradients/layouts`` for the launch)."""
GRAD_RTOL = 1e-5
"""Per tensor: ``max |g - g_ref|`` within this fraction of ``max |g_ref|`` (fp32 reduction order)..."""
SCALE_FLOOR = 1e-2
"""... where ``max |g_ref|`` counts as at least this fraction of the step's largest gradient entry: at ``GRAD_RTOL``,
an absolute floor of 1e-7 of the largest entry, fp32's resolution of it. A tensor whose gradient is far smaller than
the rest sums terms far larger than itself, in another order on each layout: a Gated DeltaNet's ``A_log`` (1e-5 of the
largest entry) is 3e-5 of its own size from one device under tp, and one device's own fp32 gradient is 8e-5 of it from
float64's; an attention key bias's exact gradient is 0. A gradient counted twice or never reduced is off by its own
size, which the floor passes only for tensors below 1e-7 of the largest."""
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_fsdp_wrapped_module|_orig_mod|module)\.")
"""Name parts that wrappers add (activation checkpointing, FSDP1, compile, DeepSpeed's engine)."""


def canonical_name(name: str) -> str:
    """A parameter's name without the parts wrappers add, as on one device."""
    while True:
        stripped = _WRAPPERS.sub(r"\1", name)
        if stripped == name:
            return name
        name = stripped


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """``p``'s whole gradient as the optimizer sees it (a collective over ``p``'s mesh or DeepSpeed group), or
    ``None`` where this rank holds none (a ZeRO-2 gradient another rank owns, a frozen parameter)."""
    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):  # DeepSpeed's partitions (stage 3; stages 1 and 2)
        from deepspeed.utils import safe_get_full_grad  # only under DeepSpeed, which imports it anyway

        g = safe_get_full_grad(p)
    else:
        g = p.grad
    if g is None:
        return None
    if hasattr(g, "full_tensor"):
        g = g.full_tensor()
    return g.detach().float().cpu().clone()


def full_gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of every parameter's gradient held by this rank, by name (wrapper parts removed), gathering DTensor
    shards and DeepSpeed's partitions (a collective: call on every rank; parameters without a gradient are left
    out)."""
    out = {}
    for name, p in module.named_parameters():
        if not p.requires_grad and p.grad is None:
            continue
        g = _full_grad(p)
        if g is not None:
            out[canonical_name(name)] = g
    return out


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """``{other name: first name}`` of every parameter registered under several names (a tied LM head)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        name = canonical_name(name)
        if id(p) in first and first[id(p)] != name:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def _merged(every: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The ranks' gradients merged by name (pipeline stages, owners), and for a name several ranks hold, the largest
    difference between them relative to the tensor's largest entry (replicas must agree)."""
    merged: dict[str, torch.Tensor] = {}
    replicas: dict[str, float] = {}
    for grads in every:
        for name, g in grads.items():
            if name not in merged:
                merged[name] = g
                continue
            first = merged[name]
            diff = float((g - first).abs().max()) if g.shape == first.shape else float("inf")
            replicas[name] = max(replicas.get(name, 0.0), _relative(diff, float(first.abs().max())))
    return merged, replicas


class GradientRecorder(pl.Callback):
    """Writes the full gradients of the first ``steps`` optimizer steps as run ``name`` (see the module doc) to
    ``folder`` (default: :data:`GRADIENTS_ENV`'s), compared there with the one-device run named ``reference``.

    Every rank must run it (it gathers); rank 0 writes ``<folder>/<name>.pt``:
    ``{"name", "reference", "world_size", "grads": [{param: tensor}, per step], "replicas": [{param: rel diff}],
    "tied": {other name: first name}, "rtol": its own tolerance or None}`` (a pipeline's last stage holds its own
    copy of a tied head, under the other name: compared with the first's gradient, which it must equal once the stages
    summed them). Test-sized models only: every rank receives every rank's full gradients.
    """

    def __init__(self, name: str, reference: str | None = None, *, steps: int = 1,
                 folder: str | Path | None = None, rtol: float | None = None) -> None:
        self.name, self.reference, self.steps, self.rtol = name, reference or name, steps, rtol
        self.folder = folder
        self.grads: list[dict[str, torch.Tensor]] = []
        self.replicas: list[dict[str, float]] = []
        self.tied: dict[str, str] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.grads, self.replicas = [], []

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if len(self.grads) >= self.steps:
            return
        mine = full_gradients(pl_module)
        every = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(every, mine)
        merged, replicas = _merged(every)
        self.tied = tied_names(pl_module)
        self.grads.append(merged)
        self.replicas.append(replicas)
        if len(self.grads) == self.steps:
            self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        folder = self.folder or os.environ.get(GRADIENTS_ENV)
        if not folder or trainer.global_rank != 0:
            return
        path = Path(folder) / f"{_file_name(self.name)}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            torch.save({"name": self.name, "reference": self.reference, "world_size": trainer.world_size,
                        "grads": self.grads, "replicas": self.replicas,
                        "tied": self.tied, "rtol": self.rtol}, f)


def recorder_for(name: str | None, reference: str | None = None, *, rtol: float | None = None) -> list[pl.Callback]:
    """``[GradientRecorder(name, reference, rtol=rtol)]`` where the harness asks for records (:data:`GRADIENTS_ENV` set
    and a name given), else ``[]``."""
    if name is None or not os.environ.get(GRADIENTS_ENV):
        return []
    return [GradientRecorder(name, reference, rtol=rtol)]


def recorder_cli_args(folder: Path, name: str, reference: str | None = None) -> list[str]:
    """The command-line flags adding a :class:`GradientRecorder` of run ``name`` to a ``lightning_llm fit``: a
    one-device reference (``reference`` None) under ``folder/reference``, else a layout run compared with it under
    ``folder/layouts`` (then :func:`check_gradient_records` on ``folder``)."""
    return ["--trainer.callbacks+=lightning_llm.testing.GradientRecorder", f"--trainer.callbacks.name={name}",
            *([f"--trainer.callbacks.reference={reference}"] if reference else []),
            f"--trainer.callbacks.folder={folder / ('layouts' if reference else 'reference')}"]


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def gradient_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *,
                    tied: dict[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """Per parameter of either: ``(max |g - g_ref|, max |g_ref|)``; a parameter only one side has a gradient for
    gives ``inf`` (unless the other side's is all zeros), and so does a NaN or inf on either side. A name of ``tied`` (another name of a parameter) that
    ``ref`` lacks is compared with its first name's gradient."""
    tied = tied or {}
    out = {}
    for name in sorted(set(got) | set(ref)):
        g, r = got.get(name), ref.get(name)
        if r is None and g is not None and tied.get(name) in ref:
            r = ref[tied[name]]
        if g is None or r is None:
            have = g if g is not None else r
            assert have is not None
            out[name] = (0.0 if bool((have == 0).all()) else float("inf"),  # a NaN is not 0
                         float(r.abs().max()) if r is not None else 0.0)
        elif g.shape != r.shape:
            out[name] = (float("inf"), float(r.abs().max()))
        else:
            diff = float((g - r).abs().max())  # NaN where either holds one: a NaN compares as no failure
            out[name] = (diff if math.isfinite(diff) else float("inf"), float(r.abs().max()))
    return out


def relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *, rtol: float = GRAD_RTOL,
                    tied: dict[str, str] | None = None) -> tuple[dict[str, float], list[str]]:
    """Per parameter, ``max |g - g_ref|`` over ``max |g_ref|`` (at least :data:`SCALE_FLOOR` of the largest entry of
    ``ref``), and one line per parameter past ``rtol`` naming it and the numbers."""
    floor = SCALE_FLOOR * max((float(g.abs().max()) for g in ref.values()), default=0.0)
    rels, failures = {}, []
    for name, (diff, scale) in gradient_errors(got, ref, tied=tied).items():
        rels[name] = rel = _relative(diff, max(scale, floor))
        if rel > rtol:
            where = "missing on one side, of another shape, or not finite" if diff == float("inf") else (
                f"max |g - g_ref| = {diff:.3e}, max |g_ref| = {scale:.3e}, relative {_relative(diff, scale):.2e} "
                f"> {rtol:g} (and > {rtol * floor:.1e}: the floor at {SCALE_FLOOR:g} of the largest entry)")
            failures.append(f"{name}: {where}")
    return rels, failures


def assert_gradients_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *,
                           rtol: float = GRAD_RTOL) -> float:
    """Every parameter's gradient of ``got`` within ``rtol`` of ``ref``'s (:func:`relative_errors`); raises
    ``AssertionError`` naming each one off. Returns the largest relative difference."""
    rels, failures = relative_errors(got, ref, rtol=rtol)
    if failures:
        raise AssertionError("gradients differ:\n" + "\n".join(failures))
    return max(rels.values(), default=0.0)


def _relative(diff: float, scale: float) -> float:
    """``diff / scale``; ``inf`` where ``diff`` is not finite or ``scale`` is not a positive number (a NaN scale
    included: a NaN would compare as within any tolerance)."""
    if diff == 0.0:
        return 0.0
    return diff / scale if math.isfinite(diff) and scale > 0 else float("inf")


def compare_gradient_records(folder: Path, *, rtol: float = GRAD_RTOL) -> dict[str, dict[str, Any]]:
    """Each layout record under ``folder/layouts`` against its reference under ``folder/reference``: per run, the
    largest relative difference over its tensors and steps (``max_rel``, at ``worst``), the replicas' largest
    disagreement, the tensors compared and ``failures`` (one line per tensor past ``rtol``, naming it and the
    numbers). ``max_rel`` is ``max |g - g_ref|`` over ``max |g_ref|``, or over :data:`SCALE_FLOOR` of the step's
    largest entry where that is larger: a run passes where ``max_rel <= rtol`` (a record's own ``rtol``, where it
    gives one, wins: mixed precision). Also written to ``folder/summary.json``."""
    refs = {}
    for path in sorted((folder / "reference").glob("*.pt")):
        rec = torch.load(path, weights_only=True)
        refs[rec["name"]] = rec
    summary: dict[str, dict[str, Any]] = {}
    for path in sorted((folder / "layouts").glob("*.pt")):
        rec = torch.load(path, weights_only=True)
        ref = refs.get(rec["reference"])
        tol = rec.get("rtol") or rtol
        row: dict[str, Any] = {"reference": rec["reference"], "failures": [], "max_rel": 0.0, "worst": None,
                               "replicas": 0.0, "tensors": 0, "rtol": tol}
        summary[rec["name"]] = row
        if ref is None:
            row["failures"].append(f"no one-device gradient record named {rec['reference']!r}")
            continue
        if len(ref["grads"]) < len(rec["grads"]):
            row["failures"].append(f"the reference recorded {len(ref['grads'])} steps, the run {len(rec['grads'])}")
            continue
        tied = {**ref.get("tied", {}), **rec.get("tied", {})}
        for step, (got, want, reps) in enumerate(zip(rec["grads"], ref["grads"], rec["replicas"], strict=False)):
            rels, failures = relative_errors(got, want, rtol=tol, tied=tied)
            row["tensors"] += len(rels)
            worst = max(rels, key=rels.__getitem__, default=None)
            if worst is not None and (row["worst"] is None or rels[worst] > row["max_rel"]):
                row["max_rel"], row["worst"] = rels[worst], worst
            row["failures"] += [f"step {step} {line}" for line in failures]
            for name, rel in reps.items():
                row["replicas"] = max(row["replicas"], rel)
                if rel > tol:
                    row["failures"].append(f"step {step} {name}: the data-parallel replicas' gradients differ by "
                                           f"{rel:.2e} of its largest entry")
        if row["tensors"] == 0:
            row["failures"].append("no gradient recorded")
    with atomic_open(folder / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def check_gradient_records(folder: Path, *, rtol: float = GRAD_RTOL) -> dict[str, dict[str, Any]]:
    """:func:`compare_gradient_records`, raising ``AssertionError`` with every failing run's lines (the first 5 per
    run)."""
    summary = compare_gradient_records(folder, rtol=rtol)
    bad = {run: row for run, row in summary.items() if row["failures"]}
    if bad:
        lines = [f"{run} (vs one device's {row['reference']!r}, {len(row['failures'])} tensors off): "
                 + "; ".join(row["failures"][:5]) for run, row in bad.items()]
        raise AssertionError("first-step gradients differ from one device's:\n" + "\n".join(lines))
    return summary


def gradient_summary(out: Path, run: str) -> str:
    """One line of a run's gradient comparison (after :func:`check_gradient_records`), for a test to print; raises
    where the run recorded none."""
    path = out / "gradients" / "summary.json"
    rows = json.loads(path.read_text()) if path.is_file() else {}
    if run not in rows:
        raise AssertionError(f"{run}: no first-step gradients recorded (LoggedLoss(grads=...) in its fit)")
    row = rows[run]
    return (f"gradients: max relative |g - one device| = {row['max_rel']:.1e} (<= {row['rtol']:g}) over "
            f"{row['tensors']} tensors (worst {row['worst']}), replicas agree to {row['replicas']:.1e}")
