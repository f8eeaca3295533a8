"""Task LightningModules. Subclass these; they share one loop (:class:`LLMTask`)."""

from lightning_llm.tasks.base import LLMTask, OptimConfig
from lightning_llm.tasks.causal_lm import CausalLMTask
from lightning_llm.tasks.classification import ClassificationTask
from lightning_llm.tasks.decoder import DecoderTask
from lightning_llm.tasks.distill import DistillTask
from lightning_llm.tasks.dpo import DPOTask
from lightning_llm.tasks.grpo import GRPOTask
from lightning_llm.tasks.kto import KTOTask
from lightning_llm.tasks.online_rl import OnlineRLTask
from lightning_llm.tasks.ppo import PPOTask
from lightning_llm.tasks.reward import RewardTask
from lightning_llm.tasks.sft import SFTTask

__all__ = ["CausalLMTask", "ClassificationTask", "DPOTask", "DecoderTask", "DistillTask", "GRPOTask", "KTOTask", "LLMTask",
           "OnlineRLTask", "OptimConfig", "PPOTask", "RewardTask", "SFTTask"]
