"""Mixture-of-Experts training under expert parallelism (and with tp, pp, ZeRO-3) equals one device.

The model (``debug-deepseek-v3`` with overrides): 4 layers of Multi-head Latent Attention (a query low-rank path, the
compressed key/value latent, decoupled rotary dims), the first dense, 3 MoE layers of 8 experts, top-2, DeepSeek-V3's
router (sigmoid scores, 2 groups of which 1 is chosen, a correction bias for the choice moved by the aux-free update
after every optimizer step) plus a shared expert, and transformers' load-balancing loss at coefficient 1.0 (so its
gradient matters), AdamW at lr 3e-3 (at 1e-2 the MLA model's loss oscillates, and fp32 reduction-order noise of
5e-6 at step 2 grew to 1e-4 by step 4 under every layout, with every routing decision and first-step gradient
equal). ``CausalLMTask`` on generated text, 8 rows of 64 byte tokens per optimizer step, fp32, 6 steps,
under each layout (torchrun, CPU, gloo) while the pytest process trains the same batches on one device. Compared
(bound 1e-5): ``train_loss`` (which includes the aux loss) at every step on every rank, every first-step gradient
(per tensor, relative to its largest entry: the harness's check, ``testing.run_layouts_and_reference``), the routers'
correction biases after the last step, and the per-expert loads written to ``expert_load.csv``.

2 processes: ep2, ep2 with ZeRO-3, ep2 with gradient accumulation 2 (against one device accumulating too), ep2 with
a router that sends every token to expert 0 (the other rank's experts receive nothing: no hang, same result), cp2 x
ep2, and without expert parallelism tp2 and zero3;
4 processes: dp2 x ep2, ep2 x tp2, ep2 x pp2 (gpipe). The 2-process launch also saves an ep2 run after 3 steps and
resumes it at tp2, and a one-process launch at ep1: steps 4-6 must be the uninterrupted one-device curve's.

The same launches train the other MoE families' debug sizes (:data:`FAMILIES`: gpt-oss with its sinks, sliding
window 8 < the 64-token blocks, biased router and experts; OLMoE with q/k norms over the whole projection) under
ep2 with ZeRO-3 and cp2 x ep2 (OLMoE: gpt-oss's sinks and sliding windows refuse context parallelism), and ep2 x tp2
and ep2 x pp2, against one device, with the load-balancing loss at coefficient 0.1.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

STEPS = 6
HALF = 3
TOL = 1e-5
MOE = dict(num_experts=8, top_k=2, intermediate_size=32, scoring="sigmoid", num_groups=2, topk_groups=1,
           norm_topk_prob=True, score_bias=True, bias_update_rate=0.01, aux_loss_coef=1.0,
           shared_intermediate_size=32, dense_layers=[0])
LAYOUTS2 = ["ep2", "ep2_zero3", "ep2_accum", "ep2_one_expert", "cp2_ep2", "tp2", "zero3"]
LAYOUTS4 = ["dp2_ep2", "ep2_tp2", "ep2_pp2"]
FAMILIES = {"gpt_oss": "debug-gpt-oss", "olmoe": "debug-olmoe"}
"""family -> its named debug size, trained at the family layouts below (aux coefficient 0.1)."""
FAMILY_LAYOUTS2 = {"gpt_oss": ["ep2_zero3"], "olmoe": ["ep2_zero3", "cp2_ep2"]}
"""(ep2 and tp2 alone are covered by ep2 x tp2: the experts over ep without ZeRO, the heads' sinks and q/k norms over
tp.)"""
FAMILY_LAYOUTS4 = ["ep2_tp2", "ep2_pp2"]
FAMILY_STEPS = 4


def _strategy(name: str) -> tuple[Any, int]:
    """(strategy, per-rank batch size) of a layout: 8 rows per optimizer step in all."""
    from lightning_llm.strategies import ExpertParallelStrategy, HybridParallelStrategy

    if name in ("ep2", "ep2_accum", "ep2_one_expert"):
        return ExpertParallelStrategy(), 4
    return {"ep2_zero3": (ExpertParallelStrategy(zero_stage=3), 4),
            # no expert parallelism: the routed experts whole on each tensor-parallel rank / in each block's FSDP2 unit
            "tp2": (HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 8),
            "zero3": (HybridParallelStrategy(data_parallel_size=2, zero_stage=3), 4),
            # ep borrowed from the context-parallel ranks: each sees every row's slice, the experts split over both
            "cp2_ep2": (HybridParallelStrategy(data_parallel_size=1, context_parallel_size=2, expert_parallel_size=2),
                        8),
            "dp2_ep2": (HybridParallelStrategy(data_parallel_size=4, expert_parallel_size=2), 2),
            "ep2_tp2": (HybridParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2),
                        4),
            "ep2_pp2": (HybridParallelStrategy(data_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2,
                                               schedule="gpipe", n_microbatches=2), 4)}[name]


class OneExpert(pl.Callback):
    """Top-1 routing whose correction bias makes expert 0 every token's choice (the bias is not updated)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for name, b in pl_module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
                b[0] = 1e3


