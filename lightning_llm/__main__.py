import sys

from lightning_llm.cli.app import main

sys.exit(main())
