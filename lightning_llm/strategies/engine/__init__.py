"""The one native engine: :class:`~.strategy.ParallelEngine` (one Lightning strategy for every layout) and its parts:
:mod:`.layout` (its arguments and checks, the pipeline stages), :mod:`.grads` and :mod:`.grad_buckets` (a step's
gradients: bucketed data-parallel reduction, clipping, accumulation), :mod:`.checkpoint` (its checkpoint IO) and
:mod:`.hybrid_checkpoint` (the layout-free checkpoint format every layout saves and loads)."""