class Probe(pl.Callback):
    """The routers' correction biases at the end."""

    def __init__(self) -> None:
        self.biases: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.biases = {n: b.detach().clone() for n, b in pl_module.named_buffers()
                       if n.endswith("e_score_correction_bias")}


def _fit(strategy: Any, devices: int, out: Path, *, batch_size: int, accumulate: int = 1, steps: int = STEPS,
         one_expert: bool = False, save: bool = False, ckpt_path: Path | None = None,
         custom: bool = True, family: str | None = None, grads: str | None = None,
         reference: str | None = None) -> dict[str, Any]:
    """``steps`` optimizer steps; the first one's gradients recorded as ``grads``, against the one-device run named
    ``reference``."""
    from lightning_llm.data import TextDataModule
    from lightning_llm.tasks import CausalLMTask, OptimConfig
    from lightning_llm.testing import LoggedLoss, table_trainer

    pl.seed_everything(11)
    moe = {**MOE, "top_k": 1, "bias_update_rate": 0.0} if one_expert else MOE
    dm = TextDataModule(block_size=64, batch_size=batch_size, cache_dir=str(out / "cache"), generated_docs=200,
                        val_fraction=0.0)
    if family is not None:
        task = CausalLMTask(FAMILIES[family], dropout=0.0, router_aux_loss_coef=0.1,
                            optim=OptimConfig(lr=1e-2, scheduler="constant", eps=1e-6))
    else:
        task = CausalLMTask("debug-deepseek-v3" if custom else "debug-moe", dropout=0.0,
                            model_overrides={"moe": moe} if custom else {},
                            optim=OptimConfig(lr=3e-3, scheduler="constant", eps=1e-6))
    rec, probe = LoggedLoss(grads=grads, reference=reference), Probe()
    callbacks: list[pl.Callback] = [rec, probe, *([OneExpert()] if one_expert else [])]
    trainer = table_trainer(out, strategy=strategy, devices=devices, max_steps=steps, callbacks=callbacks,
                            save_every_step=save)
    trainer.accumulate_grad_batches = accumulate
    trainer.log_every_n_steps = 1
    trainer.fit(task, dm, ckpt_path=ckpt_path)
    loads = out / "expert_load.csv"
    rows = [r for r in csv.reader(loads.open())][1:] if loads.exists() else []
    return {"losses": rec.losses, "biases": probe.biases, "start": rec.start, "loads": rows}


def _family_fit(family: str, name: str, out: Path) -> dict[str, Any]:
    strategy, batch_size = _strategy(name)
    return _fit(strategy, int(os.environ.get("WORLD_SIZE", "1")), out / f"{family}_{name}", batch_size=batch_size,
                steps=FAMILY_STEPS, family=family, grads=f"{family}/{name}", reference=family)


def _layout_fit(name: str, out: Path) -> dict[str, Any]:
    strategy, batch_size = _strategy(name)
    return _fit(strategy, int(os.environ.get("WORLD_SIZE", "1")), out / name, batch_size=batch_size // (
        2 if name.endswith("accum") else 1), accumulate=2 if name.endswith("accum") else 1,
        steps=2 if name.endswith("one_expert") else STEPS, one_expert=name.endswith("one_expert"), grads=name,
        reference=_reference_name(name))


