"""Task LightningModules. Subclass these; they share one loop (:class:`LLMTask`)."""

from lightning_llm.tasks.base import LLMTask, OptimConfig
from lightning_llm.tasks.causal_lm import CausalLMTask
from lightning_llm.tasks.classification import ClassificationTask
from lightning_llm.tasks.decoder import DecoderTask
from lightning_llm.tasks.distill import DistillTask
from lightning_llm.tasks.online.base import OnlineRLTask
from lightning_llm.tasks.online.grpo import GRPOTask
from lightning_llm.tasks.online.ppo import PPOTask
from lightning_llm.tasks.preference.dpo import DPOTask
from lightning_llm.tasks.preference.kto import KTOTask
from lightning_llm.tasks.preference.reward import RewardTask
from lightning_llm.tasks.sft import SFTTask

__all__ = ["CausalLMTask", "ClassificationTask", "DPOTask", "DecoderTask", "DistillTask", "GRPOTask", "KTOTask", "LLMTask",
           "OnlineRLTask", "OptimConfig", "PPOTask", "RewardTask", "SFTTask"]
