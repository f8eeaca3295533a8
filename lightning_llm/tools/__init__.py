"""The command-line tools beside training (``lightning_llm <tool> ...``, listed in :data:`lightning_llm.cli.TOOLS`):

* :mod:`.estimate`: ``lightning_llm estimate``, per-device memory of a model under a layout and the largest batch
  that fits (the numbers are :mod:`lightning_llm.memory`'s);
* :mod:`.plot`: ``lightning_llm plot``, loss / throughput curves of a CSVLogger run to a PNG;
* :mod:`.prepare`: ``lightning_llm prepare``, a pretraining corpus tokenized into its token store before training
  (:mod:`lightning_llm.data.corpus.prepare` does the work).

``export`` and ``merge`` live with the export code (:mod:`lightning_llm.export`). Nothing in the library imports
this package.
"""
