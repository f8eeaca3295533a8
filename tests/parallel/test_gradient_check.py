"""The layout harness's gradient check (``lightning_llm.testing.gradients``) on records written here, no process
launched: a gradient counted twice, one never averaged, one missing, of another shape or holding a NaN fails naming the parameter;
replicas that disagree fail; fp32 noise on a tensor far below the rest passes; a pipeline stage's copy of a tied head is
compared with the first name's gradient; the records of a real one-device fit (full tensors, tied names) round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_llm.testing.gradients import (
    GradientRecorder,
    _merged,
    check_gradient_records,
    compare_gradient_records,
    relative_errors,
    tied_names,
)


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(8, 4, generator=g), "norm.weight": torch.randn(4, generator=g) * 1e-3,
            "A_log": torch.randn(2, generator=g) * 1e-6}  # a tensor 1e-6 of the largest entry


def _write(folder: Path, name: str, grads: dict[str, torch.Tensor], *, reference: str | None = None,
           replicas: dict[str, float] | None = None, tied: dict[str, str] | None = None) -> None:
    side = folder / ("layouts" if reference else "reference")
    side.mkdir(parents=True, exist_ok=True)
    torch.save({"name": name, "reference": reference or name, "world_size": 2, "grads": [grads],
                "replicas": [replicas or {}], "tied": tied or {}, "rtol": None}, side / f"{name}.pt")


def test_equal_gradients_and_fp32_noise_below_the_floor_pass(tmp_path: Path) -> None:
    ref = _grads()
    noisy = {**ref, "embed.weight": ref["embed.weight"] * (1 + 1e-7), "A_log": ref["A_log"] * (1 + 1e-3)}
    _write(tmp_path, "one", ref)
    _write(tmp_path, "tp", noisy, reference="one")
    row = check_gradient_records(tmp_path)["tp"]
    assert row["tensors"] == 3 and row["max_rel"] < 1e-5 and not row["failures"]


@pytest.mark.parametrize(("case", "expected"), [
    ("twice", "norm.weight: max |g - g_ref| = "),  # a replicated parameter's gradient counted twice
    ("not_averaged", "embed.weight: max |g - g_ref| = "),  # summed over 2 replicas, never divided
    ("tiny_twice", "A_log: max |g - g_ref| = "),  # even 1e-6 of the largest entry: off by its own size
    ("missing", "norm.weight: missing on one side"),
    ("shape", "embed.weight: missing on one side"),
    ("replicas", "embed.weight: the data-parallel replicas' gradients differ"),
    ("nan", "norm.weight: missing on one side, of another shape, or not finite"),  # NaN > rtol is False
    ("nan_both", "norm.weight: missing on one side, of another shape, or not finite"),  # the reference's NaN too
    ("nan_missing", "norm.weight: missing on one side"),  # a NaN-only gradient the reference lacks
    ("no_reference", "no one-device gradient record named 'other'"),
])
def test_a_wrong_gradient_fails_naming_the_parameter(tmp_path: Path, case: str, expected: str) -> None:
    ref = _grads()
    got = dict(ref)
    replicas, reference = {}, "one"
    if case == "twice":
        got["norm.weight"] = 2 * ref["norm.weight"]
    elif case == "not_averaged":
        got["embed.weight"] = 2 * ref["embed.weight"]
    elif case == "tiny_twice":
        got["A_log"] = 2 * ref["A_log"]
    elif case == "missing":
        del got["norm.weight"]
    elif case == "nan":
        got["norm.weight"] = ref["norm.weight"].clone().index_fill_(0, torch.tensor([1]), float("nan"))
    elif case == "nan_both":
        ref["norm.weight"] = got["norm.weight"] = ref["norm.weight"].clone().index_fill_(0, torch.tensor([1]),
                                                                                           float("nan"))
    elif case == "nan_missing":
        del ref["norm.weight"]
        got["norm.weight"] = torch.full((4,), float("nan"))
    elif case == "shape":
        got["embed.weight"] = ref["embed.weight"][:4]
    elif case == "replicas":
        replicas = {"embed.weight": 0.5}
    else:
        reference = "other"
    _write(tmp_path, "one", ref)
    _write(tmp_path, "layout", got, reference=reference, replicas=replicas)
    with pytest.raises(AssertionError, match="first-step gradients differ from one device's") as e:
        check_gradient_records(tmp_path)
    print(str(e.value))
    assert f"layout (vs one device's '{reference}'" in str(e.value) and expected in str(e.value)
    assert compare_gradient_records(tmp_path)["layout"]["failures"]


def test_a_pipeline_stage_copy_of_a_tied_head_is_compared_with_its_first_name() -> None:
    ref = _grads()
    stage_copy = {**ref, "lm_head.weight": ref["embed.weight"].clone()}  # the last stage's copy, summed
    rels, failures = relative_errors(stage_copy, ref, tied={"lm_head.weight": "embed.weight"})
    assert not failures and rels["lm_head.weight"] == 0.0
    wrong = {**stage_copy, "lm_head.weight": ref["embed.weight"] / 2}  # the stages' halves never summed
    assert relative_errors(wrong, ref, tied={"lm_head.weight": "embed.weight"})[1]


def test_ranks_merge_by_name_and_replicas_are_measured() -> None:
    a, b = _grads(), _grads()
    b["norm.weight"] = b["norm.weight"] * 1.5
    merged, replicas = _merged([{"embed.weight": a["embed.weight"]}, {"norm.weight": a["norm.weight"]}, b])
    assert set(merged) == set(a) and replicas["embed.weight"] == 0.0 and replicas["norm.weight"] == pytest.approx(0.5)
    b["A_log"] = torch.full_like(a["A_log"], float("nan"))  # a replica's NaN: a disagreement past any tolerance
    assert _merged([a, b])[1]["A_log"] == float("inf")


def test_recorder_writes_a_one_device_fit(tmp_path: Path) -> None:
    """A tied-head decoder on one device: every trainable parameter's gradient once, the head as another name."""
    import lightning.pytorch as pl

    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask

    pl.seed_everything(0)
    task = CausalLMTask("debug-qwen2", dropout=0.0, model_overrides={"num_layers": 1})
    dm = TextDataModule(block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"), generated_docs=20)
    rec = GradientRecorder("one", folder=tmp_path / "reference")
    pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
               callbacks=[rec], default_root_dir=str(tmp_path)).fit(task, dm)
    saved = torch.load(tmp_path / "reference" / "one.pt", weights_only=True)
    names = {n for n, p in task.named_parameters() if p.requires_grad}
    assert set(saved["grads"][0]) == names and all(g.abs().sum() > 0 for g in saved["grads"][0].values())
    assert saved["tied"] == tied_names(task) and "model.lm_head.weight" in saved["tied"]
