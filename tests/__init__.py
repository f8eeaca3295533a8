"""The test suite, by concern (one folder each); shared helpers beside this file."""
