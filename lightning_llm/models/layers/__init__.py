"""The building blocks of a family's layers (no parallel code): ``block.py`` (norms, the standard attention and MLP,
the transformer block, embeddings and heads), ``masks.py`` (the mask path's attend-masks, packed rows' positions),
``attention.py`` (the attention core: SDPA over a dense mask, or flash varlen over a per-forward layout), ``sinks.py``
(gpt-oss's attention sinks), ``rope.py`` (rotary embeddings), ``mla.py`` (Multi-head Latent Attention),
``deltanet.py`` (Gated DeltaNet), ``deberta.py`` (DeBERTa's disentangled attention and its post-norm block),
``moe.py`` (Mixture-of-Experts feed-forward) and ``routing.py`` (its router statistics and load-balancing loss);
``configs.py`` holds the configs of the optional kinds (``ModelConfig.moe``, ``mla``, ``linear_attention``,
``disentangled``)."""
