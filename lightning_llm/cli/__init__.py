"""The ``lightning_llm`` command line:

* :mod:`.app`: :class:`LLMCLI` (a LightningCLI: ``fit``/``validate``/``test``/``predict``), :func:`main` (the console
  entry point, which also dispatches the tool subcommands of :data:`TOOLS` and prints :func:`usage`, one line per
  subcommand, for ``--help``) and its one-line errors;
* :mod:`.args`: what the parser is handed: registered strategy names rewritten to their class and preset, strategy
  options checked against the class, config files read and checked first.
"""

from lightning_llm.cli.app import LLMCLI, SUBCOMMAND_HELP, TOOLS, main, usage

__all__ = ["LLMCLI", "SUBCOMMAND_HELP", "TOOLS", "main", "usage"]
