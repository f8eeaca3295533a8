import sys

from lightning_llm.cli import main

sys.exit(main())