def _reference_name(layout: str) -> str:
    """The one-device run a layout is compared with."""
    return "accum" if layout.endswith("accum") else "one_expert" if layout.endswith("one_expert") else "main"


def _worker(mode: str, out: Path) -> None:
    from lightning_llm.strategies import ExpertParallelStrategy, HybridParallelStrategy
    from lightning_llm.testing import gathered, write_json_on_rank0

    if mode == "reference":
        torch.save({"main": _fit("auto", 1, out / "ref", batch_size=8, grads="main"),
                    "accum": _fit("auto", 1, out / "ref_accum", batch_size=4, accumulate=2, grads="accum"),
                    "one_expert": _fit("auto", 1, out / "ref_one", batch_size=8, steps=2, one_expert=True,
                                       grads="one_expert"),
                    **{f: _fit("auto", 1, out / f"ref_{f}", batch_size=8, steps=FAMILY_STEPS, family=f, grads=f)
                       for f in FAMILIES}},
                   out / "reference.pt")
        return
    if mode == "resume_single":
        one = _fit(HybridParallelStrategy(data_parallel_size=1), 1, out / "single_resume", batch_size=8,
                   ckpt_path=out / "ep2_save" / "ckpt" / "last.ckpt")
        write_json_on_rank0(out / "resume_single.json", {"start": one["start"], "losses": one["losses"]})
        return
    results = {}
    runs = [(layout, lambda layout=layout: _layout_fit(layout, out)) for layout in
            (LAYOUTS2 if mode == "layouts" else LAYOUTS4)]
    runs += [(f"{family}/{layout}", lambda family=family, layout=layout: _family_fit(family, layout, out))
             for family in FAMILIES
             for layout in (FAMILY_LAYOUTS2[family] if mode == "layouts" else FAMILY_LAYOUTS4)]
    for key, fit in runs:
        every = gathered(fit())
        results[key] = {"losses": [r["losses"] for r in every], "loads": every[0]["loads"],
                        "biases": {n: b for r in every for n, b in r["biases"].items()}}
    if mode == "layouts":  # the checkpoint the resume runs read (resumed here at tp2); a Qwen3-MoE-shaped one to export
        _fit(ExpertParallelStrategy(), 2, out / "ep2_save", batch_size=4, steps=HALF, save=True)
        _fit(ExpertParallelStrategy(), 2, out / "ep2_export", batch_size=4, steps=2, save=True, custom=False)
        results["lazy"] = {name: gathered(_lazy_read(out, name)) for name in LAZY}
        tp2 = _fit(HybridParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), 2, out / "tp2_resume",
                   batch_size=8, ckpt_path=out / "ep2_save" / "ckpt" / "last.ckpt")
        write_json_on_rank0(out / "resume_tp2.json", {"start": tp2["start"], "losses": tp2["losses"]})
    if torch.distributed.get_rank() == 0:
        torch.save(results, out / f"{mode}.pt")


LAZY = ("hf", "hf_deepseek_v3")
"""HF checkpoints read lazily under ep2: a Qwen3-MoE and a DeepSeek-V3 (MLA, its routers' correction biases)."""


