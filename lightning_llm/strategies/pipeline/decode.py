"""Token-by-token decoding through a pipeline: the model protocol of :func:`lightning_llm.generation.generate`
across this rank's stages.

Every pipeline rank runs the same ``generate()`` loop in lock-step (same prompts, same sampling draws). Each call
(prefill, then one per new token) walks the stages in order: the owner of stage ``s`` runs its view with the KV cache
(keys and values are kept per attention module, so one cache serves this rank's stages; its token count is reset to
the call's start before each local stage, and beam search's row reordering reaches every stage), sends
the hidden states to the owner of stage ``s + 1`` (a small header with dtype and shape, then the tensor; each
tensor-parallel rank to its peer, as in training) and the last stage's last-position logits ``[B, V]`` are broadcast
to every pipeline rank. Every rank then picks the same token, so the next call feeds every stage the same input; a
row's end (EOS) is decided on every rank alike. Prompts are not split into micro-batches: stages wait for each other
(one stage busy at a time), which is what one decoding step of one batch allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_llm.models.layers import KVCache
from lightning_llm.strategies.pipeline.split import StageSpec, stage_ranks

__all__ = ["PipelineDecoder"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype index, ndim, up to 6 sizes


class PipelineDecoder:
    """``decoder(ids [B, S], *, attention_mask [B, T], position_ids [B, S], kv_cache) -> logits [B, 1, V]`` (fp32,
    the last position only, the same on every pipeline rank)."""

    def __init__(self, *, stage_mods: Sequence[nn.Module], specs: Sequence[StageSpec], pp_group: Any,
                 pp_size: int, last_stage_rank: int, device: torch.device) -> None:
        self.stages = {s.index: mod for mod, s in zip(stage_mods, specs)}
        self.num_stages = specs[0].num_stages
        self.owners = stage_ranks(pp_size, self.num_stages // pp_size, style="loop")
        self.group, self.device, self.last_stage_rank = pp_group, device, last_stage_rank
        self.pp_rank = dist.get_rank(pp_group)
        self._vocab: int | None = None  # the logits' width, sent once by the last stage

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.owners[stage])

    def _send(self, x: Tensor, stage: int) -> None:
        local = x.to_local() if isinstance(x, DTensor) else x
        local = local.contiguous()
        header = torch.zeros(_HEADER, dtype=torch.long, device=self.device)
        header[0], header[1] = _DTYPES.index(local.dtype), local.dim()
        header[2:2 + local.dim()] = torch.tensor(local.shape, dtype=torch.long)
        dist.send(header, self._peer(stage), group=self.group)
        dist.send(local, self._peer(stage), group=self.group)

    def _recv(self, stage: int) -> Tensor:
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, self._peer(stage), group=self.group)
        ndim = int(header[1])
        out = torch.empty(header[2:2 + ndim].tolist(), dtype=_DTYPES[int(header[0])], device=self.device)
        dist.recv(out, self._peer(stage), group=self.group)
        return out

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, *, attention_mask: Tensor, position_ids: Tensor,
                 kv_cache: KVCache | None = None, **extra: Any) -> Tensor:
        """``extra``: keyword inputs every stage receives as well (e.g. ``values=False`` for PPO's actor-critic)."""
        x: Tensor | None = input_ids
        past = kv_cache.seq_len if kv_cache is not None else 0
        for s in range(self.num_stages):
            if self.owners[s] != self.pp_rank:
                continue
            if s > 0 and self.owners[s - 1] != self.pp_rank:
                x = self._recv(s - 1)
            cache_kw: dict[str, Any] = {}
            if kv_cache is not None:
                kv_cache.seq_len = past  # every stage of this call starts from the same cached length
                cache_kw["kv_cache"] = kv_cache
            x = self.stages[s](x, attention_mask=attention_mask, position_ids=position_ids, **cache_kw, **extra)
            if s < self.num_stages - 1 and self.owners[s + 1] != self.pp_rank:
                self._send(x, s + 1)
        b = input_ids.shape[0]
        if x is not None and self.owners[-1] == self.pp_rank:
            last = x[:, -1]
            last = (last.full_tensor() if isinstance(last, DTensor) else last).float().contiguous()
        else:
            last = torch.empty(0, device=self.device)
        if self._vocab is None:
            vocab = torch.tensor([last.shape[-1] if last.dim() == 2 else 0], device=self.device)
            dist.broadcast(vocab, self.last_stage_rank, group=self.group)
            self._vocab = int(vocab)
        if last.dim() != 2:
            last = torch.empty(b, self._vocab, dtype=torch.float32, device=self.device)
        dist.broadcast(last, self.last_stage_rank, group=self.group)
        return last.unsqueeze(1)
