"""The family records read as tables, what ``load_hf`` and ``save_hf`` translate by: the records found
(``registry.py``), the supported HF classes (``architectures.py``), ``config.json`` <-> ``ModelConfig``
(``config.py``), the weight names (``weights.py``), a multimodal class's language model (``multimodal.py``) and a
peft adapter's names and rows (``adapters.py``)."""
