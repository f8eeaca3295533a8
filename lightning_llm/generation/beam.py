"""Beam search (:func:`beam_search`): K beams per prompt over the eager loop's dynamic KV cache; the beams' bookkeeping
is on the host (a static cache and a compiled step do not apply: ``generate`` falls back to this path, logging it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import GenerationConfig
from .sampling import process_logits
from .stepper import Stepper

__all__ = ["beam_search"]


def beam_search(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, cfg: GenerationConfig) -> Tensor:
    """Beam search with K = num_beams beams per prompt; returns each prompt's best hypothesis [B, N].

    A hypothesis ends when it emits EOS (ranked by ``logprob_sum / len ** length_penalty``); a prompt is done when
    it has K ended hypotheses and no running beam can beat the worst of them (HF's ``early_stopping=False`` rule).
    """
    b, k, device = input_ids.shape[0], cfg.num_beams, input_ids.device
    eos = set(cfg.eos_ids)
    rows = torch.arange(b, device=device).repeat_interleave(k)  # [B*K] beam rows of each prompt
    stepper = Stepper(model, input_ids[rows], attention_mask[rows], max_new=cfg.max_new_tokens,
                       use_cache=cfg.use_cache)
    agree = getattr(model, "all_ended", None)
    logits = stepper.first()  # [B*K, V]
    beam_scores = torch.zeros(b, k, device=device)
    beam_scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first one at step 0
    history = torch.empty(b * k, 0, dtype=torch.long, device=device)  # [B*K, step]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    done = [False] * b
    vocab = logits.shape[-1]
    for step in range(cfg.max_new_tokens):
        logp = F.log_softmax(process_logits(logits, stepper.seqs, cfg), dim=-1)  # [B*K, V]
        total = (beam_scores.view(-1, 1) + logp).view(b, k * vocab)
        top_scores, top_idx = torch.topk(total, 2 * k, dim=1)  # [B, 2K]: enough to keep K non-EOS beams
        next_beam = torch.zeros(b, k, dtype=torch.long, device=device)
        next_token = torch.full((b, k), cfg.pad_token_id, dtype=torch.long, device=device)
        next_score = torch.full((b, k), float("-inf"), device=device)
        gen_len = step + 1
        for i in range(b):
            if done[i]:
                next_score[i] = 0.0  # keep the row alive with pad tokens; it is ignored
                continue
            kept = 0
            for rank, (score, idx) in enumerate(zip(top_scores[i].tolist(), top_idx[i].tolist())):
                beam, token = divmod(idx, vocab)
                if token in eos:
                    if rank < k:  # an EOS outside the top K would not have survived as a beam
                        hyp = history[i * k + beam].tolist() + [token]
                        finished[i].append((score / gen_len ** cfg.length_penalty, hyp))
                    continue
                next_beam[i, kept], next_token[i, kept], next_score[i, kept] = beam, token, score
                kept += 1
                if kept == k:
                    break
            finished[i] = sorted(finished[i], key=lambda h: -h[0])[:k]
            if len(finished[i]) == k:
                best_running = float(next_score[i].max()) / gen_len ** cfg.length_penalty
                done[i] = best_running <= finished[i][-1][0]
        order = (torch.arange(b, device=device)[:, None] * k + next_beam).view(-1)  # [B*K] source rows
        history = torch.cat([history[order], next_token.view(-1, 1)], dim=1)
        beam_scores = next_score
        ended = all(done)
        if agree is not None:  # ranks whose decoding steps run collectives stop together
            ended = agree(ended)
        if ended or step == cfg.max_new_tokens - 1:
            break
        stepper.reorder(order)
        logits = stepper.next(next_token.view(-1))
    best: list[list[int]] = []
    for i in range(b):
        pool = list(finished[i])
        if not done[i]:  # running beams compete at max length
            for j in range(k):
                score = float(beam_scores[i, j])
                if score > float("-inf"):
                    pool.append((score / history.shape[1] ** cfg.length_penalty, history[i * k + j].tolist()))
        best.append(max(pool, key=lambda h: h[0])[1])
    width = max(len(h) for h in best)
    out = torch.full((b, width), cfg.pad_token_id, dtype=torch.long, device=device)
    for i, h in enumerate(best):
        out[i, :len(h)] = torch.as_tensor(h, dtype=torch.long, device=device)
    return out
