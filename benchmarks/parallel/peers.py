"""Peers the benchmark matrix compares our strategies against, on the same model, data and optimizer.

* :class:`TPPeerTask` - Lightning's own ``ModelParallelStrategy`` with a hand-written Megatron plan applied by
  ``parallelize_module`` in ``configure_model`` (what a Lightning user writes without our ``tp`` strategy). The plan
  is the one ``lightning_llm.models.tp_plans.decoder_tp_plan(sequence_parallel=False, loss_parallel=False)``
  produces, written out by hand.
* :class:`FSDP2PeerTask` - Lightning's ``ModelParallelStrategy`` with FSDP2 ``fully_shard`` per block, the peer of
  ``zero3`` (Lightning's ``FSDPStrategy`` wraps torch's FSDP1, which needs an accelerator).
* ``python benchmarks/parallel/peers.py deepspeed --stage N ...`` (under torchrun) - the DeepSpeed engine used directly: a plain
  torch loop around ``deepspeed.initialize`` on the CPU accelerator with gloo, no Lightning.

Both report through :mod:`matrix`'s measurement helpers, so every row of the matrix is measured the same way.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from lightning_llm.tasks import CausalLMTask

log = logging.getLogger(__name__)


def peer_tp_plan() -> dict[str, Any]:
    """Megatron-style plan for our DecoderLM, module path -> ParallelStyle (no sequence parallel, gathered logits)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    # One Replicate DTensor at each block half's input: one all-reduce of the input grad per half in backward.
    half = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                              use_local_output=False)
    return {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),  # vocab-parallel
        "layers.*.self_attn": half,
        "layers.*.self_attn.q_proj": ColwiseParallel(),
        "layers.*.self_attn.k_proj": ColwiseParallel(),
        "layers.*.self_attn.v_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(),
        "layers.*.mlp": half,
        "layers.*.mlp.gate_proj": ColwiseParallel(),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),  # logits [B, S, V] on every rank
    }


class TPPeerTask(CausalLMTask):
    """CausalLMTask for Lightning's ``ModelParallelStrategy``: build the full model, then shard it with the plan."""

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed.tensor.parallel import parallelize_module

        super().configure_model()  # full model on this rank (materialised), as a plain Lightning user would
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], peer_tp_plan())


class FSDP2PeerTask(CausalLMTask):
    """CausalLMTask for Lightning's ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` with FSDP2
    applied in ``configure_model`` as Lightning documents it: ``fully_shard`` on each transformer block, then on the
    model. (Lightning's ``FSDPStrategy`` wraps torch's FSDP1, which refuses to run without an accelerator.)"""

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torch.distributed.fsdp import fully_shard

        super().configure_model()
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


# ------------------------------------------------------------------------------------------------------------------
# DeepSpeed engine used directly
# ------------------------------------------------------------------------------------------------------------------


def deepspeed_main(argv: list[str]) -> int:
    """Plain torch loop: same model / data / AdamW / LR schedule as ``configs/pretrain_debug.yaml``."""
    p = argparse.ArgumentParser(prog="peers.py deepspeed")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--size", default="debug")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--measure-step", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=0, help="the last steps, under torch.profiler (not timed)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--output", required=True)
    a = p.parse_args(argv)

    import deepspeed
    import lightning.pytorch as pl
    import torch.distributed as dist
    import torch.nn.functional as F
    from matrix import StepProfiler, gather_and_write, memory_kib
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_llm.data import TextDataModule
    from lightning_llm.models import build_model
    from lightning_llm.strategies.zero.deepspeed import (
        deepspeed_config,
        deepspeed_model_state_bytes,
    )
    from lightning_llm.tasks.base import OptimConfig, padded_vocab_size, param_groups

    pl.seed_everything(42, verbose=False)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dm = TextDataModule(block_size=a.block, batch_size=a.batch, cache_dir=a.cache_dir)
    dm.setup("fit")
    dataset = dm.datasets["fit"]
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler, drop_last=True)
    model = build_model(a.size, family="decoder", dropout=0.0, vocab_size=padded_vocab_size(dm.vocab_size))
    optim = OptimConfig(lr=a.lr, warmup_steps=5)
    opt = torch.optim.AdamW(param_groups(model, optim.weight_decay), lr=optim.lr, betas=optim.betas, eps=optim.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.lr_lambda(a.steps))
    cfg = {**deepspeed_config(stage=a.stage, offload_optimizer=False, offload_params=False, pin_memory=False),
           "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1}
    engine, _, _, _ = deepspeed.initialize(args=argparse.Namespace(device_rank=int(os.environ.get("LOCAL_RANK", "0"))),
                                           model=model, optimizer=opt, lr_scheduler=sched, config=cfg,
                                           dist_init_required=False)
    ends: list[float] = [time.perf_counter()]
    losses: list[float] = []
    state: dict[str, int] = {}
    profiler, comm = StepProfiler(), {}
    step = 0
    while step < a.steps:
        for batch in loader:
            if a.profile_steps and step == a.steps - a.profile_steps:
                profiler.start()
            logits = engine(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
            engine.backward(loss)
            if step == a.measure_step:  # as the Lightning rows: after backward, before the optimizer step
                state = deepspeed_model_state_bytes(engine)
            engine.step()
            losses.append(float(loss.detach()))
            step += 1
            if step <= a.steps - a.profile_steps:
                ends.append(time.perf_counter())
            elif step == a.steps:
                comm = profiler.stop(a.profile_steps)
            if step >= a.steps:
                break
    record = {"step_ends": ends[1:], "losses": losses, "state": state, "tokens_per_step": a.batch * a.block * world,
              "comm": comm, **memory_kib()}
    gather_and_write(record, a.output, rank=rank, world=world)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # `matrix` helpers
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if len(sys.argv) < 2 or sys.argv[1] != "deepspeed":
        print("usage: peers.py deepspeed --stage N --cache-dir DIR --output JSON [...]", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(deepspeed_main(sys.argv[2:]))
