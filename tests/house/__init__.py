"""The repository itself: install, docs that stay true, import layers, the tests' launcher."""
