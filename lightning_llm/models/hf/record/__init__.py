"""What a family's record (``families/<family>.py``) is written with: the record type (``family.py``), the weight
mapping's entry types (``entries.py``), the options not built (``options.py``) and the config readers families share
(``readers.py``)."""
