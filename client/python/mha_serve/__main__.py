"""python -m mha_serve: the mha-serve-client command (mha_serve.cli)."""

import sys

from .cli import main

sys.exit(main())
