"""Pretraining corpora: the documents a ``--data.data_path`` names (:mod:`.documents`), their one-time preparation
(:mod:`.prepare`) into memory-mapped token stores (:mod:`.token_store`), and mixtures of corpora (:mod:`.mixture`)."""
