"""What the task loop (:class:`~lightning_llm.tasks.base.LLMTask`) attaches to every run: the non-finite guard
(:mod:`.guard`), host copies without a wait and the progress bar (:mod:`.progress`), MoE routing statistics and aux
losses (:mod:`.moe`)."""
