"""The offline preference tasks: :class:`~.base.PreferenceTask` (the one model call over a pair's rows, the reference
log-probs) -> DPO (:mod:`.dpo`) and KTO (:mod:`.kto`); reward models trained on pairs (:mod:`.reward`). Users import
them from :mod:`lightning_llm.tasks`."""