def _lazy_read(out: Path, name: str) -> dict[str, int]:
    """One ep2 step from the HF checkpoint ``out/<name>`` (built lazily: each rank reads its own experts' tensors
    only): the bytes this rank read, and the bytes of the checkpoint's routed experts and of everything else."""
    from safetensors import safe_open

    from lightning_llm.data import TextDataModule
    from lightning_llm.strategies import ExpertParallelStrategy
    from lightning_llm.tasks import CausalLMTask
    from lightning_llm.testing import table_trainer

    pl.seed_everything(11)
    hf = out / name
    dm = TextDataModule(tokenizer_dir=str(hf), block_size=32, batch_size=2, cache_dir=str(out / f"cache_{name}"),
                        generated_docs=50, val_fraction=0.0)
    task = CausalLMTask(str(hf), dropout=0.0)
    table_trainer(out / f"ep2_lazy_{name}", strategy=ExpertParallelStrategy(), devices=2, max_steps=1,
                  callbacks=[]).fit(task, dm)
    sizes = {"experts": 0, "rest": 0}
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            n = int(torch.tensor(t.get_shape()).prod()) * 4
            sizes["experts" if ".experts." in key else "rest"] += n
    return {"read": task.model.weights_source.bytes_read, **sizes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightning_llm.testing import run_layouts_and_reference
    from lightning_llm.tools.tiny import write_tiny

    out = tmp_path_factory.mktemp("moe_layouts")
    _write_hf_checkpoint(out / "hf")
    write_tiny("deepseek_v3", out / "hf_deepseek_v3")
    return run_layouts_and_reference(__file__, out, lambda: _worker("reference", out), timeout=1200,
                                     then=((4, "layouts4"), (1, "resume_single")))


def _write_hf_checkpoint(out: Path) -> None:
    """A Qwen3-MoE checkpoint (8 experts) and a BPE tokenizer, as transformers and tokenizers write them."""
    import warnings

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_llm.data.text import generated_corpus
    from lightning_llm.testing import write_bpe_tokenizer

    write_bpe_tokenizer(out, generated_corpus(50), vocab_size=300)
    config = Qwen3MoeConfig(vocab_size=304, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Qwen3MoeForCausalLM(config).save_pretrained(str(out))


def _reference(layout: str, runs: Path) -> dict[str, Any]:
    return torch.load(runs / "reference.pt")[_reference_name(layout)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [*LAYOUTS2, *LAYOUTS4])
def test_moe_layout_equals_one_device(runs: Path, layout: str) -> None:
    from lightning_llm.testing import gradient_summary

    ref = _reference(layout, runs)
    run = torch.load(runs / ("layouts4.pt" if layout in LAYOUTS4 else "layouts.pt"))[layout]
    steps = len(ref["losses"])
    if not layout.endswith("one_expert"):  # (a loss per batch: two per optimizer step with accumulation)
        assert steps == STEPS * (2 if layout.endswith("accum") else 1)
        assert ref["losses"][0] - ref["losses"][-1] > 0.05  # it trains
        moved = max(float(b.abs().max()) for b in ref["biases"].values())
        assert moved > 0.01  # the aux-free update moved the biases
    loss = max(abs(a - b) for curve in run["losses"] for a, b in zip(curve, ref["losses"], strict=True))
    assert set(run["biases"]) == set(ref["biases"])
    bias = max((run["biases"][n] - b).abs().max().item() for n, b in ref["biases"].items())
    print(f"{layout} vs one device: train_loss over {steps} steps {loss:.2e}, router biases after the last step "
          f"{bias:.2e}; {gradient_summary(runs, layout)}")
    assert loss <= TOL and bias <= TOL
    assert run["loads"] == ref["loads"] and run["loads"]  # tokens per expert per layer and step, as logged
    if layout.endswith("one_expert"):
        assert all(int(r[3]) > 0 and all(int(x) == 0 for x in r[4:]) for r in run["loads"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [f"{f}/{lay}" for f in FAMILIES for lay in FAMILY_LAYOUTS2[f] + FAMILY_LAYOUTS4])
def test_moe_family_layout_equals_one_device(runs: Path, layout: str) -> None:
    """gpt-oss's and OLMoE's debug sizes: every rank's train_loss (with the aux term) at each step, every first-step
    gradient (sinks, router biases, expert biases, whole-projection q/k norms among them) and the logged loads equal
    one device's."""
    from lightning_llm.testing import gradient_summary

    family = layout.split("/")[0]
    ref = torch.load(runs / "reference.pt")[family]
    run = torch.load(runs / ("layouts4.pt" if layout.split("/")[1] in FAMILY_LAYOUTS4 else "layouts.pt"))[layout]
    assert len(ref["losses"]) == FAMILY_STEPS and ref["losses"][0] - ref["losses"][-1] > 0.05  # it trains
    loss = max(abs(a - b) for curve in run["losses"] for a, b in zip(curve, ref["losses"], strict=True))
    print(f"{layout} vs one device: train_loss over {FAMILY_STEPS} steps {loss:.2e}; {gradient_summary(runs, layout)}")
    assert loss <= TOL
    assert run["loads"] == ref["loads"] and run["loads"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["tp2", "single"])
def test_ep2_checkpoint_resumes_at_other_layouts(runs: Path, target: str) -> None:
    """The experts are saved as whole [E, ...] tensors: an ep2 run resumes at tp2 and at ep1 on the uninterrupted
    one-device curve (biases, optimizer states and data position included)."""
    from lightning_llm.testing import resumed_curve_error

    err = resumed_curve_error(runs / f"resume_{target}.json", _reference("main", runs)["losses"], start=HALF)
    print(f"ep2 -> {target}: steps {HALF + 1}-{STEPS} vs one device uninterrupted: {err:.2e}")
    assert err <= TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize(("run", "arch"), [("ep2_export", "Qwen3MoeForCausalLM"),
                                           ("ep2_save", "DeepseekV3ForCausalLM")])
def test_ep2_checkpoint_exports_transformers_key_set_and_reloads(runs: Path, tmp_path: Path, run: str,
                                                                  arch: str) -> None:
    """A checkpoint saved under ep2 (experts saved whole) exports with exactly the keys transformers' own
    save_pretrained writes, and transformers reloads it with our model's logits: a Qwen3-MoE, and the MLA model whose
    routers' correction biases the aux-free update moved for 3 steps (exported, they route transformers' tokens)."""
    import warnings

    import transformers
    from safetensors import safe_open

    from lightning_llm.export.checkpoint import read_checkpoint
    from lightning_llm.export.model import rebuild_model
    from lightning_llm.export.to_hf import export_checkpoint

    ckpt = runs / run / "ckpt" / "last.ckpt"
    export_checkpoint(ckpt, tmp_path / "hf")
    cls = getattr(transformers, arch)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls(config_cls.from_pretrained(str(tmp_path / "hf"))).save_pretrained(str(tmp_path / "own"))
        reloaded = cls.from_pretrained(str(tmp_path / "hf")).eval()
    keys = [set(safe_open(str(d / "model.safetensors"), "pt").keys()) for d in (tmp_path / "hf", tmp_path / "own")]
    assert keys[0] == keys[1] and any(".mlp.experts.7.down_proj." in k for k in keys[0])
    ours, _ = rebuild_model(read_checkpoint(ckpt))
    biases = [b for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias")]
    assert all(b.abs().max() > 0.005 for b in biases) and (arch == "DeepseekV3ForCausalLM") == bool(biases)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (reloaded(input_ids=ids).logits - ours.eval()(ids)).abs().max().item()
    print(f"ep2 checkpoint -> {arch}: {len(keys[0])} keys as save_pretrained's, logits {err:.2e}")
    assert err < 1e-5


@pytest.mark.multiprocess
def test_pipeline_with_the_aux_loss_needs_gpipe(tmp_path: Path) -> None:
    """Under a 1F1B pipeline a micro-batch's backward would run before the global batch's routing is known: refused
    in one line naming the schedule and the flag that turns the loss off."""
    from lightning_llm.testing import one_error_line_from_ranks, torchrun_cli_fails

    repo = Path(__file__).resolve().parents[2]
    out = torchrun_cli_fails(["fit", "--config", str(repo / "configs" / "pretrain_moe.yaml"), "--trainer.strategy=pp",
                              "--trainer.devices=2", "--trainer.max_steps=1", "--model.backbone=debug-moe",
                              f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
                              f"--data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path)
    line = one_error_line_from_ranks(out)
    assert "schedule=gpipe" in line and "router_aux_loss_coef=0" in line


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAZY)
def test_ep2_reads_only_its_experts_from_a_hf_checkpoint(runs: Path, name: str) -> None:
    """Built lazily under ep2, each rank reads its half of the routed experts' tensors and all the rest."""
    for rank in torch.load(runs / "layouts.pt")["lazy"][name]:
        print(f"ep2 lazy load of {name}: read {rank['read']:,} bytes of {rank['experts'] + rank['rest']:,} "
              f"(experts {rank['experts']:,})")
        assert rank["read"] == rank["rest"] + rank["experts"] // 2


if __name__ == "__main__":
    from lightning_llm.testing import run_worker

    run_worker(_worker, sys.argv[1], Path(sys.argv[2]))
