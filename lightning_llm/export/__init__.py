"""From a training checkpoint to a Hugging Face directory (``lightning_llm export`` and ``merge``):

* :mod:`.checkpoint`: :func:`read_checkpoint`, any layout our strategies write -> one consolidated checkpoint dict;
  :mod:`.legacy`: the pre-engine layouts it still reads;
* :mod:`.model`: :func:`rebuild_model`, the trained model rebuilt from that dict (PEFT included);
* :mod:`.meta`: what export needs besides the weights, stored in every checkpoint by the tasks (``ExportMetadata``);
* :mod:`.files`: the tokenizer, chat template and generation config beside the weights, and the directory written;
* :mod:`.to_hf`: :func:`export_checkpoint` and the ``lightning_llm export`` command;
* :mod:`.merge`: the ``lightning_llm merge`` command (a PEFT adapter folded into its base).
"""

from lightning_llm.export.checkpoint import read_checkpoint
from lightning_llm.export.files import ExportSources, export_sources, generation_config_dict, write_model_directory
from lightning_llm.export.meta import CHECKPOINT_KEY, ExportMetadata
from lightning_llm.export.model import base_model, peft_config_of, rebuild_model
from lightning_llm.export.to_hf import export_checkpoint

__all__ = ["CHECKPOINT_KEY", "ExportMetadata", "ExportSources", "base_model", "export_checkpoint", "export_sources",
           "generation_config_dict", "peft_config_of", "read_checkpoint", "rebuild_model", "write_model_directory"]
