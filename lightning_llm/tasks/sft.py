"""Supervised fine-tuning for generation (e.g. summarization / title generation) with generation-based metrics.

Training is causal-LM loss on response tokens (the datamodule masks the prompt with -100). Validation, test and
predict generate from left-padded prompts (:mod:`lightning_llm.generation`: KV cache, greedy / sampling / beam) and
score the decoded text against the reference with LLaMA-Factory's metrics (:class:`TextSimilarity`): logged as
``{val,test}_bleu-4``, ``..._rouge-1``, ``..._rouge-2``, ``..._rouge-l`` (x100) and ``..._samples_per_s``; ``predict``
writes ``predict_bleu-4`` ... ``predict_samples_per_second`` to ``<predictions>.metrics.json``. Predictions
(``prompt``, ``label``, ``prediction``) are written as JSONL, atomically, in record order.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_llm.files import atomic_open, write_jsonl_atomic
from lightning_llm.generation import GenerationConfig, for_datamodule, generate, strip_after_eos
from lightning_llm.metrics.text import TextSimilarity, Tokenization
from lightning_llm.tasks.causal_lm import CausalLMTask

log = logging.getLogger(__name__)

# WordPiece decoding puts spaces between CJK characters; they are not part of the text.
_CJK = r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]"
_CJK_SPACE = re.compile(rf"(?<={_CJK}) (?={_CJK})")


class SFTTask(CausalLMTask):
    """Instruction SFT with generation at evaluation time (batches from :class:`InstructionDataModule`)."""

    def __init__(
        self,
        backbone: str = "debug",
        *,
        generation: GenerationConfig | None = None,
        generate_in: list[str] | None = None,
        metric_tokenization: Tokenization = "char",
        predictions_path: str | None = None,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            backbone: A named decoder size or a local HF directory (the other backbone and PEFT arguments are
                :class:`~lightning_llm.tasks.decoder.DecoderTask`'s).
            generation: Decoding settings (EOS/pad ids default to the datamodule's tokenizer).
            generate_in: Stages that generate and score text: any of ``val``, ``test`` (``predict`` always does).
                Default both.
            metric_tokenization: Units of BLEU/ROUGE: ``char`` (Chinese), ``jieba`` or ``whitespace``.
            predictions_path: JSONL file for predictions (``{stage}`` is replaced by val/test/predict); default
                ``<log_dir>/generated_predictions_{stage}.jsonl``.
        """
        super().__init__(backbone, **kwargs)
        # predictions_path is a run-time choice: LightningCLI re-applies checkpoint hparams over the command line.
        self.save_hyperparameters(ignore=["predictions_path"])
        self.generation = generation or GenerationConfig()
        self.generate_in = list(generate_in) if generate_in is not None else ["val", "test"]
        bad = sorted(set(self.generate_in) - {"val", "test"})
        if bad:
            raise ValueError(f"--model.generate_in: unknown stages {bad} (use val, test)")
        self.predictions_path = predictions_path
        self.text_metrics = torch.nn.ModuleDict({
            # Scored once per epoch from the gathered, de-duplicated predictions (evaluation samplers pad ranks
            # with repeated rows), so no cross-rank sync of the metric itself.
            stage: TextSimilarity(tokenization=metric_tokenization, prefix=f"{stage}_", sync_on_compute=False)
            for stage in ("val", "test", "predict")
        })
        self._records: list[dict[str, Any]] = []
        self._gen_time = 0.0

    # ------------------------------------------------------------------------------------------ generation
    def _tokenizer(self) -> Any:
        dm = self.trainer.datamodule if self._trainer is not None else None
        tok = getattr(dm, "tokenizer", None)
        if tok is None:
            raise ValueError("SFTTask needs a datamodule with a tokenizer (e.g. InstructionDataModule)")
        return tok

    def _gen_config(self) -> GenerationConfig:
        return for_datamodule(self.generation, self.trainer.datamodule)

    def _decode(self, ids: list[int]) -> str:
        tok = self._tokenizer()
        text = tok.decode(ids, skip_special_tokens=True)
        if "Bert" in type(tok).__name__:
            text = _CJK_SPACE.sub("", text)
        return text.strip()

    def generate_batch(self, batch: dict[str, Any]) -> list[str]:
        """Decoded continuations of the batch's prompts (EOS and padding removed)."""
        assert self.model is not None
        cfg = self._gen_config()
        was_training = self.model.training
        self.model.eval()
        with self.decoding() as decoder:
            tokens = generate(decoder, batch["gen_input_ids"], batch["gen_attention_mask"], config=cfg)
        self.model.train(was_training)
        return [self._decode(ids) for ids in strip_after_eos(tokens, cfg.eos_ids)]

    def _generate_and_score(self, batch: dict[str, Any], stage: str) -> list[str]:
        """Generate for the batch's prompts, time it, and keep (prompt, label, prediction) records for scoring."""
        start = time.perf_counter()
        preds = self.generate_batch(batch)
        self._gen_time += time.perf_counter() - start
        for i, p in enumerate(preds):
            self._records.append({"index": int(batch["index"][i]), "prompt": batch["prompt"][i],
                                  "label": batch["label"][i], "prediction": p})
        return preds

    def _gathered_records(self) -> list[dict[str, Any]]:
        records = self._records
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, records)
            records = [r for part in parts for r in part]
        unique = {r["index"]: r for r in records}  # evaluation samplers may repeat rows to even out ranks
        return [unique[i] for i in sorted(unique)]

    def _predictions_file(self, stage: str) -> Path:
        if self.predictions_path:
            return Path(self.predictions_path.replace("{stage}", stage))
        root = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(root) / f"generated_predictions_{stage}.jsonl"

    def _finish_stage(self, stage: str) -> dict[str, float]:
        records = self._gathered_records()
        elapsed = torch.tensor(self._gen_time, dtype=torch.float64, device=self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # ranks generate in parallel: wall time = slowest
        metric = self.text_metrics[stage]
        labelled = [r for r in records if r["label"]]  # predict records may have no reference
        if labelled:
            metric.update([r["prediction"] for r in labelled], [r["label"] for r in labelled])
        scores = {k: float(v) for k, v in metric.compute().items()} if labelled else {}
        self.text_metrics[stage].reset()
        scores[f"{stage}_samples_per_s"] = len(records) / max(float(elapsed), 1e-9)
        path = self._predictions_file(stage)  # a collective (trainer.log_dir broadcasts): on every rank
        if self.trainer.global_rank == 0 and records:
            write_jsonl_atomic(path, ({k: r[k] for k in ("prompt", "label", "prediction")} for r in records))
            rank_zero_info(f"{len(records)} predictions written to {path}")
        self._records, self._gen_time = [], 0.0
        return scores

    # ------------------------------------------------------------------------------------------ stages
    @override
    def update_metrics(self, stage: str, outputs: dict[str, Any], batch: dict[str, Any]) -> None:
        if stage in self.generate_in:  # the shared eval step computed the loss; add generation + text scores
            self._generate_and_score(batch, stage)

    def _log_text_scores(self, stage: str) -> None:
        if stage not in self.generate_in or self.trainer.sanity_checking:
            self._records, self._gen_time = [], 0.0
            self.text_metrics[stage].reset()
            return
        for name, value in self._finish_stage(stage).items():
            self.log(name, value, prog_bar=name.endswith("rouge-l"), sync_dist=False, rank_zero_only=False)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        generates = stage == "predict" or bool(self.generate_in)
        if generates and not self.capabilities.generation:  # every strategy of the library generates
            raise ValueError(
                f"SFTTask: generation (--model.generate_in={self.generate_in}, and predict) is not supported by "
                f"--trainer.strategy={type(self.trainer.strategy).__name__}; train with --model.generate_in=[] "
                "(validation then logs val_loss/val_ppl only) and generate from the exported checkpoint")

    @override
    def _log_epoch_metrics(self, stage: str) -> None:
        super()._log_epoch_metrics(stage)
        self._log_text_scores(stage)

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> list[str]:
        return self._generate_and_score(batch, "predict")

    @override
    def on_predict_epoch_end(self) -> None:
        scores = self._finish_stage("predict")
        scores["predict_samples_per_second"] = scores.pop("predict_samples_per_s")
        path = self._predictions_file("predict")
        if self.trainer.global_rank == 0:
            with atomic_open(path.with_suffix(".metrics.json"), "w", encoding="utf-8") as f:
                json.dump({k: round(v, 4) for k, v in scores.items()}, f, indent=2)
            rank_zero_info("predict metrics: " + json.dumps({k: round(v, 4) for k, v in scores.items()}))
